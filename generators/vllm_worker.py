"""What runs inside vLLM's worker process: `WeightReloadExtension`, mixed into vLLM's worker class
(`worker_extension_cls`, generators/vllm_setup.py) and called by name through `collective_rpc`.

- `rl_load_file`: the verified safetensors file goes through vLLM's own in-place reload
  (`Worker.reload_weights`, which calls the model's `load_weights` layer by layer). Tied
  embeddings need one more step: the file has no `lm_head.weight` (saved deduplicated), so the
  reload refills `embed_tokens` - whose storage `lm_head` shares - but never re-processes
  `lm_head`; on CPU its GEMM handle (a oneDNN / packed copy of the weight made at load time) then
  keeps computing logits with the old embeddings. `refresh_tied_heads` re-processes every
  embedding-method layer that shares its weight with another after each reload.
- `rl_use_pre_truncation_logprobs`: with top_p < 1, the sampler reports the log-probabilities it
  had just before top-k / top-p truncation (generators/vllm_engine.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch


def refresh_tied_heads(model: torch.nn.Module) -> int:
    """Re-run weight post-processing on unquantized embedding layers that share their weight with
    another layer (a tied `lm_head`); returns how many layers were refreshed."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    groups: dict[int, list[Any]] = {}  # vLLM layers, each with its `quant_method`
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (
            isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod)
            and isinstance(weight, torch.Tensor)
            and weight.numel()
        ):
            groups.setdefault(weight.data_ptr(), []).append(module)
    refreshed = 0
    for modules in groups.values():
        if len(modules) > 1:
            for module in modules:
                module.quant_method.process_weights_after_loading(module)
                refreshed += 1
    return refreshed


def _pre_truncation_logprobs(forward: Callable) -> Callable:
    """Wrap TopKTopPSampler.forward: sample as before, but return log_softmax of the logits it
    received (already divided by the temperature) instead of the truncated, renormalised ones."""

    def wrapped(logits: torch.Tensor, generators, k, p):
        logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)  # before top-k/top-p edit logits
        sampled, _ = forward(logits, generators, k, p)
        return sampled, logprobs

    wrapped.rl_pre_truncation = True  # type: ignore[attr-defined]  # a marker on the function
    return wrapped


class WeightReloadExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); methods are called by name through
    `collective_rpc`, so nothing is pickled. `self` is the vLLM worker."""

    if TYPE_CHECKING:  # the vLLM worker's own, which these methods call
        model_runner: Any

        def reload_weights(self, **kwargs: Any) -> None: ...

    def rl_load_file(self, model_file: str) -> int:
        from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

        weights = safetensors_weights_iterator([model_file], use_tqdm_on_load=False)
        self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        return refresh_tied_heads(self.model_runner.get_model())

    def rl_use_pre_truncation_logprobs(self) -> bool:
        sampler = getattr(getattr(self.model_runner, "sampler", None), "topk_topp_sampler", None)
        if sampler is None:
            return False
        if not getattr(sampler.forward, "rl_pre_truncation", False):
            sampler.forward = _pre_truncation_logprobs(sampler.forward)
        return True
