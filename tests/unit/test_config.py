import pytest
import yaml

from rollflash.broker.config import Config, ConfigError, config_from_dict, load_config

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def test_defaults_are_valid():
    cfg = config_from_dict({})
    assert cfg.trainer.max_staleness == 1  # ceil(async_ratio = 1.0)
    assert cfg.key_prefix == "rl:demo:"


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    assert isinstance(load_config(path), Config)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"trainer": {"actor_lrr": 1e-3}}, "trainer.actor_lrr: unknown key"),
        ({"bogus": {}}, "bogus: unknown key"),
        ({"trainer": {"actor_lr": "fast"}}, "trainer.actor_lr: expected a number, got 'fast'"),
        (
            {"trainer": {"rollout_batch_size": 2.5}},
            "trainer.rollout_batch_size: expected an integer",
        ),
        ({"trainer": {"rollout_batch_size": 0}}, "trainer.rollout_batch_size: must be > 0"),
        ({"trainer": {"async_ratio": -1}}, "trainer.async_ratio: must be >= 0"),
        ({"rollout": {"engine": "tgi"}}, "rollout.engine: must be one of ['hf', 'vllm', 'sim']"),
        ({"algo": {"clip_low": 1.5}}, "algo.clip_low: must be in (0, 1)"),
        ({"algo": {"tis_cap": 0.5}}, "algo.tis_cap: must be >= 1 or null"),
        ({"rollout": {"num_return_sequences": 1}}, "rollout.num_return_sequences"),
        ({"trainer": 3}, "trainer: expected a mapping"),
        ({"rollout": {"top_p": 0}}, "rollout.top_p: must be in (0, 1]"),
        ({"trainer": {"actor_lr": True}}, "trainer.actor_lr: expected a number"),
        (
            {"rollout": {"inflight_samples": 16}},
            "rollout.inflight_samples: continuous batching needs rollout.engine vllm or sim",
        ),  # hf default
        (
            {"rollout": {"inflight_samples": -1, "engine": "sim"}},
            "rollout.inflight_samples: must be >= 0",
        ),
    ],
)
def test_bad_values_name_the_key(data, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert str(e.value).startswith(message)
    assert "\n" not in str(e.value)


def test_int_accepted_for_float_and_null_for_optional():
    cfg = config_from_dict({"trainer": {"actor_lr": 1}, "algo": {"tis_cap": None}})
    assert cfg.trainer.actor_lr == 1.0 and isinstance(cfg.trainer.actor_lr, float)
    assert cfg.algo.tis_cap is None


def test_dotted_overrides_parse_yaml_values(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"algo": {"clip_high": 0.2}}))
    cfg = load_config(
        path, ["algo.clip_high=0.28", "task.params={max_operand: 9}", "algo.dual_clip_c=null"]
    )
    assert cfg.algo.clip_high == 0.28
    assert cfg.task.params == {"max_operand": 9}
    assert cfg.algo.dual_clip_c is None


def test_override_of_unknown_key_fails():
    with pytest.raises(ConfigError, match="^algo.clip_hihg: unknown key"):
        load_config(None, ["algo.clip_hihg=0.3"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_saved_config_round_trips_and_fingerprint_ignores_local_fields(tmp_path):
    cfg = load_config(None, ["trainer.actor_lr=0.01"])
    cfg.save(tmp_path / "resolved.yaml")
    again = load_config(tmp_path / "resolved.yaml")
    assert again == cfg
    again.redis.url = "unix:///elsewhere.sock"
    again.rollout.num_rollout_workers = 7
    assert again.fingerprint() == cfg.fingerprint()
    again.trainer.actor_lr = 0.02
    assert again.fingerprint() != cfg.fingerprint()
