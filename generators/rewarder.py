"""Reward scoring in the generator: the task's rule, a reward model, or a weighted mix (`reward:`).

    reward.type: rule    reward = task.score(item, response)                      (the default)
    reward.type: model   reward = weight_model * r_phi(prompt + response)
    reward.type: mixed   reward = weight_rule * task.score(...) + weight_model * r_phi(...)

r_phi is a scalar-head Hugging Face model (`*ForSequenceClassification`, one label), such as the one
`rollctl train-rm` saves. It reads `broker.rm_input.reward_model_input_ids` (prompt + response +
EOS, the ids it was trained on) with its own tokenizer, so it need not share the policy's
vocabulary. The generator scores every response of a pull (all its groups) in micro-batches of
`reward.micro_batch_size` right after sampling, on `rollout.device` in `reward.dtype`.

Reward-model scores are not normalised here: `algo.reward_norm` / `reward_clip` in the learner do
that (a group baseline such as GRPO's is invariant to the scale anyway). The reward model stays
frozen for the whole run; dedicated reward-worker processes are not implemented (the model runs in
every generator).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

import torch

from rollflash.broker.config.config import Config
from rollflash.broker.wire.rm_input import reward_model_batch
from rollflash.envs import Item, Task, is_multi_turn
from rollflash.errors import BadInput, MissingFile

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class RewardModelScorer:
    """A frozen scalar-head model that scores (prompt, response) texts in batches."""

    def __init__(
        self,
        path: str | Path,
        dtype: str = "float32",
        micro_batch_size: int = 64,
        max_len: int = 512,
        device: str | torch.device = "cpu",
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = Path(path)
        if not (path / "config.json").is_file():
            raise MissingFile(
                f"reward.model_path: no Hugging Face model directory at {path} "
                "(train one with `rollctl train-rm`)"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=_DTYPES[dtype])
        if self.model.config.num_labels != 1:
            raise BadInput(
                f"reward.model_path: {path} has {self.model.config.num_labels} labels; "
                "a reward model needs a scalar head (num_labels 1)"
            )
        self.pad_id = self.model.config.pad_token_id
        if self.pad_id is None:
            self.pad_id = (
                self.tokenizer.pad_token_id
                if self.tokenizer.pad_token_id is not None
                else self.tokenizer.eos_token_id
            )
            self.model.config.pad_token_id = self.pad_id
        self.model.to(device).eval().requires_grad_(False)
        self.device, self.micro_batch_size, self.max_len = device, micro_batch_size, max_len

    @torch.no_grad()
    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        """One float per (prompt, response) pair, in order."""
        out: list[float] = []
        for start in range(0, len(prompts), self.micro_batch_size):
            end = start + self.micro_batch_size
            ids, mask = reward_model_batch(
                self.tokenizer, prompts[start:end], responses[start:end], self.max_len, self.pad_id
            )
            logits = self.model(
                input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
                attention_mask=torch.tensor(mask, dtype=torch.long, device=self.device),
            ).logits
            out.extend(logits[:, 0].float().cpu().tolist())
        return out


class Rewarder(Protocol):
    def score_groups(self, items: list[Item], responses: list[list[str]]) -> list[list[float]]:
        """Rewards of each item's responses, shaped like `responses`."""
        ...


class RuleRewarder:
    """`reward.type: rule`: the task's own verifier."""

    def __init__(self, task: Task):
        self.task = task

    def score_groups(self, items: list[Item], responses: list[list[str]]) -> list[list[float]]:
        batch = getattr(self.task, "score_groups", None)  # reward functions score a whole batch
        if batch is not None:
            return batch(items, responses)
        return [[self.task.score(item, r) for r in group] for item, group in zip(items, responses)]


class ModelRewarder:
    """`reward.type: model` / `mixed`: weight_model * reward model (+ weight_rule * rule)."""

    def __init__(self, task: Task, scorer: Any, weight_model: float, weight_rule: float = 0.0):
        self.rule, self.scorer = RuleRewarder(task), scorer
        self.weight_model, self.weight_rule = weight_model, weight_rule

    def score_groups(self, items: list[Item], responses: list[list[str]]) -> list[list[float]]:
        prompts = [item.prompt for item, group in zip(items, responses) for _ in group]
        flat = self.scorer.score(prompts, [r for group in responses for r in group])
        rule = self.rule.score_groups(items, responses) if self.weight_rule else None
        out, k = [], 0
        for g, group in enumerate(responses):
            row = []
            for j in range(len(group)):
                value = self.weight_model * flat[k]
                if rule is not None:
                    value += self.weight_rule * rule[g][j]
                row.append(value)
                k += 1
            out.append(row)
        return out


def make_rewarder(cfg: Config, task: Task, device: str | torch.device | None = None) -> Rewarder:
    """The rewarder the `reward:` section asks for; loads the reward model once, in
    `reward.dtype` on `device` (None: `rollout.device`, generators/device.py)."""
    reward = cfg.reward
    if reward.type == "rule":
        return RuleRewarder(task)
    if is_multi_turn(task):
        raise BadInput(
            f"reward.type: {reward.type!r} scores single responses; multi-turn task "
            f"{cfg.task.name!r} is scored by its environment (use 'rule')"
        )
    from rollflash.broker.config.config_model import resolve_model_dtype
    from rollflash.generators.device import resolve_device, resolve_dtype

    device = resolve_device(cfg.rollout.device) if device is None else torch.device(device)
    dtype = resolve_model_dtype(resolve_dtype(reward.dtype, cfg.model.dtype), device.type == "cuda")
    assert reward.model_path, "config_sections.py: a model or mixed reward has a model_path"
    scorer = RewardModelScorer(
        reward.model_path, dtype, reward.micro_batch_size, reward.max_len, device
    )
    log.info(
        "reward: %s, reward model %s on %s in %s (weight_model %g, weight_rule %g)",
        reward.type,
        reward.model_path,
        device,
        dtype,
        reward.weight_model,
        reward.weight_rule if reward.type == "mixed" else 0.0,
    )
    return ModelRewarder(
        task, scorer, reward.weight_model, reward.weight_rule if reward.type == "mixed" else 0.0
    )
