"""Prompt rendering: the one place a single-turn prompt becomes the text, and the token ids, that
the model is given (`model.chat_template: auto | none | PATH`).

- `auto`: if the tokenizer has a chat template, a prompt is rendered as a user message (after a
  system message when there is a system prompt) with the generation prompt added, as
  `tokenizer.apply_chat_template(..., add_generation_prompt=True)` does; without a template the raw
  text is used (a system prompt and a blank line before it).
- `none`: always the raw text.
- `PATH`: a Jinja chat-template file used instead of the tokenizer's.

The learner renders each item once, before it is issued (envs/dataset.py renders its rows, other
single-turn tasks are wrapped in `FormattedTask`): the prompts stream carries the rendered text,
and the HF engine, the vLLM engine and evaluation all turn it into ids with `encode_prompt`. The
learner derives the same ids when it issues a prompt (`prompt_encoder`) and trains a group only
if the generator reports those (broker/channels/provenance.py).

Multi-turn environments keep their own encoders (envs/episode.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rollflash.envs.base import Item, Task, train_stream
from rollflash.envs.episode import char_encoder, encoder_for
from rollflash.envs.multiturn import is_multi_turn
from rollflash.errors import BadInput, MissingFile

Messages = Sequence[dict[str, Any]]


def encode_prompts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """The prompt ids every process uses: the tokenizer's own special tokens (a BOS its
    post-processor adds), except that a BOS the chat template already wrote is not doubled (as in
    Llama 3, whose template and tokenizer both begin with it)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    out = []
    for ids in tokenizer(list(texts))["input_ids"]:
        ids = list(ids)
        if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]
        out.append(ids)
    return out


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """`encode_prompts` of one text."""
    return encode_prompts(tokenizer, [text])[0]


def prompt_encoder(tokenizer: Any, multi_turn: bool, vocab_size: int) -> Callable[[str], list[int]]:
    """The ids an issued prompt's text becomes in every process: a single-turn prompt's by
    `encode_prompt`, a multi-turn episode's first observation by its episode encoder
    (envs/episode.py `encoder_for`); without a tokenizer (the simulated engine and learner) one
    id per character below `vocab_size` (`char_encoder`)."""
    if tokenizer is not None and not multi_turn:
        return lambda text: encode_prompt(tokenizer, text)
    encode = char_encoder(vocab_size) if tokenizer is None else encoder_for(tokenizer)
    return lambda text: encode(text, True)


class PromptFormatter:
    """Renders prompts as `model.chat_template` says (module docstring)."""

    def __init__(self, tokenizer: Any = None, chat_template: str = "auto"):
        self.tokenizer = tokenizer
        self.template: str | None = None
        if chat_template not in ("auto", "none"):
            path = Path(chat_template)
            if not path.is_file():
                raise MissingFile(
                    f"model.chat_template: no file at {path} (use auto, none or a Jinja file)"
                )
            self.template = path.read_text()
        elif chat_template == "auto" and tokenizer is not None:
            self.template = getattr(tokenizer, "chat_template", None) or None
        if self.template is not None and tokenizer is None:
            raise BadInput("model.chat_template: a template needs the model's tokenizer")

    @property
    def templated(self) -> bool:
        return self.template is not None

    def render(self, prompt: str | Messages, system_prompt: str | None = None) -> str:
        """The model's input text for a prompt string or a list of chat messages."""
        if isinstance(prompt, str):
            if self.template is None:
                return f"{system_prompt}\n\n{prompt}" if system_prompt else prompt
            messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        else:
            if self.template is None:
                raise BadInput(
                    "chat-format rows (messages_key) need a chat template: the tokenizer has "
                    "none; set model.chat_template to a Jinja file"
                )
            messages = [dict(m) for m in prompt]
        if system_prompt and (not messages or messages[0].get("role") != "system"):
            messages.insert(0, {"role": "system", "content": system_prompt})
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.template, tokenize=False, add_generation_prompt=True
        )


class FormattedTask:
    """A single-turn task whose prompts are rendered by a formatter; scoring is unchanged."""

    def __init__(self, task: Task, formatter: PromptFormatter):
        self.task, self.formatter = task, formatter
        self.name = task.name

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.task, attr)

    def _render(self, item: Item) -> Item:
        return dataclasses.replace(item, prompt=self.formatter.render(item.prompt))

    def train_items(self, seed: int, start: int = 0) -> Iterator[Item]:
        return map(self._render, train_stream(self.task, seed, start))

    def heldout_items(self) -> list[Item]:
        return [self._render(it) for it in self.task.heldout_items()]

    def score(self, item: Item, response: str) -> float:
        return self.task.score(item, response)


def format_task(task: Task, formatter: PromptFormatter) -> Task:
    """`task` with its prompts rendered by `formatter` (the learner's side: prompts are rendered
    before they are issued). Multi-turn environments are returned as they are."""
    if is_multi_turn(task):
        return task
    use = getattr(task, "use_formatter", None)
    if use is not None:  # a dataset renders (and measures) its own rows
        use(formatter)
        return task
    return FormattedTask(task, formatter) if formatter.templated else task
