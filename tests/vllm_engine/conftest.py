"""Fixtures for the vLLM engine tests (real vLLM, CPU build; skipped where it is not installed,
except under ROLLFLASH_REQUIRE_VLLM=1, which `make test` sets: there a missing vLLM fails the run).

- `model_dirs`: two tiny Qwen2 models built by scripts/make_tiny_model.py, one with tied
  input/output embeddings (what the script builds) and one untied copy whose lm_head differs from
  the embeddings. hidden 64 / 2 heads: vLLM's CPU attention needs a head size of 32 or more.
- `harness`: one running VLLMEngine per model (module scope, ~20 s to start), a weight store to
  publish perturbed versions into, and the Hugging Face reference that scores samples under any
  state dict as log_softmax(logits / T), the quantity the learner recomputes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def pytest_configure(config):
    """CI must never skip these tests silently: with ROLLFLASH_REQUIRE_VLLM=1 a vLLM that does not
    import stops the session with one line naming the cause."""
    if os.environ.get("ROLLFLASH_REQUIRE_VLLM") != "1":
        return
    try:
        import vllm  # noqa: F401
    except Exception as e:  # ImportError, or a broken install (torchvision against the CPU torch)
        raise pytest.UsageError(
            f"ROLLFLASH_REQUIRE_VLLM=1 but vllm does not import "
            f"({type(e).__name__}: {e}); build .venv-vllm with "
            "`make install-vllm`"
        ) from e


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("vllm_models")
    tied = root / "tied"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "make_tiny_model.py"),
            "--out",
            str(tied),
            "--sft-steps",
            "40",
            "--layers",
            "1",
            "--hidden",
            "64",
            "--heads",
            "2",
            "--no-eval",
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    model = AutoModelForCausalLM.from_pretrained(tied)
    config = model.config
    config.tie_word_embeddings = False
    untied_model = type(model)(config)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.manual_seed(0)
    embed = state["model.embed_tokens.weight"]
    state["lm_head.weight"] = embed + 0.5 * embed.std() * torch.randn_like(embed)
    untied_model.load_state_dict(state)
    untied = root / "untied"
    untied_model.save_pretrained(untied)
    AutoTokenizer.from_pretrained(tied).save_pretrained(untied)
    return {"tied": tied, "untied": untied}


class Harness:
    """A running engine for one model, its weight store, and the HF reference for any version."""

    def __init__(self, engine, model_dir: Path, run_dir: Path):
        from rollflash.broker.weights.weights import WeightStore

        self.engine, self.model_dir = engine, model_dir
        self.store = WeightStore(run_dir)
        self.copies = run_dir / "copies"  # what a generator writes while it verifies a version
        self.copies.mkdir(mode=0o700)
        self.states: dict[int, dict[str, torch.Tensor] | None] = {0: None}  # None: as saved
        self._models: dict[int, torch.nn.Module] = {}

    def publish(self, seed: int, scale: float = 0.3) -> tuple[int, Path, str]:
        """Publish v = next version: every parameter of the base model plus seeded noise of
        `scale` x its std (large enough that log-probabilities move well past 1e-3); returns
        (version, a verified private copy of its model file, sha256)."""
        from transformers import AutoModelForCausalLM

        from rollflash.broker.weights.weight_stream import copy_verified

        model = AutoModelForCausalLM.from_pretrained(self.model_dir)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():  # a tied lm_head is the embedding: perturbed with it
                p.add_(scale * p.std() * torch.randn(p.shape, generator=gen))
        version = max(self.states) + 1
        info = self.store.publish(model.state_dict(), version=version, step=version)
        self.states[version] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        copy = self.copies / f"v{version:08d}"
        copy_verified(self.store, version, copy, info.sha256)
        return version, copy / "model.safetensors", info.sha256

    def hf(self, version: int) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        if version not in self._models:
            model = AutoModelForCausalLM.from_pretrained(self.model_dir).eval()
            if self.states[version] is not None:
                model.load_state_dict(self.states[version])
            self._models[version] = model
        return self._models[version]

    @torch.no_grad()
    def reference_logprobs(self, sample, version: int, temperature: float) -> torch.Tensor:
        """log_softmax(logits / T) of each response token under `version`, full prefix."""
        ids = torch.tensor([sample.prompt_ids + sample.response_ids])
        logits = self.hf(version)(ids).logits[0].float()  # [P + R, V]
        logp = torch.log_softmax(logits / temperature, dim=-1)
        start = len(sample.prompt_ids) - 1
        targets = torch.tensor(sample.response_ids)
        return logp[start : start + len(targets)].gather(-1, targets[:, None])[:, 0]  # [R]

    def max_error(self, samples, version: int, temperature: float) -> float:
        """Largest |engine logprob - HF logprob under `version`| over all tokens of `samples`."""
        return max(
            (self.reference_logprobs(s, version, temperature) - torch.tensor(s.logprobs))
            .abs()
            .max()
            .item()
            for s in samples
        )


@pytest.fixture(scope="module", params=["tied", "untied"])
def harness(request, model_dirs, tmp_path_factory):
    from rollflash.generators.vllm_engine import VLLMEngine

    engine = VLLMEngine(str(model_dirs[request.param]), dtype="float32", seed=0)
    try:
        yield Harness(
            engine, model_dirs[request.param], tmp_path_factory.mktemp(f"run_{request.param}")
        )
    finally:
        engine.close()
