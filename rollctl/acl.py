"""`rollctl acl`: the run's ACL users (broker/connect/acl.py), printed with their powers, or created."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

import redis

from rollflash.broker.config.config import Config
from rollflash.broker.connect import acl as rules
from rollflash.broker.connect.keys import NAME_RULE, valid_name


@dataclass(frozen=True)
class User:
    role: str  # "learner" or "generator ID"
    name: str
    rules: list[str]
    password: str


def acl_users(run_id: str, generators: list[str], password: str | None) -> list[User]:
    """A user for each generator id, or the learner's when there is none."""
    users = []
    for gid in generators:
        if not valid_name(gid):
            raise ValueError(f"--generator: {gid[:80]!r} is not {NAME_RULE}")
        pw = password or secrets.token_urlsafe(18)
        name = rules.generator_user(run_id, gid)
        users.append(User(f"generator {gid}", name, rules.generator_acl(run_id, gid, pw), pw))
    if not generators:
        pw = password or secrets.token_urlsafe(18)
        users.append(User("learner", rules.learner_user(run_id), rules.learner_acl(run_id, pw), pw))
    return users


def apply_users(cfg: Config, users: list[User]) -> None:
    """Create (or replace) the users on `redis.url`, which must allow ACL SETUSER, and save them
    to the server's aclfile if it has one; behind Sentinel on the master and every replica, since
    Redis does not replicate ACL users and a promoted replica must know them."""
    from rollflash.broker.connect.connection import connect
    from rollflash.broker.connect.sentinel import replica_clients

    s, timeout_s = cfg.redis.sentinel, cfg.redis.connect_timeout_s
    nodes = [connect(cfg.redis.url or "", timeout_s, s)]
    if s.hosts:
        nodes += replica_clients(cfg.redis.url or "", s.hosts, s.service)
    for r in nodes:
        for u in users:
            r.execute_command("ACL", "SETUSER", u.name, "reset", *u.rules)
        try:  # a node started with an aclfile keeps the users across its restarts
            r.execute_command("ACL", "SAVE")
        except redis.ResponseError as e:
            if "ACL file" not in str(e):  # any other refusal is the user's to see
                raise


def print_users(run_id: str, users: list[User], echo: Callable[[str], object]) -> None:
    for u in users:
        echo(f"# the {u.role} of run {run_id} may:")
        for line in rules.describe(u.rules):
            echo(line)
        echo(rules.line(u.name, u.rules))
        echo(
            f"# connect with --redis-url redis://{u.name}:{u.password}@HOST:6379 (rediss:// for TLS)"
        )
