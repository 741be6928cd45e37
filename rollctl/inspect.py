"""`rollctl inspect`: stream entries decoded for a person.

Entries are read with the project's own decoders (broker/wire/schema.py), under the limits the
learner applies (`WireLimits.for_config`, with the model's vocabulary), so an entry the learner
would refuse is shown as refused, with the reason and its code, and a hostile one costs what it
costs the learner: never a crash. Token ids are turned back into text with the model's tokenizer
(`model.path`): the text shown is what the learner trains on, not the generator's own `text`
field; where the tokenizer cannot be loaded, the generator's text is shown and says so.

Staleness is counted against the weights published now (the `weights` hash): how many versions
behind the current one the group's oldest token is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from rollflash.broker.config.config import Config
from rollflash.broker.connect.connection import connect
from rollflash.broker.connect.keys import RunKeys
from rollflash.broker.wire.schema import decode_prompt, decode_trajectory
from rollflash.broker.wire.wire import WireError, WireLimits

Stream = Literal["prompts", "trajectories", "dlq"]
_SHOWN = 200  # characters of a text field shown in full; longer ones are cut


@dataclass
class Decoder:
    """What decoding needs: the learner's limits and, when it loads, the model's tokenizer."""

    limits: WireLimits
    tokenizer: Any = None  # None: the generator's text is shown

    @classmethod
    def for_config(cls, cfg: Config) -> Decoder:
        tokenizer, vocab = None, None
        try:
            from transformers import AutoTokenizer

            from rollflash.broker.config.model_dir import model_directory

            root = model_directory(cfg.model.path)
            tokenizer = AutoTokenizer.from_pretrained(
                root, trust_remote_code=cfg.model.trust_remote_code
            )
            vocab = json.loads((root / "config.json").read_text()).get("vocab_size")
        except Exception:  # any failure: the entries are still shown, with the generator's text
            tokenizer = None
        return cls(WireLimits.for_config(cfg, vocab_size=vocab), tokenizer)

    def text(self, ids: Any, fallback: str) -> str:
        if self.tokenizer is None:
            return fallback
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def _cut(value: Any) -> str:
    text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}... ({len(text)} characters)"


def trajectory_view(fields: dict[bytes, bytes], d: Decoder, current: int | None) -> dict:
    try:
        t = decode_trajectory(fields, d.limits)
    except WireError as e:
        return {"refused": str(e), "code": e.code}
    samples = [
        {
            "response": d.text(s.response_ids, s.text),
            "reward": s.reward,
            "finished": s.finished,
            "tokens": int(s.response_ids.size),
            "versions": [int(s.token_versions.min()), int(s.token_versions.max())],
            "logprob_sum": round(float(s.logprobs.sum()), 4),
            **({"reward_failure": s.reward_failure} if s.reward_failure else {}),
        }
        for s in t.samples
    ]
    return {
        "traj_id": t.traj_id,
        "prompt_id": t.prompt_id,
        "generator": t.generator,
        "prompt": d.text(t.prompt_ids, "(prompt ids only: model.path's tokenizer not found)"),
        "behavior_version": t.behavior_version,
        "issued_version": t.issued_version,
        "staleness": None if current is None else current - t.behavior_version,
        "retried": t.retried,
        "reward_mean": t.reward_mean,
        "samples": samples,
        **({} if d.tokenizer is not None else {"text": "the generator's (no tokenizer)"}),
    }


def prompt_view(fields: dict[bytes, bytes], d: Decoder, current: int | None) -> dict:
    try:
        w = decode_prompt(fields, d.limits.max_bytes)
    except WireError as e:
        return {"refused": str(e), "code": e.code}
    item = w.item
    return {
        "prompt_id": w.prompt_id,
        "group_id": w.group_id,
        "n": w.n,
        "issued_version": w.issued_version,
        "staleness": None if current is None else current - w.issued_version,
        "prompt": _cut(item.get("prompt", "")),
        "answer": _cut(item.get("answer", "")),
        **({"sample_index": w.sample_index} if w.sample_index >= 0 else {}),
    }


def dlq_view(fields: dict[bytes, bytes], d: Decoder, current: int | None) -> dict:
    """A dead letter: its reason, and the original entry as far as it decodes (it did not)."""
    get = {k.decode(errors="replace"): v for k, v in fields.items()}
    original = {k[5:]: v for k, v in fields.items() if k.startswith(b"orig_")}
    source = _cut(get.get("source", b""))
    view = trajectory_view if ":traj:" in source else prompt_view
    return {
        "reason": _cut(get.get("reason", b"")),
        "code": _cut(get.get("code", b"")),
        "source": source,
        "original_id": _cut(get.get("original_id", b"")),
        "original": {
            k.decode(errors="replace"): _cut(v) for k, v in original.items() if k != b"data"
        },
        "decoded": view(original, d, current),
    }


VIEWS = {"prompts": prompt_view, "trajectories": trajectory_view, "dlq": dlq_view}


def read_entries(
    cfg: Config, stream: Stream, entry_id: str | None, last: int | None
) -> tuple[list[tuple[str, dict[bytes, bytes]]], int | None]:
    """The entries asked for, oldest first, and the version the `weights` hash holds now."""
    keys = RunKeys(cfg.run.run_id)
    r = connect(cfg.redis.url or "", min(cfg.redis.connect_timeout_s, 5.0), cfg.redis.sentinel)
    if stream == "trajectories":  # every generator's own stream (broker/connect/keys.py)
        gens: Any = r.hkeys(keys.generators)
        streams = [keys.trajectories(g.decode()) for g in sorted(gens) if b":" not in g]
    else:
        streams = [keys.prompts if stream == "prompts" else keys.dlq]
    raw: list[Any] = []
    for key in streams:
        if entry_id is not None:
            raw += r.xrange(key, entry_id, entry_id) or []
        else:
            raw += r.xrevrange(key, count=last) or []
    raw.sort(key=lambda e: tuple(int(x) for x in e[0].decode().split("-")))
    if entry_id is None and last:  # the last N over every stream read
        raw = raw[-last:]
    version = r.hget(keys.weights, "version")
    entries = [(i.decode(), dict(f)) for i, f in raw]
    return entries, int(version) if version is not None else None


def show_entries(
    cfg: Config, stream: Stream, entry_id: str | None, last: int | None, as_json: bool
) -> None:
    entries, current = read_entries(cfg, stream, entry_id, last)
    if not entries:
        what = f"entry {entry_id}" if entry_id else "entries"
        print(f"{stream}: no {what} (rl:{cfg.run.run_id}:{stream})")
        return
    decoder = Decoder.for_config(cfg)
    for eid, fields in entries:
        view = {"stream": stream, "id": eid, **VIEWS[stream](fields, decoder, current)}
        print(json.dumps(view) if as_json else "\n".join(lines_of(view)), flush=True)


def lines_of(v: dict) -> list[str]:
    """A view as a few lines of text."""
    head = f"{v['stream']} {v['id']}"
    if "refused" in v:
        return [f"{head}  REFUSED ({v['code']}): {v['refused']}"]
    if v["stream"] == "dlq":
        lines = [
            f"{head}  dead letter ({v['code']}) of {v['source']} {v['original_id']}: {v['reason']}"
        ]
        lines += [f"  {k}: {value}" for k, value in v["original"].items()]
        return lines
    stale = "" if v["staleness"] is None else f", staleness {v['staleness']} (weights now)"
    if v["stream"] == "prompts":
        return [
            f"{head}  prompt {v['prompt_id']} group {v['group_id']} n={v['n']}  issued "
            f"v{v['issued_version']}{stale}",
            f"  prompt: {v['prompt']!r}  answer: {v['answer']!r}",
        ]
    lines = [
        f"{head}  {v['traj_id']} from {v['generator']}  behaviour v{v['behavior_version']}, "
        f"issued v{v['issued_version']}{stale}" + ("  retried" if v["retried"] else ""),
        f"  prompt: {v['prompt']!r}" + (" (generator's text)" if "text" in v else ""),
    ]
    for k, s in enumerate(v["samples"]):
        lo, hi = s["versions"]
        lines.append(
            f"  [{k}] reward {s['reward']:.3f}  {'eos' if s['finished'] else 'cut'}  "
            f"{s['tokens']} tokens v{lo}{'' if lo == hi else f'-v{hi}'}  "
            f"logp {s['logprob_sum']:.2f}: {s['response']!r}"
            + (f"  ({s['reward_failure']})" if "reward_failure" in s else "")
        )
    return lines
