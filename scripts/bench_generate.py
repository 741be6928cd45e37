"""Generation throughput of the HF and vLLM engines on one tiny model, and their weight-reload time.

Each engine lives in a child process of its own (vLLM's model in a further worker process); they
run alternately on the same prompts and sampling parameters, so background load hits both alike;
the ratio is the number to read (STYLE.md: ratios, not absolute times). Throughput counts response
tokens actually produced (EOS included, padding of finished rows excluded) over the wall time of
`engine.generate`: the best of `--repeats` runs after one warm-up. Reload time is a generator's
reload of a version from the weight store (the streamed, verified read, then the swap), median of
`--repeats` after one warm-up.

Without `--model` a model with the demo's shape is built in a temp dir (no SFT: speed only).
Prints one JSON line:
    {"model": ..., "params": ..., "max_new_tokens": ..., "repeats": ..., "torch_threads": ...,
     "hf_tok_s": {"1": ...}, "vllm_tok_s": {...}, "vllm_over_hf": {...}, "hf_reload_s": ...,
     "vllm_reload_s": ..., "vllm_start_s": ...}

    python scripts/bench_generate.py [--model DIR] [--batches 1,16,64] [--max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def prompts_for(count: int) -> list[str]:
    """Arithmetic prompts of the demo task's shape, varied so no two rows are identical."""
    return [f"{(7 * i) % 90 + 10}+{(13 * i) % 90 + 5}=" for i in range(count)]


def rate(engine, batch: int, max_new_tokens: int) -> float:
    """Response tokens per second of one `engine.generate` call with `batch` prompts (n = 1)."""
    from rollflash.generators.sampling import SamplingParams

    params = SamplingParams(n=1, temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens)
    started = time.perf_counter()
    groups = engine.generate(prompts_for(batch), params)
    return sum(len(s.response_ids) for g in groups for s in g) / (time.perf_counter() - started)


def serve(kind: str, model_dir: str, threads: int, conn) -> None:
    """Child process: build one engine, then answer ("rate", batch, max_new_tokens) and
    ("reload", [(version, path), ...]) requests until ("stop",). Each engine gets a process of its
    own so that neither's idle OpenMP threads (or torch state) slow the other down."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    started = time.perf_counter()
    if kind == "hf":
        from rollflash.generators.hf_engine import HFEngine

        engine = HFEngine(model_dir)
    else:
        from rollflash.generators.vllm_engine import VLLMEngine

        engine = VLLMEngine(model_dir, dtype="float32", seed=0)
    conn.send(time.perf_counter() - started)
    while (msg := conn.recv())[0] != "stop":
        conn.send(rate(engine, *msg[1:]) if msg[0] == "rate" else reload_time(engine, msg[1]))
    if kind == "vllm":
        engine.close()


def paired_throughput(
    conns: dict, batches: list[int], max_new_tokens: int, repeats: int
) -> dict[str, dict[str, float]]:
    """Alternate HF and vLLM runs so background load hits both alike; per batch size the best
    tokens/s of each engine (other load only ever slows a run down, so the fastest of `repeats`
    is the closest to the engine's own speed) and their ratio vLLM / HF."""

    def ask(kind: str, *msg):
        conns[kind].send(msg)
        return conns[kind].recv()

    for kind in conns:
        ask(kind, "rate", 4, max_new_tokens)  # warm-up
    out: dict[str, dict[str, float]] = {"hf_tok_s": {}, "vllm_tok_s": {}, "vllm_over_hf": {}}
    for batch in batches:
        pairs = [
            (ask("hf", "rate", batch, max_new_tokens), ask("vllm", "rate", batch, max_new_tokens))
            for _ in range(repeats)
        ]
        hf_best, vllm_best = max(h for h, _ in pairs), max(v for _, v in pairs)
        out["hf_tok_s"][str(batch)] = round(hf_best, 1)
        out["vllm_tok_s"][str(batch)] = round(vllm_best, 1)
        out["vllm_over_hf"][str(batch)] = round(vllm_best / hf_best, 2)
    return out


def reload_time(engine, versions: tuple[Path, list[tuple[int, str]]]) -> float:
    """Median seconds of a generator's reload (generators/fetch.py: the streamed, verified read
    of the store, then the engine's swap), the first excluded as warm-up."""
    from rollflash.broker.weights.weights import WeightStore
    from rollflash.generators.fetch import Announced, SharedStoreSource

    run_dir, announced = versions
    source = SharedStoreSource(WeightStore(run_dir), run_dir / f"copies-{os.getpid()}")
    times = []
    for version, sha in announced:
        started = time.perf_counter()
        staged = source.fetch(Announced(version, sha), engine, set())
        if staged.tensors is not None:
            engine.swap_weights(staged.tensors, version)
        else:
            engine.load_weights(staged.path, version)
        staged.discard()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times[1:]), 4)


def publish_versions(
    model_dir: Path, run_dir: Path, count: int
) -> tuple[tuple[Path, list[tuple[int, str]]], int]:
    """Publish `count` perturbed versions of the model; returns the store and the versions with
    their digests, and the parameter count."""
    from transformers import AutoModelForCausalLM

    from rollflash.broker.weights.weights import WeightStore

    store = WeightStore(run_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    out = []
    for version in range(1, count + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        info = store.publish(model.state_dict(), version=version, step=version)
        out.append((version, info.sha256))
    return (run_dir, out), sum(p.numel() for p in model.parameters())


def bench(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    model_dir = Path(args.model) if args.model else tmp / "model"
    if not args.model:
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "scripts" / "make_tiny_model.py"),
                "--out",
                str(model_dir),
                "--layers",
                "2",
                "--hidden",
                "128",
                "--heads",
                "4",
                "--sft-steps",
                "0",
                "--no-eval",
            ],
            check=True,
            capture_output=True,
        )
    versions, params = publish_versions(model_dir, tmp / "run", args.repeats + 1)
    ctx = mp.get_context("spawn")
    conns, procs, start_s = {}, [], {}
    try:
        for kind in ("hf", "vllm"):
            conns[kind], child = ctx.Pipe()
            procs.append(
                ctx.Process(target=serve, args=(kind, str(model_dir), args.threads, child))
            )
            procs[-1].start()
            start_s[kind] = conns[kind].recv()
        rates = paired_throughput(conns, args.batches, args.max_new_tokens, args.repeats)
        reloads = {}
        for kind, conn in conns.items():
            conn.send(("reload", versions))
            reloads[f"{kind}_reload_s"] = conn.recv()
    finally:
        for conn in conns.values():
            try:
                conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass  # that child is already gone; its error is on stderr
        for proc in procs:
            proc.join(timeout=60)
    return {
        "model": "tiny qwen2 (make_tiny_model.py)" if not args.model else str(args.model),
        "params": params,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "torch_threads": args.threads,
        **rates,
        **reloads,
        "vllm_start_s": round(start_s["vllm"], 1),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF model dir (default: build the demo shape)")
    p.add_argument("--batches", default="1,16,64", help="comma-separated prompts per generate")
    p.add_argument("--max-new-tokens", type=int, default=32, help="response length limit")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per point (best of)")
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch intra-op threads of the HF engine (vLLM uses all cores)",
    )
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="bench_generate_") as tmp:
        result = bench(args, Path(tmp))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
