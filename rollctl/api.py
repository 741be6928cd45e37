"""The Python API: a run as an object, as TRL's `GRPOTrainer(...).train()` is.

    from rollflash import Run

    run = Run(
        "configs/demo.yaml",                        # a YAML file, a dict of sections, a Config
        model={"path": "models/tiny"},
        dataset=[{"prompt": "17+25=", "answer": "42"}, ...],   # or a datasets.Dataset
        reward={"functions": ["exact", lambda prompt, response, answer, **row: ...]},
        trainer={"total_steps": 20},
        callbacks=[lambda row: print(row["step"], row["reward/mean"])],
    )
    result = run.train()           # blocks to the end; run.start() returns at once
    result.summary["heldout_acc_after"], run.export(), run.model()

Config: `config` is a YAML file, a mapping of its sections, or a `Config`; each keyword section
replaces the keys it names (`trainer={"total_steps": 20}`; a nested mapping such as
`rollout={"vllm": {...}}` key by key). It is validated at once, with the one-line
`ConfigError` of a bad key.

Data: `dataset` (and `eval_dataset`) are rows in memory, written to the run directory as JSONL
when the run starts, so that generators on other hosts read the same rows (rollctl/api_data.py);
the task is then `task.name: dataset`, whose `params` (prompt_key, answer_key, ...) the `task`
section may still set.

Rewards: `reward.functions` may hold Python callables (lambdas too) beside the built-in names
and import strings. A callable stays in this process, which serves it to the learner and the
generators while the run runs (envs/remote_rewards.py says how and what it costs); with
callables the learner runs one rank (torchrun's ranks cannot reach this process). A function may
return None to abstain on a sample (envs/reward_functions.py): counted per step as
`reward/abstained/<name>`, never an error.

Running: `start()` starts `rollctl run`'s processes (rollctl/local.py: the embedded Redis, the
learner, the generators, the same layout, logs and run directory) as a `rollctl run` child in a
process group of its own, and returns at once; `train()` starts it if it is not running and
waits for its end. `stop()` stops it as Ctrl-C in a terminal does (SIGINT to that process
group, SIGKILL after `timeout`): the learner and generators stop, the run keeps every
checkpointed step, and `train()` or `start()` again resumes it, as the same `rollctl run`
command does; a larger `trainer.total_steps` extends a finished run. Interrupting `train()`
(Ctrl-C, a notebook's stop button) stops the run and raises KeyboardInterrupt. `take_over=True`
starts with `rollctl run --take-over` (the run's lease, broker/channels/lease.py). `echo` prints
`rollctl run`'s output (the layout, the learner's log, the summary) as it comes.

Watching: `callbacks` are called, in a thread of this process, with each step's metrics row
(a dict: `step`, `reward/mean`, `loss/policy`, ...) as the learner writes it; a callback that
raises stops the run and its exception is raised by `train()` / `wait()`. `steps()` iterates
over the same rows, `metrics` holds every step's last row so far, and `status()` says where the
run is. The trained model: `export()` writes a weight version as a Hugging Face model directory
(learner/tools/export.py, what `rollctl export` writes) and returns its path; `model()` loads it.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rollflash.broker.config.config import Config, ConfigError, config_from_dict
from rollflash.broker.connect.secrets import make_private_dir, write_private
from rollflash.envs.remote_rewards import serve_functions
from rollflash.errors import RollflashError
from rollflash.rollctl.api_data import (
    DATA_FILES,
    config_data,
    merged,
    take_callables,
    use_datasets,
    write_rows,
)
from rollflash.rollctl.progress import read_new_rows

POLL_S = 0.2  # how often the watcher reads new metrics rows


@dataclass(frozen=True)
class RunResult:
    summary: dict[str, Any]  # summary.json: heldout_acc_before/after, reward_first10, ...; {} if
    run_dir: Path  # stopped before the end
    stopped: bool = False  # stop() ended it before trainer.total_steps


class RunFailed(RollflashError):
    """`rollctl run` did not finish; the message names its exit code, its last line and the
    learner's log."""


class Run:
    """One run: `train()` it, or `start()`, watch and `stop()` it (module docstring)."""

    def __init__(
        self,
        config: str | Path | Mapping[str, Any] | Config | None = None,
        *,
        dataset: Iterable[Mapping[str, Any]] | None = None,
        eval_dataset: Iterable[Mapping[str, Any]] | None = None,
        callbacks: Iterable[Callable[[dict[str, Any]], Any]] = (),
        take_over: bool = False,
        echo: bool = True,
        **sections: Mapping[str, Any],
    ):
        data = config_data(config)
        given = {
            k: v for k, v in (("dataset", dataset), ("eval_dataset", eval_dataset)) if v is not None
        }
        if given and (data.get("task") or {}).get("name", "dataset") != "dataset":
            del data["task"]  # the config's own task gives way to the rows
        for name, values in sections.items():
            if not isinstance(values, Mapping):
                raise ConfigError(
                    f"{name}: expected a mapping of the section's keys, got {values!r}"
                )
            data[name] = merged(data.get(name) or {}, values)
        self.functions = take_callables(data)
        if given:
            run_dir = Path(config_from_dict({"run": data.get("run") or {}}).run.run_dir)
            use_datasets(data, run_dir, given)
        self.config = config_from_dict(data)
        if self.functions and self.config.trainer.num_trainer_workers > 1:
            raise ConfigError(
                "trainer.num_trainer_workers: reward functions given as Python callables need "
                "one learner rank (torchrun's ranks cannot reach them); name them by import "
                "strings ('package.module:function') for more"
            )
        self.datasets = given
        self.callbacks = list(callbacks)
        self.take_over, self.echo = take_over, echo
        self._proc: subprocess.Popen | None = None
        self._threads: list[threading.Thread] = []
        self._output: collections.deque[str] = collections.deque(maxlen=20)
        self._stopping = False
        self._error: BaseException | None = None
        self._offset = 0  # metrics.jsonl's size when the current start began

    @property
    def run_dir(self) -> Path:
        return Path(self.config.run.run_dir)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- running ---------------------------------------------------------------------------------

    def start(self) -> Run:
        """Start the run's processes and return at once (module docstring)."""
        if self.running:
            raise RollflashError(f"{self.run_dir}: this Run is running already")
        for keyword, rows in self.datasets.items():
            write_rows(rows, self.run_dir / "data" / DATA_FILES[keyword], keyword)
        config_path = self.run_dir / "api.yaml"
        make_private_dir(self.run_dir)  # as run.yaml: it may hold the Redis password
        text = yaml.safe_dump(self.config.model_dump(mode="json", exclude_unset=True))
        write_private(config_path, text)
        metrics = self.run_dir / "metrics.jsonl"
        self._offset = metrics.stat().st_size if metrics.exists() else 0
        self._stopping, self._error = False, None
        self._output.clear()
        serving = contextlib.ExitStack()
        env = serving.enter_context(serve_functions(self.functions))
        args = [sys.executable, "-m", "rollflash.rollctl.cli", "run", "--config", str(config_path)]
        try:
            self._proc = subprocess.Popen(
                [*args, *(["--take-over"] if self.take_over else [])],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=os.environ | env,
                start_new_session=True,  # its process group: stop() signals it as Ctrl-C would
            )
        except BaseException:
            serving.close()
            raise
        self._threads = [
            threading.Thread(target=self._relay, name="rollflash-output", daemon=True),
            threading.Thread(
                target=self._watch, args=(serving,), name="rollflash-steps", daemon=True
            ),
        ]
        for t in self._threads:
            t.start()
        return self

    def _relay(self) -> None:
        """Print (`echo`) and keep the last lines of `rollctl run`'s output."""
        assert self._proc is not None and self._proc.stdout is not None
        for raw in self._proc.stdout:
            line = raw.decode(errors="replace")
            self._output.append(line.rstrip("\n"))
            if self.echo:
                print(line, end="", flush=True)

    def _watch(self, serving: contextlib.ExitStack) -> None:
        """Hand each new metrics row to the callbacks until the process ends; then stop serving
        the reward functions."""
        proc, offset = self._proc, self._offset
        assert proc is not None
        try:
            while True:
                ended = proc.poll() is not None
                rows, offset = read_new_rows(self.run_dir / "metrics.jsonl", offset)
                for row in rows:
                    for callback in self.callbacks:
                        callback(row)
                if ended:
                    break
                time.sleep(POLL_S)
        except BaseException as e:  # a callback raised: the run stops, wait() raises it
            self._error = e
            self.stop()
        finally:
            proc.wait()
            serving.close()

    def wait(self, timeout: float | None = None) -> RunResult:
        """Wait for the run's end: its summary, or `stopped` after stop(); RunFailed when it
        failed, TimeoutError after `timeout` seconds, a callback's exception when one raised."""
        if self._proc is None:
            raise RollflashError("this Run has not started: call start() or train()")
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise TimeoutError(f"{self.run_dir}: still running after {timeout}s")
        if self._error is not None:
            raise self._error
        code = self._proc.returncode
        if code == 0:
            summary = json.loads((self.run_dir / "summary.json").read_text())
            return RunResult(summary, self.run_dir)
        if self._stopping:
            return RunResult({}, self.run_dir, stopped=True)
        last = self._output[-1] if self._output else ""
        log = self.run_dir / "logs" / "learner.log"
        raise RunFailed(
            f"rollctl run exited with {code}: {last}" + ("" if str(log) in last else f"; see {log}")
        )

    def train(self) -> RunResult:
        """Start the run unless it is running, and wait for its end (`wait`)."""
        if not self.running:
            self.start()
        try:
            return self.wait()
        except KeyboardInterrupt:
            self.stop()
            raise

    def stop(self, timeout: float = 120.0) -> int | None:
        """Stop the run as Ctrl-C does (module docstring); returns `rollctl run`'s exit code
        (None: it never started)."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            self._stopping = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()
        return proc.returncode

    # -- watching --------------------------------------------------------------------------------

    def steps(self) -> Iterator[dict[str, Any]]:
        """Each step's metrics row as the learner writes it, from the current start to the
        run's end (starting the run if it has not started)."""
        if self._proc is None:
            self.start()
        proc, offset = self._proc, self._offset
        assert proc is not None
        while True:
            ended = proc.poll() is not None
            rows, offset = read_new_rows(self.run_dir / "metrics.jsonl", offset)
            yield from rows
            if ended:
                return
            time.sleep(POLL_S)

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """Every step's metrics row so far, in step order (after a resume, the row the resumed
        learner wrote)."""
        rows, _ = read_new_rows(self.run_dir / "metrics.jsonl", 0)
        return sorted({row["step"]: row for row in rows}.values(), key=lambda row: row["step"])

    def status(self) -> dict[str, Any]:
        """Where the run is: `state` (not started, running, stopped, done, failed), `step`,
        `total_steps`, `exit_code`, `run_dir`, and the `summary` once done."""
        rows = self.metrics
        code = None if self._proc is None else self._proc.poll()
        if self._proc is None:
            state = "not started"
        elif code is None:
            state = "stopping" if self._stopping else "running"
        elif code == 0:
            state = "done"
        else:
            state = "stopped" if self._stopping else "failed"
        out = {
            "state": state,
            "step": rows[-1]["step"] if rows else 0,
            "total_steps": self.config.trainer.total_steps,
            "exit_code": code,
            "run_dir": str(self.run_dir),
        }
        if state == "done":
            out["summary"] = json.loads((self.run_dir / "summary.json").read_text())
        return out

    # -- the trained model -----------------------------------------------------------------------

    def export(
        self, out: str | Path | None = None, version: int | None = None, best: bool = False
    ) -> Path:
        """Write a weight version (default: the latest; `best`: the one `eval.keep_best` kept)
        as a Hugging Face model directory, a LoRA adapter merged in (learner/tools/export.py, as
        `rollctl export --merge`); returns it. `out` defaults to `{run_dir}/export/v{version}`
        (`best` for the best)."""
        from rollflash.broker.weights.weights import WeightStore
        from rollflash.learner.tools.export import export_version

        if version is None and not best:
            version = WeightStore(self.run_dir).latest()
        name = "best" if best else f"v{version:08d}" if version is not None else "latest"
        path = Path(out) if out is not None else self.run_dir / "export" / name
        with _quiet_transformers():
            return export_version(self.config, version, path, merge=True, best=best)

    def model(self, version: int | None = None, best: bool = False) -> Any:
        """The exported version (`export`) loaded as a transformers model."""
        from transformers import AutoModelForCausalLM

        path = self.export(version=version, best=best)
        with _quiet_transformers():
            return AutoModelForCausalLM.from_pretrained(path)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' progress bars off while the block runs, as they were after it (they are
    the caller's setting)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()
