"""`rollctl run`: the whole system on one machine.

Starts a private redis-server on a unix socket under the run directory (unless a Redis URL is
given), then the learner and N generators as child processes of this one. Each child asks the
kernel to SIGKILL it if this process dies (PR_SET_PDEATHSIG; redis-server gets SIGTERM), so even a
`kill -9` of `rollctl run` leaves no orphan. On Ctrl-C, or when the learner exits, the generators
get SIGTERM, then SIGKILL after a grace period, and Redis is stopped last.

With `placement.gpus` each child gets its share of the GPUs through CUDA_VISIBLE_DEVICES
(broker/placement.py); `rollctl run --dry-run` prints that layout without starting anything.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rollflash.broker.config import Config
from rollflash.broker.placement import plan_layout
from rollflash.broker.redis_server import EmbeddedRedis, die_with_parent
from rollflash.broker.secrets import PASSWORD_ENV, TOKEN_ENV, url_password
from rollflash.rollctl.cpu_layout import cpu_layout, omp_threads, usable_cores
from rollflash.rollctl.progress import StepProgress, read_new_rows, terminal_progress

log = logging.getLogger(__name__)

# exit code of a generator whose failure every other generator would meet too (a reward
# function failing on whole batches): `rollctl run` stops the run on it
EXIT_RUN_FATAL = 3


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


def plan_children(cfg: Config, config_path: Path) -> list[Child]:
    """The processes `rollctl run` starts, with the GPUs `placement:` gives each
    (broker/placement.py) or, on a CPU run, the generator count and threads the machine's cores
    allow (rollctl/cpu_layout.py)."""
    layout = plan_layout(cfg)
    cpu = cpu_layout(cfg) if layout is None else None
    if cpu is not None:
        log.info("%d cores: %s (rollctl/cpu_layout.py)", usable_cores(), cpu.describe())
    common = ["--config", str(config_path)]
    children = [
        Child(
            "learner",
            ["start-learner", *common],
            layout.learner_env() if layout else None,
            omp_threads(cfg, cpu, learner=True),
        )
    ]
    for i in range(cfg.rollout.num_rollout_workers):
        children.append(
            Child(
                f"gen-{i}",
                ["start-generator", *common, "--id", f"gen-{i}"],
                layout.generator_env(i) if layout else None,
                omp_threads(cfg, cpu, learner=False),
            )
        )
    return children


def describe_children(cfg: Config, config_path: Path) -> list[str]:
    """`rollctl run --dry-run`: one line per process, its GPUs and its command."""
    lines = []
    for c in plan_children(cfg, config_path):
        gpus = "(inherited)" if c.cuda_visible_devices is None else c.cuda_visible_devices or "-"
        lines.append(f"{c.name:<8} CUDA_VISIBLE_DEVICES={gpus:<12} rollctl {' '.join(c.args)}")
    return lines


def child_env(base: dict[str, str], child: Child) -> dict[str, str]:
    env = dict(base)
    if child.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = child.cuda_visible_devices
    if child.omp_threads is not None:
        env["OMP_NUM_THREADS"] = child.omp_threads
    return env


def run_local(cfg: Config, echo: bool = True) -> int:
    """Run learner + generators to the end of training; returns the learner's exit code.
    `echo` streams the learner's log and the summary to stdout."""
    run_dir = Path(cfg.run.run_dir)
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    server = None
    if not cfg.redis.url:
        server = EmbeddedRedis(run_dir / "redis").start()
        cfg.redis.url = server.url
        log.info("embedded redis-server at %s", server.url)
    config_path = run_dir / "run.yaml"
    children = plan_children(cfg, config_path)  # may set rollout.num_rollout_workers
    cfg.save(config_path)  # without the Redis password: the children get it in their environment
    env = {k: v for k, v in os.environ.items() if k != PASSWORD_ENV}
    password = url_password(cfg.redis.url)
    if password:
        env[PASSWORD_ENV] = password
    if cfg.weights.transport == "http" and not cfg.weights.token_file and TOKEN_ENV not in env:
        env[TOKEN_ENV] = secrets.token_urlsafe(32)  # the weights' token, for this run's processes
    procs = [_spawn(c.args, logs / f"{c.name}.log", child_env(env, c)) for c in children]
    learner, gens = procs[0], procs[1:]
    bar = terminal_progress(cfg.trainer.total_steps, sys.stdout) if echo else None
    watch = LearnerWatch(run_dir, echo, bar)
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
    except KeyboardInterrupt:
        print("interrupted: stopping learner and generators", flush=True)
        _stop([learner])
    finally:
        watch.close()
        _stop(gens)
        _stop([learner])
        if server is not None:
            server.stop()
    summary = run_dir / "summary.json"
    if echo and learner.returncode == 0 and summary.is_file():
        print(json.dumps(json.loads(summary.read_text())), flush=True)
    elif learner.returncode != 0:
        print(
            f"learner exited with {learner.returncode}; see {logs / 'learner.log'}",
            file=sys.stderr,
            flush=True,
        )
    return learner.returncode or 0
