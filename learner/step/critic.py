"""The value model for GAE (`algo.critic: true`): the policy's architecture with a scalar head.

As in PPO for LLMs (Ouyang et al. 2022; OpenRLHF, verl, ROLL), the critic is initialised from the
policy checkpoint: the transformer body (`AutoModel`, no LM head) plus a Linear(hidden, 1) head. The
head starts at zero, so the first values are 0 and the first GAE advantages are plain Monte-Carlo
returns; OpenRLHF draws it from a small normal instead, which makes the first values noise.

Values are aligned like every [b, L-1] tensor of a micro-batch: position t holds V(tokens 0..t), the
value of the state in which token t+1 is chosen. The critic has its own AdamW (`algo.critic_lr`); it
is never published to the generators. Like the policy it keeps float32 master weights and computes
in `model.dtype`; with several ranks it is wrapped as the policy is (DDP, or FSDP2 shards).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModel, PreTrainedModel

from rollflash.broker.config.config import Config
from rollflash.broker.config.model_dir import model_directory
from rollflash.learner.models.dropout import disable_dropout
from rollflash.learner.models.load import place
from rollflash.learner.models.memory import use_checkpointing
from rollflash.learner.process.device import adamw
from rollflash.learner.process.dist import Dist, wrap_model
from rollflash.learner.step.packing import forward_packed, pack, unpack


class Critic(torch.nn.Module):
    def __init__(self, backbone: PreTrainedModel, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = torch.nn.Linear(hidden_size, 1)  # float32 whatever the body's dtype
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    @classmethod
    def load(
        cls, path: str | Path, dtype: str = "float32", attn: str = "sdpa", remote: bool = False
    ) -> Critic:
        """`remote`: model.trust_remote_code."""
        backbone = AutoModel.from_pretrained(
            path, dtype=getattr(torch, dtype), attn_implementation=attn, trust_remote_code=remote
        )
        return cls(backbone, backbone.config.hidden_size)

    @classmethod
    def empty(cls, path: str | Path, attn: str = "sdpa", remote: bool = False) -> Critic:
        """The same module without reading the weights (for `learner/models/load.py`'s meta build)."""
        config = AutoConfig.from_pretrained(path, trust_remote_code=remote)
        backbone = AutoModel.from_config(
            config, dtype=torch.float32, attn_implementation=attn, trust_remote_code=remote
        )
        return cls(backbone, config.hidden_size)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, packed: bool = False
    ) -> torch.Tensor:
        """input_ids, attention_mask: [b, L] int64 -> values [b, L-1] float32 (position t: V of
        the prefix 0..t). `packed`: forward without padding (learner/step/packing.py), same result."""
        if packed:
            p = pack(input_ids, attention_mask)
            hidden = forward_packed(self.backbone, p).last_hidden_state
            return unpack(self._head(hidden), p, (input_ids.shape[0], input_ids.shape[1] - 1))
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state
        return self._head(hidden)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [b, L, H] -> values [b, L-1] float32: the head computes in float32 even under
        bf16 autocast (and FSDP keeps its own parameters float32: learner/process/dist.py)."""
        with torch.autocast(hidden.device.type, enabled=False):
            return self.value_head(hidden[:, :-1].float()).squeeze(-1)


def build_critic(cfg: Config, dist: Dist = Dist()) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The critic on this rank's device with float32 master weights (it computes in
    `model.dtype`), dropout off (learner/models/dropout.py), wrapped as the policy is (DDP, or sharded
    with `strategy: fsdp`), and its optimiser (weight decay and gradient clipping as the
    policy's)."""
    path, attn = model_directory(cfg.model.path), cfg.model.attn_implementation
    remote = cfg.model.trust_remote_code
    fsdp = cfg.trainer.strategy == "fsdp" and dist.world_size > 1

    def wrap(critic: Critic) -> torch.nn.Module:
        if cfg.trainer.disable_dropout:  # old and new values differ by the weights only
            disable_dropout(critic)
        body = critic.backbone
        if use_checkpointing(cfg, critic, body.config, dist.world_size, dist.device):
            body.gradient_checkpointing_enable({"use_reentrant": False})
        return wrap_model(critic, dist, cfg.trainer.strategy, cfg.model.dtype)

    critic = place(
        lambda: Critic.load(path, "float32", attn, remote),
        lambda: Critic.empty(path, attn, remote),
        dist,
        wrap,
        fsdp,
    )
    optimizer = adamw(critic.parameters(), cfg.algo.critic_lr, cfg.trainer.weight_decay)
    return critic, optimizer
