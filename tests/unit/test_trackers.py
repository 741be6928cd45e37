"""Trackers without a network: W&B in offline mode (its transaction log parsed back) and MLflow
on a local file store; metrics, the redacted config, tags and resume. And the sink's rule: a
tracker that fails mid-run is counted, training goes on."""

import glob
import json
import time

import pytest

from rollflash.broker.config.config import load_config
from rollflash.learner.durability.checkpoint import LearnerState
from rollflash.learner.metrics.metrics import MetricsSink
from rollflash.learner.metrics.trackers import TrackerUnavailable, mlflow_key, open_trackers
from tests.helpers.wandb_log import wandb_records

SECRET = "s3cretpw"
EVAL_ROWS = [
    {"step": 2, "eval": "greedy", "id": f"heldout-{i}", "sample": 0, "prompt": "1+2=",
     "response": r, "reward": float(r == "3"), "pass": r == "3"}
    for i, r in enumerate(["3", "4"])
]  # fmt: skip


def _cfg(tmp_path, *sets):
    return load_config(
        None,
        [
            f"run.run_dir={tmp_path / 'run'}",
            "run.run_id=obs",
            f"redis.url=redis://gen:{SECRET}@host:6379/0",
            "logging.tags=[ablation, a1]",
            *sets,
        ],
    )


def _finished_log(path):
    """The records of a W&B log once its `exit` record is there: wandb-core may still be writing
    the log when `finish()` returns."""
    for _ in range(300):
        records = wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        time.sleep(0.1)
    raise AssertionError(f"{path}: no exit record")


def _history(records):
    """Each logged step's items; W&B keeps a key with "/" as its parts (nested_key)."""
    return [
        {
            key: json.loads(i.value_json)
            for i in r.history.item
            if not (key := "/".join(i.nested_key) or i.key).startswith("_")
        }
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]


def test_wandb_offline_run_has_metrics_config_tags_and_resumes(tmp_path):
    pytest.importorskip("wandb", reason="the wandb extra is not installed: pip install -e .[wandb]")
    cfg = _cfg(tmp_path, "logging.backends=[jsonl, wandb]", "logging.wandb_mode=offline")
    [tracker] = open_trackers(cfg, {})
    tracker.log(1, {"reward/mean": 0.5, "eval/pass@4": 0.25})
    tracker.log(2, {"reward/mean": 0.75})
    tracker.log_completions(2, [{"step": 2, "pick": "best", "prompt": "1+2=", "reward": 1.0}])
    tracker.log_eval_generations(2, EVAL_ROWS)
    tracker.close()
    run_id = tracker.run_id()
    [resumed] = open_trackers(cfg, {"wandb": run_id})
    assert resumed.run_id() == run_id
    resumed.log(2, {"reward/mean": 0.8})  # a step re-trained after the checkpoint is kept
    resumed.close()

    logs = sorted(
        glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / f"run-{run_id}.wandb"))
    )
    assert len(logs) == 2  # the first run and its resumption, one id
    first, second = _finished_log(logs[0]), _finished_log(logs[1])
    [run] = [r.run for r in first if r.WhichOneof("record_type") == "run"]
    assert (run.run_id, run.project, run.display_name, list(run.tags)) == (
        run_id, "rollflash", "obs", ["ablation", "a1"]
    )  # fmt: skip
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["trainer"]["actor_lr"] == 1e-4
    assert config["redis"]["url"] == "redis://gen@host:6379/0"
    assert SECRET.encode() not in open(logs[0], "rb").read()
    history = _history(first)
    assert history[0] == {"learner/step": 1, "reward/mean": 0.5, "eval/pass@4": 0.25}
    assert history[1] == {"learner/step": 2, "reward/mean": 0.75}
    assert history[2]["completions/nrows"] == 1
    assert history[3]["eval_generations/greedy/nrows"] == 2
    assert _history(second) == [{"learner/step": 2, "reward/mean": 0.8}]


def test_mlflow_file_store_run_has_metrics_config_tags_and_resumes(tmp_path, monkeypatch):
    pytest.importorskip(
        "mlflow", reason="the mlflow extra is not installed: pip install -e .[mlflow]"
    )
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for the opt-in
    uri = f"file:{tmp_path / 'mlruns'}"
    cfg = _cfg(tmp_path, "logging.backends=[jsonl, mlflow]", f"logging.mlflow_tracking_uri={uri}")
    [tracker] = open_trackers(cfg, {})
    tracker.log(1, {"reward/mean": 0.5, "eval/pass@4": 0.25})
    tracker.log(2, {"reward/mean": 0.75})
    tracker.log_completions(2, [{"step": 2, "pick": "best", "prompt": "1+2=", "reward": 1.0}])
    tracker.log_eval_generations(2, EVAL_ROWS)
    tracker.close()
    [resumed] = open_trackers(cfg, {"mlflow": tracker.run_id()})
    assert resumed.run_id() == tracker.run_id()
    resumed.log(3, {"reward/mean": 0.9})

    client = MlflowClient(uri)
    run = client.get_run(tracker.run_id())
    assert run.info.run_name == "obs" and run.info.status == "RUNNING"  # reopened by the resume
    assert run.data.tags["ablation"] == "true" and run.data.tags["a1"] == "true"
    assert run.data.params["trainer.actor_lr"] == "0.0001"
    assert run.data.params["redis.url"] == "redis://gen@host:6379/0"
    assert SECRET not in json.dumps(run.data.params)
    history = client.get_metric_history(tracker.run_id(), "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.75), (3, 0.9)]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "eval/pass_at_4")] == [0.25]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"config.yaml", "completions", "eval_generations"}
    [generations] = client.list_artifacts(run.info.run_id, "eval_generations")
    assert generations.path == "eval_generations/step0000002_greedy.json"
    resumed.close()


def test_unreachable_mlflow_server_fails_at_start_in_one_line(tmp_path):
    pytest.importorskip(
        "mlflow", reason="the mlflow extra is not installed: pip install -e .[mlflow]"
    )
    uri = "http://127.0.0.1:1"  # nothing listens on port 1
    cfg = _cfg(tmp_path, "logging.backends=[jsonl, mlflow]", f"logging.mlflow_tracking_uri={uri}")
    with pytest.raises(TrackerUnavailable) as e:
        open_trackers(cfg, {})
    assert str(e.value).startswith("logging.backends: mlflow did not start at http://127.0.0.1:1")
    assert "\n" not in str(e.value)


def test_missing_package_fails_at_start_with_the_install_line(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # import wandb -> ImportError
    cfg = _cfg(tmp_path, "logging.backends=[jsonl, wandb]")
    with pytest.raises(TrackerUnavailable) as e:
        open_trackers(cfg, {})
    assert str(e.value) == (
        "logging.backends: wandb is listed but the wandb package is not installed "
        '(pip install -e ".[wandb]")'
    )


class _Flaky:
    name = "flaky"

    def __init__(self):
        self.calls = 0

    def log(self, step, metrics):
        self.calls += 1
        if step == 2:
            raise ConnectionError("server went away\nwith a traceback")

    def log_completions(self, step, rows):
        raise TimeoutError()

    def close(self):
        pass


def test_a_failing_tracker_is_counted_and_training_goes_on(tmp_path):
    flaky = _Flaky()
    sink = MetricsSink(tmp_path, tensorboard=False, trackers=[flaky])
    for step in (1, 2, 3):
        sink.log(step, {"reward/mean": 0.1 * step})
    sink.log_completions(3, [{"pick": "best", "reward": 0.3}])
    sink.log(4, {"reward/mean": 0.4})
    sink.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # failures: step 2's log, step 3's completions; each row carries the count so far
    assert [r["tracker/errors"] for r in rows] == [0, 0, 1, 2]
    assert flaky.calls == 4 and sink.tracker_errors == 2
    [completion] = (tmp_path / "completions.jsonl").read_text().splitlines()
    assert json.loads(completion) == {"step": 3, "pick": "best", "reward": 0.3}


def test_tracker_run_ids_travel_in_the_checkpoint_state():
    state = LearnerState(trackers={"wandb": "hk23o0ea", "mlflow": "a1b0"})
    assert LearnerState.from_json(json.loads(json.dumps(state.to_json()))).trackers == {
        "wandb": "hk23o0ea",
        "mlflow": "a1b0",
    }


def test_mlflow_key_replaces_what_mlflow_refuses():
    assert mlflow_key("eval/pass@8") == "eval/pass_at_8"
    assert mlflow_key("reward/mean") == "reward/mean"
    assert mlflow_key("a+b") == "a_b"


def test_tensorboard_gets_every_finite_metric_of_a_step_in_one_event(tmp_path):
    """One event per step holds all its scalars: TensorBoard lists each by its tag; a value
    that is not finite (None in metrics.jsonl) is left out, as add_scalar callers would."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = MetricsSink(tmp_path)
    sink.log(1, {"reward/mean": 0.25, "async/staleness_max": 1, "loss/policy": float("nan")})
    sink.log(2, {"reward/mean": 0.5, "async/staleness_max": 0, "loss/policy": -0.125})
    sink.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }
    assert scalars == {
        "reward/mean": [(1, 0.25), (2, 0.5)],
        "async/staleness_max": [(1, 1.0), (2, 0.0)],
        "loss/policy": [(2, -0.125)],
    }


def test_a_resumed_sink_cuts_the_rows_after_its_step_so_each_step_is_logged_once(tmp_path):
    """A learner resumed from step 2 trains steps 3.. again: metrics.jsonl and completions.jsonl
    keep steps 1-2 only (and a line a kill cut short goes too), then get the new 3, 4; without
    a resume step (None) nothing is cut; TensorBoard shows the new lineage's values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsSink(tmp_path)
    for step in (1, 2, 3, 4):
        first.log(step, {"reward/mean": 0.1 * step})
        first.log_completions(step, [{"prompt": "p", "response": "r"}])
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "reward/me')  # kill -9 mid-write
    MetricsSink(tmp_path, tensorboard=False).close()  # appending: nothing cut
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 5
    resumed = MetricsSink(tmp_path, resume_step=2)
    for step in (3, 4):
        resumed.log(step, {"reward/mean": 1.0 + step})
        resumed.log_completions(step, [{"prompt": "p", "response": "again"}])
    resumed.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward/mean"]) for r in rows] == [(1, 0.1), (2, 0.2), (3, 4.0), (4, 5.0)]
    done = [json.loads(x) for x in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [(r["step"], r["response"]) for r in done] == [
        (1, "r"), (2, "r"), (3, "again"), (4, "again")
    ]  # fmt: skip
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    values = [(e.step, round(e.value, 4)) for e in events.Scalars("reward/mean")]
    assert values == [(1, 0.1), (2, 0.2), (3, 4.0), (4, 5.0)]  # purged after step 2
    # a fresh start over a run that never reached a checkpoint (resume step 0) keeps nothing
    MetricsSink(tmp_path, tensorboard=False, resume_step=0).close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""
