"""Where one learner step goes: bench_pipeline.py's per-phase breakdown and flame summary.

An in-process learner (learner/build.py `start`, learner/loop.py `learner_step`) trains on a
recorded batch replayed through Redis: before each step this process answers every prompt the
learner has issued with the recorded groups (as a generator would, with the current version), so
the learner runs as it does in `rollctl run` but nothing competes with it for the cores. Timers
wrap the functions each phase runs (inclusive wall time; nested phases are reported under their
parent's name, `collect.decode`), so the figures are per step, averaged over the steps after the
first.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from rollflash.broker.connect.connection import connect
from rollflash.broker.sides.generator_side import GeneratorBroker
from rollflash.broker.wire.schema import Trajectory

# (phase name, module or class path, attribute): each is timed around every call
PHASES = [
    ("collect", "rollflash.learner.intake.collect:Collector", "collect"),
    ("collect.issue_prompts", "rollflash.learner.intake.admission:Admission", "top_up"),
    (
        "collect.redis_read",
        "rollflash.broker.sides.learner_side:LearnerBroker",
        "read_trajectories",
    ),
    ("collect.decode", "rollflash.broker.channels.trajectories", "decode_trajectory"),
    ("train", "rollflash.learner.loop", "train"),
    ("train.batch_building", "rollflash.learner.step.train", "prepare_batch"),
    ("train.forward_backward", "rollflash.learner.step.train", "policy_update"),
    ("train.metric_syncs", "rollflash.learner.metrics.metric_sums:MetricSums", "to_host"),
    ("publish", "rollflash.learner.loop", "publish"),
    ("record", "rollflash.learner.loop", "record"),
    ("checkpoint", "rollflash.learner.loop", "make_durable"),
    ("metrics", "rollflash.learner.loop", "merged_metrics"),
    ("report", "rollflash.learner.loop", "_report"),
    ("ack", "rollflash.broker.sides.learner_side:LearnerBroker", "ack_trajectories"),
]


def _target(path: str) -> Any:
    import importlib

    module, _, cls = path.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, cls) if cls else obj


@contextlib.contextmanager
def timed(totals: dict[str, float]) -> Iterator[None]:
    """Wrap every PHASES function with a timer adding to totals[name]; unwrapped on exit."""
    saved = []
    for name, path, attr in PHASES:
        owner = _target(path)
        fn = getattr(owner, attr)

        def wrapper(*a, _fn=fn, _name=name, **kw):
            started = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                totals[_name] += time.perf_counter() - started

        saved.append((owner, attr, fn))
        setattr(owner, attr, wrapper)
    try:
        yield
    finally:
        for owner, attr, fn in reversed(saved):
            setattr(owner, attr, fn)


class Replayer:
    """Answers the learner's prompts with the recorded groups, as a generator at the learner's
    current version would (the groups' samples cycle; their rewards come with them). Each answer
    carries the prompt tokens the learner issued (its prompt encoder, as a generator's engine
    encodes them), which the learner checks; the recorded samples answer other prompts, which
    costs the timing nothing."""

    def __init__(self, cfg, groups: list[Trajectory], learner):
        self.groups, self.next = groups, 0
        self.encode = learner.collector.admission.prompt_ids  # None: prompts are not checked
        self.broker = GeneratorBroker(
            connect(cfg.redis.url, 10), cfg.run.run_id, "replay", cfg.redis.max_payload_bytes
        )
        self.broker.ask_to_join({"state": "up"}, ttl_s=3600)
        learner.broker.maintain_now()  # the learner admits it (broker/channels/roster.py)
        self.broker.wait_admitted(10)

    def answer_all(self, version: int) -> None:
        while claimed := self.broker.claim_prompts(1000, block_ms=None):
            for entry_id, work in claimed:
                g = self.groups[self.next % len(self.groups)]
                self.next += 1
                samples = [
                    dataclasses.replace(
                        s, token_versions=np.full(len(s.response_ids), version, np.int32)
                    )
                    for s in g.samples
                ]
                prompt = g.prompt_ids if self.encode is None else self.encode(work.item["prompt"])
                traj = Trajectory.for_work(work, samples, prompt, "replay", version)
                self.broker.add_trajectory(traj, prompt_entry_id=entry_id)


def _flame(pid: int, seconds: float) -> subprocess.Popen | None:
    """py-spy sampling this process for `seconds` (raw collapsed stacks), or None without it."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        return None
    with tempfile.NamedTemporaryFile(prefix="bench-flame-", suffix=".txt", delete=False) as f:
        out = f.name
    cmd = [exe, "record", "--pid", str(pid), "--format", "raw", "-o", out, "--rate", "200"]
    proc = subprocess.Popen(
        [*cmd, "--duration", str(int(seconds))],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    proc.out_path = out  # type: ignore[attr-defined]
    return proc


def flame_summary(path: str, top: int = 12) -> dict[str, list[tuple[str, float]]]:
    """Collapsed stacks -> the functions under `learner_step` with the largest share of its
    samples, inclusive and self (`file:function`; the timers' wrappers left out)."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [_short(f) for f in stack.split(";") if f]
        if "loop.py:learner_step" not in frames:
            continue
        frames = frames[frames.index("loop.py:learner_step") + 1 :]  # below the step
        frames = [f for f in frames if "bench_phases.py" not in f] or ["loop.py:learner_step"]
        n = int(count)
        total += n
        own[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
    share = lambda c: [(f, round(n / max(total, 1), 3)) for f, n in c.most_common(top)]  # noqa: E731
    return {"inclusive": share(inclusive), "self": share(own), "samples": total}


def _short(frame: str) -> str:
    """'func (path/to/file.py:12)' -> 'file.py:func'."""
    name, _, where = frame.partition(" (")
    file = where.split(":")[0].rsplit("/", 1)[-1]
    return f"{file}:{name.strip()}"


def learner_phases(
    cfg, groups: list[Trajectory], steps: int, flame: bool
) -> tuple[dict[str, float], dict | None]:
    """Milliseconds per learner step by phase (steps 2..`steps`), and the flame summary."""
    from rollflash.learner.build import start
    from rollflash.learner.loop import learner_step

    cfg = cfg.model_copy(deep=True)
    cfg.run.run_dir = tempfile.mkdtemp(prefix="bench-phases-")
    ln = start(cfg, resume=False)
    replay = Replayer(cfg, groups, ln)
    totals: dict[str, float] = collections.defaultdict(float)
    step_s, profiler = 0.0, None
    try:
        for i in range(steps):
            ln.collector.admission.top_up(ln.broker, ln.state.step, ln.state.version)
            replay.answer_all(ln.state.version)
            if i == 1:
                totals.clear()
                profiler = _flame(os.getpid(), 3600) if flame else None
            started = time.perf_counter()
            with timed(totals):
                learner_step(ln)
            step_s += (time.perf_counter() - started) if i else 0.0
    finally:
        if profiler is not None:
            profiler.send_signal(2)  # SIGINT: py-spy writes what it has
            profiler.wait(timeout=60)
        ln.close()
        shutil.rmtree(cfg.run.run_dir, ignore_errors=True)
    per = max(steps - 1, 1)
    out = {k: round(1000 * v / per, 2) for k, v in sorted(totals.items())}
    out["step"] = round(1000 * step_s / per, 2)
    summary = None
    if profiler is not None and Path(profiler.out_path).exists():  # type: ignore[attr-defined]
        summary = flame_summary(profiler.out_path)  # type: ignore[attr-defined]
        Path(profiler.out_path).unlink()  # type: ignore[attr-defined]
    return out, summary
