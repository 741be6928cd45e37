"""A checkpoint's generation_config.json does not set how the run generates.

Instruct checkpoints commonly ship sampling settings (repetition_penalty, min_p, top_k,
no_repeat_ngram_size, a temperature of their own) that transformers' `generate` applies to every
value a call leaves unset. Everything the run generates with, the hf engine's samples (whose
behaviour log-probs must be the distribution they were drawn from), the learner's held-out
evaluation and the judge's completions, is set by the run's own settings alone
(`rollout.temperature`, `rollout.top_p`, greedy for evaluation): `neutral_generation_config`
replaces the checkpoint's config with one that sets only the EOS and pad ids, and names in one
warning line what it leaves out.
"""

from __future__ import annotations

import logging
from typing import Any

# generation_config.json keys that do not change which token is drawn: bookkeeping, outputs, the
# cache, lengths (`max_new_tokens` comes from the run); EOS ids are compared on their own
_NOT_SAMPLING_KEYS = {
    "transformers_version", "_from_model_config", "bos_token_id", "pad_token_id",
    "decoder_start_token_id", "eos_token_id", "use_cache", "cache_implementation",
    "cache_config", "output_attentions", "output_hidden_states", "output_scores",
    "output_logits", "return_dict_in_generate", "max_length", "max_new_tokens",
    "num_return_sequences", "do_sample",
}  # fmt: skip


def ignored_generation_settings(checkpoint: Any, eos_id: int) -> dict[str, Any]:
    """The settings of a checkpoint's generation config (a transformers GenerationConfig) that
    would change what `generate` draws: every key it sets to other than transformers' default,
    bookkeeping and lengths aside, and EOS ids other than the tokenizer's."""
    defaults = type(checkpoint)._get_default_generation_params()
    set_keys = checkpoint.to_diff_dict()
    ignored = {
        k: v
        for k, v in set_keys.items()
        if k not in _NOT_SAMPLING_KEYS and v is not None and v != defaults.get(k, None)
    }
    eos = set_keys.get("eos_token_id")
    if eos is not None and set(eos if isinstance(eos, list) else [eos]) != {eos_id}:
        ignored["eos_token_id"] = eos
    return ignored


def neutral_generation_config(
    model: Any, eos_id: int, pad_id: int, where: object, uses: str, log: logging.Logger
) -> None:
    """Give `model` (a transformers model) a generation config that sets only `eos_id` and
    `pad_id`; one warning on `log` names what the checkpoint at `where` set, and `uses` says
    what is generated with instead."""
    from transformers import GenerationConfig

    ignored = ignored_generation_settings(model.generation_config, eos_id)
    if ignored:
        settings = ", ".join(f"{k}={v}" for k, v in sorted(ignored.items()))
        log.warning("%s's generation_config sets %s; not applied: %s", where, settings, uses)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
