"""`rollctl status`: what a run is doing, read from Redis only.

Shows stream lengths, each consumer group's pending and lag, the published weight version, the
learner's progress, the reward-hacking guards' last warnings, what Redis forgot after a restart
(broker/channels/audit.py), every live generator with its loaded version and counters, and every generator
that is gone: it took prompts, and its heartbeat hash has expired. `--watch`
redraws a compact view of the same status (`compact_lines`) every few seconds until Ctrl-C.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from rollflash.broker.channels.registry import RunRegistry
from rollflash.broker.config.config import Config
from rollflash.broker.connect.connection import BrokerUnavailable, connect
from rollflash.broker.connect.keys import GEN_GROUP
from rollflash.broker.connect.redis_io import RunRedis, text


def collect_status(cfg: Config) -> dict:
    """The run's status; `BrokerUnavailable` (one line) if the Redis user may not read it."""
    assert cfg.redis.url is not None, "rollctl status finds the run's Redis first (find.py)"
    io = RunRedis(
        connect(cfg.redis.url, min(cfg.redis.connect_timeout_s, 5.0), cfg.redis.sentinel),
        cfg.run.run_id,
    )
    try:
        return _collect(cfg, io)
    except redis.exceptions.NoPermissionError as e:
        raise BrokerUnavailable(
            f"the Redis user may not read the status of run {cfg.run.run_id} ({e}): use the "
            "learner's user (rollctl acl) or an admin one"
        ) from None


def _collect(cfg: Config, io: RunRedis) -> dict:
    registry = RunRegistry(io)
    now = time.time()
    gens = {}
    for gid, f in sorted(registry.live_generators().items()):
        gens[gid] = {**f, "last_seen_s": round(now - float(f.get("heartbeat_at", now)), 1)}
    return {
        "gone": gone_generators(io, gens),
        "run": cfg.run.run_id,
        "learner": {
            k: v
            for k, v in registry.fields().items()
            if k not in ("fingerprint_keys", "registered_by")
        },
        "weights": registry.weights(),
        "streams": registry.stream_status(),
        "generators": gens,
        "dead_letters": registry.dead_letters_by_code(),
        "quarantined": registry.quarantined(),
    }


def gone_generators(io: RunRedis, live: dict) -> dict[str, dict]:
    """Generators that took prompts (consumers of the prompts stream's group) and whose heartbeat
    has expired (`rollout.heartbeat_ttl_s` after their last beat): stopped, killed or cut off.
    With how long since each last read and the prompts it still holds, which another generator
    takes over after `rollout.reclaim_idle_s`."""
    keys = io.keys
    if not io.client.exists(keys.prompts):
        return {}
    try:
        consumers: Any = io.client.xinfo_consumers(keys.prompts, GEN_GROUP)
    except redis.ResponseError:  # no such group (the run was never started)
        return {}
    gone = {
        text(c["name"]): {"idle_s": round(c["idle"] / 1000, 1), "pending": c["pending"]}
        for c in consumers
        if text(c["name"]) not in live
    }
    return dict(sorted(gone.items(), key=lambda kv: kv[1]["idle_s"]))


def gone_lines(gone: dict[str, dict], most: int = 10) -> list[str]:
    lines = [
        f"generator {gid}: gone (no heartbeat) idle={g['idle_s']}s holding={g['pending']}"
        for gid, g in list(gone.items())[:most]
    ]
    if len(gone) > most:
        lines.append(f"... and {len(gone) - most} more gone")
    return lines


def guard_line(learner: dict) -> str:
    """The reward-hacking guards' last verdict (learner/metrics/guards.py), from the run hash."""
    warnings = learner.get("guard_warnings")
    if warnings is None:
        return "guards: no step yet"
    line = "guards: ok" if warnings == "none" else f"guards: WARNING {warnings}"
    if learner.get("guard_stop"):
        line += f" | stopped by guard: {learner['guard_stop']}"
    return line


def redis_lost_line(learner: dict, generators: dict) -> str:
    """Acknowledged writes Redis forgot in a restart. Forgotten trajectory writes have two
    witnesses that may count the same write: the learner (every write it had seen, any writer)
    and each live generator (its own writes, while it lives); they are shown apart, not added."""
    by_writers = sum(int(g.get("redis_lost") or 0) for g in generators.values())
    return (
        f"redis lost: prompts={learner.get('redis_lost_prompts', 0)} (re-added) "
        f"trajectory_writes={learner.get('redis_lost_trajectory_writes', 0)} (learner's "
        f"count) | by their writers={by_writers} (live generators' redis_lost) | "
        f"prompts retried={learner.get('prompts_retried', 0)} (re-delivered after a "
        "generator died or Redis forgot an acknowledgement, not duplicates)"
    )


def dead_letter_line(by_code: dict[str, int]) -> str:
    """Entries rejected by a reader, by reason code (broker/wire/wire.py); the dlq stream holds each
    with its full reason and original fields."""
    detail = ", ".join(f"{code}={n}" for code, n in sorted(by_code.items()))
    return f"dead letters: {sum(by_code.values())}" + (f" ({detail})" if detail else "")


def quarantine_lines(quarantined: dict[str, str]) -> list[str]:
    """Generators whose entries the learner refuses, with why (broker/channels/roster.py)."""
    return [f"generator {g} QUARANTINED: {why}" for g, why in sorted(quarantined.items())]


# why entries stay unread after the run's learner has stopped (the `lag` of a consumer group)
LEFT_OVER = {
    "gen": "prompts issued ahead for steps the run did not take",
    "learner": "groups generated ahead for steps the run did not take",
}


def lag_text(group: dict, state: str | None) -> str:
    """`lag=N` (entries not yet delivered to the group; `?` when Redis cannot count them),
    explained when the run is done or stopped and N > 0: the next learner of the run (an
    extended or resumed run) uses them."""
    lag = group.get("lag")
    text = f"lag={'?' if lag is None else lag}"
    if state in ("done", "stopped") and lag and group["group"] in LEFT_OVER:
        text += f" ({LEFT_OVER[group['group']]}; a longer or resumed run uses them)"
    return text


def _queue(name: str, stream: dict, state: str | None = None) -> str:
    groups = " ".join(
        f"{g['group']}: pending={g['pending']} {lag_text(g, state)}" for g in stream["groups"]
    )
    return f"{name}={stream['length']}" + (f" ({groups})" if groups else "")


def joining(g: dict) -> bool:
    """A generator that has asked to join and loaded no version yet (its first heartbeat)."""
    return g.get("loaded_version") is None


def _get(g: dict, key: str) -> str:
    value = g.get(key)
    return "-" if value is None else str(value)


def compact_lines(s: dict, total_steps: int) -> list[str]:
    """The status of `collect_status` in a few lines: learner, queues, dead letters, guards,
    then one line per live generator with its loaded version and idle share."""
    lr, w = s["learner"], s["weights"]
    lines = [
        f"run {s['run']}  {lr.get('state', 'not started')}  step {lr.get('step', 0)}/{total_steps}"
        f"  weights v{w.get('version', '-')}  heldout_acc {lr.get('heldout_acc', '-')}",
        f"learner  reward {lr.get('reward_mean', '-')}  staleness_max "
        f"{lr.get('staleness_max', '-')}  wait {lr.get('wait_frac', '-')}  samples/s "
        f"{lr.get('samples_per_s', '-')}  ranks {lr.get('learner_ranks', 1)}  checkpoint "
        f"{lr.get('checkpoint_step', '-')}",
        "queues   "
        + "  ".join(_queue(n, st, lr.get("state")) for n, st in s["streams"].items() if n != "dlq"),
        dead_letter_line(s["dead_letters"]),
        guard_line(lr),
        *quarantine_lines(s.get("quarantined", {})),
        f"generators: {len(s['generators'])} alive"
        + (f", {len(s['gone'])} gone" if s.get("gone") else ""),
    ]
    for gid, g in s["generators"].items():
        if joining(g):
            lines.append(f"  {gid}  joining  seen {g['last_seen_s']}s ago")
            continue
        lines.append(
            f"  {gid}  {_get(g, 'state')}  v{_get(g, 'loaded_version')}  idle "
            f"{_get(g, 'idle_frac')}  groups {_get(g, 'groups')}  seen {g['last_seen_s']}s ago"
        )
    for gid, g in list(s.get("gone", {}).items())[:10]:
        lines.append(f"  {gid}  gone  last read {g['idle_s']}s ago  holding {g['pending']}")
    return lines


def watch_status(cfg: Config, interval_s: float, rounds: int | None = None) -> None:
    """Redraw `compact_lines` every `interval_s` (`rounds` times, or until Ctrl-C, which ends the
    watch normally): in place on a terminal (rich's Live display), as time-stamped blocks
    otherwise."""
    try:
        _watch(cfg, interval_s, rounds)
    except KeyboardInterrupt:
        pass


def _watch(cfg: Config, interval_s: float, rounds: int | None) -> None:
    import sys

    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    def view() -> str:
        stamp = time.strftime("%H:%M:%S")
        body = compact_lines(collect_status(cfg), cfg.trainer.total_steps)
        return "\n".join([f"{stamp}  every {interval_s:g}s, Ctrl-C to stop", *body])

    n = 0
    if not sys.stdout.isatty():
        while rounds is None or n < rounds:
            print(view() + "\n", flush=True)
            n += 1
            if rounds is None or n < rounds:
                time.sleep(interval_s)
        return
    with Live(Text(view()), console=Console(), auto_refresh=False) as live:
        while rounds is None or n < rounds:
            n += 1
            if n > 1:
                time.sleep(interval_s)
                live.update(Text(view()), refresh=True)


def show_status(cfg: Config, as_json: bool) -> None:
    s = collect_status(cfg)
    if as_json:
        print(json.dumps(s))
        return
    lr = s["learner"]
    print(
        f"run {s['run']}: state={lr.get('state', 'not started')} step={lr.get('step', 0)} "
        f"issued={lr.get('issued', 0)} replaced={lr.get('replaced', 0)} "
        f"heldout_acc={lr.get('heldout_acc', '-')}"
    )
    print(
        f"learner: reward={lr.get('reward_mean', '-')} wait_frac={lr.get('wait_frac', '-')} "
        f"staleness_max={lr.get('staleness_max', '-')} samples/s={lr.get('samples_per_s', '-')} "
        f"tokens/s={lr.get('tokens_per_s', '-')}"
    )
    print(
        f"learner ranks={lr.get('learner_ranks', 1)} checkpoint_step="
        f"{lr.get('checkpoint_step', '-')} resumed_from={lr.get('resumed_from_step', '-')}"
    )
    print(guard_line(lr))
    print(redis_lost_line(lr, s["generators"]))
    print(dead_letter_line(s["dead_letters"]))
    for line in quarantine_lines(s["quarantined"]):
        print(line)
    w = s["weights"]
    print(f"weights: v{w.get('version', '-')} {w.get('path', '')}")
    for name, st in s["streams"].items():
        groups = (
            ", ".join(
                f"{g['group']}: pending={g['pending']} {lag_text(g, lr.get('state'))} "
                f"consumers={g['consumers']}"
                for g in st["groups"]
            )
            or "no groups"
        )
        print(f"{name:<13} length={st['length']:<6} {groups}")
    if not s["generators"]:
        print("generators: none alive")
    for line in gone_lines(s["gone"]):
        print(line)
    for gid, g in s["generators"].items():
        print(generator_line(gid, g))


def generator_line(gid: str, g: dict) -> str:
    """One live generator in `rollctl status`: a joining one says so, without the counters it
    has not written yet."""
    if joining(g):
        return (
            f"generator {gid}: joining (asked to join, no version loaded yet) "
            f"last_seen={g['last_seen_s']}s ago"
        )
    return (
        f"generator {gid}: {_get(g, 'state')} loaded=v{_get(g, 'loaded_version')} "
        f"reloads={g.get('reloads', 0)} refused={g.get('reload_refused', 0)} "
        f"groups={g.get('groups', 0)} samples={g.get('samples', 0)} "
        f"redis_lost={g.get('redis_lost', 0)} idle={_get(g, 'idle_frac')} "
        + (
            f"mean_batch={g['mean_batch']} restarted={g.get('restarted', 0)} "
            if "mean_batch" in g
            else ""
        )  # continuous batching
        + (
            "agent: "
            + " ".join(f"{k[6:]}={g[k]}" for k in sorted(g) if k.startswith("agent_"))
            + " "
            if "agent_episodes" in g
            else ""
        )  # rollout.agent (generators/agent_episode.py)
        + f"last_seen={g['last_seen_s']}s ago"
    )
