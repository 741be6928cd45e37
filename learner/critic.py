"""The value model for GAE (`algo.critic: true`): the policy's architecture with a scalar head.

As in PPO for LLMs (Ouyang et al. 2022; OpenRLHF, verl, ROLL), the critic is initialised from the
policy checkpoint: the transformer body (`AutoModel`, no LM head) plus a Linear(hidden, 1) head. The
head starts at zero, so the first values are 0 and the first GAE advantages are plain Monte-Carlo
returns; OpenRLHF draws it from a small normal instead, which makes the first values noise.

Values are aligned like every [b, L-1] tensor of a micro-batch: position t holds V(tokens 0..t), the
value of the state in which token t+1 is chosen. The critic has its own AdamW (`algo.critic_lr`); it
is never published to the generators.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModel

from rollflash.broker.config import Config
from rollflash.broker.model_dir import model_directory
from rollflash.learner.packing import forward_packed, pack, unpack


class Critic(torch.nn.Module):
    def __init__(self, backbone: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = torch.nn.Linear(hidden_size, 1)  # float32 whatever the body's dtype
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    @classmethod
    def load(cls, path: str | Path, dtype: str, trust_remote_code: bool = False) -> Critic:
        backbone = AutoModel.from_pretrained(
            path, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
        )
        return cls(backbone, backbone.config.hidden_size)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, packed: bool = False
    ) -> torch.Tensor:
        """input_ids, attention_mask: [b, L] int64 -> values [b, L-1] float32 (position t: V of
        the prefix 0..t). `packed`: forward without padding (learner/packing.py), same result."""
        if packed:
            p = pack(input_ids, attention_mask)
            hidden = forward_packed(self.backbone, p).last_hidden_state
            values = self.value_head(hidden[:, :-1].float()).squeeze(-1)  # [1, T-1]
            return unpack(values, p, (input_ids.shape[0], input_ids.shape[1] - 1))
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.value_head(hidden[:, :-1].float()).squeeze(-1)


def build_critic(cfg: Config) -> tuple[Critic, torch.optim.Optimizer]:
    """The critic and its optimiser (weight decay and gradient clipping as the policy's)."""
    critic = Critic.load(
        model_directory(cfg.model.path), cfg.model.dtype, cfg.model.trust_remote_code
    )
    optimizer = torch.optim.AdamW(
        critic.parameters(), lr=cfg.algo.critic_lr, weight_decay=cfg.trainer.weight_decay
    )
    return critic, optimizer
