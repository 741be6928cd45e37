"""Experiment trackers beside metrics.jsonl and TensorBoard: W&B and MLflow (`logging.backends`).

Each tracker run gets the project (W&B project, MLflow experiment), the run name (`logging.run_name`
or `run.run_id`), the resolved config without the Redis password (`Config.public_dict`) and
`logging.tags`. `run_id()` is kept in the learner checkpoint (`LearnerState.trackers`), so a
learner resumed from it continues the same tracker run: W&B with `resume="allow"` on the same id
(steps go on a `learner/step` axis of their own, so the steps re-trained after the checkpoint are
logged, not dropped as out of order), MLflow by reopening the run id.

Starting is strict and logging is not: a missing package, a refused login or an unreachable server
raises `TrackerUnavailable` with one line before training starts; once training runs, a tracker
call that fails is counted by `MetricsSink` and training goes on (learner/metrics/metrics.py). Both
packages are optional extras (`pip install -e ".[wandb]"`, `".[mlflow]"`) imported only here.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from rollflash.broker.config.config import Config
from rollflash.errors import RollflashError


class TrackerUnavailable(RollflashError, RuntimeError):
    """A configured tracker cannot start; the message names it and the fix."""


class Tracker(Protocol):
    name: str

    def run_id(self) -> str: ...

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None: ...

    def log_eval_generations(self, step: int, rows: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


COMPLETION_COLUMNS = (
    "step", "pick", "prompt", "response", "reward", "reward_parts", "staleness",
    "behavior_version", "generator", "traj_id",
)  # fmt: skip
EVAL_COLUMNS = ("step", "eval", "id", "sample", "prompt", "response", "reward", "pass")


def _import(module: str, extra: str) -> Any:
    try:
        return __import__(module)
    except ImportError:
        raise TrackerUnavailable(
            f"logging.backends: {extra} is listed but the {module} package is not installed "
            f'(pip install -e ".[{extra}]")'
        ) from None


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{e.__class__.__name__}: {text[0]}" if text else e.__class__.__name__


class WandbTracker:
    """A W&B run (`logging.wandb_mode: offline` writes it under `{run_dir}/wandb` only)."""

    name = "wandb"

    def __init__(self, cfg: Config, resume_id: str | None):
        wandb = _import("wandb", "wandb")
        lg = cfg.logging
        self._wandb = wandb
        try:
            self._run = wandb.init(
                project=lg.project,
                entity=lg.wandb_entity,
                name=lg.run_name or cfg.run.run_id,
                tags=list(lg.tags),
                config=cfg.public_dict(),
                dir=str(Path(cfg.run.run_dir)),
                mode=lg.wandb_mode,
                id=resume_id,
                resume="allow" if resume_id else None,
                settings=wandb.Settings(console="off", init_timeout=60, silent=True),
            )
        except Exception as e:  # wandb raises its own errors for login, network, bad ids
            raise TrackerUnavailable(
                f"logging.backends: wandb did not start ({_one_line(e)})"
            ) from None
        self._run.define_metric("learner/step")
        self._run.define_metric("*", step_metric="learner/step")

    def run_id(self) -> str:
        return str(self._run.id)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log({"learner/step": step, **metrics})

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        self._table(step, "completions", COMPLETION_COLUMNS, rows)

    def log_eval_generations(self, step: int, rows: list[dict[str, Any]]) -> None:
        self._table(step, f"eval_generations/{rows[0]['eval']}", EVAL_COLUMNS, rows)

    def _table(
        self, step: int, key: str, columns: tuple[str, ...], rows: list[dict[str, Any]]
    ) -> None:
        table = self._wandb.Table(
            columns=list(columns), data=[[_cell(row.get(c)) for c in columns] for row in rows]
        )
        self._run.log({"learner/step": step, key: table})

    def close(self) -> None:
        self._run.finish()


def _cell(value: Any) -> Any:
    return json.dumps(value) if isinstance(value, (list, dict)) else value


_MLFLOW_BAD = re.compile(r"[^A-Za-z0-9_\-. :/]")


def mlflow_key(name: str) -> str:
    """A metric name MLflow accepts: `eval/pass@8` -> `eval/pass_at_8`."""
    return _MLFLOW_BAD.sub("_", name.replace("@", "_at_"))


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if not isinstance(value, str) else value
    return out


class MlflowTracker:
    """An MLflow run in experiment `logging.project`, through `MlflowClient` (no global run)."""

    name = "mlflow"

    def __init__(self, cfg: Config, resume_id: str | None):
        _import("mlflow", "mlflow")
        from mlflow import MlflowClient
        from mlflow.entities import Param, RunTag

        # fail in seconds, not after MLflow's minutes of retries, when the server is unreachable
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
        lg = cfg.logging
        uri = lg.mlflow_tracking_uri
        try:
            self._client = MlflowClient(tracking_uri=uri)
            if resume_id:
                self._run_id = self._client.get_run(resume_id).info.run_id
                self._client.update_run(self._run_id, status="RUNNING")
                return
            exp = self._client.get_experiment_by_name(lg.project)
            exp_id = exp.experiment_id if exp else self._client.create_experiment(lg.project)
            tags = {t: "true" for t in lg.tags} | {"rollflash.run_id": cfg.run.run_id}
            run = self._client.create_run(exp_id, run_name=lg.run_name or cfg.run.run_id, tags=tags)
            self._run_id = run.info.run_id
            params = [Param(k, v[:6000]) for k, v in _flat(cfg.public_dict()).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                self._client.log_batch(self._run_id, params=params[i : i + 100])
            self._client.log_batch(self._run_id, tags=[RunTag("rollflash.config", "config.yaml")])
            self._client.log_dict(self._run_id, cfg.public_dict(), "config.yaml")
        except Exception as e:  # MLflow raises MlflowException, requests' and OS errors
            raise TrackerUnavailable(
                f"logging.backends: mlflow did not start at {uri or 'the default store'} "
                f"({_one_line(e)})"
            ) from None

    def run_id(self) -> str:
        return self._run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_key(k), v, now, step) for k, v in metrics.items() if v is not None]
        for i in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics a batch
            self._client.log_batch(self._run_id, metrics=batch[i : i + 1000])

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        # mlflow annotates `dict` but json-dumps any JSON value, a list of rows too
        self._client.log_dict(self._run_id, rows, f"completions/step{step:07d}.json")  # type: ignore[arg-type]

    def log_eval_generations(self, step: int, rows: list[dict[str, Any]]) -> None:
        name = f"eval_generations/step{step:07d}_{rows[0]['eval']}.json"
        self._client.log_dict(self._run_id, rows, name)  # type: ignore[arg-type]  # as above

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


_TRACKERS: dict[str, Callable[[Config, str | None], Tracker]] = {
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}


def open_trackers(cfg: Config, resume_ids: dict[str, str]) -> list[Tracker]:
    """Start every tracker of `logging.backends` other than jsonl and tensorboard, continuing the
    runs named in `resume_ids` (backend -> run id, from the checkpoint)."""
    out: list[Tracker] = []
    try:
        for name in cfg.logging.backends:
            if name in _TRACKERS:
                out.append(_TRACKERS[name](cfg, resume_ids.get(name)))
    except TrackerUnavailable:
        for tracker in out:
            tracker.close()
        raise
    return out
