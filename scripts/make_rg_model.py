"""Warm-start a tiny chat model on a run config's reasoning-gym task (configs/rg_demo.yaml).

A fresh model from scripts/make_tiny_model.py's pieces (the architecture, the role tokens and
chat template of `--chat`, its SFT `make_tiny_model.sft`) with a small byte-level BPE tokenizer
trained on the task's train prompts and targets (`build_bpe_tokenizer`): reasoning-gym's
questions are long sentences ("State the final answer to the following arithmetic problem: 47 +
18 ="), which a character tokenizer makes 3-4 times longer, and SFT time grows with that. Digits
stay one token each (Qwen2's pre-tokenizer splits them), so sums are still learnt digit by digit.
Prompts are rendered exactly as the learner renders them (the template, the task's system
prompt).
The target is what the reward reads: `<answer>N</answer>` then EOS, with N off by one with
probability `--sft-teacher-error` (`near_miss`), as in the demo's warm start. So greedy decoding
writes the near miss for most problems and sampling the right answer about a third of the time,
the room GRPO needs; the format is learnt exactly, so the format reward rarely separates samples.

Prints one JSON line:
    {"sft_steps", "sft_loss", "sft_wall_s", "heldout_acc": {dataset: ...}, "params", "out"}

    python scripts/make_rg_model.py --config configs/rg_demo.yaml --out models/tiny-rg \\
        --sft-steps 1500 --sft-teacher-error 0.6
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import re
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollflash.envs import Item, make_task  # noqa: E402
from rollflash.envs.chat import PromptFormatter, format_task  # noqa: E402
from scripts.make_tiny_model import (  # noqa: E402
    CHAT_TEMPLATE,
    CHAT_TOKENS,
    SPECIAL_TOKENS,
    build_model,
    build_tokenizer,
    items_accuracy,
    sft,
    sft_config,
)
from scripts.sft_cli import parse_sft_args, run_script, sft_parser, shape_args  # noqa: E402

logger = logging.getLogger(__name__)

_NUMBER = re.compile(r"-?\d+")
# Qwen2's pre-tokenizer: transformers loads a qwen2 directory's tokenizer with it, so the BPE is
# trained on the same pieces (one digit each)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS_ITEMS = 4000  # train items the tokenizer is trained on


def build_bpe_tokenizer(texts: Sequence[str], vocab_size: int, max_positions: int):
    """A byte-level BPE over `texts` with the special and role tokens of make_tiny_model.py,
    `<bos>` prepended by the post-processor, and its chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + CHAT_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tok.token_to_id("<bos>"))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
        unk_token="<unk>", padding_side="left", model_max_length=max_positions,
    )  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tagged(answer: str) -> str:
    return f"<answer>{answer}</answer>"


def near_miss(target: str) -> str:
    """The teacher's wrong answer: the first integer of the tagged answer plus one."""
    return _NUMBER.sub(lambda m: str(int(m[0]) + 1), target, count=1)


class TaggedTask:
    """A task whose answers are the tagged targets the model is taught to write."""

    def __init__(self, task: Any) -> None:
        self.task, self.name = task, task.name

    def train_items(self, seed: int) -> Iterator[Item]:
        for item in self.task.train_items(seed):
            yield dataclasses.replace(item, answer=tagged(item.answer))

    def heldout_items(self) -> list[Item]:
        return [
            dataclasses.replace(it, answer=tagged(it.answer)) for it in self.task.heldout_items()
        ]


def make_rg_model(args: argparse.Namespace) -> dict[str, Any]:
    """Build, SFT on the config's task, save; returns the summary."""
    torch.set_num_threads(args.threads)
    spec = yaml.safe_load(Path(args.config).read_text())["task"]
    raw = make_task(spec["name"], spec.get("params"))
    template = PromptFormatter(build_tokenizer(chat=True))  # renders the corpus: no ids needed
    corpus = [
        text
        for item in itertools.islice(
            format_task(raw, template).train_items(args.seed + 1), CORPUS_ITEMS
        )  # fmt: skip
        for text in (item.prompt, tagged(item.answer))
    ]
    built = build_bpe_tokenizer(corpus, args.vocab_size, args.max_positions)
    model = build_model(built, args.layers, args.hidden, args.heads, args.seed,
                        args.max_positions)  # fmt: skip
    out = Path(args.out)
    model.save_pretrained(out)
    built.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)  # what the learner and generators will load
    if tokenizer(corpus[:64])["input_ids"] != built(corpus[:64])["input_ids"]:
        raise RuntimeError("the reloaded tokenizer splits the corpus differently")
    task = format_task(raw, PromptFormatter(tokenizer))
    cfg = sft_config(args, mistake=near_miss)
    started = time.perf_counter()
    steps, loss = sft(model, tokenizer, TaggedTask(task), cfg)
    wall = time.perf_counter() - started
    model.save_pretrained(out)
    acc = {}
    for domain in task.components if args.eval else []:
        items = TaggedTask(domain.task).heldout_items()
        acc[domain.name] = items_accuracy(model, tokenizer, items)
    return {
        "sft_steps": steps,
        "sft_loss": round(loss, 4),
        "sft_wall_s": round(wall, 2),
        "heldout_acc": acc or None,
        "params": sum(p.numel() for p in model.parameters()),
        "out": str(out),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = sft_parser(__doc__, steps=1500, lr=1e-3, teacher_error=0.6)
    p.add_argument("--config", required=True, help="run config whose `task:` to learn")
    shape_args(p, max_positions=96)
    p.add_argument("--vocab-size", type=int, default=384, help="BPE vocabulary (with specials)")
    return parse_sft_args(p, argv)


def main(argv: Sequence[str] | None = None) -> None:
    run_script(make_rg_model, parse_args(argv))


if __name__ == "__main__":
    main()
