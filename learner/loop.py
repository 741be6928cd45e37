"""The learner process: collect, train, publish, checkpoint, acknowledge, repeat.

    ln = start(cfg)                                   # learner/build.py: broker, models, optimiser
    every step:
        batch = ln.collector.collect(step, version)   # this rank's share of B fresh complete groups
        stats = train(ln, batch)                      # M x E decoupled-PPO updates (over the ranks)
        publish(ln, version + 1)                      # rank 0: versioned safetensors + hash + zmq
        record(ln, batch)                             # the ledger line; entries to acknowledge
        every trainer.checkpoint_every steps:
            checkpoint(ln)                            # learner/checkpoint.py: durable, then acknowledge

v0 is the model at `model.path`. Without a crash version v holds v learner steps (each of
`trainer.ppo_mini_batches` x `ppo_epochs` optimiser updates); a resumed
learner continues the version numbers after the last published one, and learner/lineage.py's
`Lineage` says which step each version holds. At the end the learner checkpoints, evaluates,
writes `summary.json`, and sets the run's `state` to `done`, which stops the generators.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from rollflash.broker.config import Config
from rollflash.broker.process import freeze_heap, setup_process, thaw_heap
from rollflash.broker.schema import Trajectory
from rollflash.learner.build import Learner, start
from rollflash.learner.checkpoint import checkpoint
from rollflash.learner.collect import Collected
from rollflash.learner.completions import pick_completions
from rollflash.learner.global_stats import global_std
from rollflash.learner.guards import guard_values
from rollflash.learner.metrics import MetricsSink, merge_rank_metrics, reward_breakdown
from rollflash.learner.pause import pause_point
from rollflash.learner.publish import publish
from rollflash.learner.simulated import SimulatedPolicy
from rollflash.learner.train import train_step

log = logging.getLogger(__name__)


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
        "async/prompts_issued": c.issued,
        "env/errors": sum(s.env_errors for g in c.groups for s in g.samples),
        **reward_breakdown(c.groups),
        "perf/wait_frac": c.wait_s / step_s,
        "perf/step_s": step_s,
        "perf/train_s": wall["train_s"],
        "perf/publish_s": wall["publish_s"],
        "perf/checkpoint_s": wall["checkpoint_s"],
        "perf/samples_per_s": len(rewards) / step_s,
        "perf/tokens_per_s": sum(lengths) / step_s,
    }


def train(ln: Learner, batch: Collected) -> dict[str, float]:
    """One optimiser step on this rank's share of the batch (a sleep for the simulated policy)."""
    if isinstance(ln.models.policy, SimulatedPolicy):
        stats = ln.models.policy.train_step()
    else:
        m = ln.models
        step_cfg = ln.guard.step_config(ln.cfg)  # with the adaptive kl_coef
        stats = train_step(m.model, ln.optim.optimizer, batch.groups, step_cfg, m.algo, ln.dist)
    ln.optim.scheduler.step()
    return stats


def record(ln: Learner, batch: Collected) -> None:
    """Note the step's entries as trained (acknowledged after the next checkpoint) and write the
    ledger line of what was trained, durably, before that (what was dropped has its own lines:
    learner/ledger.py)."""
    ln.progress.entry_ids += batch.entry_ids
    ln.progress.traj_ids += batch.part_ids
    row = {
        "step": ln.state.step,
        "version": ln.state.version,
        "trained": [g.traj_id for g in batch.groups],
        "refs": batch.entry_ids,
        "retried": batch.retried_ids,
    }
    ln.ledger.trained(row)


def add_to_history(ln: Learner, batch: Collected) -> None:
    """The step's mean reward and largest staleness over the ranks, for the summary."""
    rewards = [s.reward for g in batch.groups for s in g.samples]
    ranks = ln.dist.gather([sum(rewards), len(rewards), max(batch.staleness, default=0)])
    total, count = sum(r[0] for r in ranks), sum(r[1] for r in ranks)
    ln.history.add(total / max(count, 1), max(r[2] for r in ranks))


def make_durable(ln: Learner) -> float:
    """Checkpoint on checkpoint steps; returns the seconds it took. Without checkpoints the
    entries are acknowledged once published (a crash then loses these updates)."""
    every = ln.cfg.trainer.checkpoint_every
    checkpoint_s = checkpoint(ln) if (every and ln.state.step % every == 0) else 0.0
    if not every:
        ln.broker.ack_trajectories(ln.progress.entry_ids)
        ln.progress.clear()
    return checkpoint_s


def learner_step(ln: Learner) -> dict[str, float]:
    """Train step s into step s + 1, publish it as the next version and, on checkpoint steps,
    checkpoint and acknowledge; returns the step's metrics (merged over ranks)."""
    state, t0 = ln.state, time.monotonic()
    ln.broker.check_lease()  # renewed by every step, and stopped here if it was lost
    batch = ln.collector.collect(state.step, state.version)
    pause_point("after_read", state.step + 1)
    trained = time.monotonic()
    with ln.dist.waiting(f"the model's collectives in training step {state.step + 1}"):
        stats = train(ln, batch)
    train_s = time.monotonic() - trained
    state.step += 1
    state.version += 1
    with ln.dist.waiting(f"gathering the weights of version {state.version}"):
        publish_s = publish(ln, state.version, state.step)
    record(ln, batch)
    add_to_history(ln, batch)  # before the checkpoint, which holds the history
    pause_point("after_update", state.step)
    with ln.dist.waiting(f"the checkpoint of step {state.step}"):
        checkpoint_s = make_durable(ln)
    wall = {
        "step_s": time.monotonic() - t0,
        "train_s": train_s,
        "publish_s": publish_s,
        "checkpoint_s": checkpoint_s,
    }
    metrics = merged_metrics(ln, batch, stats, wall)
    if ln.cfg.eval.every and state.step % ln.cfg.eval.every == 0:
        metrics["eval/heldout_acc"] = ln.evaluator.greedy(state.step)
        keep_if_best(ln, metrics["eval/heldout_acc"])
        metrics.update(ln.evaluator.by_domain)  # a mixture's eval/<domain>/heldout_acc
        metrics.update(ln.evaluator.sampled(state.step))
    if ln.sink is not None:  # rank 0
        _report(ln, ln.sink, metrics, batch.groups)
    return metrics


def keep_if_best(ln: Learner, accuracy: float) -> None:
    """Offer the version just evaluated (the current one) to `eval.keep_best` (rank 0)."""
    best = ln.best
    if best is None or ln.simulated or ln.publisher is None:
        return
    if best.accuracy is not None and accuracy <= best.accuracy:
        return
    ln.publisher.wait()  # the version is on disk, manifest last, before it is linked
    best.offer(ln.publisher.store, ln.state.version, ln.state.step, accuracy)


def best_fields(ln: Learner) -> dict[str, Any]:
    """The summary's record of the kept best version (rank 0 with eval.keep_best)."""
    if ln.best is None or ln.best.record is None or ln.best.accuracy is None:
        return {}
    return {"best_version": ln.best.latest(), "best_heldout_acc": round(ln.best.accuracy, 4)}


def merged_metrics(
    ln: Learner, batch: Collected, stats: dict[str, float], wall: dict[str, float]
) -> dict[str, float]:
    """The step's metrics merged over the ranks, with the guards' verdict on them."""
    local = step_metrics(
        batch,
        {
            **stats,
            "optim/lr": float(ln.optim.scheduler.get_last_lr()[0]),
            "redis/lost_prompts": ln.broker.lost["prompts"],
            "redis/lost_trajectory_writes": ln.broker.lost["trajectory_writes"],
            **guard_values(batch.groups, ln.cfg.guards.ngram_n),
        },
        wall,
    )
    metrics = merge_rank_metrics(ln.dist.gather([local, len(batch.groups)]))
    if "guard/score_std" in metrics:  # the std of every rank's rewards, not a mean of stds
        rewards = [s.reward for g in batch.groups for s in g.samples]
        metrics["guard/score_std"] = global_std(rewards, ln.dist)
    metrics.update(
        ln.guard.after_step(
            metrics,
            int(ln.dist.sum(sum(len(g.samples) for g in batch.groups))),
            ln.broker if ln.dist.is_main else None,
        )
    )
    return metrics


def _report(
    ln: Learner, sink: MetricsSink, metrics: dict[str, float], groups: list[Trajectory]
) -> None:
    cfg, step = ln.cfg, ln.state.step
    n, version = cfg.logging.completions_per_step, ln.state.version - 1  # collected at version
    decode = ln.models.tokenizer.decode if ln.models.tokenizer is not None else str
    rows = pick_completions(groups, n, version, cfg.run.seed, step, decode)
    sink.log_completions(step, rows)
    idle, metrics["reward/errors"] = ln.broker.generator_stats()
    metrics["gen/idle_frac"] = float("nan") if idle is None else idle
    metrics.update(ln.broker.generator_reloads())
    filtered = getattr(ln.task, "filtered", None)  # a dataset's prompts over max_prompt_tokens
    if filtered is not None:
        metrics["data/filtered_train"] = filtered["train"]
        metrics["data/filtered_heldout"] = filtered["heldout"]
    sink.log(step, metrics)
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


def _flat(key: str) -> str:
    """eval/code/heldout_acc -> code_heldout_acc (a summary key)."""
    return key.removeprefix("eval/").replace("/", "_")


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return round(sum(values) / len(values), 4) if values else 0.0


def begin(ln: Learner) -> dict[str, float]:
    """Held-out accuracy before training (on a fresh run), and the run's state to `training`;
    returns the sampled evaluation before training (`eval.n_samples`) for the summary."""
    sampled = {}
    if ln.state.step == 0:
        ln.state.heldout_acc_before = ln.evaluator.greedy(0)
        log.info("held-out greedy accuracy before training: %.3f", ln.state.heldout_acc_before)
        keep_if_best(ln, ln.state.heldout_acc_before)
        sampled = {
            f"{k.removeprefix('eval/')}_before": v for k, v in ln.evaluator.sampled(0).items()
        }
        sampled.update({f"{_flat(k)}_before": v for k, v in ln.evaluator.by_domain.items()})
    if ln.dist.is_main:
        ln.broker.set_run_fields(
            state="training",
            heldout_acc=ln.state.heldout_acc_before,
            learner_ranks=ln.dist.world_size,
        )
    return sampled


def finish(ln: Learner, started: float, sampled: dict[str, float]) -> dict[str, Any]:
    """Checkpoint the last steps, evaluate, write summary.json and set the run's state to
    `done`; returns the summary."""
    cfg, history = ln.cfg, ln.history
    every = cfg.trainer.checkpoint_every
    if every and history.steps_this_process and ln.state.step % every:
        checkpoint(ln)  # the last steps' entries are acknowledged only once this is durable
    if ln.publisher is not None:
        ln.publisher.wait()  # the last version is announced before the run is done
    acc_after = ln.evaluator.greedy(ln.state.step)
    keep_if_best(ln, acc_after)
    by_domain = {_flat(k): v for k, v in ln.evaluator.by_domain.items()}
    after = ln.evaluator.sampled(ln.state.step).items()
    sampled = {**sampled, **{f"{k.removeprefix('eval/')}_after": v for k, v in after}}
    summary = {
        "steps": ln.state.step,
        "steps_this_process": history.steps_this_process,
        "wall_s_this_process": round(time.monotonic() - started, 1),
        "final_version": ln.state.version,
        "reward_first10": _mean(history.first_rewards),
        "reward_last10": _mean(history.last_rewards),
        "heldout_acc_before": round(ln.state.heldout_acc_before, 4),
        "heldout_acc_after": round(acc_after, 4),
        "heldout_size": len(ln.evaluator.items),
        "max_staleness": history.max_staleness,
        "async_ratio": cfg.trainer.async_ratio,
        "prompts_issued": ln.collector.admission.issued,
        "learner_ranks": ln.dist.world_size,
        "stopped_by_guard": ln.guard.stop_reason,
        **best_fields(ln),
        **{k: round(v, 4) for k, v in sampled.items()},
        **{f"{k}_after": round(v, 4) for k, v in by_domain.items()},
    }
    if ln.dist.is_main:
        (Path(cfg.run.run_dir) / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        ln.broker.set_run_fields(state="done", heldout_acc=acc_after)
        log.info("done: %s", json.dumps(summary))
    return summary


def run(
    cfg: Config,
    resume: bool | None = None,
    on_step: Callable[[dict], None] | None = None,
    take_over: bool = False,
) -> dict[str, Any]:
    """Train until `trainer.total_steps` (or a guard stops the run); returns the summary.
    `on_step`: called on rank 0 with each step's metrics row (`step` included), e.g. a
    progress bar (rollctl/progress.py); `take_over`: take the run's lease from a learner the
    operator knows is dead (broker/lease.py)."""
    setup_process("learner", seed=cfg.run.seed, torch_threads=cfg.run.torch_threads)
    ln = start(cfg, resume, take_over)
    try:
        return _train(ln, cfg, on_step)
    except BaseException:
        if ln.dist.is_main:
            ln.broker.release()  # a learner that failed frees the run for its successor
        raise


def _train(ln: Learner, cfg: Config, on_step: Callable[[dict], None] | None) -> dict[str, Any]:
    """`run`'s steps, from the first evaluation to the summary."""
    started = time.monotonic()
    sampled_before = begin(ln)
    if ln.publisher is not None:
        ln.publisher.ready()  # a publishing process competes for the cores only while it starts
    freeze_heap()  # what start-up built stays: full collections then skip it
    for _ in range(ln.state.step, cfg.trainer.total_steps):
        metrics = learner_step(ln)
        if on_step is not None and ln.dist.is_main:
            on_step({"step": ln.state.step, **metrics})
        if ln.guard.stop_requested:  # guards.stop_on_guard
            break
    summary = finish(ln, started, sampled_before)
    thaw_heap()
    ln.close()
    return summary
