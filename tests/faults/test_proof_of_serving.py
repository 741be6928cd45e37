"""Proof of serving with real processes and real engines (broker/weights/probe.py,
broker/channels/serving.py): a learner and two hf generators on the tiny model, one of them with a
fault that skips applying the updates from v2 on (tests/faults/skip_update.py) while it reports
every version as loaded. The learner quarantines it at the version after the first it skipped, with
one line saying why, and trains to its end with the honest one, which is never flagged. At lr 1e-3 a
step moves the probe far past the float32 tolerance (1e-3); at lr 1e-6 it moves it by less than
that, and the probe that stayed bit for bit the same while the learner's moved gives the skip
away."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import redis
import yaml
from harness import start, stop_all, wait_until

pytestmark = pytest.mark.serves_wrong_weights  # tests/conftest.py

HERE = Path(__file__).resolve().parent
STEPS = 6


def _config(tmp_path: Path, model: Path, redis_url: str, run_id: str, lr: float) -> Path:
    cfg = {
        "run": {"run_id": run_id, "run_dir": str(tmp_path / "run"), "torch_threads": 1},
        "model": {"path": str(model)},
        "redis": {"url": redis_url},
        "task": {"name": "arithmetic"},
        "eval": {"size": 4},
        "rollout": {"engine": "hf", "num_return_sequences": 2, "max_new_tokens": 4},
        # the async ratio lets the honest generator run ahead while the other is judged
        "trainer": {
            "rollout_batch_size": 2,
            "total_steps": STEPS,
            "actor_lr": lr,
            "async_ratio": 1,
            "wait_timeout_s": 120,
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize(
    "lr, rule",
    [(1e-3, "nats from the learner's"), (1e-6, "is bit for bit its probe of v")],
    ids=["beyond-the-tolerance", "frozen"],
)
def test_a_generator_that_skips_an_update_is_quarantined_within_one_version(
    tmp_path, tiny_model_dir, redis_url, run_id, lr, rule
):
    config = _config(tmp_path, tiny_model_dir, redis_url, run_id, lr)
    learner = start("start-learner", config)
    skipper = start(
        "start-generator",
        config,
        "--id",
        "skipper",
        env={"SKIP_FROM": "2"},
        wrapper=HERE / "skip_update.py",
    )
    procs = [learner, skipper]
    try:
        # the honest one joins once the skipper is in, so the run cannot end without it
        wait_until(lambda: " ready (engine" in skipper.stderr_text(), 300, "the skipper to join")
        procs.append(start("start-generator", config, "--id", "honest"))
        assert learner.wait(timeout=600) == 0, learner.stderr_text()[-3000:]
        wait_until(lambda: skipper.poll() is not None, 120, "the quarantined generator to stop")
    finally:
        stop_all(procs)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    statuses = r.hgetall(f"rl:{run_id}:generators")
    assert statuses["honest"] == "active"
    reason = statuses["skipper"]
    # the first version it loaded without applying it (v2, or a later one if it missed v2) is
    # the one judged, or the next if it loaded that before the learner looked
    loaded = [int(v) for v in re.findall(r"loaded weights v(\d+)", skipper.stderr_text())]
    first = min(v for v in loaded if v >= 2)
    judged = int(re.match(r"quarantined weights: its probe of v(\d+) ", reason).group(1))
    assert judged in (first, first + 1) and rule in reason, reason
    lines = [ln for ln in learner.stderr_text().splitlines() if "is quarantined" in ln]
    assert len(lines) == 1 and "generator skipper is quarantined: weights:" in lines[0]
    assert skipper.returncode != 0 and "is quarantined" in skipper.stderr_text().splitlines()[-1]
    # the honest generator proved each version it loaded, the last one included
    honest_hash = r.hgetall(f"rl:{run_id}:gen:honest")
    assert int(honest_hash["probe_version"]) == int(honest_hash["loaded_version"]) >= 1
    assert r.hget(f"rl:{run_id}:run", "step") == str(STEPS)
    # and a step's mismatch is split by the generators whose samples it trained with the
    # learner's own weights (the async ratio lets some steps train only older samples: no
    # generator is judged in those), the guard logged every step
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert all("guard/fired_mismatch_kl" in m for m in steps)
    assert any("mismatch/kl/honest" in m for m in steps)
