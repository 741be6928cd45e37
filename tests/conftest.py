"""Shared fixtures.

- `redis_url`: one real redis-server per test session, on a unix socket, no persistence.
- `learner_broker`, `generator_broker`: the two sides of one run on that server (its streams and
  consumer groups created), with a run id unique to the test (keys never collide).
- `tiny_model_dir`: a tiny Qwen2 model with a character tokenizer, built once per session with a
  short SFT by scripts/make_tiny_model.py (the same code path as `make demo`).

With ROLLFLASH_TEST_MODELS=DIR (set by `make test`) the models are built once into DIR and reused
by the next pytest session of the same `make test` (the vLLM suite runs in its own virtualenv).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def redis_url():
    from rollflash.broker.connect.redis_server import EmbeddedRedis

    with EmbeddedRedis() as server:
        yield server.url


_FLAGGED: set[tuple[str, str]] = set()  # (roster key, generator) quarantined for its weights


@pytest.fixture(autouse=True)
def _honest_generators_are_never_flagged(request):
    """Proof of serving (broker/channels/serving.py) must never flag an honest generator: after
    every test that used the session's redis-server, each run's roster on it is read, and a
    generator newly quarantined for its weights fails the test, unless the test is marked
    `serves_wrong_weights` (a generator that skips updates on purpose)."""
    if "redis_url" not in request.fixturenames:
        yield
        return
    url = request.getfixturevalue("redis_url")
    yield
    import redis

    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        flagged = {
            (key, gid): status
            for key in client.scan_iter("rl:*:generators", count=1000)
            if client.type(key) == "hash"
            for gid, status in client.hgetall(key).items()
            if status.startswith("quarantined weights")
        }
    finally:
        client.close()
    new = {k: v for k, v in flagged.items() if k not in _FLAGGED}
    _FLAGGED.update(new)
    if new and request.node.get_closest_marker("serves_wrong_weights") is None:
        pytest.fail(f"an honest generator was quarantined for its weights: {new}")


@pytest.fixture
def run_id() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def learner_broker(redis_url, run_id):
    """A learner's broker holding the run's lease, with the run created and registered, and
    admitting generators (what rank 0 does)."""
    from rollflash.broker.config.config import load_config
    from rollflash.broker.connect.connection import connect
    from rollflash.broker.sides.learner_side import LearnerBroker

    b = LearnerBroker(connect(redis_url, 5.0), run_id, max_payload_bytes=1_000_000)
    b.take_lease()
    b.ensure_groups()
    b.register_run(load_config(None).fingerprint())
    b.track_trajectory_writes()
    yield b
    b.release()


@pytest.fixture
def generator_broker(redis_url, run_id, learner_broker):
    """Generator gen-0 of the same run, admitted."""
    from tests.helpers.brokers import admit, generator

    g = generator(redis_url, run_id)
    admit(learner_broker, g)
    return g


@pytest.fixture
def weights_token(monkeypatch) -> str:
    """`weights.transport: http`'s token, where every process of a run reads it from."""
    from tests.helpers.weight_hosts import TOKEN

    monkeypatch.setenv("ROLLFLASH_WEIGHTS_TOKEN", TOKEN)
    return TOKEN


@pytest.fixture
def brokers(redis_url, run_id):
    """Generator id -> that generator's `GeneratorBroker` on the run (not admitted)."""
    from tests.helpers.brokers import generator

    return lambda generator_id: generator(redis_url, run_id, generator_id)


def build_model(
    tmp_path_factory, name: str, args: list[str], script: str = "make_tiny_model.py"
) -> Path:
    """scripts/`script` with `args`, built into the shared cache when there is one."""
    cache = os.environ.get("ROLLFLASH_TEST_MODELS")
    out = Path(cache) / name if cache else tmp_path_factory.mktemp(name) / "tiny"
    out.parent.mkdir(parents=True, exist_ok=True)
    # one builder per model: parallel test workers (pytest -n) and the two suites of `make test`
    # wait for it instead of training the same model twice
    with open(out.with_name(f".{out.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").is_file():
            _build(out, args, script)
    return out


def _build(out: Path, args: list[str], script: str) -> None:
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / script),
            "--out",
            str(tmp),
            *args,
            "--no-eval",
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    tmp.rename(out)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_model(
        tmp_path_factory, "tiny", ["--sft-steps", "60", "--layers", "1", "--hidden", "64"]
    )


@pytest.fixture(scope="session")
def warm_model_dir(tmp_path_factory) -> Path:
    """The demo's warm start: addition of numbers 0-99, SFT on a teacher that is off by one 60% of the
    time, where RL has room to improve (the same recipe as the Makefile's demo model)."""
    return build_model(
        tmp_path_factory,
        "warm",
        [
            "--task-params",
            '{"ops": ["+"]}',
            "--sft-steps",
            "1200",
            "--sft-lr",
            "1e-3",
            "--sft-teacher-error",
            "0.6",
            "--seed",
            "0",
        ],
    )


@pytest.fixture(scope="session")
def mixture_model_dir(tmp_path_factory, warm_model_dir) -> Path:
    """The warm start of configs/mixture.yaml (the Makefile's MIXTURE_MODEL_ARGS): the demo's
    model, then SFT on the config's mixture of addition and one-liners with a teacher wrong 60%
    of the time in each (scripts/make_mixture_model.py)."""
    config = ROOT / "configs" / "mixture.yaml"
    return build_model(
        tmp_path_factory,
        "mixture",
        ["--base", str(warm_model_dir), "--config", str(config), "--sft-steps", "600",
         "--sft-lr", "2e-3", "--sft-teacher-error", "0.6", "--seed", "0"],
        script="make_mixture_model.py",
    )  # fmt: skip
