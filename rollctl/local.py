"""`rollctl run`: the whole system on one machine.

Starts a private redis-server on a unix socket under the run directory (unless a Redis URL is
given), then the learner and N generators as child processes of this one. Each child asks the
kernel to SIGKILL it if this process dies (PR_SET_PDEATHSIG; redis-server gets SIGTERM), so even a
`kill -9` of `rollctl run` leaves no orphan. On Ctrl-C, or when the learner exits, the generators
get SIGTERM, then SIGKILL after a grace period, and Redis is stopped last. Ctrl-C ends with one
line and exit code 130.

The embedded server keeps the run's Redis data across a clean stop (`{run_dir}/redis/dump.rdb`,
broker/redis_server.py): `rollctl status`, `inspect` and `redis-cli` read a finished run from it
(rollctl/find.py), and the next `rollctl run` of the run directory, which resumes or extends the
run, starts from it. A config whose `redis.url` is the run's own embedded server (the run.yaml
this command writes) starts it again too.

Each process logs to `{run_dir}/logs/{name}.log`; the log of an earlier process of the same name is
moved to `{name}.log.1` (and so on, `KEEP_LOGS` of them), so the learner log echoed here is the new
process's alone.

The layout (the CPU rule of rollctl/cpu_layout.py, or each child's GPUs from `placement.gpus`
through CUDA_VISIBLE_DEVICES, broker/placement.py) is printed at start; `rollctl run --dry-run`
prints it without starting anything.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rollflash.broker.config import Config
from rollflash.broker.placement import plan_layout
from rollflash.broker.redis_server import EmbeddedRedis, RedisServerError, die_with_parent
from rollflash.broker.secrets import PASSWORD_ENV, TOKEN_ENV, url_password
from rollflash.rollctl.cpu_layout import cpu_layout, omp_threads, usable_cores
from rollflash.rollctl.find import is_embedded
from rollflash.rollctl.progress import StepProgress, read_new_rows, terminal_progress

# exit code of a generator whose failure every other generator would meet too (a reward
# function failing on whole batches, an engine that is not installed): `rollctl run` stops the
# run on it
EXIT_RUN_FATAL = 3
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT
KEEP_LOGS = 3  # earlier logs of each process kept beside its current one (learner.log.1, ...)


def _die_with_run() -> None:
    """SIGKILL, not SIGTERM: a generator asked to stop gracefully would first wait out its Redis
    reconnect backoff (the embedded Redis dies with this process too), and nothing a learner or
    generator holds is lost by a kill (checkpoints, pending prompts)."""
    die_with_parent(signal.SIGKILL)


def _spawn(args: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    out = open(log_path, "ab")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "rollflash.rollctl.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_run,
            env=env,
        )
    finally:
        out.close()


def _stop(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


def _follow(path: Path, offset: int) -> int:
    """Echo new learner log lines; returns the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except FileNotFoundError:
        return offset
    if chunk:
        sys.stdout.write(chunk.decode(errors="replace"))
        sys.stdout.flush()
    return offset + len(chunk)


class LearnerWatch:
    """What `rollctl run` shows of its learner: the learner's log echoed to stdout (`echo`) and,
    with a `bar` (on a terminal: rollctl/progress.py), a progress bar fed by the rows the
    learner appends to metrics.jsonl (rows already there at the start, from an earlier learner
    of the run, are not shown again)."""

    def __init__(self, run_dir: Path, echo: bool, bar: StepProgress | None):
        self.log_path, self.metrics_path = (
            run_dir / "logs" / "learner.log",
            run_dir / "metrics.jsonl",
        )
        self.echo, self.bar = echo, bar
        self.log_offset = 0
        self.metrics_offset = self.metrics_path.stat().st_size if self.metrics_path.exists() else 0

    def poll(self) -> None:
        if self.echo:
            self.log_offset = _follow(self.log_path, self.log_offset)
        if self.bar is not None:
            rows, self.metrics_offset = read_new_rows(self.metrics_path, self.metrics_offset)
            for row in rows:
                self.bar.update(row)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


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


def plan_run(cfg: Config, config_path: Path) -> Plan:
    """The processes `rollctl run` starts, with the GPUs `placement:` gives each
    (broker/placement.py) or, on a CPU run, the generator count and threads the machine's cores
    allow (rollctl/cpu_layout.py). Sets `rollout.num_rollout_workers` where the config leaves
    it open, so it is planned once."""
    layout = plan_layout(cfg)
    cpu = cpu_layout(cfg) if layout is None else None
    n = cfg.rollout.num_rollout_workers
    if layout is not None:
        line = (
            f"layout: GPUs {','.join([*layout.learner, *(g for gen in layout.generators for g in gen)])}"
            f": the learner {layout.learner_env() or '(none)'}, {n} generator(s) "
            "(broker/placement.py)"
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
            ["start-learner", *common],
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


def plan_children(cfg: Config, config_path: Path) -> list[Child]:
    return plan_run(cfg, config_path).children


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


def rotate(path: Path, keep: int = KEEP_LOGS) -> Path:
    """Move `path` to `path.1` (`.1` to `.2`, ... up to `.keep`), so that a new process's log
    starts empty and the old ones stay readable; returns `path`."""
    for k in range(keep, 0, -1):
        older = path.with_name(f"{path.name}.{k - 1}") if k > 1 else path
        if older.exists():
            older.replace(path.with_name(f"{path.name}.{k}"))
    return path


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


def run_local(cfg: Config, echo: bool = True, extra_env: dict[str, str] | None = None) -> int:
    """Run learner + generators to the end of training; returns the learner's exit code (128 +
    N when signal N ended it; 130 after Ctrl-C, which prints one line). `echo` prints the layout,
    streams the learner's log and prints the summary; `extra_env` goes to every child."""
    run_dir = Path(cfg.run.run_dir)
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    server, procs, gens = None, [], []
    previous = signal.getsignal(signal.SIGINT)
    try:
        if not cfg.redis.url or is_embedded(run_dir, cfg.redis.url):
            server = start_embedded(run_dir)
            cfg.redis.url = server.url
        config_path = run_dir / "run.yaml"
        plan = plan_run(cfg, config_path)  # may set rollout.num_rollout_workers
        cfg.save(config_path)  # without the Redis password: the children get it in their env
        if echo:
            print("\n".join(describe(plan)), flush=True)
        env = {k: v for k, v in os.environ.items() if k != PASSWORD_ENV} | (extra_env or {})
        password = url_password(cfg.redis.url)
        if password:
            env[PASSWORD_ENV] = password
        if cfg.weights.transport == "http" and not cfg.weights.token_file and TOKEN_ENV not in env:
            env[TOKEN_ENV] = secrets.token_urlsafe(32)  # the weights' token, for this run
        for c in plan.children:
            procs.append(_spawn(c.args, rotate(logs / f"{c.name}.log"), child_env(env, c)))
        gens = procs[1:]
        code = _supervise(cfg, procs, logs, echo)
    except KeyboardInterrupt:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: the shutdown goes on
        code = EXIT_INTERRUPTED
    finally:
        _stop(gens)
        _stop(procs[:1])
        if server is not None:
            server.stop()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, previous)
    if code == EXIT_INTERRUPTED:
        print(
            f"rollctl: interrupted; stopped the learner and {len(gens)} generator(s) "
            "(the same command resumes the run)",
            file=sys.stderr,
            flush=True,
        )
    return code


def _supervise(cfg: Config, procs: list[subprocess.Popen], logs: Path, echo: bool) -> int:
    """Watch the learner to its end; stop the run on a generator's EXIT_RUN_FATAL."""
    learner, gens = procs[0], procs[1:]
    bar = terminal_progress(cfg.trainer.total_steps, sys.stdout) if echo else None
    watch = LearnerWatch(Path(cfg.run.run_dir), echo, bar)
    try:
        while learner.poll() is None:
            watch.poll()
            for i, g in enumerate(gens):
                if g.returncode is None and g.poll() is not None and g.returncode != 0:
                    print(
                        f"generator gen-{i} exited with {g.returncode}: "
                        f"{_tail(logs / f'gen-{i}.log', 1)}",
                        flush=True,
                    )
                    if g.returncode == EXIT_RUN_FATAL:  # every generator would fail the same way
                        print("stopping the run", file=sys.stderr, flush=True)
                        _stop([learner])
                        return EXIT_RUN_FATAL
            time.sleep(0.5)
        watch.poll()
    finally:
        watch.close()
    summary = Path(cfg.run.run_dir) / "summary.json"
    code = learner.returncode if learner.returncode >= 0 else 128 - learner.returncode
    if echo and code == 0 and summary.is_file():
        print(json.dumps(json.loads(summary.read_text())), flush=True)
    elif code != 0:
        print(  # its last line: a start-up error is one line (a bad row, a missing model)
            f"learner exited with {code}: {_tail(logs / 'learner.log', 1)}; "
            f"see {logs / 'learner.log'}",
            file=sys.stderr,
            flush=True,
        )
    return code
