"""The GPU check runs on the GPU test machine as it is (docs/gpu.md): in a virtual environment
with only that machine's packages (tests/helpers/gpu_machine.py: no pydantic, redis, pyzmq or
vLLM, the project not installed), plus the wheels `make gpu-wheels` carries (scripts/gpu_wheels.py,
here for this Python), which the check unpacks itself, `scripts/gpu_check.py --dry-run`
runs every part on CPU and each passes its own checks. Without the wheels the check's imports
fail, and its env part says which."""

import fcntl
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import gpu_machine

ROOT = Path(__file__).resolve().parents[2]
PARTS = "env,learner_1rank,learner_2ranks,stall,bench_0.5b,generate"


@pytest.fixture(scope="session")
def machine(tmp_path_factory) -> tuple[Path, Path]:
    """(the GPU machine's python, `make gpu-wheels`' folder for this Python), built once."""
    cache = os.environ.get("ROLLFLASH_TEST_MODELS")
    # its site-packages links into this interpreter's: one per interpreter in a shared cache
    name = f"gpu-machine-{hashlib.sha256(sys.prefix.encode()).hexdigest()[:8]}"
    root = Path(cache) / name if cache else tmp_path_factory.mktemp("gpu-machine")
    python = gpu_machine.build(root)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    wheels = root / f"wheels-cp{version.replace('.', '')}"
    with open(root / ".lock", "w") as lock:  # parallel workers download once
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "gpu_wheels.py"), "--python-version",
             version, "--dest", str(wheels)],
            check=True, capture_output=True,
        )  # fmt: skip
    return python, wheels


def _check(python: Path, out: Path, parts: str, wheels: Path) -> list[dict]:
    # no PYTHONPATH: the check unpacks the wheels itself (docs/gpu.md's command)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(out), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [str(python), "scripts/gpu_check.py", "--dry-run", "--out", str(out), "--parts", parts,
         "--budget-s", "1500", "--wheels", str(wheels)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1600,
    )  # fmt: skip
    lines = [json.loads(ln) for ln in proc.stdout.splitlines()]
    assert lines == [json.loads(ln) for ln in (out / "gpu_check.jsonl").read_text().splitlines()]
    assert proc.returncode == (0 if lines[-1]["ok"] else 1)
    return lines


@pytest.mark.slow  # about two minutes: six parts, each a process
def test_the_check_runs_with_the_machines_packages_and_the_carried_wheels(machine, tmp_path):
    python, wheels = machine
    parts = {p["part"]: p for p in _check(python, tmp_path, PARTS, wheels)}
    assert parts["summary"]["ok"], {k: (v["ok"], v.get("error")) for k, v in parts.items()}
    env = parts["env"]
    assert env["import_failures"] == {} and not env["rollflash_installed"] and not env["vllm"]
    assert sorted(env["wheels"]) == sorted(w.name for w in wheels.glob("*.whl"))
    assert any(w.startswith("pydantic_core-") for w in env["wheels"])
    one = parts["learner_1rank"]
    assert set(one["cases"]) == {"fsdp", "fsdp-packed"}
    assert 0 < one["bf16_vs_cpu_fp32"] <= 0.1 and one["packed_vs_padded"] <= 1e-4  # bf16 did run
    for case in one["cases"].values():
        assert case["tied"] and case["updates"] == [4.0, 4.0] and case["published_greedy_match"]
        assert case["masters_fp32"] and case["resume_max_diff"] <= 1e-5
    two = parts["learner_2ranks"]
    assert two["world_size"] == 2 and set(two["cases"]) == {"ddp", "ddp-packed"}
    assert two["cases"]["ddp"]["vs_one_rank_max_diff"] <= 1e-5
    stall = parts["stall"]  # the dry run's trainer.dist_timeout_s is 3 s; the margin 30 s
    assert 3 <= stall["waited_s"] < 33 and "\n" not in stall["error"]
    assert stall["error"].startswith("rank 0 of 2: all_reduce (Dist.sums) ended after waiting")
    bench = parts["bench_0.5b"]
    # a version holds every parameter once (the tie) in bf16: 2 bytes each
    assert bench["bytes"] == 2 * bench["params"]
    assert all(bench[k]["tokens_per_s"] > 0 for k in ("padded", "checkpointed", "packed"))
    (tiny,) = parts["generate"]["models"].values()
    assert tiny["logprob_abs_diff_max"] < 1e-4  # same model and dtype: float32 noise at most
    assert set(tiny["tok_s"]) == {"1", "4"} and tiny["reload_s"] >= tiny["verify_s"] >= 0
    assert tiny["swap_s"] >= 0
    # the next version as a delta: 1% of the elements, applied to the held file, bit for bit
    assert tiny["delta_bit_exact"] == 1.0 and tiny["delta_kind_is_delta"] == 1.0
    assert tiny["delta_bytes_ratio"] < 0.1


def test_without_the_wheels_the_env_part_names_what_is_missing(machine, tmp_path):
    python, _ = machine
    env, summary = _check(python, tmp_path / "out", "env", tmp_path / "no-wheels")
    assert not env["ok"] and not summary["ok"] and env["wheels"] == []
    assert env["import_failures"]["rollflash.broker.config.config"] == (
        "ModuleNotFoundError: No module named 'pydantic'"
    )


def test_cuda_without_a_gpu_is_refused_in_one_line(tmp_path):
    scripts = ("gpu_smoke.py", "gpu_bench.py", "gpu_smoke_generate.py")
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "scripts" / script)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
            env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
        )
        for script in scripts
    ]  # fmt: skip
    for script, proc in zip(scripts, procs):
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 2, (script, err[-2000:])
        assert "--device cuda: torch sees no GPU" in err.strip().splitlines()[-1]
