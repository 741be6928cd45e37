"""The generator process: claim prompts, sample groups, score them, stream trajectories.

With `rollout.inflight_samples` > 0 the loop is continuous batching instead
(generators/continuous.py). Otherwise it is, one batch of `rollout.prompts_per_pull` prompts at a
time (so a fast generator never waits for a slow one):
1. heartbeat (loaded version, counters) and pick up a newer weight version if one was published;
2. claim prompts from the `prompts` stream: our own pending entries first (after a restart of this
   process, or of Redis that forgot an acknowledgement), then ones another generator abandoned,
   then new ones;
3. make sure the loaded version is at least every claimed prompt's `issued_version`: with
   async_ratio 0 this is what makes training on-policy;
4. sample n responses per prompt, score each with the task, XADD one trajectory per prompt and
   XACK its prompt in the same transaction.
The process stops when the learner marks the run done, or on SIGTERM / SIGINT. It waits out Redis
restarts and maxmemory refusals with backoff (broker/connect/retry.py) and stops
with `RunLost` if Redis comes back without the run's keys.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import cast

import numpy as np
import redis

from rollflash.broker.config.config import Config, ConfigError
from rollflash.broker.config.process import freeze_heap, setup_process, thaw_heap
from rollflash.broker.connect.connection import BrokerUnavailable, connect
from rollflash.broker.connect.redis_io import is_oom
from rollflash.broker.connect.retry import retry_until
from rollflash.broker.connect.secrets import redact
from rollflash.broker.sides.generator_side import GeneratorBroker
from rollflash.broker.wire.schema import PromptWork, Sample, Trajectory
from rollflash.envs import Item, Task, is_multi_turn, task_from_config
from rollflash.envs.scored import abstained_of, failure_of, parts_of
from rollflash.generators.continuous import ContinuousRollout
from rollflash.generators.counters import Counters, StopSignals
from rollflash.generators.engine import (
    Engine,
    EpisodeEngine,
    StreamingEngine,
    check_engine,
    make_engine,
)
from rollflash.generators.episodes import rollout_episodes
from rollflash.generators.liveness import Liveness
from rollflash.generators.reload import WeightFollower, version_source
from rollflash.generators.rewarder import Rewarder, make_rewarder
from rollflash.generators.run_setup import generator_seed, redis_url
from rollflash.generators.sampling import GeneratedSample, Groups, SamplingParams

log = logging.getLogger(__name__)


def first_finished(samples: list[GeneratedSample], n: int) -> list[GeneratedSample]:
    """Redundant sampling keeps the n samples that finished first. Decoding advances all samples in
    lockstep, so those are the n shortest (ties by order). This favours short responses, the
    price ROLL's redundant rollouts pay for cutting the long tail."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].response_ids))
    return [samples[i] for i in sorted(order[:n])]


def to_trajectory(
    work: PromptWork,
    samples: list[GeneratedSample],
    task: Task,
    generator_id: str,
    version: int,
    rewards: list[float] | None = None,
) -> Trajectory:
    """`rewards`: one per sample, from the configured rewarder (None: the task's own score)."""
    item = Item(**work.item)
    out = []
    for k, s in enumerate(samples):
        versions = (
            s.token_versions if s.token_versions is not None else [version] * len(s.response_ids)
        )
        reward = task.score(item, s.text) if rewards is None else rewards[k]
        out.append(
            Sample(
                response_ids=np.asarray(s.response_ids, dtype=np.int32),
                logprobs=np.asarray(s.logprobs, dtype=np.float32),
                token_versions=np.asarray(versions, dtype=np.int32),
                reward=float(reward),
                finished=s.finished,
                text=s.text,
                reward_failure=failure_of(reward),  # e.g. code_timeout; "" if none
                reward_parts=parts_of(reward),  # each function's score (2+ functions)
                reward_abstained=abstained_of(reward),  # the functions that returned None
            )
        )
    return Trajectory.for_work(work, out, samples[0].prompt_ids, generator_id, version)


def rollout_batch(
    claimed: list[tuple[str, PromptWork]],
    engine: Engine,
    task: Task,
    cfg: Config,
    broker: GeneratorBroker,
    generator_id: str,
    follower: WeightFollower,
    rewarder: Rewarder | None = None,
) -> tuple[int, int]:
    """Sample, score and stream one batch; returns (samples, tokens) produced."""
    if is_multi_turn(task):  # environment episodes (generators/episodes.py)
        # every engine (hf, vllm, sim) runs episodes: generators/engine.py EpisodeEngine
        episodes = cast(EpisodeEngine, engine)
        return rollout_episodes(claimed, episodes, task, cfg, broker, generator_id, follower)
    n = claimed[0][1].n
    # with prompt replication the learner issued the redundant samples as extra entries
    extra = 0 if cfg.rollout.replicate_prompts else cfg.rollout.redundant_samples
    params = SamplingParams.for_rollout(cfg.rollout, n + extra)
    version = follower.loaded_version
    on_step = follower.maybe_reload if cfg.rollout.interrupt else None
    groups = generate_limited(engine, task, [w for _, w in claimed], params, on_step)
    kept_groups = [first_finished(samples, w.n) for (_, w), samples in zip(claimed, groups)]
    return stream_groups(
        claimed, kept_groups, [version] * len(claimed), task, broker, generator_id, rewarder
    )


def response_limit(task: Task, work: PromptWork) -> int | None:
    """The response length limit of a prompt's task when it has its own (a mixture's domain:
    envs/mixture.py), else None (rollout.max_new_tokens)."""
    limit = getattr(task, "response_limit", None)
    return limit(Item(**work.item)) if limit is not None else None


def generate_limited(
    engine: Engine, task: Task, works: list[PromptWork], params: SamplingParams, on_step=None
) -> Groups:
    """`engine.generate` over `works`, one call per distinct response limit (response_limit)."""
    limits = [response_limit(task, w) or params.max_new_tokens for w in works]
    groups: Groups = [[] for _ in works]
    for limit in sorted(set(limits)):
        ks = [k for k, lim in enumerate(limits) if lim == limit]
        prompts = [works[k].item["prompt"] for k in ks]
        out = engine.generate(prompts, replace(params, max_new_tokens=limit), on_step=on_step)
        for k, samples in zip(ks, out):
            groups[k] = samples
    return groups


def stream_groups(
    claimed: list[tuple[str, PromptWork]],
    kept_groups: Groups,
    versions: list[int],
    task: Task,
    broker: GeneratorBroker,
    generator_id: str,
    rewarder: Rewarder | None,
) -> tuple[int, int]:
    """Score finished groups (one batched rewarder call) and stream them, each with its prompt's
    XACK, in one Redis transaction; `versions`: the weights each group started with. Returns
    (samples, tokens) streamed."""
    n_samples = n_tokens = 0
    out: list[tuple[Trajectory, str | None, int]] = []
    rewards = (
        rewarder.score_groups(
            [Item(**w.item) for _, w in claimed], [[s.text for s in kept] for kept in kept_groups]
        )
        if rewarder is not None
        else [None] * len(claimed)
    )
    for (entry_id, work), kept, version, group_rewards in zip(
        claimed, kept_groups, versions, rewards
    ):
        traj = to_trajectory(work, kept, task, generator_id, version, group_rewards)
        out.append((traj, entry_id, work.sample_index))
        n_samples += len(kept)
        n_tokens += sum(len(s.response_ids) for s in kept)
    broker.add_trajectories(out)
    return n_samples, n_tokens


class Generator:
    """One generator process's state; `serve_once` is one turn of the loop in the module doc."""

    def __init__(self, cfg: Config, generator_id: str):
        self.cfg, self.id = cfg, generator_id
        check_engine(cfg)  # before waiting for the run: a missing engine fails at once
        self.task = task_from_config(cfg)  # with reward.functions, if any
        if cfg.rollout.inflight_samples and is_multi_turn(self.task):  # before waiting on Redis
            raise ConfigError(
                f"rollout.inflight_samples: task {cfg.task.name!r} is multi-turn "
                "and runs its own episode runner; set it to 0 (rollout.interrupt "
                "refills that runner)"
            )
        self.broker = GeneratorBroker(
            connect(redis_url(cfg), cfg.redis.connect_timeout_s, cfg.redis.sentinel),
            cfg.run.run_id,
            generator_id,
            cfg.redis.max_payload_bytes,
            busy_timeout_s=cfg.redis.connect_timeout_s,
        )
        # the learner creates the run and admits us (broker/channels/roster.py): we only ask to join
        beat: dict[str, str | int | float] = {"state": "joining"}
        ttl = cfg.rollout.heartbeat_ttl_s
        self.broker.join_run(cfg.fingerprint(), cfg.trainer.wait_timeout_s, beat, ttl)
        self.engine = make_engine(cfg, seed=generator_seed(cfg.run.seed, generator_id))
        self.follower = WeightFollower(
            self.broker,
            version_source(cfg, generator_id, self.broker),
            self.engine,
            attempts=cfg.weights.reload_attempts,
            run_id=cfg.run.run_id,
        )
        self.rewarder = make_rewarder(cfg, self.task)  # reward: rule | model | mixed
        self.counters = Counters()
        self.liveness = Liveness(cfg.rollout)  # heartbeat TTL and reclaim time, scaled
        self.agents = None  # rollout.agent: the endpoint its episodes call
        if cfg.rollout.agent:
            from rollflash.generators.agent_episode import AgentRollout

            self.agents = AgentRollout(cfg, cast(EpisodeEngine, self.engine), self.follower)
        self._wait_while_done(cfg.trainer.wait_timeout_s)

    def _wait_while_done(self, timeout_s: float) -> None:
        """A run whose learner finished says `done` until a learner resuming it (with a larger
        `trainer.total_steps`) starts training: a generator started beside that learner waits
        for it (up to `timeout_s`) instead of stopping at once. A resumed learner publishes a
        new version before it trains, so a new version also ends the wait (a learner with no
        step left may say `done` again before this looks)."""
        if not self.finished():
            return
        log.info("the run is done; waiting up to %.0fs for a learner to extend it", timeout_s)
        deadline = time.monotonic() + timeout_s
        version = self.broker.weights().get("version")
        while self.finished() and time.monotonic() < deadline:
            if self.broker.weights().get("version") != version:
                return
            time.sleep(0.5)

    def heartbeat(self, state: str) -> None:
        writes = self.broker.writes  # acknowledged / indeterminate trajectory writes
        self.liveness.beat(self.follower.loaded_version)
        self.broker.heartbeat(
            {
                "state": state,
                **self.follower.heartbeat_fields(),
                "redis_lost": self.broker.lost["trajectories"],
                "dead_letters": self.broker.dead_lettered,
                "published": writes["acknowledged"],
                "indeterminate": writes["indeterminate"],
                "reward_errors": reward_errors(self.task),
                **self.counters.as_fields(),
                **(self.agents.heartbeat_fields() if self.agents else {}),
            },
            self.liveness.heartbeat_ttl_s,
        )

    def claim(self) -> list[tuple[str, PromptWork]]:
        count = self.cfg.rollout.prompts_per_pull
        # normally empty (a batch is finished before the next claim): non-empty after a restart
        # of this process, or when Redis forgot acknowledgements (restart without fsync)
        own = self.broker.claim_prompts(count, block_ms=0, own_pending=True)
        if own:
            return own
        reclaimed = self.broker.reclaim_prompts(self.liveness.reclaim_idle_ms, count)
        if reclaimed:
            log.warning("took over %d prompts abandoned by another generator", len(reclaimed))
            return reclaimed
        return self.broker.claim_prompts(count, block_ms=1000)

    def serve_once(self) -> None:
        c = self.counters
        self.heartbeat("up")
        self.follower.maybe_reload()
        waited = time.monotonic()
        claimed = self.claim()
        if claimed:
            self.follower.wait_for(
                max(w.issued_version for _, w in claimed),
                self.cfg.trainer.wait_timeout_s,
                self.broker.run_state,
                beat=lambda: self.heartbeat("up"),
            )
        if c.groups:  # idle time counts from the first piece of work, not from start-up
            c.idle_s += time.monotonic() - waited
        if not claimed:
            return
        started = time.monotonic()
        if self.agents is not None:
            beat = lambda: self.heartbeat("up")  # noqa: E731
            samples, tokens = self.agents.rollout(claimed, self.broker, self.id, beat)
        else:
            samples, tokens = rollout_batch(
                claimed,
                self.engine,
                self.task,
                self.cfg,
                self.broker,
                self.id,
                self.follower,
                self.rewarder,
            )
        c.busy_s += time.monotonic() - started
        self.liveness.held(time.monotonic() - waited)
        c.groups += len(claimed)
        c.samples += samples
        c.tokens += tokens

    def finished(self) -> bool:
        return self.broker.run_state() == "done"

    def serve_continuous(self, stop: StopSignals) -> None:
        """Continuous batching (generators/continuous.py) until the run is done or `stop`."""
        c = self.counters

        def beat() -> bool:
            self.heartbeat("up")
            return not (stop.requested or self.finished())

        def stream(
            entry_id: str, work: PromptWork, samples: list[GeneratedSample], version: int
        ) -> None:
            n_samples, n_tokens = stream_groups(
                [(entry_id, work)],
                [samples],
                [version],
                self.task,
                self.broker,
                self.id,
                self.rewarder,
            )
            c.groups += 1
            c.samples += n_samples
            c.tokens += n_tokens

        # config.py refuses continuous batching with the one engine that cannot (hf)
        engine = cast(StreamingEngine, self.engine)
        ContinuousRollout(
            self.cfg, engine, self.follower, self.broker, self.id, stream, beat, c,
            self.liveness, limit=lambda work: response_limit(self.task, work),
        ).run()  # fmt: skip


def reward_errors(task: Task) -> int:
    """Errors counted so far by the `reward.functions` that score `task` (0 if none do)."""
    functions = getattr(task, "functions", None)
    return functions.total_errors if functions else 0


def _redis_trouble(e: Exception) -> bool:
    """Errors to wait out: a lost connection, or Redis refusing writes at maxmemory."""
    return isinstance(e, (redis.ConnectionError, redis.TimeoutError)) or is_oom(e)


def run(cfg: Config, generator_id: str) -> None:
    setup_process(
        f"gen:{generator_id}",
        seed=generator_seed(cfg.run.seed + 1000, generator_id),
        torch_threads=cfg.run.torch_threads,
    )
    stop = StopSignals()
    gen = Generator(cfg, generator_id)
    freeze_heap()  # the engine and the model stay: full collections then skip them
    live = gen.liveness.describe()
    log.info("generator %s ready (engine %s; %s)", generator_id, cfg.rollout.engine, live)

    def turn() -> bool:
        """One turn of the loop; True once the run is done or a stop was requested."""
        if stop.requested or gen.finished():
            return True
        if cfg.rollout.inflight_samples:
            gen.serve_continuous(stop)  # returns when the run is done or on stop
        else:
            gen.serve_once()
        return False

    def give_up(e: Exception, failures: int) -> Exception:
        return BrokerUnavailable(
            f"Redis at {redact(redis_url(cfg))} unusable for {cfg.redis.connect_timeout_s:.0f}s: {e}"
        )

    try:
        # claimed prompts stay pending and are re-read (or reclaimed) once Redis is back
        while not retry_until(
            turn,
            timeout_s=cfg.redis.connect_timeout_s,
            retry_if=_redis_trouble,
            give_up=give_up,
            warn="Redis trouble (%s); retrying in %.1fs",
            logger=log,
        ):
            pass
        gen.heartbeat("stopped")
    finally:  # a quarantine too: the weights thread is joined, never killed inside torch
        thaw_heap()
        gen.follower.close()
        if gen.agents is not None:
            gen.agents.close()
    log.info("generator %s stopped: %s", generator_id, gen.counters.as_fields())
