"""What a learner step reads from the config: typed, frozen, built once per step (`StepSpec.of`).

The step's config carries the step's own kl_coef (learner/metrics/guards.py), so the spec is built from
it at the start of `train_step`; every part of the step then takes the piece it reads (the
filters a ScoreSpec, the batching a BatchSpec, the losses a LossSpec with its LogprobSpec), never
the whole Config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollflash.broker.config.config_algo import AlgoConfig
from rollflash.learner.step.batch import BatchSpec
from rollflash.learner.step.filters import ScoreSpec
from rollflash.learner.step.losses import LossSpec

if TYPE_CHECKING:
    from rollflash.broker.config.config import Config


@dataclass(frozen=True)
class StepSpec:
    loss: LossSpec  # a micro-batch's losses, with the algo section and the log-prob call
    batch: BatchSpec  # mini-batches and micro-batches
    scores: ScoreSpec  # score shaping and the DAPO filters
    model_dtype: str  # model.dtype: the compute precision of every forward pass
    max_grad_norm: float  # trainer.max_grad_norm (0: no clipping)
    sync_every_pass: bool  # trainer.fsdp_reduce_scatter is every_micro_batch
    epochs: int  # trainer.ppo_epochs
    updates: int  # trainer.updates_per_step: mini-batches x epochs

    @classmethod
    def of(cls, cfg: Config) -> StepSpec:
        t = cfg.trainer
        return cls(
            loss=LossSpec.of(cfg),
            batch=BatchSpec.of(cfg),
            scores=ScoreSpec.of(cfg),
            model_dtype=cfg.model.dtype,
            max_grad_norm=t.max_grad_norm,
            sync_every_pass=t.fsdp_reduce_scatter == "every_micro_batch",
            epochs=t.ppo_epochs,
            updates=t.updates_per_step,
        )

    @property
    def algo(self) -> AlgoConfig:
        """The step's algo section (the one the losses read)."""
        return self.loss.algo
