"""Least-privilege Redis ACL users for a run.

`generator_acl` lets a generator do exactly what its loop needs: read and acknowledge prompts
(XREADGROUP, XAUTOCLAIM, XACK), add trajectories and dead letters (XADD, write-only keys), count
dead letters by reason (HINCRBY `dlq_reasons`), read the `run` and `weights` hashes, and write its
own heartbeat hash. It cannot issue prompts, read or
delete trajectories, change weights, or touch another run's keys. `learner_acl` may use any
non-admin command on its run's keys only.

The rules are Redis 7 `ACL SETUSER` arguments, with selectors and `%R~` read-only / `%W~`
write-only key patterns.
`rollctl acl` prints them as redis-cli commands, or applies them with `--apply`.
"""

from __future__ import annotations

from rollflash.broker.keys import RunKeys


def generator_acl(run_id: str, password: str) -> list[str]:
    """Each selector `( ... )` pairs commands with the only keys they may touch."""
    k = RunKeys(run_id)
    return [
        "on",
        f">{password}",
        "resetkeys",
        "resetchannels",
        "-@all",
        "+ping",
        "+hello",
        "+multi",
        "+exec",
        "+discard",
        f"(+xreadgroup +xautoclaim +xack ~{k.prompts})",
        f"(+xadd %W~{k.trajectories} %W~{k.dlq})",
        f"(+hincrby ~{k.dlq_reasons})",
        f"(+hget +hgetall +hmget %R~{k.run} %R~{k.weights})",
        f"(+hset +pexpire ~{k.gen_pattern})",
    ]


def learner_acl(run_id: str, password: str) -> list[str]:
    return [
        "on",
        f">{password}",
        "resetkeys",
        "resetchannels",
        "+@all",
        "-@admin",
        "-@dangerous",
        "+info",
        f"~{RunKeys(run_id).prefix}*",
    ]


def acl_commands(run_id: str, generator_password: str, learner_password: str) -> list[str]:
    """redis-cli lines creating the users `rl-{run}-generator` and `rl-{run}-learner`."""

    def line(user: str, rules: list[str]) -> str:
        return f"ACL SETUSER {user} " + " ".join(f"'{r}'" if " " in r else r for r in rules)

    return [
        line(f"rl-{run_id}-generator", generator_acl(run_id, generator_password)),
        line(f"rl-{run_id}-learner", learner_acl(run_id, learner_password)),
    ]
