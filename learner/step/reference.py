"""The frozen reference policy for the KL term (`algo.kl_coef > 0`).

With LoRA (`model.lora`) the reference is the policy's own base model with its adapters switched
off (`AdaptersOffReference`): the base is frozen, so it is the initial policy, and no second copy
of the weights is loaded.

The reference is the initial policy, loaded once from `model.path` (not copied from the live policy,
so that a learner that one day resumes from a checkpoint still anchors to the starting model). It is
never trained: eval mode, no gradients. Its log-probabilities of the sampled tokens are computed once
per step, before the update, for either use of the KL (a loss term, or a penalty in the reward).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rollflash.learner.models.load import check_tied, place
from rollflash.learner.process.dist import Dist, shard
from rollflash.learner.step.batch import Sequences
from rollflash.learner.step.logprobs import LogprobSpec

if TYPE_CHECKING:
    from peft import PeftModel


class ReferencePolicy:
    def __init__(self, model: torch.nn.Module):
        self.model = model.eval()
        self.model.requires_grad_(False)

    @classmethod
    def load(
        cls,
        path: str | Path,
        dtype: str,
        dist: Dist = Dist(),
        fsdp: bool = False,
        attn: str = "sdpa",
        remote: bool = False,
    ) -> ReferencePolicy:
        """dtype: "float32" or "bfloat16", as `model.dtype` (frozen: no master copy needed), on
        this rank's device; `fsdp` shards it over the ranks like the policy (every rank must
        then run the same number of forward passes: learner/step/prepare.py); `remote`:
        model.trust_remote_code."""
        kwargs = {"dtype": getattr(torch, dtype), "attn_implementation": attn}
        kwargs["trust_remote_code"] = remote
        model = place(
            lambda: AutoModelForCausalLM.from_pretrained(path, **kwargs),
            lambda: AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(path, trust_remote_code=remote), **kwargs
            ),
            dist,
            shard if fsdp and dist.world_size > 1 else (lambda m: m),
            sharded=fsdp and dist.world_size > 1,
        )
        check_tied(model)
        return cls(model)

    @torch.no_grad()
    def logprobs(self, mb: Sequences, spec: LogprobSpec) -> torch.Tensor:
        """[b, L-1] float32 log pi_ref of each next token, aligned like `mb.mask`, computed as
        the policy's are (`spec`: learner/step/logprobs.py)."""
        logp, _ = spec(self.model, mb)
        return logp


class AdaptersOffReference(ReferencePolicy):
    """The reference of a LoRA policy: the same peft model, run with its adapters (and trained
    `modules_to_save`) disabled and in eval mode; the policy's training mode is restored."""

    def __init__(self, policy: torch.nn.Module):
        self.model = policy  # not frozen or switched to eval: it is the policy being trained

    @torch.no_grad()
    def logprobs(self, mb: Sequences, spec: LogprobSpec) -> torch.Tensor:
        training = self.model.training
        self.model.eval()
        try:
            with cast("PeftModel", self.model).disable_adapter():
                return super().logprobs(mb, spec)
        finally:
            self.model.train(training)
