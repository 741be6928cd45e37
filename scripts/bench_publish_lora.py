"""Weight hand-off cost of LoRA: full versions against adapter versions, same model, same run.

A randomly initialised Qwen2 (`--hidden`, `--layers`, `--vocab`: speed and size only) is wrapped
with LoRA adapters (`--rank`, every linear layer but the head), their B matrices set to random
values. Each repetition publishes the policy twice through the learner's own path
(`learner/models/lora.py` `published_weights` + `WeightStore.publish`): as a full version (the merged
weights, what `trainer.publish: full` writes) and as an adapter version; then a generator's
`WeightFollower` reloads each into an HF engine (the streamed, verified read, then `swap_weights`,
or a verified private copy and `load_adapter`). Times are medians of `--repeats`; bytes are what
one version puts on the shared filesystem. The ratios full / adapter are the numbers to read.
`*_train_state_bytes` is the learner's training state after one AdamW step, full fine-tuning
against LoRA: parameters, gradients and optimiser moments (activations excluded; they depend on
the batch). `--model DIR` measures an existing model (the demo's) instead of a random one.
Prints one JSON line.

    python scripts/bench_publish_lora.py [--hidden 512] [--layers 8] [--vocab 32000] [--rank 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from rollflash.broker.config.config import config_from_dict  # noqa: E402
from rollflash.broker.weights.weights import WeightStore  # noqa: E402
from rollflash.generators.fetch import SharedStoreSource  # noqa: E402
from rollflash.generators.hf_engine import HFEngine  # noqa: E402
from rollflash.generators.reload import WeightFollower  # noqa: E402
from rollflash.learner.models.lora import (  # noqa: E402
    published_weights,
    trainable_parameters,
    with_adapters,
)


class _Hash:
    """The `weights` hash as the learner announces it (no Redis needed)."""

    def __init__(self) -> None:
        self.info: dict[str, str] = {}

    def weights(self) -> dict[str, str]:
        return self.info


def build_model(out: Path, hidden: int, layers: int, vocab: int) -> None:
    from make_tiny_model import build_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(config).save_pretrained(out)
    build_tokenizer().save_pretrained(out)


def train_state_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters, gradients and AdamW moments after one step on a short batch."""
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
    optimizer.step()
    params = {p.data_ptr(): p for p in model.parameters()}.values()  # tied weights once
    moments = [t for st in optimizer.state.values() for t in st.values() if t.dim() > 0]
    tensors = [*params, *(p.grad for p in params if p.grad is not None), *moments]
    return sum(t.numel() * t.element_size() for t in tensors)


def handoff(
    policy: torch.nn.Module, cfgs: dict, model_dir: Path, workdir: Path, repeats: int
) -> dict[str, dict[str, float]]:
    """Median publish and reload seconds and bytes per version, per kind of version."""
    results: dict[str, dict[str, list[float]]] = {
        k: {"publish_s": [], "reload_s": [], "bytes": []} for k in cfgs
    }
    version = 0
    for kind, cfg in cfgs.items():
        store, hash_ = WeightStore(workdir / f"run-{kind}"), _Hash()
        engine = HFEngine(str(model_dir))
        source = SharedStoreSource(store, workdir / f"copies-{kind}")
        follower = WeightFollower(hash_, source, engine, poll_interval_s=0.001, attempts=1)
        for _ in range(repeats):
            version += 1
            started = time.perf_counter()
            tensors, adapter = published_weights(policy, cfg)
            info = store.publish(tensors, version, version, adapter_config=adapter)
            results[kind]["publish_s"].append(time.perf_counter() - started)
            hash_.info = {"version": str(version), "sha256": info.sha256}
            started = time.perf_counter()
            follower.wait_for(version, timeout_s=600)  # fetched in the follower's thread
            results[kind]["reload_s"].append(time.perf_counter() - started)
            size = sum(f.stat().st_size for f in Path(info.path).iterdir())
            results[kind]["bytes"].append(size)
            store.retain(keep=1, in_use=set())
        follower.close()
    return {k: {m: statistics.median(v) for m, v in r.items()} for k, r in results.items()}


def measure(args: argparse.Namespace, workdir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    model_dir = Path(args.model) if args.model else workdir / "model"
    if not args.model:
        build_model(model_dir, args.hidden, args.layers, args.vocab)
    lora = {"rank": args.rank, "alpha": 2 * args.rank}
    cfgs = {
        kind: config_from_dict({"model": {"path": str(model_dir), "lora": lora}, **extra})
        for kind, extra in (("full", {"trainer": {"publish": "full"}}), ("adapter", {}))
    }
    policy = with_adapters(AutoModelForCausalLM.from_pretrained(model_dir), cfgs["full"].model.lora)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    params = sum(p.numel() for p in policy.parameters())
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    out = handoff(policy, cfgs, model_dir, workdir, args.repeats)
    out["full"]["train_state_bytes"] = train_state_bytes(
        AutoModelForCausalLM.from_pretrained(model_dir)
    )
    out["adapter"]["train_state_bytes"] = train_state_bytes(policy)
    return {
        "bench": "publish_lora",
        "params": params,
        "trainable": trainable,
        "rank": args.rank,
        "dtype": "float32",
        "repeats": args.repeats,
        **{f"{k}_{m}": round(v, 4) for k, r in out.items() for m, v in r.items()},
        "bytes_ratio": round(out["full"]["bytes"] / out["adapter"]["bytes"], 1),
        "publish_ratio": round(out["full"]["publish_s"] / out["adapter"]["publish_s"], 1),
        "reload_ratio": round(out["full"]["reload_s"] / out["adapter"]["reload_s"], 1),
        "train_state_ratio": round(
            out["full"]["train_state_bytes"] / out["adapter"]["train_state_bytes"], 2
        ),
        "handoff_ratio": round(
            (out["full"]["publish_s"] + out["full"]["reload_s"])
            / (out["adapter"]["publish_s"] + out["adapter"]["reload_s"]),
            1,
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", help="an existing model directory instead of a random one")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-publish-lora-") as tmp:
        print(json.dumps(measure(args, Path(tmp))))


if __name__ == "__main__":
    main()
