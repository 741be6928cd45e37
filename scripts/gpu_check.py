"""The GPU check: everything a GPU machine should measure, as one command of at most 8 minutes
(docs/gpu.md gives the command, with the wheels it carries). One JSON line per part on stdout,
the same lines in OUT/gpu_check.jsonl, and each part's stderr in OUT/<part>.log.

    python3 scripts/gpu_check.py --out "$OUT"          # on the GPU machine, with .whl/ carried
    python3 scripts/gpu_check.py --dry-run --out DIR   # every part on CPU at toy sizes

Where pydantic is not installed (the GPU test machine), the wheels `make gpu-wheels` put in
.whl/ (`--wheels`) are unpacked into a temporary folder that goes first on this process's path
and on the parts' (PYTHONPATH): a wheel is a zip of a site-packages tree, so unpacking it
installs it, without pip or a network.

Parts, each a process of its own with a time budget (BUDGET_S in all; a part that overruns is
killed and reported, and the next ones run):
- env: Python, torch, CUDA, the GPUs, transformers, vLLM (absent: its figures are not measured),
  and the import of every module the check uses;
- learner_1rank (scripts/gpu_smoke.py under torchrun): single, DDP and FSDP2 in a one-rank group,
  padded and packed, bf16 over float32 masters, PPO mini-batches, the tie, publish / reload /
  greedy, checkpoint / resume, bf16 against float32 log-probs, packed against padded;
- learner_2ranks: the same on two ranks (sharing one GPU if there is only one), and two ranks
  against one in float32;
- stall: two ranks, one stopped: the other ends with the timeout's one-line error;
- bench_0.5b (scripts/gpu_bench.py): tokens/s, peak memory and MFU of a random Qwen2 with
  Qwen2.5-0.5B's shapes, with and without gradient checkpointing and packed, and publish /
  reload seconds at 0.5B;
- generate (scripts/gpu_smoke_generate.py): the hf engine's tokens/s at batch 1 / 16 / 64,
  reload seconds (a full version, and the next one as a delta applied to the held file, which
  must leave the engine holding it bit for bit) and its log-probs against the learner's.
The last line is the summary: `ok` when every part passed its own checks.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
BUDGET_S = 470.0  # the whole check; one command may run 10 minutes, the check fits in 8
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
STALL_TIMEOUT_S = {"gpu": 10, "dry": 3}
DRY_SLACK = 4  # the dry run's parts may take this many times their GPU budget (a busy CPU)
# name -> (budget s, argv on a GPU, argv of the dry run); a "ranks:N" first element starts N
# ranks directly (not torchrun: a stopped rank would hold torchrun's teardown)
PARTS: dict[str, tuple[float, list[str], list[str]]] = {
    "learner_1rank": (
        90,
        [*TORCHRUN, "--nproc-per-node=1", str(SCRIPTS / "gpu_smoke.py")],
        [sys.executable, str(SCRIPTS / "gpu_smoke.py"), "--device", "cpu", "--strategies", "fsdp"],
    ),
    "learner_2ranks": (
        110,
        [*TORCHRUN, "--nproc-per-node=2", str(SCRIPTS / "gpu_smoke.py")],
        [
            *TORCHRUN,
            "--nproc-per-node=2",
            str(SCRIPTS / "gpu_smoke.py"),
            "--device",
            "cpu",
            "--strategies",
            "ddp",
        ],
    ),  # fmt: skip
    "stall": (
        60,
        ["ranks:2", str(SCRIPTS / "gpu_smoke.py"), "--stall", str(STALL_TIMEOUT_S["gpu"])],
        [
            "ranks:2",
            str(SCRIPTS / "gpu_smoke.py"),
            "--device",
            "cpu",
            "--stall",
            str(STALL_TIMEOUT_S["dry"]),
        ],
    ),  # fmt: skip
    "bench_0.5b": (
        110,
        [sys.executable, str(SCRIPTS / "gpu_bench.py")],
        [sys.executable, str(SCRIPTS / "gpu_bench.py"), "--device", "cpu", "--tiny"],
    ),
    "generate": (
        80,
        [sys.executable, str(SCRIPTS / "gpu_smoke_generate.py")],
        [sys.executable, str(SCRIPTS / "gpu_smoke_generate.py"), "--device", "cpu", "--small"],
    ),
}
# every module the parts import (the env part imports them all: the check's import closure)
MODULES = (
    "rollflash.broker.config.config", "rollflash.broker.wire.schema",
    "rollflash.broker.weights.weights", "rollflash.broker.weights.weight_stream",
    "rollflash.generators.fetch", "rollflash.broker.weights.delta_write",
    "rollflash.learner.durability.checkpoint_io", "rollflash.learner.process.device",
    "rollflash.learner.process.dist", "rollflash.learner.step.logprobs",
    "rollflash.learner.models.memory", "rollflash.learner.models.policy",
    "rollflash.learner.step.prepare", "rollflash.learner.step.train",
    "rollflash.generators.hf_engine", "rollflash.generators.sampling", "make_tiny_model",
)  # fmt: skip


def use_wheels(wheels: Path, env: dict[str, str]) -> list[str]:
    """Unpack the carried wheels onto the path of this process and of `env`'s children, unless
    pydantic is installed (the module docstring); returns their file names."""
    import importlib.util

    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found or importlib.util.find_spec("pydantic") is not None:
        return []
    site = tempfile.mkdtemp(prefix="rollflash-gpu-check-site-")
    atexit.register(shutil.rmtree, site, ignore_errors=True)
    for wheel in found:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
    sys.path.insert(0, site)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    return [w.name for w in found]


def env_part() -> dict:
    """Versions, devices and the import closure, in this process."""
    import importlib
    import importlib.util

    sys.path.insert(0, str(SCRIPTS))
    from checkout import use_checkout

    installed = importlib.util.find_spec("rollflash") is not None
    use_checkout()
    failed = {}
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - reported, the part fails
            failed[name] = f"{type(e).__name__}: {e}"
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    return {
        "ok": not failed,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda
        else [],
        "transformers": transformers.__version__,
        "vllm": importlib.util.find_spec("vllm") is not None,
        "rollflash_installed": installed,
        "import_failures": failed,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(argv: list[str], env: dict[str, str], log) -> list[subprocess.Popen]:
    """The part's processes: one, or N ranks with the variables torchrun would set."""
    if not argv[0].startswith("ranks:"):
        return [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=log, text=True)]
    n, port = int(argv[0].split(":")[1]), str(_free_port())
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(n),
              "LOCAL_WORLD_SIZE": str(n)}  # fmt: skip
    return [
        subprocess.Popen(
            [sys.executable, *argv[1:]],
            env={**env, **common, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
            stderr=log,
            text=True,
        )
        for r in range(n)
    ]


def run_part(name: str, argv: list[str], budget_s: float, out: Path, env: dict) -> dict:
    started = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        procs = _start(argv, env, log)
        try:
            stdout, _ = procs[0].communicate(timeout=budget_s)
            rc = procs[0].returncode
        except subprocess.TimeoutExpired:
            stdout, rc = "", None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)  # a stopped rank (stall) ignores SIGTERM
                    p.wait()
    wall = round(time.monotonic() - started, 1)
    lines = [ln for ln in (stdout or "").splitlines() if ln.startswith("{")]
    if rc is None:
        return {"ok": False, "wall_s": wall, "error": f"ran past its {budget_s:.0f} s budget"}
    try:
        result = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        tail = (out / f"{name}.log").read_text(errors="replace").strip().splitlines()[-3:]
        return {"ok": False, "wall_s": wall, "rc": rc, "error": " | ".join(tail)}
    return {**result, "ok": bool(result.get("ok", rc == 0)) and rc == 0, "wall_s": wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-check"), help="where the lines go")
    p.add_argument("--dry-run", action="store_true", help="every part on CPU, at toy sizes")
    p.add_argument("--parts", default=",".join(["env", *PARTS]), help="comma-separated subset")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole check's seconds")
    p.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="make gpu-wheels' folder")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    wheels = use_wheels(args.wheels, env)
    if args.dry_run:
        env.setdefault("OMP_NUM_THREADS", "1")
    started, passed = time.monotonic(), True
    with open(out / "gpu_check.jsonl", "w") as jsonl:
        for name in args.parts.split(","):
            left = args.budget_s - (time.monotonic() - started)
            if name == "env":
                line = {"part": "env", **env_part(), "wheels": wheels}
            elif left < 15:
                line = {"part": name, "ok": False, "error": "no time left in the check's budget"}
            else:
                budget, gpu, dry = PARTS[name]
                budget = DRY_SLACK * budget if args.dry_run else budget
                argv = dry if args.dry_run else gpu
                line = {"part": name, **run_part(name, argv, min(budget, left), out, env)}
            passed = passed and line["ok"]
            print(json.dumps(line), flush=True)
            jsonl.write(json.dumps(line) + "\n")
        summary = {"part": "summary", "ok": passed, "wall_s": round(time.monotonic() - started, 1),
                   "dry_run": args.dry_run}  # fmt: skip
        print(json.dumps(summary), flush=True)
        jsonl.write(json.dumps(summary) + "\n")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
