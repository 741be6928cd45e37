"""What a reward model reads: the contract between reward-model training (learner/tools/rm_training.py)
and reward scoring in the generators (generators/rewarder.py).

A reward model scores the token ids of `prompt + response` (one string, tokenised by the reward
model's own tokenizer, its special tokens such as `<bos>` added), followed by the EOS token, so that
the last position, where the scalar head reads (last non-pad token, as Hugging Face's
`*ForSequenceClassification`), is always the end-of-response marker (as OpenRLHF appends EOS).
Longer inputs keep their last `max_len` tokens: the end of the response matters most.

Both sides must build inputs the same way, so it lives here, in the shared contract; tokenizer-only,
no torch.
"""

from __future__ import annotations

from typing import Any


def reward_model_input_ids(tokenizer: Any, prompt: str, response: str, max_len: int) -> list[int]:
    """Token ids of `prompt + response` + EOS, at most `max_len` (the last ones kept).

    `tokenizer` is any Hugging Face tokenizer with an EOS token (or a pad token used as EOS).
    """
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.pad_token_id
    if eos is None:
        raise ValueError("reward model tokenizer has neither an EOS nor a pad token")
    ids = list(tokenizer(prompt + response)["input_ids"]) + [eos]
    return ids[-max_len:]


def reward_model_batch(
    tokenizer: Any, prompts: list[str], responses: list[str], max_len: int, pad_id: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Right-padded input ids [N][L] and attention mask [N][L] (1 on each pair's own tokens) of
    `reward_model_input_ids` for each (prompt, response) pair, padded with `pad_id`."""
    rows = [reward_model_input_ids(tokenizer, p, r, max_len) for p, r in zip(prompts, responses)]
    width = max(len(r) for r in rows)
    pad = [width - len(r) for r in rows]
    return [r + [pad_id] * k for r, k in zip(rows, pad)], [
        [1] * len(r) + [0] * k for r, k in zip(rows, pad)
    ]
