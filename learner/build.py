"""Building one learner rank: the parts `start` wires together, each from its own builder.

dist       = init_dist()                              # torchrun's rank and world size
broker     = connect_broker(cfg, dist)                # Redis: groups, run registration
models, state, optim_states = build_models(cfg, dist, checkpoint)
optim      = build_optim(cfg, models, optim_states)   # AdamW + lr schedule, resumed
  (with model.lora the policy is the base wrapped with adapters: learner/lora.py)
collector  = build_collector(cfg, dist, broker, task, state, vocab_size)
then: publish v0, or resume after the checkpoint (learner/publish.py)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollflash.algos import RunningRewardNorm
from rollflash.broker.config import Config
from rollflash.broker.connection import connect
from rollflash.broker.learner_side import LearnerBroker
from rollflash.broker.wire import WireLimits
from rollflash.envs import Item, Task, is_multi_turn, task_from_config, train_stream
from rollflash.envs.chat import PromptFormatter, format_task
from rollflash.learner.admission import Admission
from rollflash.learner.checkpoint import CheckpointStore, LearnerState, RankProgress, restore_rng
from rollflash.learner.collect import Collector
from rollflash.learner.dist import Dist, init_dist, is_sharded, load_optimizer_state, wrap_model
from rollflash.learner.evaluate import heldout_accuracy, sampled_eval
from rollflash.learner.filters import drop_reason
from rollflash.learner.guards import GuardMonitor
from rollflash.learner.lora import trainable_parameters, with_adapters
from rollflash.learner.metrics import MetricsSink, open_sink
from rollflash.learner.prepare import AlgoModels, build_algo_models
from rollflash.learner.publish import Publisher, publish, resume_after
from rollflash.learner.schedule import warmup_decay
from rollflash.learner.simulated import SimulatedPolicy

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Models:
    policy: torch.nn.Module  # the Hugging Face model (or SimulatedPolicy with sim.learner_step_s)
    model: torch.nn.Module  # what the ranks train: DDP around `policy`, or `policy` (FSDP: sharded)
    tokenizer: Any  # None for the simulated policy
    algo: AlgoModels  # reference, critic, running reward statistics (learner/prepare.py)


@dataclass
class Optim:
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


@dataclass
class Learner:
    """Everything one learner rank holds; built once by `start`."""

    cfg: Config
    dist: Dist
    broker: LearnerBroker
    task: Task
    heldout: list[Item]
    models: Models
    optim: Optim
    collector: Collector
    checkpoints: CheckpointStore
    state: LearnerState
    guard: GuardMonitor  # reward-hacking guards, adaptive kl_coef (learner/guards.py)
    publisher: Publisher | None  # rank 0 only
    sink: MetricsSink | None  # rank 0 only
    ledger: TextIO  # one JSON line per step: the trajectory ids trained or dropped
    progress: RankProgress = field(default_factory=RankProgress)  # trained, not yet acknowledged

    @property
    def simulated(self) -> bool:
        return isinstance(self.models.policy, SimulatedPolicy)

    def evaluate(self) -> float:
        """Greedy held-out accuracy, on rank 0 (with FSDP every rank generates: the shards are
        gathered in every forward pass)."""
        if self.simulated or not (self.dist.is_main or is_sharded(self.models.model)):
            return 0.0
        m, e = self.models, self.cfg.eval
        return heldout_accuracy(
            m.policy,
            m.tokenizer,
            self.task,
            self.heldout,
            e.max_new_tokens or self.cfg.rollout.max_new_tokens,
            threshold=e.threshold,
        )

    def evaluate_sampled(self) -> dict[str, float]:
        """`eval.n_samples` > 0: mean reward, pass@1 and pass@k on the held-out items (rank 0)."""
        m, e = self.models, self.cfg.eval
        if not e.n_samples or self.simulated or not self.dist.is_main:
            return {}
        if is_multi_turn(self.task) or is_sharded(m.model):
            return {}  # episodes have their own success rate; sharded weights need every rank
        return sampled_eval(
            m.policy,
            m.tokenizer,
            self.task,
            self.heldout,
            e.n_samples,
            e.temperature,
            e.max_new_tokens or self.cfg.rollout.max_new_tokens,
            e.threshold,
            seed=self.cfg.run.seed + self.state.step,
        )

    def close(self) -> None:
        self.ledger.close()
        if self.sink is not None:
            self.sink.close()
        if self.publisher is not None:
            self.publisher.close()
        self.dist.close()


def load_policy(cfg: Config) -> tuple[torch.nn.Module, Any]:
    path = Path(cfg.model.path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path: no Hugging Face model directory at {path} "
            "(build one with scripts/make_tiny_model.py)"
        )
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[cfg.model.dtype])
    return model, tokenizer


def connect_broker(cfg: Config, dist: Dist) -> LearnerBroker:
    """The run's broker, with its consumer groups and this run registered (refused if Redis
    holds another run's schema or came back empty)."""
    broker = LearnerBroker(
        connect(cfg.redis.url, cfg.redis.connect_timeout_s),
        cfg.run.run_id,
        cfg.redis.max_payload_bytes,
        limits=WireLimits.for_config(cfg, vocab_size=None),
    )
    broker.ensure_groups()  # before registering: generators wait for the registration
    broker.register_run(cfg.fingerprint())
    broker.check_intact()  # a Redis that came back empty is reported, never silently re-created
    if dist.is_main:  # one witness of forgotten trajectory writes per run, not one per rank
        broker.track_trajectory_writes()
    return broker


def build_models(
    cfg: Config, dist: Dist, ckpt: Path | None
) -> tuple[Models, LearnerState, dict[str, Any] | None]:
    """The policy (with the checkpoint's weights when resuming), wrapped for the ranks, and the
    algorithm's models; returns them with the checkpoint's state and optimiser states."""
    sim = cfg.sim.learner_step_s > 0
    policy, tokenizer = (SimulatedPolicy(cfg.sim), None) if sim else load_policy(cfg)
    if cfg.model.lora is not None and not sim:
        policy = with_adapters(policy, cfg.model.lora)  # learner/lora.py: base frozen
    algo = AlgoModels() if sim else build_algo_models(cfg, policy)
    state, optim_states = LearnerState(), None
    if ckpt is not None:  # weights go in before sharding; optimiser state after
        state, optim_states = CheckpointStore.load(ckpt, policy, algo.critic)
    model = policy if sim else wrap_model(policy, dist, cfg.trainer.strategy)
    if algo.critic is not None and dist.world_size > 1:
        algo.critic = DistributedDataParallel(algo.critic)
    return Models(policy, model, tokenizer, algo), state, optim_states


def build_optim(cfg: Config, models: Models, optim_states: dict[str, Any] | None) -> Optim:
    """AdamW on the policy with the warm-up/decay schedule (learner/schedule.py); the
    checkpoint's optimiser, scheduler and critic-optimiser states when resuming."""
    t = cfg.trainer
    optimizer = torch.optim.AdamW(
        trainable_parameters(models.policy), lr=t.actor_lr, weight_decay=t.weight_decay
    )
    schedule = warmup_decay(t.lr_warmup_steps, t.total_steps, t.lr_schedule)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    if optim_states is not None:
        load_optimizer_state(models.model, optimizer, optim_states["optimizer"])
        scheduler.load_state_dict(optim_states["scheduler"])
        if models.algo.critic_optimizer is not None:
            models.algo.critic_optimizer.load_state_dict(optim_states["critic_optimizer"])
    return Optim(optimizer, scheduler)


def build_collector(
    cfg: Config, dist: Dist, broker: LearnerBroker, task: Task, state: LearnerState, vocab: int
) -> Collector:
    """Admission (continuing the run's prompt count) and the collector, with the consumed ids
    of the checkpoint."""
    run = broker.run_fields()
    state.issued = max(state.issued, int(run.get("issued", 0)))  # Redis is exact; see admission
    r = cfg.rollout
    admission = Admission(
        train_stream(task, cfg.run.seed, state.issued),
        cfg.trainer.rollout_batch_size,
        cfg.trainer.async_ratio,
        r.num_return_sequences,
        issued=state.issued,
        replicas=r.num_return_sequences + r.redundant_samples if r.replicate_prompts else 0,
    )
    collector = Collector(
        broker,
        admission,
        r.num_return_sequences,
        vocab,
        cfg.trainer.max_staleness,
        cfg.trainer.wait_timeout_s,
        drop=lambda g: drop_reason(g, cfg),
        dist=dist,
        lineage=state.lineage,
    )
    collector.restore(state.seen)
    return collector


def start(cfg: Config, resume: bool | None = None) -> Learner:
    """Build this rank's learner. `resume`: None resumes when a checkpoint exists, True requires
    one, False refuses to start over an earlier run's weights."""
    dist = init_dist()
    run_dir = Path(cfg.run.run_dir)
    if dist.is_main:
        cfg.save(run_dir / "config.yaml")
    broker = connect_broker(cfg, dist)
    checkpoints = CheckpointStore(run_dir)
    ckpt = None if resume is False else checkpoints.latest()
    if resume and ckpt is None:
        raise FileNotFoundError(f"--resume: no learner checkpoint in {checkpoints.root}")
    models, state, optim_states = build_models(cfg, dist, ckpt)
    # prompts are rendered (chat template) here, once, before they are issued: envs/chat.py
    task = format_task(
        task_from_config(cfg), PromptFormatter(models.tokenizer, cfg.model.chat_template)
    )
    optim = build_optim(cfg, models, optim_states)
    if ckpt is not None:
        models.algo.reward_norm = RunningRewardNorm(**state.reward_norm)
        restore_rng(state.rng)
    collector = build_collector(cfg, dist, broker, task, state, models.policy.config.vocab_size)
    main = dist.is_main
    ledger = run_dir / ("ledger.jsonl" if main else f"ledger.rank{dist.rank}.jsonl")
    ln = Learner(
        cfg=cfg,
        dist=dist,
        broker=broker,
        task=task,
        heldout=task.heldout_items()[: cfg.task.eval_size or None],
        models=models,
        optim=optim,
        collector=collector,
        checkpoints=checkpoints,
        state=state,
        guard=GuardMonitor(cfg),
        publisher=Publisher(cfg, broker, resuming=ckpt is not None) if main else None,
        sink=open_sink(cfg, state.trackers) if main else None,
        ledger=open(ledger, "a", buffering=1),  # line-buffered: a kill -9 loses no whole line
    )
    ln.guard.load_state_dict(state.guards)  # adaptive kl_coef and guard streaks, resumed
    if ckpt is None:
        publish(ln, version=0, step=0)
    else:
        resume_after(ln, ckpt)
    dist.barrier()
    return ln
