"""Build a tiny agent for the grid world: a small Qwen2 warm-started by SFT on noisy demonstrations.

Same tokenizer and architecture as scripts/make_tiny_model.py (character level, no chat template),
with room for whole episodes (`--max-positions`, default 256). The SFT data are grid-world episodes
(envs/gridworld.py) played by a noisy teacher: in every state it takes the first move of a
shortest safe path with probability 1 - `--teacher-noise`, and a uniformly random move otherwise
(which may walk into a hole and end the episode). Episodes are laid out exactly as the generators
and the learner see them (envs/episode.py, plain encoder): observation, action, EOS, observation,
... and the loss covers only the action tokens and their EOS.

Why noisy: a model distilled from this teacher samples a wrong move in a sizeable share of states,
so sampled episodes often fail (RL has something to fix), while enough of them succeed that GRPO
groups have reward variance from the first step.

Prints one JSON line: {"sft_steps", "sft_loss", "sft_wall_s", "wall_s", "greedy_success",
"sampled_success", "params", "out"}; the success rates are measured on the task's held-out seeds.

    python scripts/make_tiny_agent_model.py --out models/tiny-agent
    # success rates of a trained version on the held-out seeds (greedy, and sampled at T = 1):
    python scripts/make_tiny_agent_model.py --evaluate models/tiny-agent \
        --weights runs/agentic/weights/v00000030/model.safetensors --task-params '{...}'
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from make_tiny_model import (  # noqa: E402
    build_model,
    build_tokenizer,
    sft_optimizer,
    sft_step,
)
from sft_cli import shape_args  # noqa: E402

from rollflash.envs import Episode, make_task, plain_encoder  # noqa: E402
from rollflash.envs.gridworld import MOVES, GridWorld, shortest_action  # noqa: E402


def teacher_episode(
    env: GridWorld,
    seed: int,
    encode,
    noise: float,
    rng: random.Random,
    eos_id: int,
    max_tokens: int,
) -> tuple[list[int], list[int]]:
    """(tokens, loss mask) of one teacher episode: prompt + response, mask 1 on action tokens."""
    ep = Episode(env=env, seed=seed, encode=encode, max_tokens=max_tokens, action_tokens=2)
    while not ep.done:
        best = shortest_action(env.size, env.holes, env.pos)
        action = best if best is not None and rng.random() >= noise else rng.choice(sorted(MOVES))
        ids = encode(action, False) + [eos_id]
        ep.act(ids, [0.0] * len(ids), [0] * len(ids), action)
    return ep.prompt_ids + ep.response_ids, [0] * len(ep.prompt_ids) + ep.loss_mask


def sft_batch(rows: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (row, mask) in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        labels[i, : len(row)] = torch.where(
            torch.tensor(mask, dtype=torch.bool), torch.tensor(row), torch.tensor(-100)
        )
    return {"input_ids": ids, "attention_mask": attention, "labels": labels}


@torch.no_grad()
def success_rate(
    model,
    tokenizer,
    task,
    seeds: list[int],
    greedy: bool,
    max_positions: int,
    max_new_tokens: int = 2,
) -> float:
    """Share of episodes (one per seed) solved, actions decoded greedily or sampled at T = 1."""
    encode = plain_encoder(tokenizer)
    episodes = [
        Episode(
            env=task.make_env(), seed=s, encode=encode, max_tokens=0, action_tokens=max_new_tokens
        )
        for s in seeds
    ]
    for ep in episodes:
        ep.max_tokens = max_positions - len(ep.prompt_ids)
    while active := [ep for ep in episodes if not ep.done]:
        width = max(len(ep.context) for ep in active)
        ids = torch.full((len(active), width), tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for i, ep in enumerate(active):
            ids[i, width - len(ep.context) :] = torch.tensor(ep.context)
            attention[i, width - len(ep.context) :] = 1
        out = model.generate(
            input_ids=ids,
            attention_mask=attention,
            do_sample=not greedy,
            top_k=0,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        for ep, row in zip(active, out[:, width:].tolist()):
            if tokenizer.eos_token_id in row:
                row = row[: row.index(tokenizer.eos_token_id) + 1]
            text = tokenizer.decode(
                [t for t in row if t != tokenizer.eos_token_id], skip_special_tokens=False
            )
            ep.act(row, [0.0] * len(row), [0] * len(row), text)
    return sum(ep.success for ep in episodes) / len(episodes)


def heldout_success(
    model, tokenizer, task, episodes: int, max_positions: int
) -> tuple[float | None, float | None]:
    """(greedy, sampled) success rates on the first `episodes` held-out seeds; sampled at T = 1
    over each seed 4 times. (None, None) when `episodes` is 0."""
    held = [int(i.answer) for i in task.heldout_items()][:episodes]
    if not held:
        return None, None
    return (
        success_rate(model, tokenizer, task, held, True, max_positions),
        success_rate(model, tokenizer, task, held * 4, False, max_positions),
    )


def evaluate(model_dir: str, weights: str | None, task, episodes: int, seed: int) -> dict:
    """Greedy and sampled held-out success of a model directory, optionally with other weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if weights:
        model.load_state_dict(load_file(weights), strict=False)
        model.tie_weights()
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(seed)  # the sampled success rate is reproducible
    greedy, sampled = heldout_success(
        model, tokenizer, task, episodes, model.config.max_position_embeddings
    )
    return {
        "model": model_dir,
        "weights": weights,
        "greedy_success": greedy,
        "sampled_success": sampled,
        "episodes": min(episodes, len(task.heldout_items())),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="output directory (created)")
    p.add_argument("--evaluate", metavar="MODEL_DIR", help="only measure success rates of a model")
    p.add_argument("--weights", help="with --evaluate: a model.safetensors from the weight store")
    p.add_argument("--task-params", default="{}", help="JSON params of the gridworld task")
    p.add_argument(
        "--teacher-noise",
        type=float,
        default=0.5,
        help="probability that the teacher moves at random instead of optimally",
    )
    p.add_argument("--sft-steps", type=int, default=300)
    p.add_argument("--sft-lr", type=float, default=2e-3)
    p.add_argument("--sft-batch-size", type=int, default=32)
    shape_args(p, hidden=64, max_positions=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-episodes", type=int, default=64, help="0 skips the success rates")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if not 0.0 <= args.teacher_noise <= 1.0:
        p.error(f"--teacher-noise must be in [0, 1], got {args.teacher_noise}")
    if not args.out and not args.evaluate:
        p.error("--out is required (unless --evaluate)")
    return args


def build_untrained(args: argparse.Namespace) -> tuple[torch.nn.Module, Any, Path]:
    """The model and tokenizer, saved to `args.out` and the tokenizer loaded back from there, so
    demonstrations are tokenised exactly as generators and learner will tokenise them."""
    tokenizer = build_tokenizer(max_positions=args.max_positions)
    model = build_model(
        tokenizer, args.layers, args.hidden, args.heads, args.seed, max_positions=args.max_positions
    )
    out = Path(args.out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model, AutoTokenizer.from_pretrained(out), out


def sft_on_teacher(model: torch.nn.Module, tokenizer, task, args: argparse.Namespace) -> float:
    """`args.sft_steps` steps on batches of teacher episodes from the task's train seeds; returns
    the last loss (nan for 0 steps) and leaves the model in eval mode."""
    encode, rng = plain_encoder(tokenizer), random.Random(args.seed + 1)
    seeds = (int(item.answer) for item in task.train_items(args.seed))
    env = task.make_env()
    opt, sched = sft_optimizer(model, args.sft_lr, args.sft_steps)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(args.sft_steps):
        rows = [
            teacher_episode(
                env,
                next(seeds),
                encode,
                args.teacher_noise,
                rng,
                tokenizer.eos_token_id,
                args.max_positions - 32,
            )
            for _ in range(args.sft_batch_size)
        ]
        loss = sft_step(model, opt, sched, sft_batch(rows, tokenizer.pad_token_id))
    model.eval()
    return loss.item()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    task = make_task("gridworld", json.loads(args.task_params))
    if args.evaluate:
        print(
            json.dumps(evaluate(args.evaluate, args.weights, task, args.eval_episodes, args.seed))
        )
        return
    model, tokenizer, out = build_untrained(args)
    t1 = time.perf_counter()
    loss = sft_on_teacher(model, tokenizer, task, args)
    t2 = time.perf_counter()
    model.save_pretrained(out)
    torch.manual_seed(args.seed)  # the sampled success rate is reproducible
    greedy, sampled = heldout_success(
        model, tokenizer, task, args.eval_episodes, args.max_positions
    )
    summary = {
        "sft_steps": args.sft_steps,
        "sft_loss": round(loss, 4),
        "sft_wall_s": round(t2 - t1, 2),
        "wall_s": round(time.perf_counter() - t0, 2),
        "greedy_success": greedy,
        "sampled_success": sampled,
        "params": sum(p.numel() for p in model.parameters()),
        "out": str(out),
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
