"""The generator process: claim prompts, sample groups, score them, stream trajectories.

Loop, one batch of `rollout.prompts_per_pull` prompts at a time (so a fast generator never waits for
a slow one):
1. heartbeat (loaded version, counters) and pick up a newer weight version if one was published;
2. claim prompts from the `prompts` stream (own pending entries first, after a restart);
3. make sure the loaded version is at least every claimed prompt's `issued_version`: with
   async_ratio 0 this is what makes training on-policy;
4. sample n responses per prompt, score each with the task, XADD one trajectory per prompt and
   XACK its prompt in the same transaction.
The process stops when the learner marks the run done, or on SIGTERM / SIGINT.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass

import numpy as np

from broker.config import Config
from broker.connection import connect
from broker.process import setup_process
from broker.schema import PromptWork, Sample, Trajectory
from broker.streams import RunBroker
from broker.weights import WeightStore
from envs import Item, Task, make_task
from generators.engine import Engine, GeneratedSample, SamplingParams, make_engine
from generators.reload import WeightFollower

log = logging.getLogger(__name__)


@dataclass
class Counters:
    groups: int = 0
    samples: int = 0
    tokens: int = 0
    busy_s: float = 0.0
    idle_s: float = 0.0

    def as_fields(self) -> dict[str, str | int | float]:
        total = self.busy_s + self.idle_s
        return {"groups": self.groups, "samples": self.samples, "tokens": self.tokens,
                "busy_s": round(self.busy_s, 2), "idle_frac": round(self.idle_s / total, 3)
                if total else 0.0}


class _Stop:
    """Turns SIGTERM / SIGINT into a flag the loop checks between batches."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True


def to_trajectory(work: PromptWork, samples: list[GeneratedSample], task: Task,
                  generator_id: str, version: int) -> Trajectory:
    item = Item(**work.item)
    out = [Sample(response_ids=np.asarray(s.response_ids, dtype=np.int32),
                  logprobs=np.asarray(s.logprobs, dtype=np.float32),
                  token_versions=np.full(len(s.response_ids), version, dtype=np.int32),
                  reward=task.score(item, s.text), finished=s.finished, text=s.text)
           for s in samples]
    return Trajectory(traj_id=work.group_id, prompt_id=work.prompt_id, group_id=work.group_id,
                      generator=generator_id, behavior_version=version,
                      issued_version=work.issued_version,
                      prompt_ids=np.asarray(samples[0].prompt_ids, dtype=np.int32), samples=out)


def rollout_batch(claimed: list[tuple[str, PromptWork]], engine: Engine, task: Task,
                  params: SamplingParams, broker: RunBroker, generator_id: str,
                  version: int) -> tuple[int, int]:
    """Sample, score and stream one batch; returns (samples, tokens) produced."""
    prompts = [w.item["prompt"] for _, w in claimed]
    groups = engine.generate(prompts, params)
    n_samples = n_tokens = 0
    for (entry_id, work), samples in zip(claimed, groups):
        traj = to_trajectory(work, samples, task, generator_id, version)
        broker.add_trajectory(traj, prompt_entry_id=entry_id)
        n_samples += len(samples)
        n_tokens += sum(len(s.response_ids) for s in samples)
    return n_samples, n_tokens


def run(cfg: Config, generator_id: str) -> None:
    setup_process(f"gen:{generator_id}", seed=cfg.run.seed + 1000 + sum(map(ord, generator_id)),
                  torch_threads=cfg.run.torch_threads)
    stop = _Stop()
    broker = RunBroker(connect(cfg.redis.url, cfg.redis.connect_timeout_s), cfg.run.run_id,
                       cfg.redis.max_payload_bytes)
    broker.register_run(cfg.fingerprint())
    broker.ensure_groups()
    task = make_task(cfg.task.name, cfg.task.params)
    engine = make_engine(cfg.rollout.engine, cfg.model.path, cfg.model.dtype)
    follower = WeightFollower(broker, WeightStore(cfg.run.run_dir), engine)
    params = SamplingParams(n=cfg.rollout.num_return_sequences,
                            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                            max_new_tokens=cfg.rollout.max_new_tokens)
    counters = Counters()
    first = True
    log.info("generator %s ready (engine %s)", generator_id, cfg.rollout.engine)
    while not stop.requested and broker.run_fields().get("state") != "done":
        broker.heartbeat(generator_id, {"loaded_version": follower.loaded_version, "state": "up",
                                        "reloads": follower.reloads, **counters.as_fields()},
                         cfg.rollout.heartbeat_ttl_s)
        follower.maybe_reload()
        waited = time.monotonic()
        claimed = broker.claim_prompts(generator_id, cfg.rollout.prompts_per_pull, block_ms=1000,
                                       own_pending=first)
        first = False
        if not claimed:
            counters.idle_s += time.monotonic() - waited
            continue
        follower.wait_for(max(w.issued_version for _, w in claimed), cfg.trainer.wait_timeout_s)
        counters.idle_s += time.monotonic() - waited
        started = time.monotonic()
        samples, tokens = rollout_batch(claimed, engine, task, params, broker, generator_id,
                                        follower.loaded_version)
        counters.busy_s += time.monotonic() - started
        counters.groups += len(claimed)
        counters.samples += samples
        counters.tokens += tokens
    broker.heartbeat(generator_id, {"loaded_version": follower.loaded_version, "state": "stopped",
                                    "reloads": follower.reloads, **counters.as_fields()},
                     cfg.rollout.heartbeat_ttl_s)
    follower.close()
    log.info("generator %s stopped: %s", generator_id, counters.as_fields())
