"""Building one learner rank: the parts `start` wires together, each from its own builder.

dist       = init_dist(trainer.device)                # rank, world size, this rank's device
broker     = connect_broker(cfg, dist)                # Redis: the lease first, then the run
models     = build_models(cfg, dist)                  # on the device, wrapped (learner/load.py)
  (with model.lora the policy is the base wrapped with peft adapters: learner/lora.py)
optim      = build_optim(cfg, models)                 # AdamW + lr schedule (LoRA: adapters only)
state      = resume_state(cfg, dist, models, optim, checkpoint)  # the checkpoint's tensors, RNG
collector  = build_collector(cfg, dist, broker, task, state, vocab_size)
then: publish v0, or resume after the checkpoint (learner/checkpoint.py)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rollflash.algos import RunningRewardNorm
from rollflash.broker.config import Config
from rollflash.broker.learner_side import LearnerBroker
from rollflash.envs import Task, task_from_config, train_stream
from rollflash.envs.chat import PromptFormatter, format_task
from rollflash.errors import MissingFile
from rollflash.learner.admission import Admission
from rollflash.learner.best import BestVersion
from rollflash.learner.checkpoint import (
    CheckpointStore,
    LearnerState,
    restore_rng,
    resume_after,
)
from rollflash.learner.checkpoint_io import Trainables
from rollflash.learner.collect import Collector
from rollflash.learner.device import adamw, cuda_defaults, set_alloc_conf, startup_line
from rollflash.learner.dist import Dist, init_dist
from rollflash.learner.drops import RankProgress
from rollflash.learner.evaluator import Evaluator
from rollflash.learner.filters import drop_reason
from rollflash.learner.guards import GuardMonitor
from rollflash.learner.history import History
from rollflash.learner.ledger import Ledger
from rollflash.learner.lora import trainable_parameters
from rollflash.learner.metrics import MetricsSink, open_sink
from rollflash.learner.policy import load_policy
from rollflash.learner.prepare import AlgoModels, build_algo_models
from rollflash.learner.publish import Publisher, publish
from rollflash.learner.schedule import warmup_decay
from rollflash.learner.simulated import SimulatedPolicy

log = logging.getLogger(__name__)


@dataclass
class Models:
    policy: torch.nn.Module  # the Hugging Face model (or SimulatedPolicy with sim.learner_step_s)
    model: torch.nn.Module  # what the ranks train: DDP around `policy`, or `policy` (FSDP: sharded)
    tokenizer: Any  # None for the simulated policy
    algo: AlgoModels  # reference, critic, running reward statistics (learner/prepare.py)

    @property
    def vocab_size(self) -> int:
        config: Any = self.policy.config
        return int(config.vocab_size)


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
    models: Models
    optim: Optim
    collector: Collector
    checkpoints: CheckpointStore
    state: LearnerState
    guard: GuardMonitor  # reward-hacking guards, adaptive kl_coef (learner/guards.py)
    evaluator: Evaluator  # held-out evaluation between steps (learner/evaluator.py)
    publisher: Publisher | None  # rank 0 only
    sink: MetricsSink | None  # rank 0 only
    ledger: Ledger  # every entry trained or dropped, durably before it is acknowledged
    best: BestVersion | None = None  # rank 0 with eval.keep_best (learner/best.py)
    history: History = field(default_factory=History)  # the summary's figures (checkpointed)

    @property
    def progress(self) -> RankProgress:
        """This rank's entries trained since the last checkpoint (not yet acknowledged)."""
        return self.collector.progress

    @property
    def simulated(self) -> bool:
        return isinstance(self.models.policy, SimulatedPolicy)

    def close(self) -> None:
        self.ledger.close()
        if self.sink is not None:
            self.sink.close()
        if self.publisher is not None:
            self.publisher.close()
        if self.dist.is_main:
            self.broker.release()  # the run's lease: a successor may start at once
        self.dist.close()


def connect_broker(cfg: Config, dist: Dist, take_over: bool = False) -> LearnerBroker:
    """The run's broker: rank 0 takes the run's lease before anything is written (another
    learner's holds: `LeaseHeld`), every rank fences its writes with it; then the consumer
    groups and this run are registered (refused if Redis holds another run's schema or came
    back empty)."""
    broker = LearnerBroker.for_config(cfg)
    token = broker.take_lease(take_over) if dist.is_main else None
    broker.use_lease(dist.gather(token)[0])
    if dist.is_main:  # the others once it exists: two ranks creating one group collide
        broker.ensure_groups()  # before registering: generators wait for the registration
        broker.register_run(cfg.fingerprint())
    dist.gather(None)
    if not dist.is_main:
        broker.register_run(cfg.fingerprint())  # the run's MAC key, made by rank 0
    broker.check_intact()  # a Redis that came back empty is reported, never silently re-created
    if dist.is_main:  # one witness of forgotten trajectory writes per run, not one per rank
        broker.track_trajectory_writes()
    return broker


def build_models(cfg: Config, dist: Dist) -> Models:
    """The policy wrapped for the ranks and the algorithm's models, on this rank's device."""
    if cfg.sim.learner_step_s > 0:
        simulated = SimulatedPolicy(cfg.sim).to(dist.device)
        return Models(simulated, simulated, None, AlgoModels())
    model, tokenizer = load_policy(cfg, dist)
    policy: torch.nn.Module = getattr(model, "module", model)
    return Models(policy, model, tokenizer, build_algo_models(cfg, dist, policy))


def build_optim(cfg: Config, models: Models) -> Optim:
    """AdamW on the policy's trainable (float32, possibly sharded) parameters, all of them or
    a LoRA policy's adapters, with the warm-up/decay schedule (learner/schedule.py)."""
    t = cfg.trainer
    optimizer = adamw(trainable_parameters(models.model), t.actor_lr, t.weight_decay)
    schedule = warmup_decay(t.lr_warmup_steps, t.total_steps, t.lr_schedule)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return Optim(optimizer, scheduler)


def resume_state(cfg: Config, dist: Dist, models: Models, optim: Optim, ckpt: Path) -> LearnerState:
    """Load the checkpoint into the models and optimisers (collective); restore the scheduler,
    the running reward statistics and this rank's RNG; return the checkpoint's state."""
    state = CheckpointStore.load(ckpt, Trainables.of(models, optim))
    if state.scheduler:
        optim.scheduler.load_state_dict(state.scheduler)
    models.algo.reward_norm = RunningRewardNorm(**state.reward_norm)
    restore_rng(state.rng, dist.rank)
    return state


def rebase_admission(broker: LearnerBroker, state: LearnerState, batch_size: int) -> int:
    """Make the run hash's admission counters hold what a resumed learner must continue from;
    returns how many groups it credits as lost (learner/admission.py).

    Redis holds `issued` and `replaced` exactly, and every prompt issued is still in it (in a
    stream, or trained by a step the crash lost, then pending to the learner and trained again),
    unless Redis itself is new or older than the checkpoint: `rollctl run` starts its embedded
    Redis afresh, and a Redis restarted from an old snapshot forgets its tail. Then the prompts
    issued after what Redis remembers are gone, and so are the groups they would have become;
    without a credit the resumed learner would believe them in flight and issue that many fewer,
    losing its asynchrony for the rest of the run. They are credited as replaced groups (at most
    the checkpoint's prompts in flight, issued - step x B - replaced), so the first step after
    resume has async_ratio x B prompts ahead, as on a fresh run."""
    run = broker.run_fields()
    redis_issued, redis_replaced = int(run.get("issued", 0)), int(run.get("replaced", 0))
    in_flight = state.issued - state.step * batch_size - state.replaced
    lost = max(0, min(state.issued - redis_issued, in_flight))
    credit = max(0, state.replaced - redis_replaced) + lost
    if credit:
        broker.count_in_run("replaced", credit)
    if lost:
        log.warning(
            "Redis holds %d of the %d prompts the checkpoint issued: %d groups in flight are "
            "lost and issued again",
            redis_issued,
            state.issued,
            lost,
        )
    return lost


def build_collector(
    cfg: Config, dist: Dist, broker: LearnerBroker, task: Task, state: LearnerState, vocab: int
) -> Collector:
    """Admission (continuing the run's prompt count) and the collector, with the consumed ids
    of the checkpoint."""
    if dist.is_main:
        rebase_admission(broker, state, cfg.trainer.rollout_batch_size)
    dist.barrier()
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


def start(cfg: Config, resume: bool | None = None, take_over: bool = False) -> Learner:
    """Build this rank's learner. `resume`: None resumes when a checkpoint exists, True requires
    one, False refuses to start over an earlier run's weights; `take_over`: take the run's lease
    from a dead learner (broker/lease.py)."""
    alloc = set_alloc_conf(cfg.trainer.cuda_alloc_conf)  # before CUDA allocates anything
    dist = init_dist(cfg.trainer.device, cfg.trainer.dist_timeout_s)
    cuda_defaults(dist.device, cfg.trainer.tf32)
    run_dir = Path(cfg.run.run_dir)
    broker = connect_broker(cfg, dist, take_over)  # before any write: one learner per run
    if dist.is_main:
        cfg.save(run_dir / "config.yaml")
    checkpoints = CheckpointStore(run_dir)
    ckpt = None if resume is False else checkpoints.latest()
    if resume and ckpt is None:
        raise MissingFile(f"--resume: no learner checkpoint in {checkpoints.root}")
    models = build_models(cfg, dist)
    log.info(startup_line(cfg, dist.rank, dist.world_size, dist.device, models.policy, alloc))
    # prompts are rendered (chat template) here, once, before they are issued: envs/chat.py;
    # an agent program gets its items raw and the endpoint renders its messages
    task = task_from_config(cfg)
    if not cfg.rollout.agent:
        task = format_task(task, PromptFormatter(models.tokenizer, cfg.model.chat_template))
    optim = build_optim(cfg, models)
    state = LearnerState() if ckpt is None else resume_state(cfg, dist, models, optim, ckpt)
    collector = build_collector(cfg, dist, broker, task, state, models.vocab_size)
    main = dist.is_main
    ledger = Ledger(
        run_dir / ("ledger.jsonl" if main else f"ledger.rank{dist.rank}.jsonl"),
        fence=broker.check_lease,  # no record from a learner that lost the run
    )
    collector.ledger, collector.lost = ledger, broker.lost_prompts if main else None
    # the held-out rows are read (and checked: a bad row stops here) before anything is logged
    heldout = task.heldout_items()[: cfg.eval.size or None]
    sink = open_sink(cfg, state.trackers) if main else None
    p = models.policy
    ln = Learner(
        cfg=cfg,
        dist=dist,
        broker=broker,
        task=task,
        models=models,
        optim=optim,
        collector=collector,
        checkpoints=checkpoints,
        state=state,
        guard=GuardMonitor(cfg),
        evaluator=Evaluator(cfg, dist, task, heldout, p, models.model, models.tokenizer, sink),
        publisher=Publisher(cfg, broker, resuming=ckpt is not None) if main else None,
        sink=sink,
        ledger=ledger,
        best=BestVersion(run_dir) if main and cfg.eval.keep_best else None,
        history=History.from_json(state.history),
    )
    if ckpt is None:
        publish(ln, version=0, step=0)
    else:
        ln.guard.load_state_dict(state.guards)  # adaptive kl_coef and guard streaks, resumed
        resume_after(ln, ckpt)
    dist.barrier()
    return ln
