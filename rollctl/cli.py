"""`rollctl`: the command line. Each command parses, sets up, and calls one function.

Heavy imports (torch, transformers) happen inside the commands so that `rollctl --help` is instant.
The app, the shared options and the error handling are in rollctl/cli_base.py; the commands a person
runs beside a run (status, inspect, redis-cli) in rollctl/operate.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from rollflash.rollctl.cli_base import (
    ConfigOpt,
    RedisOpt,
    SetOpt,
    app,
    config_app,
)
from rollflash.rollctl.cli_base import fail as _fail
from rollflash.rollctl.cli_base import guarded as _guarded
from rollflash.rollctl.cli_base import load as _load
from rollflash.rollctl.cli_base import need_redis as _need_redis
from rollflash.rollctl.preflight import PREFLIGHT_DONE_ENV


@app.command("start-learner")
def start_learner(
    config: Path | None = ConfigOpt,
    set_: list[str] | None = SetOpt,
    redis_url: str | None = RedisOpt,
    nproc: int | None = typer.Option(
        None,
        "--nproc",
        min=1,
        help="Learner ranks on this node (torchrun underneath; default trainer.num_trainer_workers).",
    ),
    nnodes: int = typer.Option(1, "--nnodes", min=1, help="Nodes (torchrun)."),
    rdzv_endpoint: str | None = typer.Option(
        None, "--rdzv-endpoint", help="HOST:PORT of the rendezvous, for --nnodes > 1 (torchrun)."
    ),
    resume: bool | None = typer.Option(
        None,
        "--resume/--no-resume",
        help="Resume from the run's latest checkpoint, or from the initial weights when an "
        "earlier learner published weights but no checkpoint (default: when either exists).",
    ),
    take_over: bool = typer.Option(
        False,
        "--take-over",
        help="Take the run's lease from a learner you know is dead, without waiting for it to "
        "expire (redis.lease_ttl_s). Never while it may still run: both would write the run.",
    ),
) -> None:
    """Run the learner: train, publish weights, checkpoint, write metrics and summary.json.
    One learner per run: a second one stops at once and names the one holding the run."""

    cfg = _load(config, set_, redis_url)
    _need_redis(cfg)
    ranks = nproc or cfg.trainer.num_trainer_workers
    launcher = "LOCAL_RANK" not in os.environ  # not a rank torchrun started
    if launcher:
        _preflight(cfg, "learner")
    if (ranks > 1 or nnodes > 1) and launcher:
        from rollflash.learner.process.launch import torchrun_argv

        if config is not None and not config.is_file():
            _fail(f"--config: {config} is not a file that every rank can read (a pipe?)")
        argv = torchrun_argv(ranks, nnodes, rdzv_endpoint, sys.argv[1:])
        os.environ[PREFLIGHT_DONE_ENV] = "1"  # checked here, once for every rank
        os.execv(argv[0], argv)  # torchrun starts the ranks, each running this command again
    from rollflash import learner
    from rollflash.rollctl.progress import terminal_progress

    bar = terminal_progress(cfg.trainer.total_steps, sys.stderr)  # None off a terminal
    try:
        _guarded(learner.run, cfg, resume, bar.update if bar else None, take_over)
    finally:
        if bar is not None:
            bar.close()


@app.command("start-generator")
def start_generator(
    config: Path | None = ConfigOpt,
    set_: list[str] | None = SetOpt,
    redis_url: str | None = RedisOpt,
    engine: str | None = typer.Option(None, help="hf | vllm | sim (overrides rollout.engine)"),
    generator_id: str | None = typer.Option(
        None, "--id", help="Stable generator name (default: host-pid)."
    ),
    gpus: str | None = typer.Option(
        None,
        "--gpus",
        help="GPU ids for this generator, e.g. 3 or 4,5 (its CUDA_VISIBLE_DEVICES; as many as "
        "rollout.vllm.tensor_parallel_size).",
    ),
) -> None:
    """Run one generator: claim prompts, sample, score, stream trajectories."""
    import socket

    cfg = _load(config, (set_ or []) + ([f"rollout.engine={engine}"] if engine else []), redis_url)
    _need_redis(cfg)
    if gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = _generator_gpus(cfg, gpus)
    _preflight(cfg, "generator")
    from rollflash import generators
    from rollflash.broker.connect.keys import NAME_RULE, valid_name

    gid = generator_id or f"{socket.gethostname()[:50]}-{os.getpid()}"
    if not valid_name(gid):
        _fail(f"--id: {gid[:80]!r} is not {NAME_RULE} (it names the generator's Redis keys)")
    _guarded(generators.run, cfg, gid)


@app.command("start-reward-worker")
def start_reward_worker(
    config: Path | None = ConfigOpt,
    set_: list[str] | None = SetOpt,
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8100, help="Port (reward.judge.url must point here)."),
) -> None:
    """Serve reward.judge.model_path for the `judge` reward (OpenAI-style /v1/completions)."""
    cfg = _load(config, set_ or [], None)
    from rollflash.broker.config.process import setup_process
    from rollflash.generators import judge_server

    setup_process("reward-worker", seed=cfg.run.seed, torch_threads=cfg.run.torch_threads)
    _guarded(judge_server.serve, cfg, host, port)


def _preflight(cfg, role) -> None:
    """The checks before anything starts (rollctl/preflight.py), as one line each."""
    from rollflash.rollctl.preflight import preflight

    _guarded(preflight, cfg, (role,))


def _generator_gpus(cfg, spec: str) -> str:
    """`start-generator --gpus`: the ids as CUDA_VISIBLE_DEVICES, as many as one generator uses."""
    from rollflash.broker.config.config import ConfigError
    from rollflash.broker.config.placement import gpus_per_generator, parse_gpus

    try:
        ids = parse_gpus(spec, key="--gpus")
    except ConfigError as e:
        _fail(str(e))
    need = gpus_per_generator(cfg.rollout)
    if len(ids) != need:
        _fail(
            f"--gpus: {len(ids)} GPUs given, but a {cfg.rollout.engine} generator uses {need} "
            f"(rollout.vllm.tensor_parallel_size {cfg.rollout.vllm.tensor_parallel_size})"
        )
    return ",".join(ids)


@app.command("run")
def run(
    config: Path | None = ConfigOpt,
    set_: list[str] | None = SetOpt,
    redis_url: str | None = RedisOpt,
    generators: int | None = typer.Option(
        None,
        "--generators",
        "-g",
        help="Generator processes (overrides rollout.num_rollout_workers).",
    ),
    engine: str | None = typer.Option(None, help="hf | vllm | sim (overrides rollout.engine)"),
    gpus: str | None = typer.Option(
        None, "--gpus", help="GPU ids to share out, e.g. 0-7 or 0,2,3 (placement.gpus)."
    ),
    learner_gpus: int | None = typer.Option(
        None,
        "--learner-gpus",
        min=0,
        help="The first N GPUs go to the learner, one per rank (placement.learner_gpus).",
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print each process's GPUs and command, start nothing."
    ),
    take_over: bool = typer.Option(
        False,
        "--take-over",
        help="The learner takes the run's lease from a learner you know is dead (a learner this "
        "command started and saw die is freed without it).",
    ),
) -> None:
    """Run everything on this machine: Redis (embedded unless --redis-url), learner, generators.
    Ctrl-C or SIGTERM stops them at a step boundary, checkpointed: the same command resumes."""
    sets = list(set_ or [])
    for key, value in (
        ("rollout.num_rollout_workers", generators),
        ("rollout.engine", engine),
        ("placement.gpus", repr(gpus) if gpus is not None else None),
        ("placement.learner_gpus", learner_gpus),
    ):
        if value is not None:
            sets.append(f"{key}={value}")
    cfg = _load(config, sets, redis_url)
    from rollflash.rollctl.local import describe_children, run_local

    if dry_run:
        for line in describe_children(cfg, Path(cfg.run.run_dir) / "run.yaml"):
            typer.echo(line)
        raise typer.Exit(0)

    code = _guarded(run_local, cfg, True, None, take_over)
    raise typer.Exit(code)


@app.command("train-rm")
def train_rm(config: Path | None = ConfigOpt, set_: list[str] | None = SetOpt) -> None:
    """Train a Bradley-Terry reward model on preference pairs (the `rm:` section); under
    `torchrun --nproc-per-node N -m rollflash.rollctl.cli train-rm ...` on N ranks."""
    import json

    cfg = _load(config, set_, None)
    from rollflash.learner.tools.rm_training import run as train

    summary = _guarded(train, cfg)
    typer.echo(json.dumps(summary))


@app.command("acl")
def acl(
    config: Path | None = ConfigOpt,
    set_: list[str] | None = SetOpt,
    redis_url: str | None = RedisOpt,
    generator: list[str] | None = typer.Option(
        None,
        "--generator",
        help="A generator id (its --id) to make a user for (repeatable); without it, the "
        "learner's user.",
    ),
    password: str | None = typer.Option(None, help="The user's password (default: random)."),
    apply: bool = typer.Option(
        False, "--apply", help="Create the users on --redis-url (needs an admin connection)."
    ),
) -> None:
    """Print (or apply) least-privilege Redis ACL users for this run: the learner's, or one per
    generator, each with what it may do (docs/security.md)."""
    cfg = _load(config, set_, redis_url)
    from rollflash.rollctl.acl import acl_users, apply_users, print_users

    try:
        users = acl_users(cfg.run.run_id, generator or [], password)
    except ValueError as e:
        _fail(str(e))
    if apply:
        _need_redis(cfg)
        _guarded(apply_users, cfg, users)
    print_users(cfg.run.run_id, users, typer.echo)


@app.command("plot")
def plot(
    run_dir: Path = typer.Argument(..., help="A run directory (holds metrics.jsonl)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="PNG (default RUN_DIR/report.png)."),
    compare: list[Path] | None = typer.Option(
        None, "--compare", help="Another run directory drawn on the same panels (repeatable)."
    ),
    smooth: int = typer.Option(
        0, "--smooth", min=0, help="Trailing-mean window in steps (0 = a tenth of the run)."
    ),
) -> None:
    """Draw a run's curves (reward, accuracy, length, staleness, KL, wait, speed) into a PNG."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        _fail("rollctl plot needs matplotlib: pip install -e '.[plot]'")
    from rollflash.rollctl.plot import PlotError, render

    try:
        report = render([run_dir, *(compare or [])], out or run_dir / "report.png", smooth)
    except PlotError as e:
        _fail(str(e))
    typer.echo(f"report: {report.path}")


@config_app.command("show")
def config_show(config: Path | None = ConfigOpt, set_: list[str] | None = SetOpt) -> None:
    """Print the config as YAML: every key with its value and, in a comment, its type, default
    (`*` where the value differs) and doc. Without --config, the defaults."""
    from rollflash.broker.config.config_reference import show_lines

    cfg = _load(config, set_, None)
    for line in show_lines(cfg):
        typer.echo(line)


@config_app.command("schema")
def config_schema() -> None:
    """Print the config's JSON Schema (for editors: YAML completion, hover docs, validation)."""
    import json

    from rollflash.broker.config.config_reference import json_schema

    typer.echo(json.dumps(json_schema(), indent=1))


from rollflash.rollctl import operate  # noqa: E402, F401  (status, inspect, redis-cli, export)


def main() -> None:
    app(prog_name="rollctl")


if __name__ == "__main__":
    main()
