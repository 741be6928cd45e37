"""Multi-turn rollouts: run environment episodes with environment-level asynchrony.

For a pull of claimed prompts (each an episode seed, envs/multiturn.py), every group starts
n + r episodes (r = `rollout.redundant_samples`, 0 with prompt replication, where the learner
issued the extra entries). Each episode runs in its own thread:

    episode = Episode(env, seed)                 # reset; the first observation is the prompt
    loop: action = server.generate(context)      # queued, answered in a shared engine batch
          episode.act(action)                    # env.step in this thread, observation appended
    until the environment ends it or the token budget (`rollout.max_episode_tokens`) is spent

The engine is driven by this module's main loop (`EpisodeRunner.run`) alone: it gathers the
requests that are waiting, runs one batched `generate_ids` over them, and hands each episode its
action. There is no barrier between episodes: an episode whose environment is slow (a sandboxed
tool call, a simulated step latency) misses a batch or two while the others go on, and a group is
streamed to the learner (XADD + XACK) the moment its first n episodes have finished; its remaining
redundant episodes are cancelled at their next turn. Which n are kept is decided by wall-clock
finishing order, so redundancy cuts the tail of slow environments as well as of long generations.

With `rollout.interrupt`, there is no barrier between pulls either: each time a group is
streamed, `refill` claims a new prompt and its episodes join the running ones (for up to a third
of the heartbeat TTL; then the pull drains and the generator heartbeats). Without `interrupt` a
pull is the unit between weight loads: a refilled episode would have to finish before newer
weights could be loaded, which lengthens every drain, so pulls stay whole. A new prompt issued
for a newer weight version than the one loaded cannot start under the current weights (that would
break a = 0's on-policy rule), so it stays claimed, pending, and opens the next pull after the
reload.

Weight versions: without `rollout.interrupt` the weights never change during a pull. With it,
the main loop calls the weight follower between engine batches, so later turns of an episode may
come from a newer version; every token records the version that produced it (observation tokens
take the version of the action before them).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from rollflash.broker.config.config import Config
from rollflash.broker.sides.generator_side import GeneratorBroker
from rollflash.broker.wire.schema import PromptWork, Sample, Trajectory
from rollflash.envs import EnvTask, Episode
from rollflash.generators.engine import EpisodeEngine
from rollflash.generators.reload import WeightFollower
from rollflash.generators.sampling import GeneratedSample, OnStep, SamplingParams

log = logging.getLogger(__name__)

GATHER_S = 0.005  # wait this long for more requests while some episodes are in env.step


@dataclass
class _Run:
    """One episode in flight; `group` indexes the groups of the pull."""

    group: int
    seed: int
    episode: Episode | None = None
    cancelled: bool = False
    reply: queue.Queue[GeneratedSample | None] = field(default_factory=lambda: queue.Queue(1))


@dataclass
class GroupSpec:
    make_env: Callable
    seed: int
    keep: int  # n: episodes that make the group
    start: int  # n + r: episodes started
    prompt: str | None = None  # the first observation as the learner issued it (envs/episode.py)


class EpisodeRunner:
    """Runs the episodes of one pull; see the module docstring."""

    def __init__(
        self,
        engine: EpisodeEngine,
        params: SamplingParams,
        max_episode_tokens: int,
        version: Callable[[], int],
        on_step: OnStep | None = None,
    ) -> None:
        self.engine, self.params = engine, params
        self.max_tokens = max_episode_tokens
        self.version, self.on_step = version, on_step
        self.events: queue.Queue = queue.Queue()
        encode, lock = engine.observation_encoder(), threading.Lock()

        def locked_encode(text: str, first: bool) -> list[int]:
            with lock:  # a fast tokenizer's settings are shared state; episode threads take turns
                return encode(text, first)

        self.encode = locked_encode

    def _play(self, run: _Run, spec: GroupSpec) -> None:
        """Episode thread: alternate between asking for an action and stepping the environment."""
        try:
            ep = Episode(
                env=spec.make_env(),
                seed=spec.seed,
                encode=self.encode,
                max_tokens=self.max_tokens,
                action_tokens=self.params.max_new_tokens,
                first_observation=spec.prompt,
            )
            run.episode = ep
            try:
                while not ep.done and not run.cancelled:
                    self.events.put(("generate", run))
                    sample = run.reply.get()
                    if sample is None:
                        return
                    versions = sample.token_versions or [self.version()] * len(sample.response_ids)
                    ep.act(sample.response_ids, sample.logprobs, versions, sample.text)
            finally:
                ep.close()
            if ep.done:
                self.events.put(("done", run))
        except Exception as e:  # an environment bug: reported by the main loop, not swallowed
            self.events.put(("error", run, e))
        finally:
            self.events.put(("exit", run))

    def run(
        self,
        specs: list[GroupSpec],
        on_group: Callable[[int, list[Episode]], None],
        refill: Callable[[], list[GroupSpec]] | None = None,
    ) -> None:
        """Play every group; `on_group(index, episodes)` is called (in this thread) as soon as a
        group's first `keep` episodes have finished. After that, `refill()` may return new groups
        (indexed after the earlier ones), which start at once."""
        self.specs: list[GroupSpec] = []
        self.runs: list[_Run] = []
        self.finished: list[list[Episode]] = []  # per group, its finished episodes in order
        self.refill, self.live = refill, 0  # live: episode threads not yet exited
        self._start(specs)
        self.waiting: list[_Run] = []
        runs = self.runs
        try:
            self._loop(on_group)
        finally:  # normally only cancelled leftovers; after an error, every episode stops too
            for run in runs:
                run.cancelled = True
            for run in self.waiting:
                _release(run)
            while True:
                try:
                    event = self.events.get_nowait()
                except queue.Empty:
                    break
                if event[0] == "generate":
                    _release(event[1])

    def _start(self, specs: list[GroupSpec]) -> int:
        """Start the episodes of new groups; returns how many groups were added."""
        first = len(self.specs)
        self.specs += specs
        self.finished += [[] for _ in specs]
        new = [
            _Run(group=first + g, seed=s.seed) for g, s in enumerate(specs) for _ in range(s.start)
        ]
        self.runs += new
        self.live += len(new)
        for run in new:
            threading.Thread(
                target=self._play,
                args=(run, self.specs[run.group]),
                daemon=True,
                name=f"episode-{run.group}",
            ).start()
        return len(specs)

    def _loop(self, on_group: Callable[[int, list[Episode]], None]) -> None:
        runs, specs, finished, waiting = self.runs, self.specs, self.finished, self.waiting
        open_groups = len(specs)
        while open_groups:
            events = [self.events.get()]
            deadline = time.monotonic() + GATHER_S
            while True:
                try:
                    events.append(self.events.get_nowait())
                    continue
                except queue.Empty:
                    pass
                busy = self.live - len(waiting) - sum(e[0] == "generate" for e in events)
                left = deadline - time.monotonic()
                if busy <= 0 or left <= 0:
                    break
                try:
                    events.append(self.events.get(timeout=left))
                except queue.Empty:
                    break
            for event in events:
                kind, run = event[0], event[1]
                if kind == "error":
                    raise RuntimeError(
                        f"environment failed in episode seed {run.seed}: {event[2]!r}"
                    ) from event[2]
                if kind == "exit":
                    self.live -= 1
                elif kind == "generate":
                    if run.cancelled:
                        _release(run)
                    else:
                        waiting.append(run)
                elif kind == "done" and len(finished[run.group]) < specs[run.group].keep:
                    group = finished[run.group]
                    group.append(run.episode)
                    if len(group) == specs[run.group].keep:
                        open_groups -= 1
                        self._cancel_rest(runs, run.group, waiting)
                        on_group(run.group, group)
                        if self.refill is not None:
                            open_groups += self._start(self.refill())
            waiting[:] = [r for r in waiting if not r.cancelled]
            if waiting and open_groups:
                self._serve(waiting)
                waiting.clear()

    def _cancel_rest(self, runs: list[_Run], group: int, waiting: list[_Run]) -> None:
        for run in runs:
            if run.group == group and not run.cancelled and not (run.episode and run.episode.done):
                run.cancelled = True
                if run in waiting:
                    _release(run)

    def _serve(self, waiting: list[_Run]) -> None:
        """One engine batch over the waiting episodes, then (interrupt mode) a weight check."""
        contexts = []
        for r in waiting:
            assert r.episode is not None  # an episode asks to generate once it has been reset
            contexts.append(r.episode.context)
        groups = self.engine.generate_ids(contexts, self.params)
        for run, group in zip(waiting, groups):
            sample = group[0]
            if sample.token_versions is None:
                sample.token_versions = [self.version()] * len(sample.response_ids)
            run.reply.put(sample)
        if self.on_step is not None:
            self.on_step()


def _release(run: _Run) -> None:
    """Tell a waiting episode thread to stop (at most one reply is ever pending)."""
    try:
        run.reply.put_nowait(None)
    except queue.Full:
        pass


def episodes_to_trajectory(
    work: PromptWork, episodes: list[Episode], generator_id: str
) -> Trajectory:
    samples = []
    for ep in episodes:
        samples.append(
            Sample(
                response_ids=np.asarray(ep.response_ids, dtype=np.int32),
                logprobs=np.asarray(ep.logprobs, dtype=np.float32),
                token_versions=np.asarray(ep.versions, dtype=np.int32),
                reward=ep.reward,
                finished=not ep.truncated,
                text=" | ".join(ep.actions),
                loss_mask=np.asarray(ep.loss_mask, dtype=np.uint8),
                turn_starts=np.asarray(ep.turn_starts, dtype=np.int32),
                turn_rewards=np.asarray(ep.turn_rewards, dtype=np.float32),
                turn_states=np.asarray(ep.turn_states, dtype=np.int64),
                env_errors=ep.env_errors,
            )
        )
    return Trajectory.for_work(
        work,
        samples,
        episodes[0].prompt_ids,
        generator_id,
        version=int(samples[0].token_versions.min()),
    )


def _check_supported(engine: EpisodeEngine, task: EnvTask, cfg: Config) -> None:
    """Refuse, naming the key, what the episode runner cannot do: an engine without token-id
    generation, or a reward other than the environment's own."""
    if not hasattr(engine, "generate_ids"):
        raise NotImplementedError(
            f"rollout.engine {cfg.rollout.engine!r} cannot run multi-turn "
            f"environments (task {task.name!r}); use 'hf', 'vllm' or 'sim'"
        )
    reward = getattr(cfg, "reward", None)
    if reward is not None and reward.type != "rule":
        raise NotImplementedError(
            f"reward.type {reward.type!r} is not applied to multi-turn "
            f"environments (task {task.name!r}); use reward.type: rule"
        )


def _group_spec(task: EnvTask, work: PromptWork, extra: int) -> GroupSpec:
    """The episodes of one claimed prompt: `work.n` kept of `work.n + extra` started, all on the
    seed the prompt carries (so the same map)."""
    return GroupSpec(
        make_env=task.make_env,
        seed=int(work.item["answer"]),
        prompt=work.item["prompt"],
        keep=work.n,
        start=work.n + extra,
    )


def rollout_episodes(
    claimed: list[tuple[str, PromptWork]],
    engine: EpisodeEngine,
    task: EnvTask,
    cfg: Config,
    broker: GeneratorBroker,
    generator_id: str,
    follower: WeightFollower,
) -> tuple[int, int]:
    """Play and stream one pull of multi-turn prompts; returns (episodes, tokens) streamed."""
    _check_supported(engine, task, cfg)
    extra = 0 if cfg.rollout.replicate_prompts else cfg.rollout.redundant_samples
    runner = EpisodeRunner(
        engine,
        SamplingParams.for_rollout(cfg.rollout, 1),  # one action per episode turn
        cfg.rollout.max_episode_tokens,
        version=lambda: follower.loaded_version,
        on_step=follower.maybe_reload if cfg.rollout.interrupt else None,
    )
    specs = [_group_spec(task, w, extra) for _, w in claimed]
    totals = [0, 0]

    def stream(index: int, episodes: list[Episode]) -> None:
        entry_id, work = claimed[index]
        broker.add_trajectory(
            episodes_to_trajectory(work, episodes, generator_id), prompt_entry_id=entry_id
        )
        totals[0] += len(episodes)
        totals[1] += sum(len(ep.response_ids) for ep in episodes)

    pull_started = time.monotonic()

    def refill() -> list[GroupSpec]:
        """One new prompt per streamed group, if one is waiting and startable now; only while
        weights can change mid-pull (interrupt) and for a third of the heartbeat TTL, so that the
        generator's heartbeat stays fresh."""
        if time.monotonic() - pull_started > cfg.rollout.heartbeat_ttl_s / 3:
            return []
        new = broker.claim_prompts(1, block_ms=None)
        ready = [(e, w) for e, w in new if w.issued_version <= follower.loaded_version]
        claimed.extend(ready)  # the rest stay pending: the next pull starts with them
        return [_group_spec(task, w, extra) for _, w in ready]

    runner.run(specs, stream, refill=refill if cfg.rollout.interrupt else None)
    return totals[0], totals[1]
