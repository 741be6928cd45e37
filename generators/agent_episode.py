"""Agent programs on a generator (`rollout.agent`, docs/agentic.md): groups of episodes of the
user's function, their calls answered by this generator's engine, streamed as trajectories.

One `AgentRollout` per generator process holds the endpoint (envs/agent_server.py) and the
host (envs/agent_host.py). For a pull of claimed prompts, every group starts n + r episodes of
the agent on the prompt's item (r = rollout.redundant_samples; 0 with prompt replication); the
host's loop answers their calls in shared engine batches (`generate_ids`, from the exact token
context of each call), and a group is streamed (XADD + XACK in one transaction) as soon as its
first n episodes have ended, the rest cancelled. With rollout.interrupt the weight follower runs
between engine batches, so an episode can cross a weight version: every token records its own,
and `refill` claims a new prompt each time a group is streamed (as for multi-turn episodes,
generators/episodes.py). Without it the weights never change during a pull.

A trajectory sample is an episode's final chain (envs/agent.py): the group's prompt is the
longest common prefix of its episodes' chain prompts (normally the first call's whole prompt),
and the rest of each episode's prompt leads its response with loss mask 0. An episode with no
model tokens to train (it made no call; its prompt shares no token with the group's) is a
sample with one masked token and no turn, whose reward still enters the group's baseline.
Failures travel as `reward_failure` (agent_error, agent_timeout, agent_bad_return,
agent_no_call; the learner counts `reward/<reason>`), errors and timeouts also as `env_errors`
(the learner's `env/errors`); the heartbeat counts episodes, calls, fallbacks and the rest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollflash.broker.config.config import Config, ConfigError
from rollflash.broker.sides.generator_side import GeneratorBroker
from rollflash.broker.wire.schema import PromptWork, Sample, Trajectory
from rollflash.envs import Item
from rollflash.envs.agent import Codec, Sequence, TextCodec, load_agent, turn_rewards, turn_states
from rollflash.envs.agent_host import AgentHost, Run
from rollflash.envs.agent_protocol import Limits
from rollflash.envs.chat import PromptFormatter
from rollflash.generators.engine import EpisodeEngine
from rollflash.generators.reload import WeightFollower
from rollflash.generators.sampling import SamplingParams

log = logging.getLogger(__name__)

_TEXT = 1000  # characters of a sample's text kept for inspection
_ERRORS = {"agent_error", "agent_timeout", "agent_bad_return"}


class SimCodec:
    """The sim engine's stand-in for a tokenizer: one token per character, no chat template
    beyond `role: content` lines (its tokens and texts are meaningless anyway)."""

    eos_id: int | None = None
    eos_text: str | None = None
    max_context: int | None = None

    def __init__(self, engine: EpisodeEngine) -> None:
        self._encode, self._span = engine.observation_encoder(), engine.vocab_size - 3

    def render_chat(self, messages: list[dict[str, Any]], tools: list | None) -> str:
        lines = [f"{m['role']}: {m.get('content') or ''}\n" for m in messages]
        return "".join(lines) + "assistant: "

    def encode_prompt(self, text: str) -> list[int]:
        return self._encode(text, True)

    def encode_more(self, text: str) -> list[int]:
        return self._encode(text, False)

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + (i - 3) % 26) for i in ids)


def codec_for(engine: EpisodeEngine, cfg: Config) -> TextCodec:
    """The endpoint's tokenizer side: the engine's tokenizer with `model.chat_template`."""
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None:
        return SimCodec(engine)
    template = PromptFormatter(tokenizer, cfg.model.chat_template).template
    return Codec(tokenizer, template, max_context(engine))


def max_context(engine: object) -> int | None:
    """The model's context length: the hf engine's model config, vLLM's max_model_len."""
    hf = getattr(getattr(engine, "model", None), "config", None)
    if hf is not None:
        return getattr(hf, "max_position_embeddings", None)
    llm = getattr(engine, "llm", None)
    return getattr(getattr(getattr(llm, "llm_engine", None), "model_config", None),
                   "max_model_len", None)  # fmt: skip


@dataclass
class _Group:
    entry_id: str
    work: PromptWork
    runs: list[Run] = field(default_factory=list)
    finished: list[Run] = field(default_factory=list)
    streamed: bool = False


class AgentRollout:
    """The agent endpoint and host of one generator (module docstring)."""

    def __init__(self, cfg: Config, engine: EpisodeEngine, follower: WeightFollower) -> None:
        if not hasattr(engine, "generate_ids"):
            raise ConfigError(
                f"rollout.agent: engine {cfg.rollout.engine!r} cannot serve agent calls"
            )
        rollout = cfg.rollout
        self.cfg, self.engine, self.follower = cfg, engine, follower
        self.codec = codec_for(engine, cfg)
        self.host = AgentHost(
            load_agent(rollout.agent or ""), self.codec, Limits.of(rollout), engine.vocab_size,
            version=lambda: follower.loaded_version, model_name=cfg.model.path,
        )  # fmt: skip

    def heartbeat_fields(self) -> dict[str, float]:
        return self.host.counters.fields()

    def close(self) -> None:
        self.host.close()

    def _generate(self, prompts: list[list[int]], params) -> list[list]:
        sampling = SamplingParams(params.n, params.temperature, params.top_p, params.max_tokens)
        return self.engine.generate_ids(prompts, sampling)

    def rollout(
        self,
        claimed: list[tuple[str, PromptWork]],
        broker: GeneratorBroker,
        generator_id: str,
        beat: Callable[[], None] = lambda: None,
    ) -> tuple[int, int]:
        """Play and stream one pull; returns (episodes, tokens) streamed. `beat` (the
        generator's heartbeat) runs every third of rollout.heartbeat_ttl_s while the pull lasts:
        agent episodes may take minutes."""
        rollout = self.cfg.rollout
        extra = 0 if rollout.replicate_prompts else rollout.redundant_samples
        groups: list[_Group] = []
        totals = [0, 0]
        started = time.monotonic()

        def start(entry_id: str, work: PromptWork) -> None:
            group = _Group(entry_id, work)
            item = Item(**work.item)
            group.runs = [self.host.start(item, len(groups)) for _ in range(work.n + extra)]
            groups.append(group)

        def on_finish(run: Run) -> None:
            group = groups[run.key]
            if group.streamed:
                return
            group.finished.append(run)
            if len(group.finished) < group.work.n:
                return
            group.streamed = True
            for other in group.runs:
                self.host.cancel(other)
            traj = group_trajectory(group.work, group.finished, self.codec, generator_id,
                                    self.follower.loaded_version)  # fmt: skip
            broker.add_trajectory(traj, prompt_entry_id=group.entry_id)
            totals[0] += len(traj.samples)
            totals[1] += sum(len(s.response_ids) for s in traj.samples)
            if rollout.interrupt and time.monotonic() - started < rollout.heartbeat_ttl_s / 3:
                for entry_id, work in broker.claim_prompts(1, block_ms=None):
                    if work.issued_version <= self.follower.loaded_version:
                        start(entry_id, work)  # else it stays pending: the next pull's

        for entry_id, work in claimed:
            start(entry_id, work)
        on_step = self.follower.maybe_reload if rollout.interrupt else None
        last_beat = [time.monotonic()]

        def done() -> bool:  # the host's loop asks at least once a second
            if time.monotonic() - last_beat[0] > rollout.heartbeat_ttl_s / 3:
                beat()
                last_beat[0] = time.monotonic()
            return all(g.streamed for g in groups)

        self.host.serve(done, self._generate, on_finish, on_step)
        return totals[0], totals[1]


def group_trajectory(
    work: PromptWork, runs: list[Run], codec: TextCodec, generator_id: str, version: int
) -> Trajectory:
    """The group's samples (module docstring); `version`: the loaded one, for samples without
    a model token."""
    seqs = [run.record.sequence() for run in runs]
    seqs = [s if s is not None and any(s.loss_mask) else None for s in seqs]
    prompt = _common_prefix([s.prompt_ids for s in seqs if s is not None])
    if not prompt:  # none trains, or their prompts share no token: keep the first's first
        first = next((s for s in seqs if s is not None), None)
        text = str(work.item.get("prompt", ""))
        prompt = (first.prompt_ids if first else codec.encode_prompt(text))[:1] or [0]
    samples = []
    for run, seq in zip(runs, seqs):
        fits = seq is not None and seq.prompt_ids[: len(prompt)] == prompt
        if fits:
            samples.append(_sample(run, seq, len(prompt)))  # type: ignore[arg-type]
        else:
            samples.append(_untrained(run, codec.eos_id or 0, version))
    return Trajectory.for_work(work, samples, prompt, generator_id, version=version)


def _untrained(run: Run, pad: int, version: int) -> Sample:
    """An episode with no model token to train: one masked token, no turn."""
    out = run.outcome
    assert out is not None
    failure = out.failure or ("agent_dropped" if run.record.calls else "agent_no_call")
    return Sample(
        response_ids=np.asarray([pad], np.int32),
        logprobs=np.zeros(1, np.float32),
        token_versions=np.asarray([version], np.int32),
        reward=out.reward,
        finished=False,
        loss_mask=np.zeros(1, np.uint8),
        turn_starts=np.zeros(0, np.int32),
        turn_rewards=np.zeros(0, np.float32),
        turn_states=np.zeros(0, np.int64),
        env_errors=int(failure in _ERRORS),
        reward_failure=failure,
    )


def _sample(run: Run, seq: Sequence, shared: int) -> Sample:
    """An episode's final chain after the group's `shared` prompt tokens."""
    out = run.outcome
    assert out is not None
    lead = seq.prompt_ids[shared:]
    return Sample(
        response_ids=np.asarray(lead + seq.response_ids, np.int32),
        logprobs=np.asarray([0.0] * len(lead) + seq.logprobs, np.float32),
        token_versions=np.asarray(seq.versions[:1] * len(lead) + seq.versions, np.int32),
        reward=out.reward,
        finished=seq.finished and not out.failure,
        text=" | ".join(seq.texts)[:_TEXT],
        loss_mask=np.asarray([0] * len(lead) + seq.loss_mask, np.uint8),
        turn_starts=np.asarray([len(lead) + t for t in seq.turn_starts], np.int32),
        turn_rewards=np.asarray(turn_rewards(out, seq), np.float32),
        turn_states=np.asarray(turn_states(run.record, seq), np.int64),
        env_errors=int(out.failure in _ERRORS),
        reward_failure=out.failure,
    )


def _common_prefix(prompts: list[list[int]]) -> list[int]:
    if not prompts:
        return []
    first = prompts[0]
    n = len(first)
    for p in prompts[1:]:
        n = min(n, len(p))
        n = next((i for i in range(n) if p[i] != first[i]), n)
    return first[:n]
