"""The `run:` and `redis:` sections of the run config: who the run is and where its Redis is.

Same rules as broker/config/config_sections.py: each field's type, bounds and one-line description are
the single source of truth, and a violated rule is one `ConfigError` naming the key.
"""

from __future__ import annotations

from pydantic import Field, StrictInt, StrictStr, model_validator

from rollflash.broker.config.config_base import Number, Section
from rollflash.broker.config.config_errors import ConfigError
from rollflash.broker.connect.keys import NAME_RULE, valid_name
from rollflash.broker.connect.secrets import (
    env_password,
    read_password_file,
    url_password,
    with_password,
)


def sentinel_address(host: str) -> tuple[str, int]:
    """`host:port` (IPv6 as `[addr]:port`) as redis-py's Sentinel takes it; ValueError if bad.
    Here, not in broker/connect/sentinel.py, so that the config imports no redis (the GPU check)."""
    name, sep, port = host.rpartition(":")
    if not sep or not port.isdigit() or not name:
        raise ValueError(f"{host!r} is not host:port")
    return name.strip("[]"), int(port)


class RunConfig(Section):
    run_id: StrictStr = Field(
        "demo",
        description="names the Redis keys rl:{run_id}:* and the run directory; "
        "1 to 64 of A-Z a-z 0-9 _ . -",
    )
    run_dir: StrictStr = Field(
        "runs/demo", description="checkpoints, weights, metrics, summary.json"
    )
    seed: StrictInt = Field(0, description="seeds prompt order, sampling and initialisation")

    @model_validator(mode="after")
    def _run_id_is_a_name(self) -> RunConfig:
        """The id goes into ACL key patterns (broker/connect/acl.py), where `*`, `?` or `[` would give
        a run's users another run's keys."""
        if not valid_name(self.run_id):
            raise ConfigError(f"run.run_id: {self.run_id[:80]!r} is not {NAME_RULE}")
        return self

    torch_threads: StrictInt = Field(
        0,
        ge=0,
        description="intra-op threads per process (0 = torch's default, which `rollctl run` "
        "on a CPU sets from the cores: rollctl/cpu_layout.py)",
    )


class SentinelConfig(Section):
    """Redis Sentinel (broker/connect/sentinel.py): the master's address comes from the Sentinels, and
    redis.url gives only the user, password, database and TLS of the master."""

    hosts: list[StrictStr] = Field(
        default_factory=list,
        description="the Sentinels as host:port; empty = no Sentinel, redis.url names the server",
    )
    service: StrictStr = Field(
        "rollflash", description="the master's name in the Sentinels (sentinel monitor NAME ...)"
    )
    replicas: StrictInt = Field(
        1,
        ge=1,
        description="a write counts once this many replicas hold it (WAIT); "
        "with fewer up, writes wait up to redis.connect_timeout_s",
    )

    @model_validator(mode="after")
    def _hosts_are_addresses(self) -> SentinelConfig:
        for i, host in enumerate(self.hosts):
            try:
                sentinel_address(host)
            except ValueError as e:
                raise ConfigError(f"redis.sentinel.hosts[{i}]: {e}") from None
        return self


class RedisConfig(Section):
    url: StrictStr | None = Field(
        None,
        description="redis://, rediss:// or unix://; null lets `rollctl run` start its own",
    )
    connect_timeout_s: Number = Field(
        30.0,
        gt=0,
        description="a running process waits out a lost connection (with backoff) this long; "
        "the first contact at start-up gives up after 1 s",
    )
    max_payload_bytes: StrictInt = Field(
        8_000_000,
        gt=0,
        description="entries larger than this go to the dead-letter stream undecoded",
    )
    password_file: StrictStr | None = Field(
        None,
        description="file whose first line is the Redis password, when redis.url holds none",
    )
    lease_ttl_s: Number = Field(
        30.0,
        gt=0,
        description="the learner's lease on the run lapses this long after its last renewal; "
        "a successor starts then (or at once with --take-over)",
    )
    keep_acknowledged_s: Number = Field(
        30.0,
        ge=0,
        description="acknowledged trajectories stay readable (redis-cli XRANGE) this long, "
        "then are trimmed",
    )
    sentinel: SentinelConfig = Field(default_factory=SentinelConfig, description="Redis Sentinel")
    dlq_max_entries: StrictInt = Field(
        1000, gt=0, description="dead-letter streams keep at most this many entries"
    )
    dlq_max_age_s: Number = Field(
        7 * 86400.0, gt=0, description="dead-letter streams drop entries older than this"
    )

    @model_validator(mode="after")
    def _password_into_url(self) -> RedisConfig:
        """Put the password from `password_file` or $ROLLFLASH_REDIS_PASSWORD into the in-memory
        URL (broker/connect/secrets.py); it is never saved."""
        if self.url is None:
            return self
        if self.password_file is not None:
            if url_password(self.url) is not None:
                raise ConfigError(
                    "redis.password_file: redis.url already holds a password; keep one of them"
                )
            try:
                password = read_password_file(self.password_file)
            except (OSError, ValueError) as e:
                raise ConfigError(
                    f"redis.password_file: cannot read a password from {self.password_file} ({e})"
                ) from None
            self.url = with_password(self.url, password)
        elif url_password(self.url) is None and env_password() is not None:
            self.url = with_password(self.url, env_password() or "")
        return self
