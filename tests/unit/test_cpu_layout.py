"""rollctl/cpu_layout.py: how `rollctl run` shares a CPU machine's cores."""

from rollflash.broker.config.config import config_from_dict
from rollflash.rollctl.cpu_layout import SMALL_MODEL_BYTES, CpuLayout, cpu_layout, plan_cpu
from rollflash.rollctl.local import child_env, plan_run

SMALL, LARGE = 3 * 2**20, SMALL_MODEL_BYTES


def test_a_small_model_gets_one_core_per_process():
    # 2 cores: learner 1 thread + 1 generator; 8 cores: learner + 7 generators, 1 thread each
    assert plan_cpu(2, SMALL, None) == CpuLayout(
        generators=1, learner_threads=1, generator_threads=1
    )
    assert plan_cpu(8, SMALL, None) == CpuLayout(7, 1, 1)
    assert plan_cpu(1, SMALL, None) == CpuLayout(1, 1, 1)
    # async_ratio 0: learner and generators take turns, so the generators get every core
    assert plan_cpu(2, SMALL, None, async_ratio=0) == CpuLayout(2, 1, 1)
    assert plan_cpu(2, SMALL, None, async_ratio=0.5) == CpuLayout(1, 1, 1)


def test_an_explicit_generator_count_is_kept_and_the_cores_shared():
    assert plan_cpu(2, SMALL, 2) == CpuLayout(2, 1, 1)  # 3 processes on 2 cores: 1 thread each
    assert plan_cpu(16, SMALL, 3) == CpuLayout(3, 4, 4)  # 16 // (1 + 3) = 4 threads each


def test_a_large_model_splits_the_cores_between_learner_and_one_generator():
    assert plan_cpu(16, LARGE, None) == CpuLayout(1, 8, 8)
    assert plan_cpu(7, LARGE, None) == CpuLayout(1, 3, 4)
    assert plan_cpu(16, LARGE, 2) == CpuLayout(2, 8, 4)  # (16 - 8) // 2


def _config(tmp_path, **rollout):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\0" * 1024)  # a small model
    return config_from_dict(
        {"model": {"path": str(model)}, "rollout": {"engine": "hf", "device": "cpu", **rollout}}
    )


def test_rollctl_run_gives_each_child_the_layouts_threads(tmp_path, monkeypatch):
    monkeypatch.setattr("rollflash.rollctl.cpu_layout.usable_cores", lambda: 4)
    monkeypatch.setattr("rollflash.rollctl.local.usable_cores", lambda: 4)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = _config(tmp_path)
    children = plan_run(cfg, tmp_path / "run.yaml").children
    # 4 cores, small model, generators left open: learner + 3 generators, 1 thread each
    assert [c.name for c in children] == ["learner", "gen-0", "gen-1", "gen-2"]
    assert cfg.rollout.num_rollout_workers == 3
    assert {child_env({}, c)["OMP_NUM_THREADS"] for c in children} == {"1"}
    # an explicit count is kept (4 // (1 + 1) = 2 threads each); explicit threads are left alone
    two = plan_run(_config(tmp_path, num_rollout_workers=1), tmp_path / "run.yaml").children
    assert [child_env({}, c)["OMP_NUM_THREADS"] for c in two] == ["2", "2"]
    cfg = _config(tmp_path)
    cfg.run.torch_threads = 3
    assert all("OMP_NUM_THREADS" not in child_env({}, c) for c in plan_run(cfg, tmp_path).children)


def test_the_layout_leaves_other_engines_alone(tmp_path):
    cfg = _config(tmp_path, engine="sim")
    assert cpu_layout(cfg) is None and cfg.rollout.num_rollout_workers == 2  # the default


def test_the_cpu_layout_is_what_dry_run_prints_first(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from rollflash.rollctl.cli import app

    monkeypatch.setattr("rollflash.rollctl.cpu_layout.usable_cores", lambda: 2)
    monkeypatch.setattr("rollflash.rollctl.local.usable_cores", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    _config(tmp_path)  # the small model directory
    sets = [f"model.path={tmp_path / 'model'}", "rollout.device=cpu", "trainer.device=cpu"]
    args = ["run", "--dry-run", "--set", f"run.run_dir={tmp_path / 'run'}"]
    result = CliRunner().invoke(app, args + [a for s in sets for a in ("--set", s)])
    assert result.exit_code == 0, result.output
    layout, learner, gen = result.output.splitlines()
    # 2 cores, small model: the learner on one core, one generator on the other
    assert layout == (
        "layout: 2 cores: learner 1 thread(s), 1 generator(s) x 1 thread(s) (rollctl/cpu_layout.py)"
    )
    assert learner.split()[:3] == [
        "learner",
        "CUDA_VISIBLE_DEVICES=(inherited)",
        "OMP_NUM_THREADS=1",
    ]
    assert gen.split()[:3] == ["gen-0", "CUDA_VISIBLE_DEVICES=(inherited)", "OMP_NUM_THREADS=1"]
