"""`rollctl run`: the whole system on one machine.

Checks what can be checked in seconds before anything starts (rollctl/preflight.py), then starts
a private redis-server on a unix socket under the run directory (unless a Redis URL is given),
then the learner and N generators as child processes of this one, watched to the learner's end
(rollctl/supervise.py: each child in a process group of its own and killed if this process dies,
a generator that dies restarted, the lease of a learner that died freed). On Ctrl-C or SIGTERM
the learner stops at a step boundary, checkpointed, the generators stop, and Redis is stopped
last; one line says so, and the exit code is 128 + the signal's number (130, 143). A second
Ctrl-C stops the learner at once.

The embedded server keeps the run's Redis data across a clean stop (`{run_dir}/redis/dump.rdb`,
broker/connect/redis_server.py): `rollctl status`, `inspect` and `redis-cli` read a finished run from it
(rollctl/find.py), and the next `rollctl run` of the run directory, which resumes or extends the
run, starts from it. A config whose `redis.url` is the run's own embedded server (the run.yaml
this command writes) starts it again too.

Each process logs to `{run_dir}/logs/{name}.log`; the log of an earlier process of the same name is
moved to `{name}.log.1` (and so on, `KEEP_LOGS` of them), so the learner log echoed here is the new
process's alone.

The layout (the CPU rule of rollctl/cpu_layout.py, or each child's GPUs from `placement.gpus`
through CUDA_VISIBLE_DEVICES, broker/config/placement.py) is printed at start; `rollctl run --dry-run`
prints it without starting anything.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import redis

from rollflash.broker.config.config import Config
from rollflash.broker.config.placement import plan_layout
from rollflash.broker.connect.redis_server import EmbeddedRedis, RedisServerError
from rollflash.broker.connect.secrets import (
    PASSWORD_ENV,
    TOKEN_ENV,
    make_private_dir,
    private_subdir,
    url_password,
)
from rollflash.learner.process.stop import signal_name
from rollflash.rollctl.cli_base import (  # noqa: F401 (EXIT_INTERRUPTED, EXIT_RUN_FATAL: the API's)
    EXIT_DISK_FULL,
    EXIT_INTERRUPTED,
    EXIT_RUN_FATAL,
    disk_full_line,
)
from rollflash.rollctl.cpu_layout import cpu_layout, omp_threads, usable_cores
from rollflash.rollctl.find import is_embedded
from rollflash.rollctl.preflight import PREFLIGHT_DONE_ENV, preflight
from rollflash.rollctl.supervise import (
    KEEP_LOGS,  # noqa: F401 (the module docstring's)
    RunInterrupted,
    Supervisor,
    describe_exit,
    restore_signals,
    signals_to,
    tail,
)


@dataclass(frozen=True)
class Child:
    name: str  # learner, gen-0, gen-1, ...
    args: list[str]  # of `rollctl`
    cuda_visible_devices: str | None  # None: inherited
    omp_threads: str | None = None  # OMP_NUM_THREADS (rollctl/cpu_layout.py); None: inherited


@dataclass(frozen=True)
class Plan:
    children: list[Child]
    layout: str  # one line: the CPU or GPU layout, as printed at start and by --dry-run


def plan_run(cfg: Config, config_path: Path, take_over: bool = False) -> Plan:
    """The processes `rollctl run` starts, with the GPUs `placement:` gives each
    (broker/config/placement.py) or, on a CPU run, the generator count and threads the machine's cores
    allow (rollctl/cpu_layout.py). Sets `rollout.num_rollout_workers` where the config leaves
    it open, so it is planned once. `take_over`: the learner starts with --take-over."""
    layout = plan_layout(cfg.placement, cfg.rollout, cfg.trainer)
    cpu = cpu_layout(cfg) if layout is None else None
    n = cfg.rollout.num_rollout_workers
    if layout is not None:
        line = (
            f"layout: GPUs {','.join([*layout.learner, *(g for gen in layout.generators for g in gen)])}"
            f": the learner {layout.learner_env() or '(none)'}, {n} generator(s) "
            "(broker/config/placement.py)"
        )
    elif cpu is not None:
        line = f"layout: {usable_cores()} cores: {cpu.describe()} (rollctl/cpu_layout.py)"
    else:
        threads = cfg.run.torch_threads or "torch's default"
        line = (
            f"layout: the learner and {n} {cfg.rollout.engine} generator(s), devices as "
            f"trainer.device / rollout.device say, threads {threads}"
        )
    common = ["--config", str(config_path)]
    children = [
        Child(
            "learner",
            ["start-learner", *common, *(["--take-over"] if take_over else [])],
            layout.learner_env() if layout else None,
            omp_threads(cfg, cpu, learner=True),
        )
    ]
    for i in range(n):
        children.append(
            Child(
                f"gen-{i}",
                ["start-generator", *common, "--id", f"gen-{i}"],
                layout.generator_env(i) if layout else None,
                omp_threads(cfg, cpu, learner=False),
            )
        )
    return Plan(children, line)


def describe(plan: Plan) -> list[str]:
    """The layout line, then one line per process: its GPUs, its threads and its command."""
    lines = [plan.layout]
    for c in plan.children:
        gpus = "(inherited)" if c.cuda_visible_devices is None else c.cuda_visible_devices or "-"
        threads = f"OMP_NUM_THREADS={c.omp_threads} " if c.omp_threads else ""
        lines.append(
            f"{c.name:<8} CUDA_VISIBLE_DEVICES={gpus:<12} {threads}rollctl {' '.join(c.args)}"
        )
    return lines


def describe_children(cfg: Config, config_path: Path) -> list[str]:
    """`rollctl run --dry-run`: the layout, and each process's GPUs and command."""
    return describe(plan_run(cfg, config_path))


def child_env(base: dict[str, str], child: Child) -> dict[str, str]:
    env = dict(base)
    if child.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = child.cuda_visible_devices
    if child.omp_threads is not None:
        env["OMP_NUM_THREADS"] = child.omp_threads
    return env


def start_embedded(run_dir: Path) -> EmbeddedRedis:
    """The run's own redis-server (module docstring), loaded from the snapshot its last clean stop
    left; refuses a run directory whose server still answers (another `rollctl run` of it)."""
    from rollflash.rollctl.find import answers, record_embedded

    server = EmbeddedRedis(run_dir / "redis", snapshot=True)
    if answers(server.url):
        raise RedisServerError(
            f"{run_dir}: another rollctl run of this run directory is running (its Redis "
            f"answers at {server.url}); stop it first, or choose another run.run_dir"
        )
    server.start()
    record_embedded(run_dir, server.url)
    return server


def run_local(
    cfg: Config,
    echo: bool = True,
    extra_env: dict[str, str] | None = None,
    take_over: bool = False,
) -> int:
    """Run learner + generators to the end of training (module docstring); returns the exit
    code of `rollctl run`: the learner's (128 + N when signal N ended it), or 128 + N after this
    process was stopped by signal N, with one line saying so. `echo` prints the layout,
    streams the learner's log and prints the summary; `extra_env` goes to every child;
    `take_over`: the learner takes the run's lease from a learner the caller knows is dead
    (broker/channels/lease.py)."""
    preflight(cfg, ("learner", "generator"), extra_env or {})  # before anything starts
    run_dir = Path(cfg.run.run_dir)
    make_private_dir(run_dir)
    logs = private_subdir(run_dir / "logs")
    server: EmbeddedRedis | None = None
    sup = Supervisor(echo)
    asked: list[int] = []  # the signals that asked this process to stop
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        asked.append(signum)
        if len(asked) == 1 and not stopping:
            raise RunInterrupted(signum)
        sup.interrupt_again()  # while stopping: the learner stops at once

    previous = signals_to(on_signal)
    try:
        if not cfg.redis.url or is_embedded(run_dir, cfg.redis.url):
            server = start_embedded(run_dir)
            cfg.redis.url = server.url
        config_path = run_dir / "run.yaml"
        plan = plan_run(cfg, config_path, take_over)  # may set rollout.num_rollout_workers
        cfg.save(config_path)  # without the Redis password: the children get it in their env
        if echo:
            print("\n".join(describe(plan)), flush=True)
        env = _children_env(cfg, extra_env)
        sup.start([(c.name, c.args, child_env(env, c)) for c in plan.children], logs)
        code = sup.watch(run_dir, cfg.trainer.total_steps)
        _report(cfg, sup, code, logs, echo)
    except RunInterrupted as e:
        asked[:1] = [e.signum]
        code = 128 + e.signum
    finally:
        stopping = True
        sup.stop()
        if sup.procs and (sup.learner.popen.returncode or 0) < 0:  # killed: it could not
            free_lease(cfg, sup.learner.popen.pid)
        if server is not None:
            server.stop()
        restore_signals(previous)
    if asked:
        _say_stopped(asked[0], len(sup.generators))
    return code


def _say_stopped(signum: int, generators: int) -> None:
    how = "interrupted" if signum == signal.SIGINT else f"stopped by {signal_name(signum)}"
    print(
        f"rollctl: {how}; stopped the learner and {generators} generator(s) (the same command "
        "resumes the run)",
        file=sys.stderr,
        flush=True,
    )


def _children_env(cfg: Config, extra_env: dict[str, str] | None) -> dict[str, str]:
    """What every child's environment holds: this one's, `extra_env`, the Redis password (never
    written to the run directory) and, for `weights.transport: http`, the run's weights token."""
    env = {k: v for k, v in os.environ.items() if k != PASSWORD_ENV} | (extra_env or {})
    env[PREFLIGHT_DONE_ENV] = "1"  # checked here, once
    password = url_password(cfg.redis.url or "")
    if password:
        env[PASSWORD_ENV] = password
    if cfg.weights.transport == "http" and not cfg.weights.token_file and TOKEN_ENV not in env:
        env[TOKEN_ENV] = secrets.token_urlsafe(32)  # the weights' token, for this run
    return env


def free_lease(cfg: Config, learner_pid: int) -> None:
    """The learner this process started has exited: free the run's lease if it still holds it
    (killed, it could not; broker/channels/lease.py `release_dead`), so the next start need not wait."""
    from rollflash.broker.channels.lease import release_dead
    from rollflash.broker.connect.connection import BrokerUnavailable, connect
    from rollflash.broker.connect.redis_io import RunRedis

    try:
        io = RunRedis(connect(cfg.redis.url or "", 2.0, cfg.redis.sentinel), cfg.run.run_id)
        if release_dead(io, learner_pid):
            print(
                f"freed the run's lease held by the learner (pid {learner_pid}), which died",
                flush=True,
            )
    except (BrokerUnavailable, redis.RedisError) as e:  # it expires by itself
        print(
            f"could not free the lease of the learner that died: {e}", file=sys.stderr, flush=True
        )


def _report(cfg: Config, sup: Supervisor, code: int, logs: Path, echo: bool) -> None:
    """The summary after a learner that finished, or one line on one that did not."""
    summary = Path(cfg.run.run_dir) / "summary.json"
    returncode = sup.learner.popen.returncode
    if echo and code == 0 and summary.is_file():
        print(json.dumps(json.loads(summary.read_text())), flush=True)
    elif code != 0 and returncode is not None and returncode < 0:
        print(
            f"the learner {describe_exit(returncode)}; the same command resumes the run "
            "from its last checkpoint",
            file=sys.stderr,
            flush=True,
        )
    elif code == EXIT_DISK_FULL:  # its own line may not have reached its log on that disk
        print(f"learner exited with {code}: {disk_full_line('')}", file=sys.stderr, flush=True)
    elif code != 0 and returncode is not None:
        print(  # its last line: a start-up error is one line (a bad row, a missing model)
            f"learner exited with {code}: {tail(logs / 'learner.log', 1)}; "
            f"see {logs / 'learner.log'}",
            file=sys.stderr,
            flush=True,
        )
