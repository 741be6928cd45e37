"""The config fingerprint: the keys every process of a run must agree on, and what differs.

The learner records, in the run hash, a digest of these keys and their values; a generator (or a
learner resuming the run) compares its own and is refused with `RunMismatch` naming each key
that differs and both values. The record is the run's for good once it has trained; before that
a learner replaces a failed start's (broker/channels/registry.py `register`). The fingerprint covers what
decides what a sample is and how it is read, nothing a process may choose for itself:
- `model:` the weights, tokenizer, dtype, chat template and LoRA shape every version is made for
  (not `attn_implementation`: how the learner computes);
- `task:` the task, its data and parameters;
- `reward:` how a response is scored (not how the scorer runs: its batch size, the code
  verifier's worker threads, the judge's URL and request timeout);
- sampling (`rollout.num_return_sequences`, `max_new_tokens`, `temperature`, `top_p`,
  `max_episode_tokens`) and how groups travel (`rollout.replicate_prompts`);
- the wire limits: `redis.max_payload_bytes` (and `reward.max_abs_reward`, with `reward:`);
- how weight versions travel (`weights.transport`; the other `weights:` keys are one host's own:
  its address, files and certificates).

Everything else may differ between processes and between a run and its resumption: the whole of
`trainer:` (total_steps, learning rate, batch sizes, checkpoints, devices), `algo:`, `eval:`,
`logging:`, `guards:`, `placement:`, `sim:`, `rm:`, `run:` (the run id names the keys already),
the Redis URL and timeouts, and a generator's engine and its options (`rollout.engine`,
`device`, `vllm`, `inflight_samples`, `interrupt`, `prompts_per_pull`, `redundant_samples`,
`reclaim_idle_s`, `heartbeat_ttl_s`) and the number of generators. The hf and vllm engines
report the same log-probabilities (log_softmax(logits / temperature) before top-p,
generators/sampling.py); the sim engine's are a constant.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollflash.broker.connect.redis_io import RunMismatch

# section -> the keys of it that are shared (None: the whole section), and those left out of it
SHARED: dict[str, tuple[str, ...] | None] = {
    "model": ("path", "trust_remote_code", "dtype", "chat_template", "lora"),
    "task": None,
    "reward": None,
    "rollout": (
        "num_return_sequences",
        "max_new_tokens",
        "temperature",
        "top_p",
        "max_episode_tokens",
        "replicate_prompts",
    ),
    "redis": ("max_payload_bytes",),
    "weights": ("transport",),
}
# dotted keys inside a shared section that say how one process runs
LOCAL: frozenset[str] = frozenset(
    {
        "reward.micro_batch_size",
        "reward.code.max_workers",
        "reward.judge.url",
        "reward.judge.timeout_s",
    }
)


# sub-sections named key by key (other values, such as task.params or model.lora, are one key)
NESTED: frozenset[str] = frozenset({"reward.code", "reward.judge"})


def _flat(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if prefix in NESTED:
        for k, v in value.items():
            _flat(f"{prefix}.{k}", v, out)
    elif prefix not in LOCAL:
        out[prefix] = value


def shared_keys(config: dict[str, Any]) -> dict[str, Any]:
    """The shared part of a config's `to_dict()`, as dotted key -> value (sorted)."""
    out: dict[str, Any] = {}
    for section, keys in SHARED.items():
        data = config[section]
        for key in keys if keys is not None else data:
            _flat(f"{section}.{key}", data[key], out)
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class Fingerprint:
    """The shared keys of one config (`Config.fingerprint()`) and their digest."""

    values: dict[str, Any]  # dotted key -> value

    @property
    def digest(self) -> str:
        """16 hex digits of the sha256 of the keys and values, as JSON."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps(self.values, sort_keys=True)

    def __str__(self) -> str:
        return self.digest


_ABSENT = object()


def _shown(value: Any) -> str:
    text = "absent" if value is _ABSENT else json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def differences(recorded: dict[str, Any], mine: Fingerprint) -> list[str]:
    """One 'key (the run: A, this process: B)' per shared key whose values differ."""
    out = []
    for key in sorted(recorded.keys() | mine.values.keys()):
        have, want = recorded.get(key, _ABSENT), mine.values.get(key, _ABSENT)
        if have != want:
            out.append(f"{key} (the run: {_shown(have)}, this process: {_shown(want)})")
    return out


def fingerprint_mismatch(prefix: str, recorded_json: str | None, mine: Fingerprint) -> RunMismatch:
    """The refusal of a process whose shared keys differ from those the run recorded."""
    from rollflash.broker.connect.redis_io import (
        RunMismatch,  # the config loader imports no Redis client
    )

    try:
        recorded = json.loads(recorded_json) if recorded_json else None
    except ValueError:
        recorded = None
    found = differences(recorded, mine) if isinstance(recorded, dict) else []
    what = "; ".join(found) if found else "the run recorded no readable keys"
    return RunMismatch(
        f"run {prefix} was started with another config; keys every process must agree on "
        f"differ: {what}. Use the run's config (its run.yaml), or another run.run_id "
        "(docs/config.md lists the keys that may differ)"
    )
