"""The learner process: collect, train, publish, repeat.

    batch = collect(...)                      # fresh complete groups for version v
    stats = train_step(model, opt, batch)      # one decoupled-PPO update
    publish(model, v + 1)                      # versioned safetensors + hash + zmq notification
    ack(batch)                                 # only now are the trajectories acknowledged

v0 is the model at `model.path`; version v is the result of v optimiser updates. At the end the
learner evaluates, writes `summary.json`, and sets the run's `state` to `done`, which stops the
generators.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from broker.config import Config
from broker.connection import connect
from broker.notify import VersionPublisher
from broker.process import setup_process
from broker.streams import RunBroker
from broker.weights import WeightStore
from envs import Item, Task, make_task
from learner.admission import Admission
from learner.prepare import AlgoModels, build_algo_models
from learner.assemble import GroupAssembler
from learner.collect import Collected, collect
from learner.evaluate import heldout_accuracy
from learner.filters import drop_reason
from learner.metrics import MetricsSink
from learner.simulated import SimulatedPolicy
from learner.train import train_step

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_policy(cfg: Config):
    path = Path(cfg.model.path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.path: no Hugging Face model directory at {path} "
                                "(build one with scripts/make_tiny_model.py)")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[cfg.model.dtype])
    return model, tokenizer


class Publisher:
    """Writes a version to the weight store, records it in Redis and announces it over zmq."""

    def __init__(self, cfg: Config, broker: RunBroker):
        self.store = WeightStore(cfg.run.run_dir)
        if self.store.versions():
            raise FileExistsError(f"run.run_dir: {cfg.run.run_dir} already holds weights of an "
                                  "earlier run and resuming is not supported yet; choose another "
                                  "run_dir or delete it")
        removed = self.store.clean_temp()
        if removed:
            log.warning("removed %d partial weight versions left by an earlier crash", removed)
        self.broker = broker
        self.keep = cfg.trainer.keep_versions
        self.zmq = VersionPublisher()

    def publish(self, model: torch.nn.Module, version: int, step: int) -> float:
        started = time.monotonic()
        info = self.store.publish(model.state_dict(), version, step)
        self.broker.announce_weights(version, info.path, info.sha256, self.zmq.endpoint)
        self.zmq.announce(version, info.path, info.sha256)
        self.store.retain(self.keep, in_use=self.broker.loaded_versions())
        return time.monotonic() - started

    def close(self) -> None:
        self.zmq.close()


def step_metrics(c: Collected, train: dict[str, float], wall: dict[str, float]) -> dict[str, float]:
    rewards = [s.reward for g in c.groups for s in g.samples]
    lengths = [len(s.response_ids) for g in c.groups for s in g.samples]
    step_s = wall["step_s"]
    return {
        **train,
        "reward/mean": sum(rewards) / len(rewards),
        "response/length_mean": sum(lengths) / len(lengths),
        "async/staleness_max": max(c.staleness),
        "async/staleness_mean": sum(k * v for k, v in c.staleness.items()) / len(c.groups),
        **{f"async/staleness_hist/{k}": v for k, v in sorted(c.staleness.items())},
        "async/dropped_stale": len(c.stale_ids), "async/duplicates": len(c.duplicate_ids),
        "async/late_samples": len(c.late_ids),
        **{f"filter/dropped_{reason}": n for reason, n in sorted(c.filtered.items())},
        "async/rejected": c.rejected,
        "perf/wait_frac": c.wait_s / step_s, "perf/step_s": step_s,
        "perf/publish_s": wall["publish_s"],
        "perf/samples_per_s": len(rewards) / step_s, "perf/tokens_per_s": sum(lengths) / step_s,
    }


@dataclass
class Learner:
    """Everything one learner process holds; built once by `start`."""

    cfg: Config
    broker: RunBroker
    task: Task
    heldout: list[Item]
    model: torch.nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    publisher: Publisher
    admission: Admission
    sink: MetricsSink
    ledger: TextIO  # one JSON line per step: the trajectory ids trained or dropped
    assembler: GroupAssembler  # groups whose samples are still arriving
    seen: set[str] = field(default_factory=set)  # trajectory ids already consumed
    algo: AlgoModels = field(default_factory=AlgoModels)  # reference, critic (learner/prepare.py)

    def evaluate(self) -> float:
        if isinstance(self.model, SimulatedPolicy):
            return 0.0
        return heldout_accuracy(self.model, self.tokenizer, self.task, self.heldout,
                                self.cfg.rollout.max_new_tokens)

    def close(self) -> None:
        self.sink.close()
        self.ledger.close()
        self.publisher.close()


def start(cfg: Config) -> Learner:
    run_dir = Path(cfg.run.run_dir)
    cfg.save(run_dir / "config.yaml")
    broker = RunBroker(connect(cfg.redis.url, cfg.redis.connect_timeout_s), cfg.run.run_id,
                       cfg.redis.max_payload_bytes)
    broker.ensure_groups()  # before registering: generators wait for the registration
    broker.register_run(cfg.fingerprint())
    task = make_task(cfg.task.name, cfg.task.params)
    model, tokenizer = (SimulatedPolicy(cfg.sim), None) if cfg.sim.learner_step_s > 0 \
        else load_policy(cfg)
    publisher = Publisher(cfg, broker)
    publisher.publish(model, version=0, step=0)
    return Learner(
        cfg=cfg, broker=broker, task=task,
        heldout=task.heldout_items()[:cfg.task.eval_size or None], model=model,
        tokenizer=tokenizer,
        optimizer=torch.optim.AdamW(model.parameters(), lr=cfg.trainer.actor_lr,
                                    weight_decay=cfg.trainer.weight_decay),
        publisher=publisher,
        admission=Admission(task.train_items(cfg.run.seed), cfg.trainer.rollout_batch_size,
                            cfg.trainer.async_ratio, cfg.rollout.num_return_sequences,
                            replicas=cfg.rollout.num_return_sequences
                            + cfg.rollout.redundant_samples if cfg.rollout.replicate_prompts
                            else 0),
        assembler=GroupAssembler(cfg.rollout.num_return_sequences), sink=MetricsSink(run_dir),
        ledger=open(run_dir / "ledger.jsonl", "a", buffering=1),
        algo=AlgoModels() if isinstance(model, SimulatedPolicy) else build_algo_models(cfg))


def learner_step(ln: Learner, step: int) -> dict[str, float]:
    """Train version `step - 1` into version `step` and publish it; returns the step's metrics."""
    cfg, version, t0 = ln.cfg, step - 1, time.monotonic()
    batch = collect(ln.broker, ln.admission, ln.assembler, version, cfg.trainer.max_staleness,
                    ln.seen, ln.model.config.vocab_size, consumer="rank0",
                    timeout_s=cfg.trainer.wait_timeout_s, drop=lambda g: drop_reason(g, cfg))
    if isinstance(ln.model, SimulatedPolicy):
        stats = ln.model.train_step()
    else:
        stats = train_step(ln.model, ln.optimizer, batch.groups, cfg, ln.algo)
    publish_s = ln.publisher.publish(ln.model, version=step, step=step)
    ln.broker.ack_trajectories(batch.entry_ids)
    ln.ledger.write(json.dumps({"step": step, "trained": [g.traj_id for g in batch.groups],
                                "stale": batch.stale_ids, "duplicate": batch.duplicate_ids,
                                "late": batch.late_ids, "filtered": batch.filtered_ids}) + "\n")
    metrics = step_metrics(batch, stats, {"step_s": time.monotonic() - t0, "publish_s": publish_s})
    if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0:
        metrics["eval/heldout_acc"] = ln.evaluate()
    ln.sink.log(step, metrics)
    ln.broker.set_run_fields(version=step, step=step, reward_mean=round(metrics["reward/mean"], 4),
                             wait_frac=round(metrics["perf/wait_frac"], 3),
                             staleness_max=metrics["async/staleness_max"],
                             samples_per_s=round(metrics["perf/samples_per_s"], 2),
                             tokens_per_s=round(metrics["perf/tokens_per_s"], 1))
    log.info("step %d/%d  v%d  reward %.3f  loss %.4f  stale<=%d  wait %.0f%%  %.1fs",
             step, cfg.trainer.total_steps, step, metrics["reward/mean"], metrics["loss/policy"],
             metrics["async/staleness_max"], 100 * metrics["perf/wait_frac"], metrics["perf/step_s"])
    return metrics


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 4) if values else 0.0


def run(cfg: Config) -> dict:
    setup_process("learner", seed=cfg.run.seed, torch_threads=cfg.run.torch_threads)
    ln = start(cfg)
    started = time.monotonic()
    acc_before = ln.evaluate()
    log.info("held-out greedy accuracy before training: %.3f", acc_before)
    ln.broker.set_run_fields(state="training", version=0, heldout_acc=acc_before)
    history = [learner_step(ln, step) for step in range(1, cfg.trainer.total_steps + 1)]
    acc_after = ln.evaluate()
    rewards = [m["reward/mean"] for m in history]
    summary = {
        "steps": len(history), "wall_s": round(time.monotonic() - started, 1),
        "final_version": len(history),
        "reward_first10": _mean(rewards[:10]), "reward_last10": _mean(rewards[-10:]),
        "heldout_acc_before": round(acc_before, 4), "heldout_acc_after": round(acc_after, 4),
        "heldout_size": len(ln.heldout),
        "max_staleness": max((m["async/staleness_max"] for m in history), default=0),
        "async_ratio": cfg.trainer.async_ratio, "prompts_issued": ln.admission.issued,
    }
    (Path(cfg.run.run_dir) / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    ln.broker.set_run_fields(state="done", heldout_acc=acc_after)
    ln.close()
    log.info("done: %s", json.dumps(summary))
    return summary
