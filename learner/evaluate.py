"""Greedy evaluation on the task's held-out set, run by the learner on its own weights.

For a multi-turn environment the score is the success rate of greedy episodes on the held-out
seeds (`heldout_success`), played in lockstep batches with the same token bookkeeping as the
generators (envs/episode.py)."""

from __future__ import annotations

import torch

from rollflash.envs import (
    Episode,
    Item,
    Task,
    chat_encoder,
    is_multi_turn,
    plain_encoder,
    response_text,
)

EVAL_EPISODE_TOKENS = 1024  # response budget of an evaluation episode (also capped by the model)


@torch.no_grad()
def heldout_accuracy(
    model: torch.nn.Module,
    tokenizer,
    task: Task,
    items: list[Item],
    max_new_tokens: int,
    batch_size: int = 64,
) -> float:
    """Fraction of `items` answered correctly with greedy decoding (a reward of at least 1), or of
    held-out episodes solved, for a multi-turn environment."""
    if is_multi_turn(task):
        return heldout_success(model, tokenizer, task, items, max_new_tokens, batch_size)
    model.eval()
    tokenizer.padding_side = "left"
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    correct = 0
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        enc = tokenizer([it.prompt for it in chunk], return_tensors="pt", padding=True)
        out = model.generate(
            **enc,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        texts = [
            response_text(tokenizer, row, tokenizer.eos_token_id)
            for row in out[:, enc["input_ids"].shape[1] :].tolist()
        ]
        correct += sum(task.score(it, text) >= 1.0 for it, text in zip(chunk, texts))
    return correct / max(len(items), 1)


def _left_pad(contexts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(contexts), width), dtype=torch.long)
    for i, c in enumerate(contexts):
        ids[i, width - len(c) :] = torch.tensor(c)
        attention[i, width - len(c) :] = 1
    return ids, attention


@torch.no_grad()
def heldout_success(
    model: torch.nn.Module,
    tokenizer,
    task,
    items: list[Item],
    max_new_tokens: int,
    batch_size: int = 64,
) -> float:
    """Fraction of held-out episodes (item.answer = seed) that end in success with greedy actions."""
    model.eval()
    encode = (
        chat_encoder(tokenizer)
        if getattr(tokenizer, "chat_template", None)
        else plain_encoder(tokenizer)
    )
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    limit = getattr(model.config, "max_position_embeddings", None) or 10**9
    episodes = []
    for it in items:
        ep = Episode(
            env=task.make_env(),
            seed=int(it.answer),
            encode=encode,
            max_tokens=0,
            action_tokens=max_new_tokens,
        )
        ep.max_tokens = min(EVAL_EPISODE_TOKENS, limit - len(ep.prompt_ids))
        episodes.append(ep)
    while True:
        active = [ep for ep in episodes if not ep.done]
        if not active:
            break
        for start in range(0, len(active), batch_size):
            chunk = active[start : start + batch_size]
            ids, attention = _left_pad([ep.context for ep in chunk], pad_id)
            out = model.generate(
                input_ids=ids,
                attention_mask=attention,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=pad_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            for ep, row in zip(chunk, out[:, ids.shape[1] :].tolist()):
                if tokenizer.eos_token_id in row:
                    row = row[: row.index(tokenizer.eos_token_id) + 1]
                text = response_text(tokenizer, row, tokenizer.eos_token_id)
                ep.act(row, [0.0] * len(row), [0] * len(row), text)
    for ep in episodes:
        ep.close()
    return sum(ep.success for ep in episodes) / max(len(episodes), 1)
