"""The learner process: collect, train, publish, checkpoint, acknowledge, repeat.

    ln = start(cfg)                                   # learner/build.py: broker, models, optimiser
    every step:
        batch = ln.collector.collect(step, version)   # this rank's share of B fresh complete groups
        stats = train(ln, batch)                      # M x E decoupled-PPO updates (over the ranks)
        ln.publish(version + 1)                       # rank 0: versioned safetensors + hash + zmq
        record(ln, batch)                             # the ledger line; entries to acknowledge
        every trainer.checkpoint_every steps:
            checkpoint(ln)                            # learner/rank.py: durable, then acknowledge

v0 is the model at `model.path`. Without a crash version v holds v learner steps (each of
`trainer.ppo_mini_batches` x `ppo_epochs` optimiser updates); a resumed
learner continues the version numbers after the last published one, and learner/intake/lineage.py's
`Lineage` says which step each version holds. At the end the learner checkpoints, evaluates
(once: the last step's evaluation when `eval.every` made one), writes `summary.json`, and sets
the run's `state` to `done`, which stops the generators. SIGTERM or SIGINT stops it at a step
boundary, checkpointed, with the run's lease released (learner/process/stop.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from rollflash.broker.config.config import Config
from rollflash.broker.config.process import freeze_heap, setup_process, thaw_heap
from rollflash.broker.wire.schema import Trajectory
from rollflash.errors import Stopped
from rollflash.learner.build import start
from rollflash.learner.evaluation.heldout import Evaluation, best_fields, evaluate, keep_if_best
from rollflash.learner.intake.collect import NoData
from rollflash.learner.intake.collected import Collected
from rollflash.learner.metrics.completions import pick_completions
from rollflash.learner.metrics.guards import guard_values
from rollflash.learner.metrics.health import step_health, summary_fields
from rollflash.learner.metrics.metrics import MetricsSink, merge_rank_metrics, reward_breakdown
from rollflash.learner.process.stop import StopSignals, stopped_at_once, stopped_cleanly
from rollflash.learner.rank import Learner, checkpoint
from rollflash.learner.step.global_stats import global_std

log = logging.getLogger(__name__)


def step_metrics(c: Collected, train: dict[str, float], wall: dict[str, float]) -> dict[str, float]:
    """This rank's metrics of the step (merged over ranks by metrics.merge_rank_metrics)."""
    rewards = [s.reward for g in c.groups for s in g.samples]
    lengths = [len(s.response_ids) for g in c.groups for s in g.samples]
    step_s = wall["step_s"]
    return {
        **train,
        "reward/mean": sum(rewards) / max(len(rewards), 1),
        **c.step_wide,
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
    """One optimiser step on this rank's share of the batch."""
    models = ln.models
    step_cfg = ln.guard.step_config(ln.cfg)  # with the adaptive kl_coef
    optimizer = ln.optim.optimizer
    stats = models.train_step(
        models.model, optimizer, batch.groups, step_cfg, models.algo, ln.dist, ln.state.version
    )
    ln.optim.scheduler.step()
    return stats


def record(ln: Learner, batch: Collected) -> None:
    """Note the step's entries as trained (acknowledged after the next checkpoint) and write the
    ledger line of what was trained, durably, before that (what was dropped has its own lines:
    learner/durability/ledger.py)."""
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


def learner_step(ln: Learner) -> tuple[dict[str, float], Evaluation | None]:
    """Train step s into step s + 1, publish it as the next version and, on checkpoint steps,
    checkpoint and acknowledge; returns the step's metrics (merged over ranks) and, on
    evaluation steps (`eval.every`), the evaluation."""
    state, t0 = ln.state, time.monotonic()
    ln.broker.check_lease()  # renewed by every step, and stopped here if it was lost
    batch = ln.collector.collect(state.step, state.version)
    trained = time.monotonic()
    with ln.dist.waiting(f"the model's collectives in training step {state.step + 1}"):
        stats = train(ln, batch)
    train_s = time.monotonic() - trained
    state.step += 1
    state.version += 1
    with ln.dist.waiting(f"gathering the weights of version {state.version}"):
        publish_s = ln.publish(state.version, state.step)
    record(ln, batch)
    add_to_history(ln, batch)  # before the checkpoint, which holds the history
    with ln.dist.waiting(f"the checkpoint of step {state.step}"):
        checkpoint_s = make_durable(ln)
    wall = {
        "step_s": time.monotonic() - t0,
        "train_s": train_s,
        "publish_s": publish_s,
        "checkpoint_s": checkpoint_s,
    }
    metrics = merged_metrics(ln, batch, stats, wall)
    ln.evaluator.observe_step(metrics["reward/mean"])
    evaluation = None
    if ln.cfg.eval.every and state.step % ln.cfg.eval.every == 0:
        evaluation = evaluate(ln)
        metrics["eval/heldout_acc"] = evaluation.accuracy
        metrics.update(evaluation.health)
        metrics.update(evaluation.by_domain)  # a mixture's eval/<domain>/heldout_acc
        metrics.update(evaluation.sampled)
    if ln.sink is not None:  # rank 0
        _report(ln, ln.sink, metrics, batch.groups)
    return metrics, evaluation


def merged_metrics(
    ln: Learner, batch: Collected, stats: dict[str, float], wall: dict[str, float]
) -> dict[str, float]:
    """The step's metrics merged over the ranks, with the guards' verdict on them."""
    local = step_metrics(
        batch,
        {
            "optim/lr": float(ln.optim.scheduler.get_last_lr()[0]),
            "redis/lost_prompts": ln.broker.lost["prompts"],
            "redis/lost_trajectory_writes": ln.broker.lost["trajectory_writes"],
            **guard_values(batch.groups, ln.cfg.guards.ngram_n),
            **step_health(ln.task, batch.groups),
        },
        wall,
    )
    # train_step's metrics are over every rank already (learner/metrics/metric_sums.py)
    metrics = {**merge_rank_metrics(ln.dist.gather([local, len(batch.groups)])), **stats}
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
    ln.evaluator.check_threshold()
    if ln.state.step == 0:
        ln.state.heldout_acc_before = ln.evaluator.greedy(0)
        log.info("held-out greedy accuracy before training: %.3f", ln.state.heldout_acc_before)
        ln.evaluator.health(0, ln.state.heldout_acc_before)
        keep_if_best(ln, ln.state.heldout_acc_before)
        sampled = {
            f"{k.removeprefix('eval/')}_before": v for k, v in ln.evaluator.sampled(0).items()
        }
        sampled.update({f"{_flat(k)}_before": v for k, v in ln.evaluator.by_domain.items()})
        sampled.update(summary_fields(ln.evaluator.top, "before"))
    if ln.dist.is_main:
        ln.broker.set_run_fields(
            state="training",
            heldout_acc=ln.state.heldout_acc_before,
            learner_ranks=ln.dist.world_size,
        )
    return sampled


def settle_last_steps(ln: Learner, stopping: bool = False) -> None:
    """Checkpoint the steps since the last checkpoint (their entries are acknowledged only once
    it is durable) and wait until the last version is announced: before the run is done or,
    `stopping`, stopped on a signal, where this step is checkpointed whatever
    `trainer.checkpoint_every` says (step 0 too), so the same command resumes from here."""
    every = ln.cfg.trainer.checkpoint_every
    if stopping:
        due = ln.checkpoints.latest() != ln.checkpoints.step_dir(ln.state.step)
    else:
        due = bool(every and ln.history.steps_this_process and ln.state.step % every)
    if due:
        checkpoint(ln)
    if ln.publisher is not None:
        ln.publisher.wait()


def finish(
    ln: Learner, started: float, sampled: dict[str, float], last: Evaluation | None = None
) -> dict[str, Any]:
    """Checkpoint the last steps, evaluate (unless `last`, the last step's evaluation, is of
    the final version already), write summary.json and set the run's state to `done`;
    returns the summary."""
    cfg, history = ln.cfg, ln.history
    settle_last_steps(ln)
    final = last if last is not None and last.step == ln.state.step else evaluate(ln)
    by_domain = {_flat(k): v for k, v in final.by_domain.items()}
    after = final.sampled.items()
    sampled = {**sampled, **{f"{k.removeprefix('eval/')}_after": v for k, v in after}}
    summary = {
        "steps": ln.state.step,
        "steps_this_process": history.steps_this_process,
        "wall_s_this_process": round(time.monotonic() - started, 1),
        "final_version": ln.state.version,
        "reward_first10": _mean(history.first_rewards),
        "reward_last10": _mean(history.last_rewards),
        "heldout_acc_before": round(ln.state.heldout_acc_before, 4),
        "heldout_acc_after": round(final.accuracy, 4),
        "heldout_size": len(ln.evaluator.items),
        "max_staleness": history.max_staleness,
        "async_ratio": cfg.trainer.async_ratio,
        "prompts_issued": ln.collector.admission.issued,
        "learner_ranks": ln.dist.world_size,
        "stopped_by_guard": ln.guard.stop_reason,
        **summary_fields(ln.evaluator.top, "after"),
        "health_warnings": ln.evaluator.watch.warnings if ln.evaluator.watch else [],
        **best_fields(ln),
        **{k: round(v, 4) for k, v in sampled.items()},
        **{f"{k}_after": round(v, 4) for k, v in by_domain.items()},
    }
    if ln.dist.is_main:
        (Path(cfg.run.run_dir) / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        ln.broker.set_run_fields(state="done", heldout_acc=final.accuracy)
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
    operator knows is dead (broker/channels/lease.py). SIGTERM and SIGINT stop it (learner/process/stop.py):
    it raises `Stopped` once it has stopped."""
    setup_process("learner", seed=cfg.run.seed, torch_threads=cfg.run.torch_threads)
    with StopSignals() as signals:
        ln = start(cfg, resume, take_over)  # a lease taken, then an error: released at exit
        signals.on_request(lambda: setattr(ln.collector, "timeout_s", 0.0))  # stop waiting
        try:
            result = _train(ln, cfg, on_step, signals)
        except Stopped as e:  # a second signal
            if ln.dist.is_main:
                ln.broker.release()
            raise stopped_at_once(e.signum, ln.state.step) from None
        except BaseException:
            if ln.dist.is_main:
                ln.broker.release()  # a learner that failed frees the run for its successor
            raise
    if isinstance(result, Stopped):
        raise result
    return result


def _train(
    ln: Learner, cfg: Config, on_step: Callable[[dict], None] | None, signals: StopSignals
) -> dict[str, Any] | Stopped:
    """`run`'s steps, from the first evaluation to the summary; after a stop requested by a
    signal (learner/process/stop.py), at a step boundary, the `Stopped` to raise: the last steps
    checkpointed, the run marked `stopped`, the lease released."""
    started = time.monotonic()
    sampled_before = begin(ln)
    if ln.publisher is not None:
        ln.publisher.ready()  # a publishing process competes for the cores only while it starts
    freeze_heap()  # what start-up built stays: full collections then skip it
    evaluation, stopped = None, None
    for _ in range(ln.state.step, cfg.trainer.total_steps):
        stopped = agreed_stop(ln, signals)  # asked while the last step trained
        if stopped is not None:
            break
        try:
            metrics, evaluation = learner_step(ln)
        except NoData:  # the wait ended: timed out, or stopped by a signal (on rank 0 at least)
            stopped = agreed_stop(ln, signals)
            if stopped is None:
                raise
            break
        if on_step is not None and ln.dist.is_main:
            on_step({"step": ln.state.step, **metrics})
        if ln.guard.stop_requested:  # guards.stop_on_guard
            break
    if stopped is None:
        result: dict[str, Any] | Stopped = finish(ln, started, sampled_before, evaluation)
    else:
        settle_last_steps(ln, stopping=True)
        if ln.dist.is_main:
            ln.broker.set_run_fields(state="stopped")
        result = stopped_cleanly(stopped, ln.state.step)
    thaw_heap()
    ln.close()
    return result


def agreed_stop(ln: Learner, signals: StopSignals) -> int | None:
    """The signal that asked some rank to stop (every rank gets the same answer), or None."""
    return next((s for s in ln.dist.gather(signals.signum) if s is not None), None)
