"""How `rollctl run` shares one machine's CPU cores among its processes.

The rule applies to CPU runs of the `hf` engine (no `placement.gpus`, no GPU device asked for or
present) and only to what the config leaves open: `rollout.num_rollout_workers` when it is not
set, the torch threads when `run.torch_threads` is 0. With P the cores this process may use
(`os.sched_getaffinity`, else `os.cpu_count()`) and the model's weight bytes W:

- small model (W < SMALL_MODEL_BYTES, ~50 M float32 parameters): one torch thread per process,
  the learner on one core and a generator on each other core: G = max(1, P - 1). At this size a
  second intra-op thread speeds an op up far less than twice (about 1.4x for the demo's 0.8 M
  parameter model), while a second process doubles the work done, so the cores go to processes;
  and a process per core, not more, keeps the learner from sharing its core with generators.
  With `trainer.async_ratio` 0 the learner and the generators take turns (neither runs while the
  other works), so the generators get every core: G = P.
- larger model: intra-op threads pay and every generator holds its own copy of the weights, so
  one generator (G = 1) and the cores split in two: the learner P // 2 threads (at least 1),
  the generator the rest.
- an explicit `num_rollout_workers` G with a small model keeps one thread per process when
  1 + G >= P, and otherwise gives each process max(1, P // (1 + G)) threads.

The threads reach each child as OMP_NUM_THREADS, torch's default intra-op thread count, which
`run.torch_threads: 0` keeps; an OMP_NUM_THREADS already in the environment is left alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from rollflash.broker.config.config import Config

SMALL_MODEL_BYTES = 200 * 2**20  # ~50 M float32 parameters
_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")


@dataclass(frozen=True)
class CpuLayout:
    generators: int
    learner_threads: int
    generator_threads: int

    def describe(self) -> str:
        return (
            f"learner {self.learner_threads} thread(s), {self.generators} generator(s) x "
            f"{self.generator_threads} thread(s)"
        )


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def plan_cpu(
    cores: int, model_bytes: int, generators: int | None, async_ratio: float = 1.0
) -> CpuLayout:
    """The layout for `cores` cores, a model of `model_bytes`, the generator count the config
    sets (None: chosen here) and `trainer.async_ratio`; see the module docstring."""
    cores = max(cores, 1)
    if model_bytes >= SMALL_MODEL_BYTES:
        g = generators or 1
        learner = max(1, cores // 2)
        return CpuLayout(g, learner, max(1, (cores - learner) // g))
    if generators is None:
        return CpuLayout(cores if async_ratio == 0 else max(1, cores - 1), 1, 1)
    threads = max(1, cores // (1 + generators))
    return CpuLayout(generators, threads, threads)


def model_bytes(path: str) -> int | None:
    """Bytes of the model's weight files (None if the directory cannot be found)."""
    from rollflash.broker.config.model_dir import model_directory

    try:
        root = model_directory(path)
    except Exception:
        return None
    files = [f for pattern in _WEIGHT_FILES for f in Path(root).glob(pattern)]
    return sum(f.stat().st_size for f in files) if files else None


def cpu_layout(cfg: Config) -> CpuLayout | None:
    """The layout of a CPU run of the hf engine (None when the rule does not apply); sets
    `rollout.num_rollout_workers` when the config leaves it open."""
    gpu_present = Path("/dev/nvidiactl").exists()
    devices = (cfg.rollout.device, cfg.trainer.device)
    if (
        cfg.rollout.engine != "hf"
        or cfg.placement.gpus is not None
        or "cuda" in devices
        or ("auto" in devices and gpu_present)
    ):
        return None
    size = model_bytes(cfg.model.path)
    if size is None:
        return None
    set_by_config = "num_rollout_workers" in cfg.rollout.model_fields_set
    layout = plan_cpu(
        usable_cores(),
        size,
        cfg.rollout.num_rollout_workers if set_by_config else None,
        cfg.trainer.async_ratio,
    )
    cfg.rollout.num_rollout_workers = layout.generators
    return layout


def omp_threads(cfg: Config, layout: CpuLayout | None, learner: bool) -> str | None:
    """OMP_NUM_THREADS for a child, when the layout chooses its threads (None: inherited)."""
    if layout is None or cfg.run.torch_threads or "OMP_NUM_THREADS" in os.environ:
        return None
    return str(layout.learner_threads if learner else layout.generator_threads)
