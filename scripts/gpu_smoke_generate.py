"""GPU smoke test of the generator side: the hf engine on cuda, with a tiny model and a randomly
initialised model of Qwen2-0.5B's shape (hidden 896, 24 layers, 14 heads / 2 KV heads, vocabulary
151936; ~494M parameters, bfloat16). For each model it measures:

- tokens/s of `HFEngine.generate` at batch 1, 16 and 64 (n = 1, `--max-new-tokens` each; a random
  model rarely stops early, so rows are full length), after one warm-up call;
- reload time: a version published to a weight store, then what a generator does (the streamed,
  verified read into tensors on the engine's device, generators/fetch.py; then the swap,
  `engine.swap_weights`);
- delta reload: the next version, 1% of its elements changed, published as a delta
  (broker/weights/delta_write.py) and applied by the generator to the full file of the version it holds
  (generators/held.py) into tensors on the device: its fetch and swap seconds, the bytes it read
  over the full version's, and whether the engine then holds that version bit for bit;
- log-probability match: the engine's behaviour log-probabilities of its samples against the
  learner's recomputation (`learner.logprobs.token_logprobs` over the same tokens, same model and
  dtype), max and mean |difference| over response tokens.

Prints one JSON line. Needs the GPU test machine's packages and the carried wheels (docs/gpu.md),
and this repository, installed or not (scripts/checkout.py). `--device cpu --small` runs the
tiny model only, with small batches: a smoke test of the script itself (scripts/gpu_check.py
--dry-run, tests/e2e/test_gpu_check.py).

    python scripts/gpu_smoke_generate.py                  # on a GPU machine
    python scripts/gpu_smoke_generate.py --device cpu --small
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from checkout import use_checkout  # noqa: E402

QWEN2_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
)
TINY = dict(
    hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=2,
)  # fmt: skip


def build(out: Path, shape: dict[str, int], dtype: torch.dtype) -> Path:
    """A randomly initialised Qwen2 of `shape` with the tiny character tokenizer, saved to `out`."""
    from make_tiny_model import build_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        **{"vocab_size": len(tokenizer), **shape},
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(dtype)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tokens_per_s(engine, batch: int, max_new_tokens: int) -> tuple[float, list]:
    from rollflash.generators.sampling import SamplingParams

    params = SamplingParams(n=1, temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens)
    prompts = [f"{(7 * i) % 90 + 10}+{(13 * i) % 90 + 5}=" for i in range(batch)]
    sync(engine.device)
    started = time.perf_counter()
    groups = engine.generate(prompts, params)
    sync(engine.device)
    samples = [s for g in groups for s in g]
    return sum(len(s.response_ids) for s in samples) / (time.perf_counter() - started), samples


def logprob_match(engine, samples: list) -> dict[str, float]:
    """Engine behaviour log-probabilities vs the learner's recomputation, over response tokens."""
    from rollflash.learner.step.logprobs import token_logprobs

    rows = [s.prompt_ids + s.response_ids for s in samples]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), engine.pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):  # right padding, as the learner's batches
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    with torch.no_grad():
        logp, _ = token_logprobs(engine.model, ids.to(engine.device), mask.to(engine.device), 1.0)
    diffs = []
    for i, s in enumerate(samples):
        start = len(s.prompt_ids) - 1  # position t scores token t + 1
        learner = logp[i, start : start + len(s.response_ids)].float().cpu()
        diffs.append((learner - torch.tensor(s.logprobs)).abs())
    d = torch.cat(diffs)
    return {"logprob_abs_diff_max": d.max().item(), "logprob_abs_diff_mean": d.mean().item()}


def reload_time(engine, work: Path) -> dict[str, float]:
    """Publish the engine's weights as v1, then fetch, verify and swap them as a generator does."""
    from rollflash.broker.weights.weights import WeightStore
    from rollflash.generators.fetch import Announced, SharedStoreSource

    store = WeightStore(work / "run")
    info = store.publish(engine.model.state_dict(), version=1, step=1)
    started = time.perf_counter()
    staged = SharedStoreSource(store, work / "copies").fetch(
        Announced(1, info.sha256), engine, set()
    )
    sync(engine.device)
    verified = time.perf_counter()
    engine.swap_weights(staged.tensors, 1)
    sync(engine.device)
    done = time.perf_counter()
    return {"reload_s": done - started, "verify_s": verified - started, "swap_s": done - verified}


def delta_reload(engine, work: Path) -> dict[str, float]:
    """Publish the engine's weights as v1 and v1 with 1% of its elements changed as v2 (a delta);
    stage and swap both as a generator does, holding v1's file (generators/held.py); v2's
    fetch and swap seconds (no WeightFollower: the machine has no pyzmq)."""
    from rollflash.broker.weights.delta_write import VersionChain
    from rollflash.broker.weights.weights import WeightStore, unique_tensors
    from rollflash.generators.fetch import Announced, SharedStoreSource
    from rollflash.generators.held import HeldCopy

    store, chain = WeightStore(work / "run"), VersionChain(work / "chain", 100)
    v1 = {n: t.clone() for n, t in unique_tensors(engine.model.state_dict()).items()}
    v2 = {n: torch.where(torch.rand(t.shape) < 0.01, t * 1.5, t) for n, t in v1.items()}
    source = SharedStoreSource(store, work / "copies", HeldCopy(work / "held"))
    for version, state in ((1, v1), (2, v2)):
        info = store.publish(state, version, version, chain=chain)
        started = time.perf_counter()
        staged = source.fetch(Announced(version, info.sha256), engine, set())
        sync(engine.device)
        verified = time.perf_counter()
        engine.swap_weights(staged.tensors, version)
        sync(engine.device)
        done = time.perf_counter()
        staged.loaded()
    served = engine.model.state_dict()
    return {
        "delta_fetch_s": verified - started,
        "delta_swap_s": done - verified,
        "delta_bytes_ratio": staged.fetched / store.manifest(1).form_size("full"),
        "delta_kind_is_delta": float(store.manifest(2).kind == "delta"),
        "delta_bit_exact": float(all(torch.equal(served[n].cpu(), t) for n, t in v2.items())),
    }


def measure(name: str, shape: dict, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from rollflash.generators.hf_engine import HFEngine

    device = torch.device(args.device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    model_dir = build(work / name, shape, getattr(torch, dtype))
    engine = HFEngine(str(model_dir), dtype=dtype, device=device)
    out: dict[str, Any] = {
        "params": sum(p.numel() for p in engine.model.parameters()),
        "dtype": dtype,
        "tok_s": {},
    }
    tokens_per_s(engine, args.batches[0], 4)  # warm-up
    samples: list = []
    for batch in args.batches:
        rate, samples = tokens_per_s(engine, batch, args.max_new_tokens)
        out["tok_s"][str(batch)] = round(rate, 1)
    out.update({k: round(v, 6) for k, v in logprob_match(engine, samples[:16]).items()})
    out.update({k: round(v, 3) for k, v in reload_time(engine, work / f"{name}-store").items()})
    out.update({k: round(v, 4) for k, v in delta_reload(engine, work / f"{name}-delta").items()})
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--small", action="store_true", help="the tiny model only, batches 1 and 4")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no GPU; use --device cpu --small for a smoke test")
    args.batches = [1, 4] if args.small else [int(b) for b in args.batches.split(",")]
    if args.small:
        args.max_new_tokens = min(args.max_new_tokens, 8)
    use_checkout()
    torch.manual_seed(0)
    result: dict[str, Any] = {
        "device": args.device,
        "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
        "torch": torch.__version__,
        "max_new_tokens": args.max_new_tokens,
        "models": {},
    }
    models = {"tiny": TINY} if args.small else {"tiny": TINY, "qwen2-0.5b-random": QWEN2_05B}
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in models.items():
            result["models"][name] = measure(name, shape, args, Path(tmp))
    result["ok"] = all(m["delta_bit_exact"] == 1.0 for m in result["models"].values())
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
