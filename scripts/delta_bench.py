"""The delta part of scripts/bench_weight_sync.py: consecutive versions of real training runs
published both ways in one run, as deltas (`weights.anchor_every`, broker/weights/delta_write.py) and
whole, and loaded by an hf engine through the production reload path both ways.

Two sources of versions:
- `qwen05b`: a Qwen2 of the shape of Qwen2-0.5B (hidden 896, 24 layers, 14 heads, 2 KV heads,
  intermediate 4864, vocabulary 151936, tied embeddings: 494 M parameters; the one of
  scripts/gpu_smoke_generate.py), randomly initialised offline with transformers, trained on CPU
  for `--delta-steps` AdamW steps at lr 1e-6 (float32 masters, a language-modelling loss on
  random token sequences of 128), each version published in bfloat16 as
  `trainer.publish_dtype: bfloat16` does;
- `demo`: the versions of a real `configs/demo.yaml` run (GRPO on models/tiny, its learning rate,
  `rollctl run` for `--demo-steps` steps), published as the demo does (float32) and cast to
  bfloat16 (`demo_bf16`: what `trainer.publish_dtype: bfloat16` would publish).
For each: bytes of a version's delta over its full file, the share of elements that changed,
the publishing time of a version each way (WeightStore.publish, fsyncs included), and in a
process of its own the hf engine's pause to swap in a version each way (`WeightFollower`, the
delta applied from the full file it holds) with the fetch that preceded it (off the sampling
path). Medians over the versions after the first (which every generator reads whole).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
ANCHOR_EVERY = 10  # the default: the versions measured here are all deltas after the first


def qwen05b(out: Path) -> None:
    """The random Qwen2 of Qwen2-0.5B's shape the GPU check measures (float32 masters)."""
    from gpu_smoke_generate import QWEN2_05B, build

    build(out, QWEN2_05B, torch.float32)


def trained_versions(model_dir: Path, steps: int, lr: float) -> Iterator[dict[str, torch.Tensor]]:
    """v0 and `steps` versions after it, each the bfloat16 state of an AdamW step."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()  # stored once
    for step in range(steps + 1):
        if step:
            ids = torch.randint(0, model.config.vocab_size, (1, 128))
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            state = model.state_dict()
            yield {n: p.detach().to(torch.bfloat16) for n, p in state.items() if n not in tied}


def run_versions(run_dir: Path, dtype: torch.dtype) -> Iterator[dict[str, torch.Tensor]]:
    """The versions a finished run left in its store, in `dtype`."""
    from rollflash.broker.weights.weight_chain import verified_tensors
    from rollflash.broker.weights.weights import WeightStore

    store = WeightStore(run_dir)
    for v in store.versions():
        yield {n: t.to(dtype) for n, t in verified_tensors(store, v).items()}


def demo_run(work: Path, steps: int, model: Path) -> Path:
    """`configs/demo.yaml` for `steps` steps, every version kept whole; returns its run_dir."""
    run_dir = work / "demo-run"
    sets = [
        f"trainer.total_steps={steps}", f"trainer.keep_versions={steps + 1}",
        f"run.run_dir={run_dir}", f"model.path={model}", "weights.anchor_every=1",
        "eval.size=20",
    ]  # fmt: skip
    args = [sys.executable, "-m", "rollflash.rollctl.cli", "run", "--config", "configs/demo.yaml"]
    subprocess.run(
        [*args, *[x for s in sets for x in ("--set", s)]], cwd=ROOT, check=True, capture_output=True
    )
    return run_dir


def publish_both(versions: Iterator[dict[str, torch.Tensor]], work: Path) -> list[dict]:
    """Publish each version whole and as a delta (two stores, one chain); per version its
    publishing times, sizes and changed share."""
    from rollflash.broker.weights.delta_write import VersionChain
    from rollflash.broker.weights.weights import WeightStore

    full, delta = WeightStore(work / "full"), WeightStore(work / "delta")
    chain = VersionChain(work / "chain", ANCHOR_EVERY)
    rows, previous = [], None
    for v, state in enumerate(versions):
        started = time.perf_counter()
        full.publish(state, v, v)
        middle = time.perf_counter()
        delta.publish(state, v, v, chain=chain)
        done = time.perf_counter()
        m = delta.manifest(v)
        numel = sum(t.numel() for t in state.values())
        changed = chain.last_changed if m.delta is not None else _changed(previous, state)
        rows.append(
            {
                "version": v,
                "full_s": middle - started,
                "delta_s": done - middle,
                "full_bytes": full.manifest(v).form_size("full"),
                "delta_bytes": m.form_size("delta") if "delta" in m.forms else None,
                "changed_share": changed / numel if v else None,
            }
        )
        previous = None if m.delta is not None else state
    chain.close()
    return rows


def _changed(previous: dict[str, torch.Tensor] | None, state: dict[str, torch.Tensor]) -> int:
    if previous is None:
        return 0
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return sum(
        int((previous[n].view(bits[t.element_size()]) != t.view(bits[t.element_size()])).sum())
        for n, t in state.items()
    )


def pause_child(model_dir: str, work: str, dtype: str, last: int) -> None:
    """In a process of its own: the hf engine loads v0 .. v`last` from each store through its
    `WeightFollower`; prints per store the pause, fetch and bytes of every version."""
    from rollflash.broker.weights.weights import WeightStore
    from rollflash.generators.fetch import SharedStoreSource
    from rollflash.generators.held import HeldCopy
    from rollflash.generators.hf_engine import HFEngine
    from rollflash.generators.reload import WeightFollower

    class Hash:
        info: dict[str, str] = {}

        def weights(self) -> dict[str, str]:
            return self.info

    torch.set_num_threads(2)
    engine, out = HFEngine(model_dir, dtype=dtype), {}
    for form in ("full", "delta"):
        store, hash_ = WeightStore(Path(work) / form), Hash()
        # whole versions as a run with anchor_every 1 reads them (nothing held); deltas applied
        # to the full file held (generators/held.py)
        held = HeldCopy(Path(work) / "held") if form == "delta" else None
        source = SharedStoreSource(store, Path(work) / f"copies-{form}", held)
        follower = WeightFollower(hash_, source, engine, poll_interval_s=0.01, attempts=1)
        rows = []
        for v in range(last + 1):
            hash_.info = {"version": str(v), "sha256": store.manifest(v).digest}
            follower.wait_for(v, timeout_s=3600)
            rows.append((follower.reload_pause_s, follower.reload_fetch_s, follower.reload_bytes))
        follower.close()
        out[form] = rows
    print(json.dumps(out))


def measure(case: str, model_dir: Path, versions: Iterator[dict], work: Path, dtype: str) -> dict:
    """The figures of one case, as `{case}_...` keys (module docstring)."""
    work.mkdir(parents=True)
    rows = publish_both(versions, work)
    later = rows[1:]
    child = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_weight_sync.py"), "--delta-pause",
         str(model_dir), str(work), dtype, str(len(rows) - 1)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    loads = json.loads(child.stdout.splitlines()[-1])
    pause = {f: statistics.median(p for p, _, _ in loads[f][2:]) for f in loads}
    fetch = {f: statistics.median(s for _, s, _ in loads[f][2:]) for f in loads}
    deltas = [r for r in later if r["delta_bytes"] is not None]
    med = statistics.median
    return {
        f"{case}_versions": len(later),
        f"{case}_full_mib": round(rows[0]["full_bytes"] / 2**20, 1),
        f"{case}_changed_share": round(med(r["changed_share"] for r in later), 5),
        f"{case}_delta_versions": len(deltas),
        f"{case}_bytes_ratio": round(med(r["delta_bytes"] / r["full_bytes"] for r in deltas), 4)
        if deltas
        else None,
        f"{case}_fetched_bytes_ratio": round(
            med(b for _, _, b in loads["delta"][2:]) / med(b for _, _, b in loads["full"][2:]), 4
        ),
        f"{case}_publish_full_s": round(med(r["full_s"] for r in later), 3),
        f"{case}_publish_delta_s": round(med(r["delta_s"] for r in later), 3),
        f"{case}_pause_full_s": round(pause["full"], 4),
        f"{case}_pause_delta_s": round(pause["delta"], 4),
        f"{case}_pause_ratio": round(pause["delta"] / pause["full"], 2),
        f"{case}_fetch_full_s": round(fetch["full"], 3),
        f"{case}_fetch_delta_s": round(fetch["delta"], 3),
    }
