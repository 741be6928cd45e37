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
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from broker.config import Config
from broker.connection import connect
from broker.notify import VersionPublisher
from broker.process import setup_process
from broker.streams import RunBroker
from broker.weights import WeightStore
from envs import make_task
from learner.admission import Admission
from learner.batch import group_records, micro_batches
from learner.collect import Collected, collect
from learner.evaluate import heldout_accuracy
from learner.metrics import MetricsSink
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
        "async/rejected": c.rejected,
        "perf/wait_frac": c.wait_s / step_s, "perf/step_s": step_s,
        "perf/publish_s": wall["publish_s"],
        "perf/samples_per_s": len(rewards) / step_s, "perf/tokens_per_s": sum(lengths) / step_s,
    }


def run(cfg: Config) -> dict:
    setup_process("learner", seed=cfg.run.seed, torch_threads=cfg.run.torch_threads)
    run_dir = Path(cfg.run.run_dir)
    cfg.save(run_dir / "config.yaml")
    broker = RunBroker(connect(cfg.redis.url, cfg.redis.connect_timeout_s), cfg.run.run_id,
                       cfg.redis.max_payload_bytes)
    broker.register_run(cfg.fingerprint())
    broker.ensure_groups()
    task = make_task(cfg.task.name, cfg.task.params)
    heldout = task.heldout_items()[:cfg.task.eval_size or None]
    model, tokenizer = load_policy(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.actor_lr,
                                  weight_decay=cfg.trainer.weight_decay)
    publisher = Publisher(cfg, broker)
    publisher.publish(model, version=0, step=0)
    admission = Admission(task.train_items(cfg.run.seed), cfg.trainer.rollout_batch_size,
                          cfg.trainer.async_ratio, cfg.rollout.num_return_sequences)
    sink = MetricsSink(run_dir)
    ledger = open(run_dir / "ledger.jsonl", "a", buffering=1)  # which trajectory went where
    started = time.monotonic()
    acc_before = heldout_accuracy(model, tokenizer, task, heldout, cfg.rollout.max_new_tokens)
    log.info("held-out greedy accuracy before training: %.3f", acc_before)
    broker.set_run_fields(state="training", version=0, heldout_acc=acc_before)
    seen: set[str] = set()
    reward_curve: list[float] = []
    max_staleness = 0
    for step in range(1, cfg.trainer.total_steps + 1):
        version = step - 1
        t0 = time.monotonic()
        batch = collect(broker, admission, version, cfg.trainer.max_staleness, seen,
                        model.config.vocab_size, consumer="rank0",
                        timeout_s=cfg.trainer.wait_timeout_s)
        records = group_records(batch.groups, scale=cfg.algo.adv_estimator == "grpo")
        stats = train_step(model, optimizer, micro_batches(records, cfg.trainer.micro_batch_size),
                           cfg)
        publish_s = publisher.publish(model, version=step, step=step)
        broker.ack_trajectories(batch.entry_ids)
        ledger.write(json.dumps({"step": step, "trained": [g.traj_id for g in batch.groups],
                                 "stale": batch.stale_ids,
                                 "duplicate": batch.duplicate_ids}) + "\n")
        metrics = step_metrics(batch, stats, {"step_s": time.monotonic() - t0,
                                              "publish_s": publish_s})
        if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0:
            metrics["eval/heldout_acc"] = heldout_accuracy(model, tokenizer, task, heldout,
                                                           cfg.rollout.max_new_tokens)
        sink.log(step, metrics)
        broker.set_run_fields(version=step, step=step)
        reward_curve.append(metrics["reward/mean"])
        max_staleness = max(max_staleness, metrics["async/staleness_max"])
        log.info("step %d/%d  v%d  reward %.3f  loss %.4f  stale<=%d  wait %.0f%%  %.1fs",
                 step, cfg.trainer.total_steps, step, metrics["reward/mean"],
                 metrics["loss/policy"], metrics["async/staleness_max"],
                 100 * metrics["perf/wait_frac"], metrics["perf/step_s"])
    acc_after = heldout_accuracy(model, tokenizer, task, heldout, cfg.rollout.max_new_tokens)
    summary = {
        "steps": cfg.trainer.total_steps, "wall_s": round(time.monotonic() - started, 1),
        "final_version": cfg.trainer.total_steps,
        "reward_first10": round(sum(reward_curve[:10]) / len(reward_curve[:10]), 4),
        "reward_last10": round(sum(reward_curve[-10:]) / len(reward_curve[-10:]), 4),
        "heldout_acc_before": round(acc_before, 4), "heldout_acc_after": round(acc_after, 4),
        "heldout_size": len(heldout), "max_staleness": max_staleness,
        "async_ratio": cfg.trainer.async_ratio, "prompts_issued": admission.issued,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    broker.set_run_fields(state="done", heldout_acc=acc_after)
    sink.close()
    ledger.close()
    publisher.close()
    log.info("done: %s", json.dumps(summary))
    return summary
