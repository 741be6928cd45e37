"""Which GPUs each process of `rollctl run` (and `rollctl start-generator --gpus`) sees.

A process is given its GPUs through `CUDA_VISIBLE_DEVICES`, so inside it they are cuda:0, cuda:1,
... whatever their machine ids. From `placement.gpus` (the ids listed, in order):

- separate (the default): the learner takes the first `placement.learner_gpus` ids, one per rank,
  and generator i the next `gpus_per_generator` ids after those of generator i - 1;
  `gpus_per_generator` is `rollout.vllm.tensor_parallel_size` for the vllm engine, 1 for hf / sim.
  When `rollout.num_rollout_workers` is not set explicitly it becomes the number of generators the
  remaining GPUs hold, which must then be a whole number.
- colocated (`placement.colocate`): the generators share the learner's GPUs, generator i starting
  at learner GPU (i * tensor_parallel_size) mod learner_gpus; the vLLM memory shares on each GPU
  plus `placement.learner_memory_share` must fit in 1.

A layout that cannot be honoured raises `ConfigError` with one line naming the keys at fault.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from rollflash.broker.config.config_errors import ConfigError
from rollflash.broker.config.config_gpu import PlacementConfig
from rollflash.broker.config.config_sections import RolloutConfig, TrainerConfig


@dataclass(frozen=True)
class Layout:
    learner: tuple[str, ...]  # GPU ids of the learner (its ranks take them in order)
    generators: tuple[tuple[str, ...], ...]  # GPU ids of generator i

    def learner_env(self) -> str:
        """CUDA_VISIBLE_DEVICES of the learner ('' hides every GPU)."""
        return ",".join(self.learner)

    def generator_env(self, i: int) -> str:
        """CUDA_VISIBLE_DEVICES of generator i."""
        return ",".join(self.generators[i])

    def describe(self) -> list[str]:
        """One line per process, as `rollctl run --dry-run` prints them."""
        lines = [f"learner  CUDA_VISIBLE_DEVICES={self.learner_env() or '(none)'}"]
        lines += [
            f"gen-{i}    CUDA_VISIBLE_DEVICES={self.generator_env(i)}"
            for i in range(len(self.generators))
        ]
        return lines


def parse_gpus(spec: str | int, key: str = "placement.gpus") -> list[str]:
    """'0-3' -> ['0', '1', '2', '3']; '4,5' -> ['4', '5']; 3 -> ['3']. Ids are listed once."""
    ids: list[str] = []
    for part in str(spec).split(","):
        part = part.strip()
        low, dash, high = part.partition("-")
        if not (low.isdigit() and (not dash or high.isdigit())):
            raise ConfigError(f"{key}: expected GPU ids such as '0-7' or '0,2,3', got {spec!r}")
        if dash and int(high) < int(low):
            raise ConfigError(f"{key}: range {part!r} runs backwards")
        ids += [str(i) for i in range(int(low), int(high if dash else low) + 1)]
    repeated = sorted({i for i in ids if ids.count(i) > 1}, key=int)
    if repeated:
        raise ConfigError(f"{key}: GPU {', '.join(repeated)} listed more than once")
    return ids


def gpus_per_generator(rollout: RolloutConfig) -> int:
    """GPUs one generator process uses: its tensor-parallel size with vLLM, else 1."""
    return rollout.vllm.tensor_parallel_size if rollout.engine == "vllm" else 1


def plan_layout(
    placement: PlacementConfig, rollout: RolloutConfig, trainer: TrainerConfig
) -> Layout | None:
    """The layout `placement:` asks for (None: no GPUs listed). Sets
    `rollout.num_rollout_workers` (and `trainer.num_trainer_workers` from
    `placement.learner_gpus`) when the config leaves them to the GPUs."""
    if placement.gpus is None:
        if placement.learner_gpus is not None or placement.colocate:
            key = (
                "placement.learner_gpus"
                if placement.learner_gpus is not None
                else "placement.colocate"
            )
            raise ConfigError(f"{key}: needs placement.gpus, the GPU ids to share out")
        return None
    ids = parse_gpus(placement.gpus)
    n_learner = _learner_gpus(placement, trainer)
    if n_learner > len(ids):
        raise ConfigError(
            f"placement.learner_gpus: {n_learner} learner GPUs, but placement.gpus lists "
            f"only {len(ids)}"
        )
    learner = tuple(ids[:n_learner])
    if placement.colocate:
        return Layout(learner, _colocated(placement, rollout, learner))
    return Layout(learner, _separate(rollout, ids[n_learner:]))


def _learner_gpus(placement: PlacementConfig, trainer: TrainerConfig) -> int:
    """placement.learner_gpus, which fixes trainer.num_trainer_workers when that is not set."""
    if placement.learner_gpus is None:
        return trainer.num_trainer_workers
    if placement.learner_gpus and placement.learner_gpus != trainer.num_trainer_workers:
        if "num_trainer_workers" in trainer.model_fields_set:
            raise ConfigError(
                f"placement.learner_gpus: {placement.learner_gpus} GPUs for "
                f"trainer.num_trainer_workers {trainer.num_trainer_workers} ranks (one GPU per rank)"
            )
        trainer.num_trainer_workers = placement.learner_gpus
    return placement.learner_gpus


def _separate(rollout: RolloutConfig, rest: list[str]) -> tuple[tuple[str, ...], ...]:
    per = gpus_per_generator(rollout)
    if "num_rollout_workers" not in rollout.model_fields_set:
        if not rest or len(rest) % per:
            raise ConfigError(
                f"rollout.vllm.tensor_parallel_size: {per} does not divide the {len(rest)} "
                "GPUs left for generators (placement.gpus after placement.learner_gpus)"
            )
        rollout.num_rollout_workers = len(rest) // per
    need = rollout.num_rollout_workers * per
    if need > len(rest):
        raise ConfigError(
            f"placement.gpus: {len(rest)} GPUs left after the learner's, but "
            f"rollout.num_rollout_workers {rollout.num_rollout_workers} x {per} GPUs each "
            f"(rollout.vllm.tensor_parallel_size) need {need}"
        )
    return tuple(tuple(rest[i * per : (i + 1) * per]) for i in range(rollout.num_rollout_workers))


def _colocated(
    placement: PlacementConfig, rollout: RolloutConfig, learner: tuple[str, ...]
) -> tuple[tuple[str, ...], ...]:
    per, share = gpus_per_generator(rollout), rollout.vllm.gpu_memory_utilization
    if not learner or per > len(learner):
        raise ConfigError(
            f"placement.colocate: generators of {per} GPUs each cannot share "
            f"{len(learner)} learner GPUs (placement.learner_gpus)"
        )
    gens = tuple(
        tuple(learner[(i * per + k) % len(learner)] for k in range(per))
        for i in range(rollout.num_rollout_workers)
    )
    if rollout.engine == "vllm":
        if share is None:
            raise ConfigError(
                "rollout.vllm.gpu_memory_utilization: placement.colocate needs an explicit "
                "share (vLLM's default 0.9 leaves nothing to the learner)"
            )
        gpu, count = Counter(g for ids in gens for g in ids).most_common(1)[0]
        total = count * share + placement.learner_memory_share
        if total > 1 + 1e-9:
            raise ConfigError(
                f"rollout.vllm.gpu_memory_utilization: {count} generators x {share:g} + "
                f"placement.learner_memory_share {placement.learner_memory_share:g} = "
                f"{total:g} > 1 on GPU {gpu}"
            )
    return gens
