"""Evaluation on the task's held-out set, run by the learner on its own weights: greedy accuracy
and, with `eval.n_samples` = k > 0, k sampled responses per item scored for mean reward, pass@1
and pass@k (`sampled_eval`). A response is correct when its reward is at least `eval.threshold`
(1.0 by default: the built-in tasks and verifiers give 1 for a right answer).

It runs in the learner between steps, on rank 0, or with sharded weights (FSDP) on every rank,
each generating for its share of the items (item i on rank i mod N) with `synced_gpus`: a rank
whose sequences are done keeps taking part in the forward passes (and their all-gathers) until
every rank's are, and every rank makes as many `generate` calls as the busiest one (an idle
rank generates for a one-token prompt), so ranks that stop at different lengths never wait on
each other's collectives. The accuracy and the records are those of one rank over all items.

The learner evaluates between steps: the learner already holds the newest weights,
so no version has to be loaded anywhere else, and generators keep sampling for the next steps
meanwhile (asynchrony absorbs the pause). A generator-side evaluation would take a generator
away from rollouts and need its own result channel.

For a multi-turn environment the score is the success rate of greedy episodes on the held-out
seeds (`heldout_success`), played in lockstep batches with the same token bookkeeping as the
generators (envs/episode.py).

`record`: a list that greedy and sampled evaluation append their generations to, one row per
response: {"eval": "greedy" | "sampled", "id", "sample" (0..k-1), "prompt", "response",
"reward", "pass"} (`pass`: reward >= threshold). The learner writes them to
`eval_generations.jsonl` and the trackers (learner/metrics/metrics.py). Episodes are not recorded."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from rollflash.envs import (
    Episode,
    Item,
    Task,
    encoder_for,
    is_multi_turn,
    response_text,
)
from rollflash.envs.chat import encode_prompts
from rollflash.learner.process.dist import Dist

EVAL_EPISODE_TOKENS = 1024  # response budget of an evaluation episode (also capped by the model)


@torch.no_grad()
def heldout_accuracy(
    model: torch.nn.Module,
    tokenizer,
    task: Task,
    items: list[Item],
    max_new_tokens: int,
    batch_size: int = 64,
    threshold: float = 1.0,
    record: list[dict] | None = None,
    dist: Dist | None = None,
) -> float:
    """Fraction of `items` answered correctly with greedy decoding (a reward of at least
    `threshold`), or of held-out episodes solved, for a multi-turn environment; the generations
    are appended to `record` (module docstring). `dist`: the ranks of a sharded `model`, each of
    which calls this with the same arguments (None: this process alone)."""
    if is_multi_turn(task):
        return heldout_success(model, tokenizer, task, items, max_new_tokens, batch_size, dist)
    model.eval()
    ranks = dist if dist is not None and dist.world_size > 1 else None
    mine = list(enumerate(items))
    if ranks is not None:
        mine = mine[ranks.rank :: ranks.world_size]
    correct, rows = 0, []
    for chunk in _batches(mine, batch_size, ranks):
        texts = _greedy(model, tokenizer, [it.prompt for _, it in chunk], max_new_tokens, ranks)
        for (i, it), text in zip(chunk, texts):
            reward = task.score(it, text)
            correct += reward >= threshold
            rows.append((i, text, reward))
    if ranks is not None:
        correct = int(ranks.sum(correct))
        rows = sorted((r for rank in ranks.gather(rows) for r in rank), key=lambda r: r[0])
    for i, text, reward in rows:
        _record(record, "greedy", items[i], 0, text, reward, threshold)
    return correct / max(len(items), 1)


def _batches(rows: list, batch_size: int, ranks: Dist | None) -> Iterator[list]:
    """`rows` in batches of `batch_size`; with ranks, as many batches on every rank as on the
    busiest one (empty past this rank's own), since their `generate` calls run in step."""
    count = -(-len(rows) // batch_size)
    if ranks is not None:
        count = max(ranks.gather(count))
    for b in range(count):
        yield rows[b * batch_size : (b + 1) * batch_size]


def _greedy(
    model: torch.nn.Module, tokenizer, prompts: list[str], max_new_tokens: int, ranks: Dist | None
) -> list[str]:
    """Greedy responses (text) to `prompts` in one `generate` call (`greedy_ids`)."""
    contexts = encode_prompts(tokenizer, prompts) if prompts else []
    rows = greedy_ids(model, tokenizer, contexts, max_new_tokens, ranks)
    return [response_text(tokenizer, r, tokenizer.eos_token_id) for r in rows]


def greedy_ids(
    model: torch.nn.Module,
    tokenizer,
    contexts: list[list[int]],
    max_new_tokens: int,
    ranks: Dist | None = None,
) -> list[list[int]]:
    """Greedy response ids to token `contexts`, in one `generate` call; with ranks it runs in
    step with theirs (`synced_gpus`), and an empty batch generates for a one-token prompt whose
    answer is dropped."""
    pad_id = _pad_id(tokenizer)
    ids, attention = _left_pad(contexts or [[pad_id]], pad_id)
    out = _generate(
        model,
        ids,
        attention,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        eos_token_id=tokenizer.eos_token_id,
        synced_gpus=ranks is not None,
    )
    return out[: len(contexts), ids.shape[1] :].tolist()


def _generate(
    model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor, **options: Any
) -> torch.Tensor:
    """A Hugging Face model's `generate` on left-padded `ids`, on the model's device."""
    hf: Any = model  # transformers' GenerationMixin
    return hf.generate(
        input_ids=ids.to(hf.device), attention_mask=attention.to(hf.device), **options
    )


def until_eos(row: list[int], eos_id: int) -> list[int]:
    """A generated row up to and including its first EOS (all of it without one)."""
    return row[: row.index(eos_id) + 1] if eos_id in row else row


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _record(
    record: list[dict] | None,
    kind: str,
    item: Item,
    sample: int,
    response: str,
    reward: float,
    threshold: float,
) -> None:
    if record is not None:
        record.append(
            {
                "eval": kind,
                "id": item.id,
                "sample": sample,
                "prompt": item.prompt,
                "response": response,
                "reward": float(reward),
                "pass": bool(reward >= threshold),
            }
        )


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from n samples of which c are correct (Chen et al. 2021,
    "Evaluating Large Language Models Trained on Code", eq. 1): 1 - C(n - c, k) / C(n, k),
    computed as a product so that large n does not overflow."""
    if not 0 <= c <= n or not 0 < k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 0 < k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@torch.no_grad()
def sampled_eval(
    model: torch.nn.Module,
    tokenizer,
    task: Task,
    items: list[Item],
    n_samples: int,
    temperature: float,
    max_new_tokens: int,
    threshold: float = 1.0,
    seed: int = 0,
    batch_size: int = 64,
    record: list[dict] | None = None,
) -> dict[str, float]:
    """k = n_samples sampled responses per item: `eval/reward_mean`, `eval/pass@1` and
    `eval/pass@k`, each the mean over items. Sampling runs under its own seed inside
    `torch.random.fork_rng`, so evaluating never changes the training run's random stream.
    The generations are appended to `record` (module docstring)."""
    model.eval()
    pad_id = _pad_id(tokenizer)
    rewards: list[list[float]] = []
    per_batch = max(1, batch_size // n_samples)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for start in range(0, len(items), per_batch):
            chunk = items[start : start + per_batch]
            ids, attention = _left_pad(
                encode_prompts(tokenizer, [it.prompt for it in chunk]), pad_id
            )
            out = _generate(
                model,
                ids.repeat_interleave(n_samples, dim=0),
                attention.repeat_interleave(n_samples, dim=0),
                do_sample=True,
                temperature=temperature,
                top_p=1.0,
                top_k=0,
                max_new_tokens=max_new_tokens,
                pad_token_id=pad_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            rows = out[:, ids.shape[1] :].tolist()
            for i, it in enumerate(chunk):
                group = rows[i * n_samples : (i + 1) * n_samples]
                texts = [response_text(tokenizer, r, tokenizer.eos_token_id) for r in group]
                rewards.append([task.score(it, t) for t in texts])
                for j, (text, reward) in enumerate(zip(texts, rewards[-1])):
                    _record(record, "sampled", it, j, text, reward, threshold)
    count = max(len(rewards), 1)
    correct = [sum(r >= threshold for r in group) for group in rewards]
    return {
        "eval/reward_mean": sum(sum(g) / len(g) for g in rewards) / count,
        "eval/pass@1": sum(pass_at_k(n_samples, c, 1) for c in correct) / count,
        f"eval/pass@{n_samples}": sum(pass_at_k(n_samples, c, n_samples) for c in correct) / count,
    }


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
    dist: Dist | None = None,
) -> float:
    """Fraction of held-out episodes (item.answer = seed) that end in success with greedy actions;
    with the ranks of a sharded model each plays its share (item i on rank i mod N) in step."""
    model.eval()
    encode = encoder_for(tokenizer)
    ranks = dist if dist is not None and dist.world_size > 1 else None
    mine = items[ranks.rank :: ranks.world_size] if ranks is not None else items
    limit = getattr(model.config, "max_position_embeddings", None) or 10**9
    episodes = []
    for it in mine:
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
        if not (ranks.sum(len(active)) if ranks is not None else active):
            break
        for chunk in _batches(active, batch_size, ranks):
            contexts = [ep.context for ep in chunk]
            rows = greedy_ids(model, tokenizer, contexts, max_new_tokens, ranks)
            for ep, row in zip(chunk, rows):
                row = until_eos(row, tokenizer.eos_token_id)
                text = response_text(tokenizer, row, tokenizer.eos_token_id)
                ep.act(row, [0.0] * len(row), [0] * len(row), text)
    for ep in episodes:
        ep.close()
    solved = sum(ep.success for ep in episodes)
    return (ranks.sum(solved) if ranks is not None else solved) / max(len(items), 1)
