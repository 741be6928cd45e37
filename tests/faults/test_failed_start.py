"""A start that fails changes nothing: after a mistyped `model.path` (found before anything
starts) or a model that cannot be loaded (found by the learner after it took the run's lease and
registered its config), the corrected command on the same run directory trains at once. The
run's identity (its config fingerprint, broker/channels/registry.py) is fixed by the first learner that
trains, and from then on a process with another config is refused. Real processes and a real
redis-server; the learner is the tiny model's, the generators simulated."""

import shutil

import redis
import yaml
from harness import rollctl_run, write_config

from rollflash.broker.connect.keys import RunKeys

STEPS, B = 3, 4


def _with_model(config, model) -> None:
    cfg = yaml.safe_load(config.read_text())
    cfg["model"] = {"path": str(model)}
    config.write_text(yaml.safe_dump(cfg))


def test_a_failed_start_changes_nothing_and_the_first_training_fixes_the_run(
    tmp_path, redis_url, run_id, tiny_model_dir
):
    sim = {"per_token_s": 0.001, "length_median": 8, "learner_step_s": 0, "vocab_size": 51}
    config = write_config(tmp_path, redis_url, run_id, STEPS, B, sim=sim,
                          rollout={"max_new_tokens": 16})  # fmt: skip
    r, keys = redis.Redis.from_url(redis_url), RunKeys(run_id)

    _with_model(config, "nope")  # a typo: found before Redis or any process
    typo = rollctl_run(config)
    assert typo.returncode == 2, typo.stderr[-3000:]
    assert typo.stderr.splitlines() == [
        "rollctl: error: model.path: no model directory at nope and no copy of that hub model "
        f"in the Hugging Face cache ({typo.stderr.split('cache (')[1].split(';')[0]}; "
        "LocalEntryNotFoundError); download it first: huggingface-cli download nope (or build "
        "a local one with scripts/make_tiny_model.py)"
    ]
    assert not r.exists(keys.run) and not r.exists(keys.lease)  # nothing written

    broken = tmp_path / "broken"  # every file there, the weights cut short: the learner fails
    shutil.copytree(tiny_model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    _with_model(config, broken)
    failed = rollctl_run(config)
    assert failed.returncode != 0, failed.stderr[-3000:]
    assert "learner exited with" in failed.stderr
    assert not r.exists(keys.lease)  # given back as the learner exited
    assert r.hget(keys.run, "state") is None  # registered, never trained
    assert str(broken) in r.hget(keys.run, "fingerprint_keys").decode()

    _with_model(config, tiny_model_dir)  # the corrected command
    fixed = rollctl_run(config)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    log = (tmp_path / "run" / "logs" / "learner.log").read_text()
    assert "its earlier learner stopped before training with another config (model.path" in log
    assert str(tiny_model_dir) in r.hget(keys.run, "fingerprint_keys").decode()
    assert r.hget(keys.run, "state") == b"done"

    _with_model(config, broken)  # the run has trained: its identity is fixed now
    refused = rollctl_run(config)  # the generator, or the learner, whichever joins first
    assert refused.returncode in (2, 3), refused.stderr[-3000:]
    said = "was started with another config; keys every process must agree on differ: model.path"
    assert said in refused.stdout + refused.stderr
