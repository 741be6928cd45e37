"""GPU placement (broker/config/placement.py, rollctl/local.py): the CUDA_VISIBLE_DEVICES each child of
`rollctl run` gets, `rollctl run --dry-run`, `rollctl start-generator --gpus`, and layouts that
cannot fit refused with one line naming the keys. No GPU needed: only environments are compared."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollflash.broker.config.config import ConfigError, config_from_dict, load_config
from rollflash.broker.config.placement import parse_gpus
from rollflash.rollctl.cli import app
from rollflash.rollctl.local import child_env, plan_run
from rollflash.rollctl.preflight import PREFLIGHT_DONE_ENV

RUN_YAML = Path("runs/x/run.yaml")


def _envs(data: dict) -> dict[str, str | None]:
    """name -> CUDA_VISIBLE_DEVICES of each child, as _spawn receives it (None: not set)."""
    cfg = config_from_dict(data)
    base = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "inherited"}
    out = {}
    for child in plan_run(cfg, RUN_YAML).children:
        env = child_env(base, child)
        assert env["PATH"] == "/bin"  # the rest of the environment is passed on
        out[child.name] = env["CUDA_VISIBLE_DEVICES"]
    return out


def _vllm(tp: int, **rollout) -> dict:
    return {"engine": "vllm", "vllm": {"tensor_parallel_size": tp}, **rollout}


@pytest.mark.parametrize(
    "data, expected",
    [
        # 8 GPUs, a 2-GPU learner, TP=2: the remaining 6 hold 3 generators (count derived)
        (
            {"placement": {"gpus": "0-7", "learner_gpus": 2}, "rollout": _vllm(2)},
            {"learner": "0,1", "gen-0": "2,3", "gen-1": "4,5", "gen-2": "6,7"},
        ),
        # 1 learner GPU (trainer.num_trainer_workers' default), 3 hf generators of one GPU each
        (
            {"placement": {"gpus": "0,1,2,3"}, "rollout": {"engine": "hf"}},
            {"learner": "0", "gen-0": "1", "gen-1": "2", "gen-2": "3"},
        ),
        # ids need not start at 0 nor be contiguous; an explicit generator count may leave GPUs idle
        (
            {
                "placement": {"gpus": "2,5-7,9", "learner_gpus": 1},
                "rollout": _vllm(2, num_rollout_workers=1),
            },
            {"learner": "2", "gen-0": "5,6"},
        ),
        # a CPU learner: every GPU to the generators
        (
            {"placement": {"gpus": "0-3", "learner_gpus": 0}, "rollout": _vllm(4)},
            {"learner": "", "gen-0": "0,1,2,3"},
        ),
        # colocated: two generators share the learner's one GPU, 2 x 0.2 + 0.5 <= 1
        (
            {
                "placement": {"gpus": 0, "colocate": True},
                "rollout": _vllm(1, num_rollout_workers=2, vllm_share=0.2),
            },
            {"learner": "0", "gen-0": "0", "gen-1": "0"},
        ),
        # colocated over a 2-GPU learner: generator i starts at learner GPU (i * 1) mod 2
        (
            {
                "placement": {"gpus": "4-5", "learner_gpus": 2, "colocate": True},
                "rollout": _vllm(1, num_rollout_workers=3, vllm_share=0.25),
            },
            {"learner": "4,5", "gen-0": "4", "gen-1": "5", "gen-2": "4"},
        ),
        # no placement.gpus: nothing is set, each child inherits the parent's value
        (  # no GPUs listed (an explicit count: rollctl/cpu_layout.py may choose it otherwise)
            {"rollout": {"num_rollout_workers": 2}},
            {"learner": "inherited", "gen-0": "inherited", "gen-1": "inherited"},
        ),
    ],
)
def test_each_child_gets_its_gpus(data, expected):
    rollout = data.get("rollout", {})
    if "vllm_share" in rollout:
        rollout["vllm"]["gpu_memory_utilization"] = rollout.pop("vllm_share")
    assert _envs(data) == expected


def test_learner_gpus_set_the_learner_ranks_unless_they_disagree():
    cfg = config_from_dict({"placement": {"gpus": "0-7", "learner_gpus": 2}})
    assert cfg.trainer.num_trainer_workers == 2 and cfg.rollout.num_rollout_workers == 6
    with pytest.raises(ConfigError) as e:
        config_from_dict(
            {"placement": {"gpus": "0-7", "learner_gpus": 2}, "trainer": {"num_trainer_workers": 4}}
        )
    assert str(e.value) == (
        "placement.learner_gpus: 2 GPUs for trainer.num_trainer_workers 4 ranks (one GPU per rank)"
    )


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {"placement": {"gpus": "0-6", "learner_gpus": 2}, "rollout": _vllm(2)},
            "rollout.vllm.tensor_parallel_size: 2 does not divide the 5 GPUs left for generators "
            "(placement.gpus after placement.learner_gpus)",
        ),
        (
            {
                "placement": {"gpus": "0-7", "learner_gpus": 2},
                "rollout": _vllm(2, num_rollout_workers=4),
            },
            "placement.gpus: 6 GPUs left after the learner's, but rollout.num_rollout_workers 4 x 2 "
            "GPUs each (rollout.vllm.tensor_parallel_size) need 8",
        ),
        (
            {"placement": {"gpus": "0-1", "learner_gpus": 3}},
            "placement.learner_gpus: 3 learner GPUs, but placement.gpus lists only 2",
        ),
        (
            {"placement": {"gpus": "0,1,1"}},
            "placement.gpus: GPU 1 listed more than once",
        ),
        (
            {"placement": {"gpus": "0-3,x"}},
            "placement.gpus: expected GPU ids such as '0-7' or '0,2,3', got '0-3,x'",
        ),
        ({"placement": {"gpus": "3-1"}}, "placement.gpus: range '3-1' runs backwards"),
        (
            {"placement": {"learner_gpus": 2}},
            "placement.learner_gpus: needs placement.gpus, the GPU ids to share out",
        ),
        (
            {"placement": {"gpus": "0", "colocate": True}, "rollout": _vllm(1)},
            "rollout.vllm.gpu_memory_utilization: placement.colocate needs an explicit share "
            "(vLLM's default 0.9 leaves nothing to the learner)",
        ),
        (
            # 2 generators x 0.3 + 0.5 = 1.1 > 1
            {
                "placement": {"gpus": "0", "colocate": True},
                "rollout": {**_vllm(1), "vllm": {"gpu_memory_utilization": 0.3}},
            },
            "rollout.vllm.gpu_memory_utilization: 2 generators x 0.3 + "
            "placement.learner_memory_share 0.5 = 1.1 > 1 on GPU 0",
        ),
        (
            {
                "placement": {"gpus": "0,1", "learner_gpus": 1, "colocate": True},
                "rollout": _vllm(2),
            },
            "placement.colocate: generators of 2 GPUs each cannot share 1 learner GPUs "
            "(placement.learner_gpus)",
        ),
    ],
)
def test_a_layout_that_cannot_fit_is_refused_naming_the_keys(data, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert str(e.value) == message


def test_parse_gpus():
    assert parse_gpus("0-3") == ["0", "1", "2", "3"]
    assert parse_gpus("4,5") == ["4", "5"] and parse_gpus(3) == ["3"]
    assert parse_gpus(" 1, 6-7 ") == ["1", "6", "7"]


def test_run_dry_run_prints_the_layout_and_starts_nothing(tmp_path):
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(
        app,
        ["run", "--dry-run", "--gpus", "0-7", "--learner-gpus", "2", "--engine", "vllm"]
        + ["--set", "rollout.vllm.tensor_parallel_size=2", "--set", f"run.run_dir={run_dir}"],
    )
    assert result.exit_code == 0, result.output
    layout, *lines = result.output.splitlines()
    assert layout == (
        "layout: GPUs 0,1,2,3,4,5,6,7: the learner 0,1, 3 generator(s) (broker/config/placement.py)"
    )
    assert [line.split()[:2] for line in lines] == [
        ["learner", "CUDA_VISIBLE_DEVICES=0,1"],
        ["gen-0", "CUDA_VISIBLE_DEVICES=2,3"],
        ["gen-1", "CUDA_VISIBLE_DEVICES=4,5"],
        ["gen-2", "CUDA_VISIBLE_DEVICES=6,7"],
    ]
    assert lines[1].endswith(f"rollctl start-generator --config {run_dir}/run.yaml --id gen-0")
    assert not run_dir.exists()  # no Redis, no run directory, no children


def test_run_dry_run_refuses_a_bad_layout_in_one_line():
    result = CliRunner().invoke(app, ["run", "--dry-run", "--gpus", "0-2", "--learner-gpus", "4"])
    assert result.exit_code == 2
    assert result.output.strip() == (
        "rollctl: error: placement.learner_gpus: 4 learner GPUs, but placement.gpus lists only 3"
    )


@pytest.mark.parametrize(
    "gpus, tp, expected",
    [("3", 1, "3"), ("4,5", 2, "4,5"), ("4-7", 4, "4,5,6,7")],
)
def test_start_generator_gpus_become_its_cuda_visible_devices(monkeypatch, gpus, tp, expected):
    import rollflash.generators

    seen = []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "untouched")  # restored after the test
    monkeypatch.setenv(PREFLIGHT_DONE_ENV, "1")  # no model, no vLLM, no GPU here: not checked
    monkeypatch.setattr(
        rollflash.generators,
        "run",
        lambda cfg, gid: seen.append(__import__("os").environ["CUDA_VISIBLE_DEVICES"]),
    )
    result = CliRunner().invoke(
        app,
        ["start-generator", "--redis-url", "redis://localhost:1", "--engine", "vllm"]
        + ["--gpus", gpus, "--set", f"rollout.vllm.tensor_parallel_size={tp}"],
    )
    assert result.exit_code == 0, result.output
    assert seen == [expected]


def test_start_generator_gpus_must_match_the_tensor_parallel_size():
    result = CliRunner().invoke(
        app,
        ["start-generator", "--redis-url", "redis://localhost:1", "--engine", "vllm"]
        + ["--gpus", "4,5"],
    )
    assert result.exit_code == 2
    assert result.output.strip() == (
        "rollctl: error: --gpus: 2 GPUs given, but a vllm generator uses 1 "
        "(rollout.vllm.tensor_parallel_size 1)"
    )


def test_shipped_configs_still_load_without_gpus():
    for path in Path(__file__).resolve().parents[2].joinpath("configs").glob("*.yaml"):
        assert load_config(path).placement.gpus is None
