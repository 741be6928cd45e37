"""Single-turn rollouts with continuous batching (`rollout.inflight_samples` = K > 0).

A generator that samples a pull at a time (generators/rollout.py `rollout_batch`) waits for the
longest sample of the pull before it claims more work: with long-tail response lengths most of the
engine's batch sits empty while the last sample decodes. Here, as in a serving engine, up to K
samples are decoding, a prompt is claimed as soon as its group's n + r samples fit in the free
slots (one at least when nothing is in flight), and the loop runs between decode steps:
1. stream every group whose first n samples have finished (score, XADD + XACK in one transaction,
   as `rollout_batch` does) and abort its redundant rest;
2. pick up new weights: with `rollout.interrupt` as soon as they are published (every in-flight
   sample continues under them and its later tokens record the new version); without it only while
   nothing is in flight, so every sample keeps the weights it started with. A group that started
   more versions before the weights now loaded than the learner accepts of a group still being
   generated (`trainer.max_overdue_staleness`, learner/intake/ready.py) is started again: the learner
   would drop it as stale (its oldest token counts) and issue a replacement;
3. fill the free slots: claim new prompts, and, at most once a second, our own pending entries
   (after a restart, or when Redis forgot an acknowledgement) and ones another generator abandoned;
4. one decode step of everything in flight.
A claimed prompt issued for a newer version than the loaded one waits until those weights are
loaded, and nothing is admitted ahead of it: without interrupt the in-flight samples drain first.
That keeps a = 0 on-policy, as in pull mode.

Engines: `add_request` / `step` / `abort` (generators/engine.py `StreamingEngine`): vllm and sim;
transformers' `generate` runs a batch to its end, so hf has only pulls. Multi-turn environments
use their own runner (generators/episodes.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from rollflash.broker.config.config import Config
from rollflash.broker.sides.generator_side import GeneratorBroker
from rollflash.broker.wire.schema import PromptWork
from rollflash.generators.engine import StreamingEngine
from rollflash.generators.liveness import Liveness
from rollflash.generators.reload import WeightFollower
from rollflash.generators.sampling import GeneratedSample, SamplingParams

log = logging.getLogger(__name__)

FULL_CLAIM_INTERVAL_S = 1.0  # how often own pending and abandoned prompts are looked for
BEAT_INTERVAL_S = 1.0  # heartbeat and run-state check while work is in flight
IDLE_BLOCK_MS = 200  # with nothing in flight, wait this long for a new prompt per claim


@dataclass
class _Group:
    work: PromptWork
    version: int  # loaded when the group started
    samples: list[GeneratedSample] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)  # first started (not restarted)


class Usage(Protocol):
    """Where the loop adds up its time (generators/counters.py `Counters`)."""

    busy_s: float  # decoding
    idle_s: float  # nothing in flight: waiting for prompts or weights
    seq_s: float  # sum over decode steps of (sequences in flight x step time)
    restarted: int  # groups started again because they had grown too stale to be trained


class ContinuousRollout:
    """The loop in the module docstring; `stream(entry_id, work, samples, version)` scores and
    streams one finished group, `beat()` heartbeats and returns False once the run is done or the
    process was asked to stop."""

    def __init__(
        self,
        cfg: Config,
        engine: StreamingEngine,
        follower: WeightFollower,
        broker: GeneratorBroker,
        generator_id: str,
        stream: Callable[[str, PromptWork, list[GeneratedSample], int], None],
        beat: Callable[[], bool],
        usage: Usage,
        liveness: Liveness,
        limit: Callable[[PromptWork], int | None] | None = None,
    ) -> None:
        """`limit(work)`: a prompt's own response limit (None: rollout.max_new_tokens);
        `liveness`: the reclaim time, and where the groups' hold times go."""
        self.cfg, self.engine, self.follower, self.liveness = cfg, engine, follower, liveness
        self.broker, self.id = broker, generator_id
        self.stream, self.beat, self.usage, self.limit = stream, beat, usage, limit
        self.slots = cfg.rollout.inflight_samples
        self.extra = 0 if cfg.rollout.replicate_prompts else cfg.rollout.redundant_samples
        # samples one claimed prompt starts (an entry holds one sample with prompt replication)
        self.per_prompt = (
            1 if cfg.rollout.replicate_prompts else cfg.rollout.num_return_sequences + self.extra
        )
        self.inflight: dict[str, _Group] = {}
        self.held: list[tuple[str, PromptWork]] = []  # claimed, waiting for newer weights
        self.worked = False  # idle time counts from the first piece of work, not from start-up

    def run(self) -> None:
        """Until `beat` says stop. On an exception (Redis trouble) the samples in flight are
        dropped: their prompts stay pending for us and are claimed again by the next run."""
        try:
            self._loop()
        finally:
            for entry_id in self.inflight:
                self.engine.abort(entry_id)

    def _loop(self) -> None:
        next_beat = next_full = 0.0
        while True:
            now = time.monotonic()
            if now >= next_beat:
                if not self.beat():
                    break
                next_beat = now + BEAT_INTERVAL_S
            if self.cfg.rollout.interrupt or not self.engine.num_active:
                if self.follower.maybe_reload():
                    self._restart_doomed()
            full = now >= next_full
            if full:
                next_full = now + FULL_CLAIM_INTERVAL_S
            self._admit(full)
            self._decode(now)

    def _restart_doomed(self) -> None:
        """Start again, under the weights just loaded, every group that started more than
        `trainer.max_overdue_staleness` versions ago: the learner, which has published them,
        would drop it as stale and issue a replacement prompt, so finishing it only wastes decode
        slots and a round trip. The prompt entry stays ours. (Versions, not steps: after a
        learner resume this can restart a group the learner would still have taken; it never
        keeps a doomed one.)"""
        loaded = self.follower.loaded_version
        for entry_id, group in list(self.inflight.items()):
            if loaded - group.version > self.cfg.trainer.max_overdue_staleness:
                self.engine.abort(entry_id)
                self.inflight[entry_id] = _Group(group.work, loaded, started=group.started)
                self.engine.add_request(
                    entry_id, group.work.item["prompt"], self._params(group.work)
                )
                self.usage.restarted += 1

    def _params(self, work: PromptWork) -> SamplingParams:
        params = SamplingParams.for_rollout(self.cfg.rollout, work.n + self.extra)
        limit = self.limit(work) if self.limit is not None else None
        return dataclasses.replace(params, max_new_tokens=limit) if limit else params

    def _admit(self, full: bool) -> None:
        loaded = self.follower.loaded_version
        ready = [(e, w) for e, w in self.held if w.issued_version <= loaded]
        self.held = [(e, w) for e, w in self.held if w.issued_version > loaded]
        for entry_id, work in ready:
            self._start(entry_id, work)
        active = self.engine.num_active
        free = (
            (self.slots - active) // self.per_prompt
            if active
            else max(1, self.slots // self.per_prompt)
        )
        if self.held or free <= 0:
            return
        block_ms = None if self.inflight else IDLE_BLOCK_MS
        for entry_id, work in self._claim(free, full, block_ms):
            if work.issued_version > loaded or self.held:
                self.held.append((entry_id, work))
            else:
                self._start(entry_id, work)

    def _claim(self, count: int, full: bool, block_ms: int | None) -> list[tuple[str, PromptWork]]:
        """New prompts; with `full`, first our own pending entries that are not in flight here
        and then prompts another generator abandoned (as `Generator.claim` does per pull)."""
        if full:
            taken = set(self.inflight) | {e for e, _ in self.held}  # pending for us, being handled
            own = self.broker.claim_prompts(count + len(taken), block_ms=None, own_pending=True)
            own = [(e, w) for e, w in own if e not in taken]
            if own:
                return own
            reclaimed = [
                (e, w)
                for e, w in self.broker.reclaim_prompts(self.liveness.reclaim_idle_ms, count)
                if e not in taken
            ]
            if reclaimed:
                log.warning("took over %d prompts abandoned by another generator", len(reclaimed))
                return reclaimed
        return self.broker.claim_prompts(count, block_ms=block_ms)

    def _start(self, entry_id: str, work: PromptWork) -> None:
        self.inflight[entry_id] = _Group(work, self.follower.loaded_version)
        self.engine.add_request(entry_id, work.item["prompt"], self._params(work))
        self.worked = True

    def _decode(self, turn_started: float) -> None:
        """One decode step; with nothing in flight, the time since `turn_started` was idle."""
        started = time.monotonic()
        if not self.engine.num_active:
            if self.held:  # nothing to drain: wait for the weights the held prompts need
                self.follower.wait_for(
                    max(w.issued_version for _, w in self.held),
                    self.cfg.trainer.wait_timeout_s,
                    self.broker.run_state,
                    beat=self.beat,
                )
            if self.worked:
                self.usage.idle_s += time.monotonic() - turn_started
            return
        active = self.engine.num_active
        finished = self.engine.step()
        spent = time.monotonic() - started
        self.usage.busy_s += spent
        self.usage.seq_s += active * spent
        for entry_id, sample in finished:
            group = self.inflight.get(entry_id)
            if group is None:  # a redundant sample that finished in the step its group did
                continue
            group.samples.append(sample)
            if len(group.samples) == group.work.n:
                self.engine.abort(entry_id)  # redundant samples still decoding
                del self.inflight[entry_id]
                self.stream(entry_id, group.work, group.samples, group.version)
                self.liveness.held(time.monotonic() - group.started)
