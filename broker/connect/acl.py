"""Least-privilege Redis ACL users for a run: one per generator, one for the learner.

Redis checks every command a function runs against the calling user, and cannot restrict XADD's
arguments (an explicit id, MAXLEN, NOMKSTREAM), so a user who may XADD to a stream may also brick
or empty it. Confinement is therefore by keys: each generator has its own user
`rl-{run}-gen-{id}`, which may write only that generator's keys:

| generator user may | on |
|---|---|
| XREADGROUP, XAUTOCLAIM, XACK (claim, take over, acknowledge prompts) | `prompts` |
| XADD (write-only), FCALL (add a trajectory, then acknowledge its prompt) | its own `traj:{id}`, `dlq:{id}` |
| HSET, PEXPIRE (its heartbeat) | its own `gen:{id}` |
| SADD (ask to join) | `joined` |
| HGET, HGETALL, HMGET (read-only) | `run`, `weights`, `generators` |
| PING, HELLO, MULTI, EXEC, DISCARD, WAIT (a write counts once replicated: broker/connect/sentinel.py) | - |

So it cannot issue prompts, read, trim or delete another generator's trajectories, touch the
learner's `dlq` or `dlq_reasons`, write another generator's heartbeat, read the MAC key, change
weights, run Lua of its own (no EVAL, no FUNCTION), or reach another run. What it can still do to
others, by the nature of a shared prompts stream: acknowledge or take over prompts they hold
(the learner issues those again, broker/channels/inflight.py), and claim more work than it does.

The learner user `rl-{run}-learner` may run the commands `LEARNER_COMMANDS` lists, on its run's
keys only: no SCAN or KEYS (they list other runs' key names), no SELECT, no FUNCTION FLUSH,
DELETE or RESTORE, no SCRIPT, no FLUSHDB/FLUSHALL, CONFIG, DEBUG, MONITOR, CLIENT, INFO or
anything else server-wide. Its one server-wide write is FUNCTION LOAD of the rollflash library,
which never replaces an existing library (broker/connect/functions.py).

The rules are Redis 7 `ACL SETUSER` arguments, with selectors and `%R~` read-only / `%W~`
write-only key patterns. `rollctl acl` prints them as redis-cli commands with these powers in
comments (`describe`), or applies them with `--apply`.
"""

from __future__ import annotations

from rollflash.broker.connect.keys import RunKeys

LEARNER_COMMANDS = (
    "ping hello multi exec discard wait time "
    "exists del pexpire get set "
    "hget hgetall hmget hvals hset hsetnx hincrby hdel "
    "smembers srem "
    "xadd xreadgroup xack xtrim xrange xrevrange xlen xpending xinfo|stream xinfo|groups "
    "xinfo|consumers "
    "xgroup|create xgroup|destroy "
    "fcall fcall_ro function|load"
).split()


def generator_user(run_id: str, generator_id: str) -> str:
    return f"rl-{run_id}-gen-{generator_id}"


def learner_user(run_id: str) -> str:
    return f"rl-{run_id}-learner"


def _fresh_user(password: str) -> list[str]:
    """The rules that start every user: enabled, `password`, and no keys, channels or commands
    until the rules after these grant them."""
    return ["on", f">{password}", "resetkeys", "resetchannels", "-@all"]


def generator_acl(run_id: str, generator_id: str, password: str) -> list[str]:
    """Each selector `( ... )` pairs commands with the only keys they may touch."""
    k = RunKeys(run_id)
    own = [k.trajectories(generator_id), k.generator_dlq(generator_id)]
    return [
        *_fresh_user(password),
        "+ping",
        "+hello",
        "+multi",
        "+exec",
        "+discard",
        "+wait",
        f"(+xreadgroup +xautoclaim +xack ~{k.prompts})",
        f"(+xadd %W~{own[0]} %W~{own[1]})",
        f"(+fcall ~{own[0]} ~{own[1]} ~{k.prompts})",
        f"(+hset +pexpire ~{k.gen(generator_id)})",
        f"(+sadd %W~{k.joined})",
        f"(+hget +hgetall +hmget %R~{k.run} %R~{k.weights} %R~{k.generators})",
    ]


def learner_acl(run_id: str, password: str) -> list[str]:
    return [
        *_fresh_user(password),
        *(f"+{c}" for c in LEARNER_COMMANDS),
        f"~{RunKeys(run_id).prefix}*",
    ]


def _key(pattern: str) -> str:
    """`%W~k` -> `k (write-only)`, `%R~k` -> `k (read-only)`, `~k` -> `k`."""
    access, _, key = pattern.partition("~")
    return key + {"%W": " (write-only)", "%R": " (read-only)"}.get(access, "")


def describe(rules: list[str]) -> list[str]:
    """The powers `rules` give, one comment line per selector (what `rollctl acl` prints)."""
    out, loose = [], []
    for rule in rules:
        if rule.startswith("("):
            parts = rule.strip("()").split()
            commands = " ".join(p[1:].upper() for p in parts if p.startswith("+"))
            keys = " ".join(_key(p) for p in parts if "~" in p)
            out.append(f"#   {commands} on {keys}")
        elif rule.startswith("+"):
            loose.append(rule[1:].upper())
        elif rule.startswith("~"):
            out.append(f"#   on keys {rule[1:]} only; nothing else (no SCAN, SELECT, FLUSH, ...)")
    if loose:
        out.insert(0, "#   " + " ".join(loose) + (" (keyless, or on the keys below)"))
    return out


def line(user: str, rules: list[str]) -> str:
    """A redis-cli line creating `user` with `rules`."""
    return f"ACL SETUSER {user} " + " ".join(f"'{r}'" if " " in r else r for r in rules)
