"""What a generator process derives from the run config and its own id."""

from __future__ import annotations

import hashlib

from rollflash.broker.config.config import Config, ConfigError


def generator_seed(seed: int, generator_id: str) -> int:
    """`seed` plus a stable hash of the generator's id (31 bits of its BLAKE2b): distinct ids
    draw distinct streams, and one id draws the same stream in every process (Python's `hash`
    of a str is salted per process). With a `seed` below 2**31 the sum stays below the 2**32 that
    numpy and vLLM accept."""
    digest = hashlib.blake2b(generator_id.encode(), digest_size=4).digest()
    return seed + (int.from_bytes(digest, "little") >> 1)


def redis_url(cfg: Config) -> str:
    """The run's Redis address; a generator is always given one (`rollctl run` fills it in)."""
    if cfg.redis.url is None:
        raise ConfigError("redis.url: a generator needs the address of the run's Redis")
    return cfg.redis.url
