"""Export a published weight version as a standard Hugging Face model or PEFT adapter directory.

The weight store keeps bare safetensors (tied tensors stored once); an exported directory adds the
model's config and tokenizer from `model.path`, so `AutoModelForCausalLM.from_pretrained(DIR)` and
`AutoTokenizer.from_pretrained(DIR)` load it anywhere. An adapter version (LoRA) is exported as a
PEFT adapter directory (`PeftModel.from_pretrained(base, DIR)`, or peft's
`AutoPeftModelForCausalLM.from_pretrained(DIR)`, which finds the base at `model.path`), or with
`merge` as the merged model (`rollctl export --merge`). `rollctl export --best` exports the version
with the best held-out accuracy (`eval.keep_best`, learner/evaluation/best.py). The version is
verified against its
manifest first, and what is exported is the verified bytes: a corrupt version is never exported.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from rollflash.broker.config.config import Config
from rollflash.broker.config.model_dir import model_directory
from rollflash.broker.weights.weight_chain import verified_tensors
from rollflash.broker.weights.weight_stream import copy_verified
from rollflash.broker.weights.weights import ADAPTER_CONFIG, WeightStore
from rollflash.errors import MissingFile
from rollflash.learner.evaluation.best import BestVersion


def export_version(
    cfg: Config, version: int | None, out: Path, merge: bool = False, best: bool = False
) -> Path:
    """`version` (default: the latest) of the run's weight store, or with `best` the version
    `eval.keep_best` kept (learner/evaluation/best.py)."""
    if best:
        store = BestVersion(cfg.run.run_dir).store
        kept = store.versions()
        if not kept:
            raise MissingFile(
                f"--best: no best version in {store.root} (eval.keep_best keeps one once the "
                "learner has evaluated)"
            )
        version = kept[-1]
    else:
        store = WeightStore(cfg.run.run_dir)
        version = store.latest() if version is None else version
    if version is None:
        raise MissingFile(f"run.run_dir: no published weights in {store.root}")
    if store.manifest(version).kind in ("full", "delta"):
        # read whole or rebuilt from its anchor, verified, before anything is written to `out`
        state = verified_tensors(store, version)
        out.mkdir(parents=True, exist_ok=True)
        _save_full(cfg, version, state, out)
    else:
        with tempfile.TemporaryDirectory(prefix="rollflash-adapter-") as tmp:
            adapter = Path(tmp) / "adapter"
            copy_verified(store, version, adapter)
            _name_the_base(cfg, adapter)
            out.mkdir(parents=True, exist_ok=True)
            if merge:
                _save_merged(cfg, adapter, out)
            else:
                for f in adapter.iterdir():
                    shutil.copyfile(f, out / f.name)
    source, remote = model_directory(cfg.model.path), cfg.model.trust_remote_code
    AutoTokenizer.from_pretrained(source, trust_remote_code=remote).save_pretrained(out)
    return out


def _base(cfg: Config) -> PreTrainedModel:
    """The base model at `model.path` (a directory or a cached hub id)."""
    source, remote = model_directory(cfg.model.path), cfg.model.trust_remote_code
    return AutoModelForCausalLM.from_pretrained(source, trust_remote_code=remote)


def _save_full(cfg: Config, version: int, state: dict[str, torch.Tensor], out: Path) -> None:
    model = _base(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise ValueError(
            f"weights v{version} do not fit {cfg.model.path}: missing {missing}, "
            f"unexpected {unexpected}"
        )
    model.tie_weights()
    model.save_pretrained(out)


def _name_the_base(cfg: Config, adapter: Path) -> None:
    """Make the verified adapter's config name the base by absolute path."""
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    config["base_model_name_or_path"] = str(Path(model_directory(cfg.model.path)).resolve())
    (adapter / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))


def _save_merged(cfg: Config, adapter: Path, out: Path) -> None:
    """The base at `model.path` with the adapter merged in (peft's merge_and_unload)."""
    from peft import PeftModel

    merged = PeftModel.from_pretrained(_base(cfg), str(adapter)).merge_and_unload()
    merged.save_pretrained(out)
