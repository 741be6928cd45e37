"""Building one learner rank: the parts `start` wires together, each from its own builder.

hooks      = hooks_from_env(os.environ)               # a fault test's hooks (learner/process/hooks.py)
dist       = init_dist(trainer.device)                # rank, world size, this rank's device
broker     = connect_broker(cfg, dist)                # Redis: the lease first, then the run
models     = build_models(cfg, dist)                  # on the device, wrapped (learner/models/load.py)
  (with model.lora the policy is the base wrapped with peft adapters: learner/models/lora.py)
optim      = build_optim(cfg, models)                 # AdamW + lr schedule (LoRA: adapters only)
state      = resume_state(cfg, dist, models, optim, checkpoint)  # the checkpoint's tensors, RNG
ledger     = Ledger(run_dir / "ledger.jsonl", ...)     # every entry's fate (learner/durability/ledger.py)
collector  = build_collector(cfg, dist, broker, task, state, models, ledger, hooks)
then: publish v0, or resume after the checkpoint, or restart from the initial weights when an
earlier learner published weights but wrote no checkpoint (learner/durability/checkpoint.py)
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from rollflash.algos import RunningRewardNorm
from rollflash.broker.config.config import Config
from rollflash.broker.config.model_dir import tokenizer_if_present
from rollflash.broker.sides.learner_side import LearnerBroker
from rollflash.broker.weights.weights import WeightStore
from rollflash.envs import Task, is_multi_turn, task_from_config, train_stream
from rollflash.envs.chat import PromptFormatter, format_task, prompt_encoder
from rollflash.errors import MissingFile
from rollflash.learner.durability.checkpoint import CheckpointStore, LearnerState, restore_rng
from rollflash.learner.durability.checkpoint_io import Trainables
from rollflash.learner.durability.ledger import Ledger
from rollflash.learner.durability.publish import Publisher, refuse_earlier_weights
from rollflash.learner.evaluation.best import BestVersion
from rollflash.learner.evaluation.evaluator import Evaluator
from rollflash.learner.intake.admission import Admission
from rollflash.learner.intake.collect import Collector
from rollflash.learner.metrics.guards import GuardMonitor
from rollflash.learner.metrics.history import History
from rollflash.learner.metrics.metrics import open_sink
from rollflash.learner.models.lora import trainable_parameters
from rollflash.learner.models.policy import load_policy
from rollflash.learner.models.schedule import warmup_decay
from rollflash.learner.models.simulated import SimulatedPolicy
from rollflash.learner.process.device import adamw, cuda_defaults, set_alloc_conf, startup_line
from rollflash.learner.process.dist import Dist, init_dist
from rollflash.learner.process.hooks import FaultHooks, hooks_from_env
from rollflash.learner.rank import Learner, Models, Optim, resume_after
from rollflash.learner.step.filters import ScoreSpec, drop_reason
from rollflash.learner.step.prepare import AlgoModels, build_algo_models
from rollflash.learner.step.train import train_step

log = logging.getLogger(__name__)


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
        return Models(simulated, simulated, None, AlgoModels(), simulated.train_step)
    model, tokenizer = load_policy(cfg, dist)
    policy: torch.nn.Module = getattr(model, "module", model)
    return Models(policy, model, tokenizer, build_algo_models(cfg, dist, policy), train_step)


def build_optim(cfg: Config, models: Models) -> Optim:
    """AdamW on the policy's trainable (float32, possibly sharded) parameters, all of them or
    a LoRA policy's adapters, with the warm-up/decay schedule (learner/models/schedule.py)."""
    trainer = cfg.trainer
    optimizer = adamw(trainable_parameters(models.model), trainer.actor_lr, trainer.weight_decay)
    schedule = warmup_decay(trainer.lr_warmup_steps, trainer.total_steps, trainer.lr_schedule)
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
    returns how many groups it credits as lost (learner/intake/admission.py).

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


def prompt_ids(cfg: Config, models: Models, task: Task) -> Callable[[str], list[int]] | None:
    """How rank 0 derives the token ids of the prompts it issues, which their MAC signs
    (broker/channels/provenance.py): as every engine encodes them (envs/chat.py `prompt_encoder`); the
    simulated policy has no tokenizer and uses the one the simulated engine does. None with
    `rollout.agent`: an agent program composes its own prompts."""
    if cfg.rollout.agent:
        return None
    tokenizer = models.tokenizer
    if isinstance(models.policy, SimulatedPolicy):
        tokenizer = tokenizer_if_present(cfg.model.path, cfg.model.trust_remote_code)
    return prompt_encoder(tokenizer, is_multi_turn(task), models.vocab_size)


def build_collector(
    cfg: Config,
    dist: Dist,
    broker: LearnerBroker,
    task: Task,
    state: LearnerState,
    models: Models,
    ledger: Ledger,
    hooks: FaultHooks,
) -> Collector:
    """Admission (continuing the run's prompt count; rank 0 issues prompts with their token
    ids) and the collector, with the consumed ids of the checkpoint; rank 0's also checks for
    lost prompts (broker/channels/inflight.py)."""
    if dist.is_main:
        rebase_admission(broker, state, cfg.trainer.rollout_batch_size)
    dist.barrier()
    run = broker.run_fields()
    state.issued = max(state.issued, int(run.get("issued", 0)))  # Redis is exact; see admission
    rollout, trainer = cfg.rollout, cfg.trainer
    replicas = rollout.num_return_sequences + rollout.redundant_samples
    admission = Admission(
        train_stream(task, cfg.run.seed, state.issued),
        trainer.rollout_batch_size,
        trainer.async_ratio,
        rollout.num_return_sequences,
        issued=state.issued,
        replicas=replicas if rollout.replicate_prompts else 0,
        prompt_ids=prompt_ids(cfg, models, task) if dist.is_main else None,
    )
    collector = Collector(
        broker,
        admission,
        rollout.num_return_sequences,
        models.vocab_size,
        trainer.max_staleness,
        trainer.wait_timeout_s,
        drop=functools.partial(drop_reason, spec=ScoreSpec.of(cfg)),
        dist=dist,
        lineage=state.lineage,
        ledger=ledger,
        lost=broker.lost_prompts if dist.is_main else None,
        max_overdue=trainer.max_overdue_staleness,
        hooks=hooks,
    )
    collector.restore(state.seen)
    return collector


def open_ledger(run_dir: Path, dist: Dist, broker: LearnerBroker, hooks: FaultHooks) -> Ledger:
    """This rank's ledger; no record from a learner that lost the run (its lease: `fence`)."""
    name = "ledger.jsonl" if dist.is_main else f"ledger.rank{dist.rank}.jsonl"
    return Ledger(run_dir / name, fence=broker.check_lease, hooks=hooks)


def resume_point(
    cfg: Config, dist: Dist, checkpoints: CheckpointStore, resume: bool | None
) -> tuple[Path | None, bool]:
    """(the checkpoint to resume from, whether this learner continues an earlier one). An
    earlier learner left a checkpoint, or only published weights: killed before its first
    checkpoint, it made nothing durable (its entries are acknowledged only by a checkpoint), so
    the run restarts from the initial weights at step 0, continuing its versions and Redis's
    prompts (learner/rank.py `resume_after`). Rank 0 decides (the store is its)."""
    if resume is False and dist.is_main:
        refuse_earlier_weights(cfg.run.run_dir)  # before anything of theirs is touched
    ckpt = None if resume is False else checkpoints.latest()
    published = (
        dist.is_main and resume is not False and bool(WeightStore(cfg.run.run_dir).versions())
    )
    restart = bool(dist.gather(ckpt is not None or published)[0])
    if resume and not restart:
        raise MissingFile(
            f"--resume: nothing to resume in {cfg.run.run_dir} (no learner checkpoint in "
            f"{checkpoints.root}, no published weights)"
        )
    return ckpt, restart


def start(cfg: Config, resume: bool | None = None, take_over: bool = False) -> Learner:
    """Build this rank's learner. `resume`: None resumes when an earlier learner of the run
    left a checkpoint or published weights (`resume_point`), True requires that, False refuses
    to start over an earlier run's weights; `take_over`: take the run's lease from a dead
    learner (broker/channels/lease.py)."""
    hooks = hooks_from_env(os.environ)
    alloc = set_alloc_conf(cfg.trainer.cuda_alloc_conf)  # before CUDA allocates anything
    dist = init_dist(cfg.trainer.device, cfg.trainer.dist_timeout_s)
    cuda_defaults(dist.device, cfg.trainer.tf32)
    run_dir = Path(cfg.run.run_dir)
    broker = connect_broker(cfg, dist, take_over)  # before any write: one learner per run
    if dist.is_main:
        cfg.save(run_dir / "config.yaml")
    hooks.at("after_lease", 0)
    checkpoints = CheckpointStore(run_dir)
    ckpt, restart = resume_point(cfg, dist, checkpoints, resume)
    models = build_models(cfg, dist)
    log.info(startup_line(cfg, dist.rank, dist.world_size, dist.device, models.policy, alloc))
    # prompts are rendered (chat template) here, once, before they are issued: envs/chat.py;
    # an agent program gets its items raw and the endpoint renders its messages
    task = task_from_config(cfg)
    if not cfg.rollout.agent:
        task = format_task(task, PromptFormatter(models.tokenizer, cfg.model.chat_template))
    optim = build_optim(cfg, models)
    state = LearnerState() if ckpt is None else resume_state(cfg, dist, models, optim, ckpt)
    main = dist.is_main
    ledger = open_ledger(run_dir, dist, broker, hooks)
    collector = build_collector(cfg, dist, broker, task, state, models, ledger, hooks)
    # the held-out rows are read (and checked: a bad row stops here) before anything is logged
    heldout = task.heldout_items()[: cfg.eval.size or None]
    sink = open_sink(cfg, state.trackers, state.step) if main else None
    policy, tokenizer = models.policy, models.tokenizer
    keep_best = main and cfg.eval.keep_best and models.has_weights
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
        evaluator=Evaluator(cfg, dist, task, heldout, policy, models.model, tokenizer, sink),
        publisher=Publisher(cfg, broker, resuming=restart) if main else None,
        sink=sink,
        ledger=ledger,
        hooks=hooks,
        best=BestVersion(run_dir) if keep_best else None,
        history=History.from_json(state.history),
    )
    first_version(ln, ckpt, restart)
    hooks.at("after_start", state.step)
    dist.barrier()
    return ln


def first_version(ln: Learner, ckpt: Path | None, restart: bool) -> None:
    """Publish v0 on a fresh run; else continue the earlier learner's run after its
    checkpoint, or from the initial weights without one (learner/durability/checkpoint.py)."""
    if not restart:
        ln.publish(version=0, step=0)
        return
    if ckpt is not None:
        ln.guard.load_state_dict(ln.state.guards)  # adaptive kl_coef and guard streaks, resumed
    resume_after(ln, ckpt)
