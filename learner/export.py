"""Export a published weight version as a standard Hugging Face model directory.

The weight store keeps bare safetensors (tied tensors stored once); an exported directory adds the
model's config and tokenizer from `model.path`, so `AutoModelForCausalLM.from_pretrained(DIR)` and
`AutoTokenizer.from_pretrained(DIR)` load it anywhere. The version is verified against its
manifest first: a corrupt version is never exported.
"""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollflash.broker.config import Config
from rollflash.broker.model_dir import model_directory
from rollflash.broker.weights import WeightStore


def export_version(cfg: Config, version: int | None, out: Path) -> Path:
    store = WeightStore(cfg.run.run_dir)
    version = store.latest() if version is None else version
    if version is None:
        raise FileNotFoundError(f"run.run_dir: no published weights in {store.root}")
    state = load_file(str(store.verified_path(version)))
    source, remote = model_directory(cfg.model.path), cfg.model.trust_remote_code
    model = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=remote)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise ValueError(
            f"weights v{version} do not fit {cfg.model.path}: missing {missing}, "
            f"unexpected {unexpected}"
        )
    model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source, trust_remote_code=remote).save_pretrained(out)
    return out
