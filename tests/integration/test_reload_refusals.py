"""A generator whose engine cannot load a published version tries it `weights.reload_attempts`
times, then keeps running on the weights it has, and `rollctl status` shows the refusal (real
Redis; the sim engine with a failing loader)."""

from __future__ import annotations

import time

from rollflash.broker.config.config import config_from_dict
from rollflash.broker.weights.weights import WeightStore
from rollflash.generators import sim_engine
from rollflash.rollctl.status import show_status
from tests.helpers.brokers import joined


def test_a_loader_error_is_counted_in_status_and_the_generator_keeps_its_version(
    tmp_path, redis_url, run_id, monkeypatch, capsys
):
    import torch

    cfg = config_from_dict(
        {
            "run": {"run_id": run_id, "run_dir": str(tmp_path / "run")},
            "redis": {"url": redis_url},
            "rollout": {"engine": "sim"},
            "weights": {"reload_attempts": 2},
        }
    )
    loaded = []

    def swap_weights(self, weights, version):
        if version == 1:
            raise RuntimeError("the engine cannot load v1")
        loaded.append(version)

    monkeypatch.setattr(sim_engine.SimEngine, "swap_weights", swap_weights)
    store = WeightStore(cfg.run.run_dir)
    with joined(cfg, "gen-x") as (learner_broker, gen):
        for version in (1, 2):
            info = store.publish({"w": torch.zeros(2) + version}, version, version)
            learner_broker.announce_weights(version, info.path, info.sha256, "")
            deadline = time.monotonic() + 60  # the rollout loop's turns, until v settles
            while (gen.follower.loaded_version, gen.follower.reload_refused) == (0, version - 1):
                assert time.monotonic() < deadline, f"v{version} never settled"
                gen.follower.maybe_reload(wait_s=0.05)
            gen.heartbeat("up")
            show_status(cfg, as_json=False)
            lines = capsys.readouterr().out.splitlines()
            line = next(x for x in lines if x.startswith("generator gen-x"))
            expected = "loaded=v0 reloads=0 refused=1" if version == 1 else "loaded=v2 reloads=1"
            assert expected in line, line
        assert "refused=1" in line and loaded == [2]
        assert gen.follower.reload_retries == 1  # v1: two attempts, then refused
