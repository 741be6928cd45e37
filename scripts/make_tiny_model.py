"""Build a tiny, offline, warm-started causal LM for tests and the demo.

What it writes (a standard Hugging Face directory, loadable with AutoModelForCausalLM / AutoTokenizer):
a small Qwen2ForCausalLM and a character-level tokenizer (`<bos>` prepended by the post-processor,
`<eos>` ends every target, `<pad>` for padding, left padding because generation pads on the left).
`--chat` adds capitals, role tokens and a chat template, and SFT sees the prompts rendered with it
(the worked example of docs/tasks.md: word problems, `--task dataset`, GSM8K answers).

Why warm-start: a randomly initialised model never writes a correct answer, so every GRPO group has equal
rewards and zero advantage. A short SFT on the task's train items (loss on answer + EOS tokens only) gives
a model that is right sometimes and nearly right often; RL then has something to sharpen. Two ways to
leave room for RL (held-out greedy accuracy well below what sampling reaches):
- `--sft-teacher-error P` (the demo's choice): an imperfect teacher whose answer is off by one with
  probability P; RL with the exact-match reward corrects it within tens of steps (see `sft_items`).
- `--sft-target-acc A`: stop SFT once validation greedy accuracy reaches A. RL gains from such a model
  range from -2 to +50 points in 300 steps with the seed and learning rates (see `sft`): too uneven
  for a demo.

Deterministic for a seed and a thread count. Prints one JSON line at the end:
    {"sft_steps": ..., "sft_loss": ..., "build_wall_s": ..., "sft_wall_s": ..., "wall_s": ...,
     "heldout_acc": ..., "params": ..., "out": ...}

    python scripts/make_tiny_model.py --out models/tiny --task arithmetic --sft-steps 300 --seed 0
    # the demo's warm start (held-out greedy accuracy ~0.2-0.35, ~1 min on one core); `make byo`
    # shows the --chat one:
    python scripts/make_tiny_model.py --out models/tiny --task-params '{"ops": ["+"]}' \
        --sft-steps 1200 --sft-lr 1e-3 --sft-teacher-error 0.6 --seed 0
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import random
import string
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sft_cli import (  # noqa: E402
    MAX_POSITIONS,
    parse_sft_args,
    run_script,
    sft_parser,
    shape_args,
)

from rollflash.envs import Item, Task, make_task
from rollflash.envs.chat import PromptFormatter, format_task
from rollflash.envs.verifiers import final_answer
from rollflash.learner.models.schedule import warmup_decay

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]  # ids 0..3, in this order
CHARS = string.digits + string.ascii_lowercase + " +-*/=().,?"
# `--chat`: capitals for word problems, role markers and a chat template over them
CHAT_CHARS = CHARS + string.ascii_uppercase
CHAT_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(
    chars: str = CHARS, max_positions: int = MAX_POSITIONS, chat: bool = False
) -> PreTrainedTokenizerFast:
    """Character-level tokenizer: one token per character, `<bos>` prepended, decode joins characters.

    It is a byte-level BPE without merges (space is the byte-level symbol "Ġ"): transformers 5's
    AutoTokenizer loads any model_type qwen2 directory with Qwen2Tokenizer, which replaces the
    pre-tokenizer with its own regex + ByteLevel one; a plain character vocabulary then loses
    every space, this one tokenizes the same under both. `chat`: also the role tokens of
    CHAT_TOKENS (after the characters, so the other ids are unchanged) and CHAT_TEMPLATE."""
    symbols = ["Ġ" if c == " " else c for c in dict.fromkeys(chars)]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + symbols + (CHAT_TOKENS * chat))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    if chat:
        tok.add_special_tokens(CHAT_TOKENS)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=max_positions,
    )
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(
    tokenizer: PreTrainedTokenizerFast,
    layers: int,
    hidden: int,
    heads: int,
    seed: int,
    max_positions: int = MAX_POSITIONS,
) -> Qwen2ForCausalLM:
    """A small Qwen2 (tied embeddings, MLP 4x hidden) with weights drawn from torch.manual_seed(seed)."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def sft_batch(tokenizer: PreTrainedTokenizerFast, items: Sequence[Item]) -> dict[str, torch.Tensor]:
    """Right-padded `<bos> prompt answer <eos>` rows; labels are -100 except on answer + EOS tokens.

    Returns input_ids [B, L] long, attention_mask [B, L] long, labels [B, L] long.
    Right padding keeps position ids 0..n-1 for real tokens, the same as generation's left padding
    (which derives positions from the attention mask).
    """
    rows, targets = [], []
    for item in items:
        prompt = tokenizer(item.prompt)["input_ids"]
        answer = tokenizer(item.answer, add_special_tokens=False)["input_ids"] + [
            tokenizer.eos_token_id
        ]
        rows.append(prompt + answer)
        targets.append([-100] * len(prompt) + answer)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (row, target) in enumerate(zip(rows, targets)):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
        labels[i, : len(row)] = torch.tensor(target)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def sft_items(
    task: Task, seed: int, teacher_error: float, mistake: Callable[[str], str] | None = None
) -> Iterator[Item]:
    """The task's train items with their final answer as target (what follows a GSM8K answer's
    `####`: the model answers with the number only), replaced by answer + 1 with probability
    `teacher_error`.

    Why: a model distilled from such a teacher puts ~`teacher_error` of its mass on "answer + 1" and
    the rest on the answer, so for teacher_error a little above 0.5 greedy decoding is right only where
    its estimate happens to tip the other way, while sampling is right about half the time: pass@n is
    far above greedy pass@1, the gap RL with a verifier closes (it only has to learn one consistent
    shift, so it does so in tens of steps). Needs integer answers, or `mistake`: answer -> wrong one.
    """
    rng = random.Random(seed + 1)
    for item in task.train_items(seed):
        answer = final_answer(item.answer)
        if teacher_error > 0 and rng.random() < teacher_error:
            answer = mistake(answer) if mistake else str(int(answer) + 1)
        yield Item(id=item.id, prompt=item.prompt, answer=answer)


def warmup_cosine(steps: int) -> Callable[[int], float]:
    """lr multiplier: linear warmup over min(50, steps // 10) steps, then cosine from 1 to 0.1
    (learner/models/schedule.py)."""
    return warmup_decay(max(1, min(50, steps // 10)), steps, "cosine", floor=0.1)


@dataclass(frozen=True)
class SFTConfig:
    """Warm-start settings (flags of the same names with an `sft-` prefix)."""

    steps: int = 300  # optimiser steps; also the horizon of the cosine schedule
    lr: float = 1e-3  # peak AdamW lr; 3e-3 is erratic (200 to 800+ steps to one accuracy)
    batch_size: int = 64  # train items per step
    seed: int = 0  # seeds the train stream and the teacher's errors
    target_acc: float | None = None  # stop once validation greedy accuracy reaches this
    teacher_error: float = 0.0  # probability that a target is answer + 1 (see sft_items)
    eval_every: int = 25  # steps between validation checks (only with target_acc)
    mistake: Callable[[str], str] | None = None  # the teacher's wrong answer (None: answer + 1)


def sft_optimizer(
    model: torch.nn.Module, lr: float, steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW (no weight decay, betas 0.9/0.98) at peak `lr`, on the `warmup_cosine(steps)` schedule."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(steps))


def sft_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    batch: dict[str, torch.Tensor],
) -> torch.Tensor:
    """One optimiser step on HF's loss of `batch` (labels -100 where no loss), gradient norm
    clipped to 1.0; returns the loss."""
    loss = model(**batch).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss


def sft(
    model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, task: Task, cfg: SFTConfig
) -> tuple[int, float]:
    """`sft_step`s of `sft_optimizer` (AdamW, grad clip 1.0, the `warmup_cosine(steps)` schedule).

    HF's loss is a mean over answer tokens (labels shift inside the model). With `target_acc`, stop as
    soon as greedy accuracy on 200 validation items (train problems from another seed's stream, never
    held-out ones) reaches it, checked every `eval_every` steps: where the model lands on the steep
    early-learning curve varies a lot between seeds, the accuracy it stops at much less. Give a long
    horizon (`steps`) with a target so the lr is still near its peak at the stop: RL gains far less
    from a model annealed onto a plateau at the same accuracy (about +5 points rather than +25 to +50).
    Returns (steps taken, last loss).
    """
    if cfg.steps <= 0:
        return 0, float("nan")
    items = sft_items(task, cfg.seed, cfg.teacher_error, cfg.mistake)
    opt, sched = sft_optimizer(model, cfg.lr, cfg.steps)
    model.train()
    loss = torch.tensor(float("nan"))
    for step in range(1, cfg.steps + 1):
        batch = sft_batch(tokenizer, list(itertools.islice(items, cfg.batch_size)))
        loss = sft_step(model, opt, sched, batch)
        if step % 100 == 0:
            logger.info("sft step %d loss %.4f", step, loss.item())
        if cfg.target_acc is not None and step % cfg.eval_every == 0:
            if reached_target(model, tokenizer, task, cfg, step):
                return step, float(loss.item())
    model.eval()
    return cfg.steps, float(loss.item())


def reached_target(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    task: Task,
    cfg: SFTConfig,
    step: int,
) -> bool:
    """Validation check for `sft`; leaves the model in eval mode if the target is reached."""
    val = list(itertools.islice(task.train_items(cfg.seed + 10_000), 200))
    model.eval()
    acc = items_accuracy(model, tokenizer, val)
    logger.info("sft step %d validation greedy acc %.3f", step, acc)
    if acc >= cfg.target_acc:
        return True
    model.train()
    return False


@torch.no_grad()
def greedy_responses(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    prompts: Sequence[str],
    max_new_tokens: int,
) -> list[str]:
    """Greedy completions, each cut at the first EOS (EOS itself removed, as the generator does)."""
    enc = tokenizer(list(prompts), return_tensors="pt", padding=True, padding_side="left")
    out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens)
    responses = []
    for row in out[:, enc["input_ids"].shape[1] :].tolist():
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id)]
        responses.append(tokenizer.decode(row, skip_special_tokens=True))
    return responses


def heldout_accuracy(
    model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, task: Task
) -> float:
    """Fraction of held-out items whose greedy response equals the answer exactly."""
    return items_accuracy(model, tokenizer, task.heldout_items())


def items_accuracy(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    items: Sequence[Item],
    batch_size: int = 256,
) -> float:
    """Fraction of `items` whose greedy response equals the (final) answer exactly."""
    answers = [final_answer(it.answer) for it in items]
    max_new = max(len(a) for a in answers) + 2
    hits = 0
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        responses = greedy_responses(model, tokenizer, [it.prompt for it in chunk], max_new)
        hits += sum(r == a for r, a in zip(responses, answers[start : start + batch_size]))
    return hits / len(items)


def make_tiny_model(args: argparse.Namespace) -> dict[str, Any]:
    """Build, warm-start and save; returns the summary printed as JSON."""
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    positions = args.max_positions
    tokenizer = build_tokenizer(CHAT_CHARS if args.chat else CHARS, positions, chat=args.chat)
    # prompts as the learner renders them (the chat template, when the tokenizer has one)
    task = format_task(
        make_task(args.task, json.loads(args.task_params)), PromptFormatter(tokenizer, "auto")
    )
    model = build_model(tokenizer, args.layers, args.hidden, args.heads, args.seed, positions)
    t1 = time.perf_counter()
    cfg = sft_config(args, batch_size=args.sft_batch_size, target_acc=args.sft_target_acc)
    steps, loss = sft(model, tokenizer, task, cfg)
    t2 = time.perf_counter()
    out = Path(args.out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    acc = heldout_accuracy(model, tokenizer, task) if args.eval else None
    return {
        "sft_steps": steps,
        "sft_loss": round(loss, 4),
        "build_wall_s": round(t1 - t0, 2),
        "sft_wall_s": round(t2 - t1, 2),
        "wall_s": round(time.perf_counter() - t0, 2),
        "heldout_acc": acc,
        "params": sum(p.numel() for p in model.parameters()),
        "out": str(out),
    }


def sft_config(args: argparse.Namespace, **more: Any) -> SFTConfig:
    """The SFT schedule `sft_parser`'s options give, with `more` of SFTConfig's fields."""
    return SFTConfig(
        steps=args.sft_steps,
        lr=args.sft_lr,
        seed=args.seed,
        teacher_error=args.sft_teacher_error,
        **more,
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = sft_parser(__doc__, steps=300, lr=1e-3, teacher_error=0.0)
    p.add_argument("--task", default="arithmetic", help="task name for envs.make_task")
    p.add_argument("--task-params", default="{}", help="JSON dict of task constructor params")
    p.add_argument("--sft-batch-size", type=int, default=64, help="train items per SFT step")
    p.add_argument(
        "--sft-target-acc",
        type=float,
        default=None,
        help="stop SFT early once validation greedy accuracy reaches this (0..1)",
    )
    shape_args(p)
    p.add_argument("--chat", action="store_true", help="capitals, role tokens, CHAT_TEMPLATE")
    args = parse_sft_args(p, argv)
    if args.sft_target_acc is not None and not 0.0 <= args.sft_target_acc <= 1.0:
        p.error(f"--sft-target-acc must be in [0, 1], got {args.sft_target_acc}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    run_script(make_tiny_model, parse_args(argv))


if __name__ == "__main__":
    main()
