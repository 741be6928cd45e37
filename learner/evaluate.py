"""Greedy evaluation on the task's held-out set, run by the learner on its own weights."""

from __future__ import annotations

import torch

from envs import Item, Task, response_text


@torch.no_grad()
def heldout_accuracy(model: torch.nn.Module, tokenizer, task: Task, items: list[Item],
                     max_new_tokens: int, batch_size: int = 64) -> float:
    """Fraction of `items` answered correctly with greedy decoding (a reward of at least 1)."""
    model.eval()
    tokenizer.padding_side = "left"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    correct = 0
    for start in range(0, len(items), batch_size):
        chunk = items[start:start + batch_size]
        enc = tokenizer([it.prompt for it in chunk], return_tensors="pt", padding=True)
        out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=pad_id, eos_token_id=tokenizer.eos_token_id)
        texts = [response_text(tokenizer, row, tokenizer.eos_token_id)
                 for row in out[:, enc["input_ids"].shape[1]:].tolist()]
        correct += sum(task.score(it, text) >= 1.0 for it, text in zip(chunk, texts))
    return correct / max(len(items), 1)
