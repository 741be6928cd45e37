"""The processes `rollctl run` starts, watched to the learner's end (rollctl/local.py plans them).

- Each child runs `rollctl ...` in a process group of its own, so a terminal's Ctrl-C reaches
  `rollctl run` alone, which then stops each child with exactly one SIGTERM (a second Ctrl-C, or
  SIGTERM, sends the learner a second one: it stops at once, learner/process/stop.py). The kernel sends
  every child SIGKILL if `rollctl run` dies (PR_SET_PDEATHSIG), so even a `kill -9` of it leaves
  no orphan; nothing a learner or generator holds is lost by a kill (checkpoints, pending
  prompts).
- A generator that dies under the run (killed by a signal, or an error with a traceback, exit
  code 1) is started again under its id, after 1 s, then 2, 4, 8, 16 s, at most
  `GENERATOR_RESTARTS` times in a run, each logged; it re-reads the prompts it held. One that
  ends with the project's one-line error (exit code 2: config, Redis, the run) is not restarted,
  as it would meet the same error; one that exits with `EXIT_RUN_FATAL` (a failure every
  generator meets) stops the run, and so does a run left with no generator.
- The learner is watched, not restarted. Once it has exited, whatever the cause, `rollctl run`
  frees the run's lease if that learner still holds it (broker/channels/lease.py `release_dead`: it
  started it and saw it die), so that the same command resumes at once, after a kill -9 too.
- Stopping: the learner and the generators get SIGTERM together (the learner stops at a step
  boundary without them: learner/process/stop.py); a child still running after its grace period
  (`LEARNER_GRACE_S`, `GENERATOR_GRACE_S`) is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollflash.broker.connect.redis_server import die_with_parent
from rollflash.rollctl.cli_base import EXIT_ERROR, EXIT_RUN_FATAL
from rollflash.rollctl.progress import StepProgress, read_new_rows, terminal_progress

GENERATOR_RESTARTS = 5  # restarts of one generator in a run
RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0)  # before restart 1, 2, ... (the last one after)
LEARNER_GRACE_S = 120.0  # to finish its step and checkpoint after SIGTERM
GENERATOR_GRACE_S = 10.0
KEEP_LOGS = 3  # earlier logs of each process kept beside its current one (learner.log.1, ...)


def _own_group_dying_with_run() -> None:
    """preexec_fn of a child: a process group of its own (module docstring), and SIGKILL, not
    SIGTERM, when `rollctl run` dies: a generator asked to stop gracefully would first wait out
    its Redis reconnect backoff (the embedded Redis dies with `rollctl run` too)."""
    os.setpgid(0, 0)
    die_with_parent(signal.SIGKILL)


def rotate(path: Path, keep: int = KEEP_LOGS) -> Path:
    """Move `path` to `path.1` (`.1` to `.2`, ... up to `.keep`), so that a new process's log
    starts empty and the old ones stay readable; returns `path`."""
    for k in range(keep, 0, -1):
        older = path.with_name(f"{path.name}.{k - 1}") if k > 1 else path
        if older.exists():
            older.replace(path.with_name(f"{path.name}.{k}"))
    return path


def spawn(args: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    """`rollctl <args>` as a child, its output in `log_path` (rotated first)."""
    out = open(rotate(log_path), "ab")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "rollflash.rollctl.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_own_group_dying_with_run,
            env=env,
        )
    finally:
        out.close()


def tail(path: Path, lines: int = 5) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


def describe_exit(code: int) -> str:
    """'exited with 2', or 'was killed by SIGKILL' for a process a signal ended."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with {code}"


def exit_code(returncode: int) -> int:
    """A Popen returncode as a shell reports it: 128 + N for a process signal N ended."""
    return returncode if returncode >= 0 else 128 - returncode


@dataclass
class Proc:
    """One child of the run and what its restarts need."""

    name: str
    args: list[str]
    env: dict[str, str]
    log: Path
    popen: subprocess.Popen
    restarts: int = 0
    restart_at: float | None = None  # time.monotonic() of a scheduled restart
    given_up: bool = False  # died too often: not restarted again
    finished: bool = False  # exited with 0

    @property
    def running(self) -> bool:
        return self.popen.poll() is None


class LearnerWatch:
    """What `rollctl run` shows of its learner: the learner's log echoed to stdout (`echo`) and,
    with a `bar` (on a terminal: rollctl/progress.py), a progress bar fed by the rows the
    learner appends to metrics.jsonl (rows already there at the start, from an earlier learner
    of the run, are not shown again)."""

    def __init__(self, run_dir: Path, echo: bool, bar: StepProgress | None):
        self.log_path = run_dir / "logs" / "learner.log"
        self.metrics_path = run_dir / "metrics.jsonl"
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


class RunInterrupted(Exception):
    """`rollctl run` was asked to stop by a signal (SIGINT, SIGTERM)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Supervisor:
    """The learner (first) and the generators of one `rollctl run` (module docstring)."""

    def __init__(self, echo: bool = True):
        self.procs: list[Proc] = []
        self.echo = echo

    def start(self, children: list[tuple[str, list[str], dict[str, str]]], logs: Path) -> None:
        """Start `children` (name, args of `rollctl`, environment), the learner first."""
        for name, args, env in children:
            log = logs / f"{name}.log"
            self.procs.append(Proc(name, args, env, log, spawn(args, log, env)))

    @property
    def learner(self) -> Proc:
        return self.procs[0]

    @property
    def generators(self) -> list[Proc]:
        return self.procs[1:]

    def say(self, line: str, err: bool = False) -> None:
        print(line, file=sys.stderr if err else sys.stdout, flush=True)

    def watch(self, run_dir: Path, total_steps: int) -> int:
        """Follow the learner to its end, restarting generators that die; returns the exit code
        of `rollctl run` (the learner's, or EXIT_RUN_FATAL)."""
        bar = terminal_progress(total_steps, sys.stdout) if self.echo else None
        watch = LearnerWatch(run_dir, self.echo, bar)
        try:
            while self.learner.running:
                watch.poll()
                if self._tend_generators():
                    return EXIT_RUN_FATAL
                time.sleep(0.5)
            watch.poll()
        finally:
            watch.close()
        return exit_code(self.learner.popen.returncode)

    def _tend_generators(self) -> bool:
        """Restart dead generators when their time comes; True if the run must stop."""
        now = time.monotonic()
        for g in self.generators:
            if g.restart_at is not None and now >= g.restart_at:
                g.restart_at = None
                g.popen = spawn(g.args, g.log, g.env)
                continue
            if g.given_up or g.finished or g.restart_at is not None or g.running:
                continue
            code = g.popen.returncode
            if code == 0:  # the run is done, or someone stopped it on purpose
                g.finished = True
                continue
            why = f"generator {g.name} {describe_exit(code)}"
            if code > 0:  # its last line says why (a signal leaves none)
                why += f": {tail(g.log, 1)}"
            if code == EXIT_RUN_FATAL:  # every generator would fail the same way
                self.say(why)
                self.say("stopping the run", err=True)
                return True
            if code == EXIT_ERROR:  # its one-line error (config, Redis, the run): permanent
                g.given_up = True
                self.say(f"{why}; not restarted: it would meet the same error")
            elif g.restarts >= GENERATOR_RESTARTS:
                g.given_up = True
                self.say(f"{why}; not restarted: it died {g.restarts + 1} times")
            else:
                wait = RESTART_BACKOFF_S[min(g.restarts, len(RESTART_BACKOFF_S) - 1)]
                g.restarts += 1
                g.restart_at = now + wait
                self.say(
                    f"{why}; restarting it in {wait:.0f}s "
                    f"(restart {g.restarts} of {GENERATOR_RESTARTS})"
                )
        alive = any(g.running or g.restart_at is not None for g in self.generators)
        if not alive and any(g.given_up for g in self.generators):
            self.say("no generator left: stopping the run", err=True)
            return True
        return False

    def interrupt_again(self) -> None:
        """A second stop request: the learner stops at once (learner/process/stop.py)."""
        if self.procs and self.learner.running:
            self.learner.popen.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        """SIGTERM to every child still running, then wait for each (a kill after its grace
        period: module docstring)."""
        if not self.procs:
            return
        for p in self.procs:
            p.restart_at = None
            if p.running:
                p.popen.send_signal(signal.SIGTERM)
        started = time.monotonic()
        for p in [*self.generators, self.learner]:
            grace = LEARNER_GRACE_S if p is self.learner else GENERATOR_GRACE_S
            try:
                p.popen.wait(timeout=max(0.1, started + grace - time.monotonic()))
            except subprocess.TimeoutExpired:
                if p is self.learner:
                    self.say(f"the learner did not stop within {grace:.0f}s: killed", err=True)
                p.popen.kill()
                p.popen.wait()


def signals_to(handler: Any) -> dict[int, Any]:
    """Install `handler` for SIGINT and SIGTERM (main thread only); the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}


def restore_signals(previous: dict[int, Any]) -> None:
    for s, handler in previous.items():
        signal.signal(s, handler)
