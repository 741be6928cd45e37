"""The learner process: collect, train, publish, checkpoint, acknowledge, repeat.

    batch = collector.collect(step, version)   # this rank's share of B fresh complete groups
    stats = train_step(model, opt, batch)       # one decoupled-PPO update (DDP over the ranks)
    publish(model, version + 1)                 # rank 0: versioned safetensors + hash + zmq
    every trainer.checkpoint_every steps:
        checkpoint(...)                         # model, optimiser, counters, trained entry ids
        ack(entries trained since the last one) # only now: a crash re-delivers them

v0 is the model at `model.path`. Without a crash version v holds v optimiser updates; a resumed
learner continues the version numbers after the last published one, and learner/checkpoint.py's
`Lineage` says which step each version holds. At the end the learner checkpoints, evaluates,
writes `summary.json`, and sets the run's `state` to `done`, which stops the generators.

Set ROLLFLASH_PAUSE_AT=<point>:<step> (points: after_read, after_update, after_checkpoint) and the
learner stops itself with SIGSTOP there, so a fault test can kill -9 it inside that exact window.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollflash.algos import RunningRewardNorm
from rollflash.broker.config import Config
from rollflash.broker.connection import connect
from rollflash.broker.learner_side import LearnerBroker
from rollflash.broker.notify import VersionPublisher
from rollflash.broker.process import setup_process
from rollflash.broker.schema import Trajectory
from rollflash.broker.weights import WeightStore
from rollflash.broker.wire import WireLimits
from rollflash.envs import Item, Task, is_multi_turn, task_from_config, train_stream
from rollflash.envs.chat import PromptFormatter, format_task
from rollflash.learner.admission import Admission
from rollflash.learner.checkpoint import (
    CheckpointStore,
    LearnerState,
    RankProgress,
    restore_rng,
    rng_state,
)
from rollflash.learner.collect import Collected, Collector
from rollflash.learner.completions import pick_completions
from rollflash.learner.dist import (
    Dist,
    full_state_dict,
    init_dist,
    is_sharded,
    load_optimizer_state,
    optimizer_state,
    wrap_model,
)
from rollflash.learner.evaluate import heldout_accuracy, sampled_eval
from rollflash.learner.filters import drop_reason
from rollflash.learner.guards import GuardMonitor, guard_values
from rollflash.learner.metrics import MetricsSink, merge_rank_metrics, open_sink
from rollflash.learner.prepare import AlgoModels, build_algo_models
from rollflash.learner.simulated import SimulatedPolicy
from rollflash.learner.train import train_step

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_policy(cfg: Config):
    path = Path(cfg.model.path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path: no Hugging Face model directory at {path} "
            "(build one with scripts/make_tiny_model.py)"
        )
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[cfg.model.dtype])
    return model, tokenizer


class Publisher:
    """Writes a version to the weight store, records it in Redis and announces it over zmq."""

    def __init__(self, cfg: Config, broker: LearnerBroker, resuming: bool):
        self.store = WeightStore(cfg.run.run_dir)
        if self.store.versions() and not resuming:
            raise FileExistsError(
                f"run.run_dir: {cfg.run.run_dir} holds weights but no learner "
                "checkpoint to resume from; choose another run_dir or delete it"
            )
        removed = self.store.clean_temp()
        if removed:
            log.warning("removed %d partial weight versions left by an earlier crash", removed)
        self.broker = broker
        self.keep = cfg.trainer.keep_versions
        self.zmq = VersionPublisher()

    def publish(self, weights: dict[str, torch.Tensor], version: int, step: int) -> float:
        started = time.monotonic()
        info = self.store.publish(weights, version, step)
        self.broker.announce_weights(version, info.path, info.sha256, self.zmq.endpoint)
        self.zmq.announce(version, info.path, info.sha256)
        self.store.retain(self.keep, in_use=self.broker.loaded_versions())
        return time.monotonic() - started

    def close(self) -> None:
        self.zmq.close()


def step_metrics(c: Collected, train: dict[str, float], wall: dict[str, float]) -> dict[str, float]:
    """This rank's metrics of the step (merged over ranks by metrics.merge_rank_metrics)."""
    rewards = [s.reward for g in c.groups for s in g.samples]
    lengths = [len(s.response_ids) for g in c.groups for s in g.samples]
    step_s = wall["step_s"]
    return {
        **train,
        "reward/mean": sum(rewards) / max(len(rewards), 1),
        "response/length_mean": sum(lengths) / max(len(lengths), 1),
        "async/staleness_max": max(c.staleness, default=0),
        "async/staleness_mean": sum(k * v for k, v in c.staleness.items()) / max(len(c.groups), 1),
        **{f"async/staleness_hist/{k}": v for k, v in sorted(c.staleness.items())},
        "async/dropped_stale": len(c.stale_ids),
        "async/duplicates": len(c.duplicate_ids),
        "async/late_samples": len(c.late_ids),
        "async/retried": len(c.retried_ids),
        **{f"filter/dropped_{reason}": n for reason, n in sorted(c.filtered.items())},
        "async/rejected": c.rejected,
        "env/errors": sum(s.env_errors for g in c.groups for s in g.samples),
        "perf/wait_frac": c.wait_s / step_s,
        "perf/step_s": step_s,
        "perf/publish_s": wall["publish_s"],
        "perf/checkpoint_s": wall["checkpoint_s"],
        "perf/samples_per_s": len(rewards) / step_s,
        "perf/tokens_per_s": sum(lengths) / step_s,
    }


@dataclass
class Learner:
    """Everything one learner rank holds; built once by `start`."""

    cfg: Config
    dist: Dist
    broker: LearnerBroker
    task: Task
    heldout: list[Item]
    model: torch.nn.Module  # DistributedDataParallel around `policy` with several ranks
    policy: torch.nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    collector: Collector
    checkpoints: CheckpointStore
    state: LearnerState
    publisher: Publisher | None  # rank 0 only
    sink: MetricsSink | None  # rank 0 only
    ledger: TextIO  # one JSON line per step: the trajectory ids trained or dropped
    progress: RankProgress = field(default_factory=RankProgress)  # trained, not yet acknowledged
    algo: AlgoModels = field(default_factory=AlgoModels)  # reference, critic (learner/prepare.py)
    guard: GuardMonitor | None = None  # reward-hacking guards, adaptive kl_coef (learner/guards.py)

    def evaluate(self) -> float:
        """Greedy held-out accuracy, on rank 0 (with FSDP every rank generates: the shards are
        gathered in every forward pass)."""
        if isinstance(self.policy, SimulatedPolicy) or not (
            self.dist.is_main or is_sharded(self.model)
        ):
            return 0.0
        e = self.cfg.eval
        return heldout_accuracy(
            self.policy,
            self.tokenizer,
            self.task,
            self.heldout,
            e.max_new_tokens or self.cfg.rollout.max_new_tokens,
            threshold=e.threshold,
        )

    def evaluate_sampled(self) -> dict[str, float]:
        """`eval.n_samples` > 0: mean reward, pass@1 and pass@k on the held-out items (rank 0)."""
        e = self.cfg.eval
        if not e.n_samples or isinstance(self.policy, SimulatedPolicy) or not self.dist.is_main:
            return {}
        if is_multi_turn(self.task) or is_sharded(self.model):
            return {}  # episodes have their own success rate; sharded weights need every rank
        return sampled_eval(
            self.policy,
            self.tokenizer,
            self.task,
            self.heldout,
            e.n_samples,
            e.temperature,
            e.max_new_tokens or self.cfg.rollout.max_new_tokens,
            e.threshold,
            seed=self.cfg.run.seed + self.state.step,
        )

    def close(self) -> None:
        self.ledger.close()
        if self.sink is not None:
            self.sink.close()
        if self.publisher is not None:
            self.publisher.close()
        self.dist.close()


def publish(ln: Learner, version: int, step: int) -> float:
    """Publish the policy as `version` (rank 0; every rank helps gather FSDP shards)."""
    weights = full_state_dict(ln.model)
    return ln.publisher.publish(weights, version, step) if ln.dist.is_main else 0.0


def pause_point(name: str, step: int) -> None:
    """Stop this process here when ROLLFLASH_PAUSE_AT names this point (fault tests)."""
    if os.environ.get("ROLLFLASH_PAUSE_AT") == f"{name}:{step}":
        log.warning("pausing at %s of step %d (ROLLFLASH_PAUSE_AT)", name, step)
        os.kill(os.getpid(), signal.SIGSTOP)


def lr_schedule(cfg: Config):
    """Linear warm-up over `trainer.lr_warmup_steps`, then constant or cosine decay to 0."""
    t = cfg.trainer

    def factor(step: int) -> float:
        if step < t.lr_warmup_steps:
            return (step + 1) / t.lr_warmup_steps
        if t.lr_schedule == "cosine":
            done = (step - t.lr_warmup_steps) / max(1, t.total_steps - t.lr_warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, done)))
        return 1.0

    return factor


def start(cfg: Config, resume: bool | None = None) -> Learner:
    """Build this rank's learner. `resume`: None resumes when a checkpoint exists, True requires
    one, False refuses to start over an earlier run's weights."""
    dist = init_dist()
    run_dir = Path(cfg.run.run_dir)
    if dist.is_main:
        cfg.save(run_dir / "config.yaml")
    broker = LearnerBroker(
        connect(cfg.redis.url, cfg.redis.connect_timeout_s),
        cfg.run.run_id,
        cfg.redis.max_payload_bytes,
        limits=WireLimits.for_config(cfg, vocab_size=None),
    )
    broker.ensure_groups()  # before registering: generators wait for the registration
    broker.register_run(cfg.fingerprint())
    broker.check_intact()  # a Redis that came back empty is reported, never silently re-created
    if dist.is_main:  # one witness of forgotten trajectory writes per run, not one per rank
        broker.track_trajectory_writes()
    checkpoints = CheckpointStore(run_dir)
    ckpt = None if resume is False else checkpoints.latest()
    if resume and ckpt is None:
        raise FileNotFoundError(f"--resume: no learner checkpoint in {checkpoints.root}")
    task = task_from_config(cfg)
    sim = cfg.sim.learner_step_s > 0
    policy, tokenizer = (SimulatedPolicy(cfg.sim), None) if sim else load_policy(cfg)
    # prompts are rendered (chat template) here, once, before they are issued: envs/chat.py
    task = format_task(task, PromptFormatter(tokenizer, cfg.model.chat_template))
    algo = AlgoModels() if sim else build_algo_models(cfg)
    state, optim_states = LearnerState(), None
    if ckpt is not None:  # weights go in before sharding; optimiser state after
        state, optim_states = CheckpointStore.load(ckpt, policy, algo.critic)
    model = policy if sim else wrap_model(policy, dist, cfg.trainer.strategy)
    if algo.critic is not None and dist.world_size > 1:
        algo.critic = DistributedDataParallel(algo.critic)
    optimizer = torch.optim.AdamW(
        policy.parameters(), lr=cfg.trainer.actor_lr, weight_decay=cfg.trainer.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(cfg))
    if optim_states is not None:
        load_optimizer_state(model, optimizer, optim_states["optimizer"])
        scheduler.load_state_dict(optim_states["scheduler"])
        if algo.critic_optimizer is not None:
            algo.critic_optimizer.load_state_dict(optim_states["critic_optimizer"])
        algo.reward_norm = RunningRewardNorm(**state.reward_norm)
        restore_rng(state.rng)
    run = broker.run_fields()
    state.issued = max(state.issued, int(run.get("issued", 0)))  # Redis is exact; see admission
    admission = Admission(
        train_stream(task, cfg.run.seed, state.issued),
        cfg.trainer.rollout_batch_size,
        cfg.trainer.async_ratio,
        cfg.rollout.num_return_sequences,
        issued=state.issued,
        replicas=cfg.rollout.num_return_sequences + cfg.rollout.redundant_samples
        if cfg.rollout.replicate_prompts
        else 0,
    )
    vocab = policy.config.vocab_size
    collector = Collector(
        broker,
        admission,
        cfg.rollout.num_return_sequences,
        vocab,
        cfg.trainer.max_staleness,
        cfg.trainer.wait_timeout_s,
        drop=lambda g: drop_reason(g, cfg),
        dist=dist,
        lineage=state.lineage,
    )
    collector.seen.update(state.seen)
    ledger_name = "ledger.jsonl" if dist.is_main else f"ledger.rank{dist.rank}.jsonl"
    ln = Learner(
        cfg=cfg,
        dist=dist,
        broker=broker,
        task=task,
        heldout=task.heldout_items()[: cfg.task.eval_size or None],
        model=model,
        policy=policy,
        tokenizer=tokenizer,
        optimizer=optimizer,
        scheduler=scheduler,
        collector=collector,
        checkpoints=checkpoints,
        state=state,
        publisher=Publisher(cfg, broker, resuming=ckpt is not None) if dist.is_main else None,
        sink=open_sink(cfg, state.trackers) if dist.is_main else None,
        ledger=open(run_dir / ledger_name, "a", buffering=1),
        algo=algo,
    )
    ln.guard = GuardMonitor(cfg)
    for name, value in state.guards.items():  # adaptive kl_coef and guard streaks, resumed
        setattr(ln.guard, name, value)
    if ckpt is None:
        publish(ln, version=0, step=0)
    else:
        _resume(ln, ckpt)
    dist.barrier()
    return ln


def _resume(ln: Learner, ckpt: Path) -> None:
    """Continue after the checkpoint: publish it as the next version, acknowledge what it
    already holds, and queue this rank's other pending entries to be trained again."""
    state, dist = ln.state, ln.dist
    last = max([state.version] + (ln.publisher.store.versions() if dist.is_main else []))
    last = dist.gather(last)[0]
    state.version = last + 1
    state.lineage.rebase(state.version, state.step)
    publish(ln, version=state.version, step=state.step)
    if dist.is_main:
        ln.broker.set_run_fields(
            version=state.version, step=state.step, state="training", resumed_from_step=state.step
        )
    done = RankProgress(**state.ranks.get(dist.consumer, {}))
    ln.broker.ack_trajectories(done.entry_ids)
    done_ids = set(done.entry_ids)
    after = "0"
    while True:
        good, _ = ln.broker.read_trajectories(
            dist.consumer,
            count=512,
            block_ms=0,
            vocab_size=ln.policy.config.vocab_size,
            own_pending=True,
            after=after,
        )
        if not good:
            break
        after = good[-1][0]
        ln.collector.backlog += [(i, t) for i, t in good if i not in done_ids]
    log.info(
        "resumed from %s: step %d, now version %d; %d pending entries to train again",
        ckpt.name,
        state.step,
        state.version,
        len(ln.collector.backlog),
    )
    ln.ledger.write(
        json.dumps({"event": "resume", "step": state.step, "version": state.version}) + "\n"
    )


def checkpoint(ln: Learner) -> float:
    """Make the model's current state durable, then acknowledge what it was trained on."""
    started, dist, state = time.monotonic(), ln.dist, ln.state
    parts = dist.gather(
        [
            dist.consumer,
            ln.progress.entry_ids,
            ln.progress.traj_ids,
            sorted(ln.collector.seen | ln.collector.trained),
        ]
    )
    weights = full_state_dict(ln.model)  # collective with FSDP
    optim = {
        "optimizer": optimizer_state(ln.model, ln.optimizer),
        "scheduler": ln.scheduler.state_dict(),
    }
    if dist.is_main:
        state.ranks = {name: {"entry_ids": ids, "traj_ids": trajs} for name, ids, trajs, _ in parts}
        state.seen = sorted({t for *_, seen in parts for t in seen})
        state.issued = ln.collector.admission.issued
        state.replaced = ln.broker.replaced_groups()
        state.reward_norm = vars(ln.algo.reward_norm).copy()
        state.rng = rng_state()
        g = ln.guard
        state.guards = {
            "kl_coef": g.kl_coef,
            "kl_history": g.kl_history,
            "streaks": g.streaks,
            "first_score_std": g.first_score_std,
        }
        if ln.algo.critic_optimizer is not None:
            optim["critic_optimizer"] = ln.algo.critic_optimizer.state_dict()
        ln.checkpoints.save(
            state, weights, optim, getattr(ln.algo.critic, "module", ln.algo.critic)
        )
        ln.broker.set_run_fields(checkpoint_step=state.step)
    dist.barrier()
    pause_point("after_checkpoint", state.step)
    ln.broker.ack_trajectories(ln.progress.entry_ids)
    ln.progress.clear()
    return time.monotonic() - started


def learner_step(ln: Learner) -> dict[str, float]:
    """Train step s into step s + 1, publish it as the next version and, on checkpoint steps,
    checkpoint and acknowledge; returns the step's metrics (merged over ranks)."""
    cfg, state, t0 = ln.cfg, ln.state, time.monotonic()
    batch = ln.collector.collect(state.step, state.version)
    pause_point("after_read", state.step + 1)
    if isinstance(ln.policy, SimulatedPolicy):
        stats = ln.policy.train_step()
    else:
        stats = train_step(
            ln.model, ln.optimizer, batch.groups, ln.guard.step_config(cfg), ln.algo, ln.dist
        )
    ln.scheduler.step()
    state.step += 1
    state.version += 1
    publish_s = publish(ln, state.version, state.step)
    ln.progress.entry_ids += batch.entry_ids
    ln.progress.traj_ids += [g.traj_id for g in batch.groups]
    ln.ledger.write(
        json.dumps(
            {
                "step": state.step,
                "version": state.version,
                "trained": [g.traj_id for g in batch.groups],
                "stale": batch.stale_ids,
                "duplicate": batch.duplicate_ids,
                "late": batch.late_ids,
                "filtered": batch.filtered_ids,
                "retried": batch.retried_ids,
            }
        )
        + "\n"
    )
    pause_point("after_update", state.step)
    every = cfg.trainer.checkpoint_every
    checkpoint_s = checkpoint(ln) if (every and state.step % every == 0) else 0.0
    if not every:  # no checkpoints: acknowledge once published (a crash loses these updates)
        ln.broker.ack_trajectories(ln.progress.entry_ids)
        ln.progress.clear()
    local = step_metrics(
        batch,
        {
            **stats,
            "optim/lr": ln.scheduler.get_last_lr()[0],
            "redis/lost_prompts": ln.broker.lost["prompts"],
            "redis/lost_trajectory_writes": ln.broker.lost["trajectory_writes"],
            **guard_values(batch.groups, cfg.guards.ngram_n),
        },
        {"step_s": time.monotonic() - t0, "publish_s": publish_s, "checkpoint_s": checkpoint_s},
    )
    metrics = merge_rank_metrics(ln.dist.gather([local, len(batch.groups)]))
    metrics.update(
        ln.guard.after_step(
            metrics,
            ln.dist.sum(sum(len(g.samples) for g in batch.groups)),
            ln.broker if ln.dist.is_main else None,
        )
    )
    if cfg.trainer.eval_every and state.step % cfg.trainer.eval_every == 0:
        metrics["eval/heldout_acc"] = ln.evaluate()
        metrics.update(ln.evaluate_sampled())
    if ln.dist.is_main:
        _report(ln, metrics, batch.groups)
    return metrics


def _report(ln: Learner, metrics: dict[str, float], groups: list[Trajectory]) -> None:
    cfg, step = ln.cfg, ln.state.step
    n, version = cfg.logging.completions_per_step, ln.state.version - 1  # collected at version
    rows = pick_completions(groups, n, version, cfg.run.seed, step, ln.tokenizer.decode)
    ln.sink.log_completions(step, rows)
    metrics["gen/idle_frac"] = ln.broker.generator_idle_frac()
    ln.sink.log(step, metrics)
    ln.broker.set_run_fields(
        version=ln.state.version,
        step=step,
        reward_mean=round(metrics["reward/mean"], 4),
        wait_frac=round(metrics["perf/wait_frac"], 3),
        staleness_max=metrics["async/staleness_max"],
        samples_per_s=round(metrics["perf/samples_per_s"], 2),
        tokens_per_s=round(metrics["perf/tokens_per_s"], 1),
    )
    log.info(
        "step %d/%d  v%d  reward %.3f  loss %.4f  stale<=%d  wait %.0f%%  %.1fs",
        step,
        cfg.trainer.total_steps,
        ln.state.version,
        metrics["reward/mean"],
        metrics["loss/policy"],
        metrics["async/staleness_max"],
        100 * metrics["perf/wait_frac"],
        metrics["perf/step_s"],
    )


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 4) if values else 0.0


def run(cfg: Config, resume: bool | None = None) -> dict:
    setup_process("learner", seed=cfg.run.seed, torch_threads=cfg.run.torch_threads)
    ln = start(cfg, resume)
    started = time.monotonic()
    sampled = {}  # eval.n_samples: sampled evaluation before (this process's) training
    if ln.state.step == 0:
        ln.state.heldout_acc_before = ln.evaluate()
        log.info("held-out greedy accuracy before training: %.3f", ln.state.heldout_acc_before)
        sampled = {f"{k.removeprefix('eval/')}_before": v for k, v in ln.evaluate_sampled().items()}
    if ln.dist.is_main:
        ln.broker.set_run_fields(
            state="training",
            heldout_acc=ln.state.heldout_acc_before,
            learner_ranks=ln.dist.world_size,
        )
    history = []
    for _ in range(ln.state.step, cfg.trainer.total_steps):
        history.append(learner_step(ln))
        if ln.guard.stop_requested:  # guards.stop_on_guard
            break
    every = cfg.trainer.checkpoint_every
    if every and history and ln.state.step % every:
        checkpoint(ln)  # the last steps' entries are acknowledged only once this is durable
    acc_after = ln.evaluate()
    sampled.update(
        {f"{k.removeprefix('eval/')}_after": v for k, v in ln.evaluate_sampled().items()}
    )
    rewards = [m["reward/mean"] for m in history]
    summary = {
        "steps": ln.state.step,
        "steps_this_process": len(history),
        "wall_s": round(time.monotonic() - started, 1),
        "final_version": ln.state.version,
        "reward_first10": _mean(rewards[:10]),
        "reward_last10": _mean(rewards[-10:]),
        "heldout_acc_before": round(ln.state.heldout_acc_before, 4),
        "heldout_acc_after": round(acc_after, 4),
        "heldout_size": len(ln.heldout),
        "max_staleness": max((m["async/staleness_max"] for m in history), default=0),
        "async_ratio": cfg.trainer.async_ratio,
        "prompts_issued": ln.collector.admission.issued,
        "learner_ranks": ln.dist.world_size,
        "stopped_by_guard": ln.guard.stop_reason,
        **{k: round(v, 4) for k, v in sampled.items()},
    }
    if ln.dist.is_main:
        (Path(cfg.run.run_dir) / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        ln.broker.set_run_fields(state="done", heldout_acc=acc_after)
        log.info("done: %s", json.dumps(summary))
    ln.close()
    return summary
