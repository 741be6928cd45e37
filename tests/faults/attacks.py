"""A run under least-privilege ACL users, for the attack tests (tests/faults/test_attacks.py): the
learner and each generator connect as the users `rollctl acl` makes (rollctl/acl.py), and an
attacker is a plain redis-py client holding one generator's password."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import redis
from harness import start, status_text, write_config

from rollflash.broker.config.config import SimConfig
from rollflash.broker.connect.keys import RunKeys
from rollflash.broker.wire.schema import Sample, Trajectory, decode_prompt, encode_trajectory
from rollflash.envs.chat import prompt_encoder
from rollflash.rollctl.acl import acl_users


class AclRun:
    def __init__(
        self, tmp_path: Path, redis_url: str, run_id: str, steps: int, batch: int, gens: int, **kw
    ):
        self.admin = redis.Redis.from_url(redis_url)
        self.sock, self.run_id, self.keys = (
            redis_url.removeprefix("unix://"),
            run_id,
            RunKeys(run_id),
        )
        ids = [f"gen-{i}" for i in range(gens)]
        self.users = acl_users(run_id, [], "learner-pw") + acl_users(run_id, ids, "gen-pw")
        for u in self.users:  # what `rollctl acl --apply` does
            self.admin.execute_command("ACL", "SETUSER", u.name, "reset", *u.rules)
        self.run_dir = tmp_path / "run"
        self.config = write_config(
            tmp_path, self._url(self.users[0].name, "learner-pw"), run_id, steps, batch, **kw
        )

    def _url(self, user: str, password: str) -> str:
        return f"unix://{user}:{password}@{self.sock}"

    def gen_url(self, gid: str) -> str:
        user = next(u for u in self.users if u.role == f"generator {gid}")
        return self._url(user.name, user.password)

    def generator(self, gid: str):
        return start("start-generator", self.config, "--id", gid, "--redis-url", self.gen_url(gid))

    def learner(self, *extra: str, env: dict[str, str] | None = None):
        return start("start-learner", self.config, *extra, env=env)

    def attacker(self, gid: str) -> redis.Redis:
        """A client with generator `gid`'s credentials and nothing else."""
        return redis.Redis.from_url(self.gen_url(gid))

    def status(self) -> str:
        return status_text(self.config)

    def run_hash(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.admin.hgetall(self.keys.run).items()}

    def generator_status(self, gid: str) -> str | None:
        v = self.admin.hget(self.keys.generators, gid)
        return None if v is None else v.decode()

    def close(self) -> None:
        self.admin.execute_command("ACL", "DELUSER", *[u.name for u in self.users])


def steal_prompt(attacker: redis.Redis, keys: RunKeys, gid: str, timeout_s: float = 60):
    """Claim one prompt as generator `gid` (what its credentials allow): (entry id, fields)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reply = attacker.xreadgroup("gen", gid, {keys.prompts: ">"}, count=1, block=200)
        if reply:
            entry_id, fields = reply[0][1][0]
            return entry_id.decode(), fields
    raise AssertionError("no prompt to steal")


def issued_prompt_ids(fields: dict) -> list[int]:
    """The prompt ids the learner derived for the prompt entry `fields` and signed: the
    harness's runs have no model directory, so one id per character (envs/chat.py
    `prompt_encoder`, as the simulated engine and learner do)."""
    item = decode_prompt(fields, 1 << 20).item
    return prompt_encoder(None, False, SimConfig().vocab_size)(item["prompt"])


def answer(
    fields: dict,
    gid: str,
    version: int = 0,
    text: str = "x",
    n: int = 2,
    prompt: list[int] | None = None,
    **over,
) -> dict:
    """A trajectory entry answering the prompt entry `fields` as generator `gid` would, with the
    prompt's MAC and tokens (`prompt`: other tokens); `over` replaces readable fields (a
    forgery)."""
    s = Sample(
        np.array([5, 6], np.int32),
        np.array([-0.5, -1.0], np.float32),
        np.array([version, version], np.int32),
        1.0,
        True,
        text=text,
    )
    group = fields[b"group_id"].decode()
    issued = int(fields[b"issued_version"])
    ids = np.array(issued_prompt_ids(fields) if prompt is None else prompt, np.int32)
    t = Trajectory(group, fields[b"prompt_id"].decode(), group, gid, version, issued, ids,
                   [s] * n, mac=fields[b"mac"].decode())  # fmt: skip
    return {**encode_trajectory(t), **over}


def partial(gid: str, k: int, tokens: int = 60_000) -> dict:
    """One sample of a group the learner never issued, claiming a version far in the future,
    `tokens` long (about 12 bytes a token: the finding was such partial groups, held forever)."""
    s = Sample(
        np.full(tokens, 5, np.int32),
        np.full(tokens, -0.5, np.float32),
        np.zeros(tokens, np.int32),
        1.0,
        False,
    )
    t = Trajectory(f"h{k}/0", "p", f"h{k}", gid, 0, 2**31 - 1, np.array([1, 2], np.int32), [s],
                   mac="0" * 32)  # fmt: skip
    return encode_trajectory(t)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")
