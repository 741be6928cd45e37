import pytest
import yaml

from rollflash.broker.config.config import Config, ConfigError, config_from_dict, load_config
from rollflash.broker.connect.keys import run_prefix

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def test_defaults_are_valid():
    cfg = config_from_dict({})
    assert cfg.trainer.max_staleness == 1  # ceil(async_ratio = 1.0)
    assert run_prefix(cfg.run.run_id) == "rl:demo:"


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
        (
            {"trainer": {"background_publish": True}},
            "trainer.background_publish: true is not a mode; set process",
        ),
        ({"trainer": {"background_publish": 0}}, "trainer.background_publish: must be process"),
        ({"algo": {"clip_low": 1.5}}, "algo.clip_low: must be in (0, 1]"),
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
        (
            {"redis": {"sentinel": {"hosts": ["10.0.0.1:26379", "sentinel-b"]}}},
            "redis.sentinel.hosts[1]: 'sentinel-b' is not host:port",
        ),
        ({"redis": {"sentinel": {"replicas": 0}}}, "redis.sentinel.replicas: must be >= 1"),
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


def test_exponent_numbers_are_floats_in_files_and_overrides(tmp_path):
    # YAML 1.1 (PyYAML) needs a dot in a float; `1e-4` as people write it is a float here too
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  actor_lr: 1e-4\nalgo:\n  critic_lr: 5E-6\n  kl_coef: 2e-2\n")
    cfg = load_config(path, ["algo.clip_high=3e-1", "reward.max_abs_reward=+1e3"])
    assert (cfg.trainer.actor_lr, cfg.algo.critic_lr, cfg.algo.kl_coef) == (1e-4, 5e-6, 0.02)
    assert (cfg.algo.clip_high, cfg.reward.max_abs_reward) == (0.3, 1000.0)
    with pytest.raises(ConfigError, match="^algo.clip_high: .*-1000"):
        load_config(None, ["algo.clip_high=-1e3"])  # a float, refused by the bound, not the type
    # strings that are not numbers keep the message they had
    for bad in ("1e", "e-4", "1e-4x", "'1e-4'"):
        with pytest.raises(ConfigError, match="^trainer.actor_lr: expected a number, got"):
            load_config(None, [f"trainer.actor_lr={bad}"])


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
    again.rollout.temperature = 0.5
    assert again.fingerprint() != cfg.fingerprint()


def test_logging_is_learner_local_and_left_out_of_the_fingerprint():
    # only the learner reads logging:, so a generator with other trackers still joins the run
    base = load_config(None)
    other = load_config(
        None, ["logging.backends=[jsonl, mlflow]", "logging.completions_per_step=4"]
    )
    assert other.fingerprint() == base.fingerprint()


# Fingerprints of the shipped configs (broker/config/fingerprint.py): processes of one run compare
# them, so the config's representation may not change them. A new shared key or a new default
# of one changes them on purpose (update the values then; model.dtype: auto was the last).
@pytest.mark.parametrize(
    "name, overrides, expected",
    [
        (None, [], "b5e99beb48c4507e"),
        ("demo.yaml", [], "a56221935eea2e48"),
        ("ppo_gae.yaml", [], "79f900b921aabbb2"),  # the two differ in trainer: and algo: only
        ("dapo.yaml", [], "79f900b921aabbb2"),
        ("rlhf.yaml", [], "88f3ddb6e234e176"),
        ("rm.yaml", [], "b5e99beb48c4507e"),  # rm: alone, which only `rollctl train-rm` reads
        ("agentic_gridworld.yaml", [], "5a131250cfe4fb16"),
        (None, ["trainer.actor_lr=1", "task.params={max_operand: 9}", "rollout.temperature=2"],
         "ae7bd81ab87d80a3"),
    ],
)  # fmt: skip
def test_fingerprint_is_unchanged_by_the_config_representation(name, overrides, expected):
    path = ROOT / "configs" / name if name else None
    assert load_config(path, overrides).fingerprint().digest == expected


def test_an_int_given_for_a_float_is_fingerprinted_as_the_float():
    one = load_config(None, ["rollout.temperature=2"]).fingerprint()
    assert one == load_config(None, ["rollout.temperature=2.0"]).fingerprint()


# what may differ between processes and between a run and its resumption (docs/config.md)
MAY_DIFFER = [
    "trainer.total_steps=300",
    "trainer.actor_lr=0.5",
    "trainer.async_ratio=3",
    "logging.completions_per_step=4",
    "eval.every=7",
    "eval.size=5",
    "rollout.engine=sim",
    "rollout.interrupt=true",
    "rollout.prompts_per_pull=3",
    "rollout.heartbeat_ttl_s=5",
    "rollout.num_rollout_workers=5",
    "rollout.vllm.max_num_seqs=7",
    "sim.per_token_s=0.5",
    "algo.clip_high=0.28",
    "reward.micro_batch_size=3",
    "redis.connect_timeout_s=3",
    "run.seed=7",
]
MUST_AGREE = [
    ("model.path=models/other", "model.path"),
    ("model.dtype=bfloat16", "model.dtype"),
    ("task.params={ops: ['*']}", "task.params"),
    ("reward.code.time_s=5", "reward.code.time_s"),
    ("reward.max_abs_reward=5", "reward.max_abs_reward"),
    ("rollout.temperature=0.7", "rollout.temperature"),
    ("rollout.top_p=0.9", "rollout.top_p"),
    ("rollout.max_new_tokens=4", "rollout.max_new_tokens"),
    ("rollout.num_return_sequences=2", "rollout.num_return_sequences"),
    ("redis.max_payload_bytes=1000", "redis.max_payload_bytes"),
]


@pytest.mark.parametrize("override", MAY_DIFFER)
def test_a_key_that_may_differ_leaves_the_fingerprint(override):
    assert load_config(None, [override]).fingerprint() == load_config(None).fingerprint()


@pytest.mark.parametrize("override, key", MUST_AGREE)
def test_a_shared_key_is_named_where_it_differs(override, key):
    from rollflash.broker.config.fingerprint import differences

    base, other = load_config(None).fingerprint(), load_config(None, [override]).fingerprint()
    assert other != base
    (difference,) = differences(base.values, other)
    assert difference.startswith(f"{key} (the run: ")


def test_saved_yaml_has_every_section_and_key_in_declaration_order(tmp_path):
    cfg = load_config(None, ["trainer.actor_lr=1"])
    cfg.save(tmp_path / "resolved.yaml")
    saved = yaml.safe_load((tmp_path / "resolved.yaml").read_text())
    assert list(saved) == [
        "run", "redis", "model", "task", "rollout", "trainer", "algo", "sim", "reward", "eval",
        "rm", "guards", "logging", "placement", "weights",
    ]  # fmt: skip
    assert list(saved["run"]) == ["run_id", "run_dir", "seed", "torch_threads"]
    assert saved["trainer"]["actor_lr"] == 1.0 and isinstance(saved["trainer"]["actor_lr"], float)
    # every field of the dataclass config this replaced, counted by hand, and no property; since:
    # model +4 (chat_template, attn_implementation, trust_remote_code, lora), reward +6
    # (functions, weights, timeout_s, dtype, the code and judge sections), rollout +4 (device, the
    # vllm section, agent, agent_timeout_s), trainer +8 (the learner's device and precision keys,
    # publish) and -1 (eval_every moved to eval.every) and +2 (ppo_mini_batches, ppo_epochs) and
    # +4 (tf32, cuda_alloc_conf, dist_timeout_s, fsdp_reduce_scatter) +1 (overdue_steps)
    # +1 (disable_dropout), task -1 (eval_size moved to eval.size), redis +4 (the lease's TTL,
    # how long acknowledged trajectories stay, the dead letters' retention: count and age) +1
    # (the sentinel section), algo +1 (recipe), guards +1 (max_mismatch_kl), and eval (7),
    # logging (8), placement (4) and weights (10) +3 (its servers' request timeout and
    # connection caps) +3 (anchor_every, probe, probe_tolerance)
    assert {name: len(section) for name, section in saved.items()} == {
        "run": 4, "redis": 9, "model": 6, "task": 2, "rollout": 18, "trainer": 31, "algo": 30,
        "sim": 6, "reward": 13, "eval": 7, "rm": 14, "guards": 12, "logging": 8, "placement": 4,
        "weights": 16,
    }  # fmt: skip
    assert len(saved["rollout"]["vllm"]) == 10
    assert (len(saved["reward"]["code"]), len(saved["reward"]["judge"])) == (6, 7)
    assert "max_staleness" not in saved["trainer"] and "key_prefix" not in saved
    assert "max_overdue_staleness" not in saved["trainer"]


@pytest.mark.parametrize(
    "data, message",
    [
        ({"trainer": {"actor_lr": "fast"}}, "trainer.actor_lr: expected a number, got 'fast'"),
        (
            {"trainer": {"total_steps": "many"}},
            "trainer.total_steps: expected an integer, got 'many'",
        ),
        ({"trainer": {"total_steps": True}}, "trainer.total_steps: expected an integer, got True"),
        ({"rollout": {"top_p": 1.5}}, "rollout.top_p: must be in (0, 1], got 1.5"),
        ({"trainer": {"async_ratio": -1}}, "trainer.async_ratio: must be >= 0, got -1.0"),
        ({"trainer": {"rollout_batch_size": 0}}, "trainer.rollout_batch_size: must be > 0, got 0"),
        ({"rollout": {"interrupt": "no"}}, "rollout.interrupt: expected true or false, got 'no'"),
        ({"run": {"run_id": 7}}, "run.run_id: expected a string, got 7"),
        ({"task": {"params": [1]}}, "task.params: expected a mapping, got [1]"),
        ({"sim": None}, "sim: expected a mapping, got None"),
        (
            {"redis": {"connect_timeout_s": float("nan")}},
            "redis.connect_timeout_s: must be finite, got nan",
        ),
        (
            {"rollout": {"temperature": float("nan")}},
            "rollout.temperature: must be finite, got nan",
        ),
        (
            {"rollout": {"temperature": float("inf")}},
            "rollout.temperature: must be finite, got inf",
        ),
        (
            {"model": {"dtype": "fp16"}},
            "model.dtype: must be one of ['auto', 'float32', 'bfloat16'], got 'fp16'",
        ),
        ({"model": {"lora": {"rank": 0}}}, "model.lora.rank: must be in (0, 512], got 0"),
        (
            {"model": {"lora": {"rnk": 8}}},
            "model.lora.rnk: unknown key (known: alpha, dropout, modules_to_save, rank, "
            "target_modules)",
        ),
        ({"model": {"lora": 8}}, "model.lora: expected a mapping, got 8"),
        (
            {"trainer": {"publish": "adapter"}},
            "trainer.publish: adapter versions need model.lora; set it or publish: full",
        ),
        (
            {"trainer": {"strategy": "fsdp"}, "model": {"lora": {"rank": 8}}},
            "trainer.strategy: fsdp does not shard LoRA adapters yet; use ddp with model.lora",
        ),
        (
            {"trainer": {"strategy": "fsdp"}, "algo": {"adv_estimator": "gae", "critic": True}},
            "trainer.strategy: fsdp does not shard the critic yet; use ddp with algo.critic: true",
        ),
        (
            {"rollout": {"replicate_prompts": True}, "trainer": {"num_trainer_workers": 2}},
            "rollout.replicate_prompts: not supported with trainer.num_trainer_workers > 1 (a "
            "group's samples would be read by different learner ranks)",
        ),
        (
            {"guards": {"enabld": True}},
            "guards.enabld: unknown key (known: enabled, kl_max_rise, kl_window, max_mismatch_kl, "
            "max_ngram_repeat, max_truncated_frac, min_length, ngram_n, patience, score_std_drop, "
            "score_std_min, stop_on_guard)",
        ),
        (
            {"logging": {"backends": ["tensorboard"]}},
            "logging.backends: must include jsonl (metrics.jsonl feeds summary.json and "
            "`rollctl plot`), got ['tensorboard']",
        ),
        (
            {"logging": {"backends": ["jsonl", "wandb", "wandb"]}},
            "logging.backends: a backend is listed twice, got ['jsonl', 'wandb', 'wandb']",
        ),
        (
            {"logging": {"completions_per_step": -1}},
            "logging.completions_per_step: must be >= 0, got -1",
        ),
        (
            {"trainer": {"eval_every": 5}},
            "trainer.eval_every: moved to eval.every; set eval.every: 5 instead",
        ),
        (
            {"task": {"name": "arithmetic", "eval_size": 8}},
            "task.eval_size: moved to eval.size; set eval.size: 8 instead",
        ),
        (
            {"bogus": {}},
            "bogus: unknown key (known: algo, eval, guards, logging, model, placement, redis, reward, rm, "
            "rollout, run, sim, task, trainer, weights)",
        ),
    ],
)
def test_messages_are_exactly_one_line_naming_the_key(data, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert str(e.value) == message


def test_a_top_level_that_is_not_a_mapping_is_refused():
    with pytest.raises(ConfigError) as e:
        config_from_dict([1, 2])  # type: ignore[arg-type]
    assert str(e.value) == "config: expected a mapping, got [1, 2]"


def test_every_field_has_a_type_and_a_description():
    sections = Config.model_fields
    assert len(sections) == 15
    for name, section in sections.items():
        assert section.description, name
        for key, info in section.annotation.model_fields.items():
            assert info.annotation is not None, f"{name}.{key}"
            assert info.description and "\n" not in info.description, f"{name}.{key}"
