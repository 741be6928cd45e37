"""`rollflash.Run` before it trains: how a config and its sections become the run's config, and
how callables among the reward functions become the specs the processes see."""

from pathlib import Path

import pytest

from rollflash.broker.config.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_sections_replace_keys_and_callables_become_specs():
    from rollflash import Run

    def exact(prompt, response, answer, **row):
        return 1.0

    run = Run(
        ROOT / "configs" / "demo.yaml",
        trainer={"total_steps": 5},
        rollout={"vllm": {"max_num_seqs": 4}},
        reward={"functions": ["math", exact, lambda *a, **k: 0.0, lambda *a, **k: 1.0]},
    )
    cfg = run.config
    assert cfg.trainer.total_steps == 5 and cfg.trainer.rollout_batch_size == 32  # the file's
    assert cfg.rollout.vllm.max_num_seqs == 4 and cfg.rollout.temperature == 1.0
    assert cfg.reward.functions == ["math", "python:exact", "python:lambda", "python:lambda_2"]
    assert set(run.functions) == {"python:exact", "python:lambda", "python:lambda_2"}
    # what the file leaves open stays open: rollctl run still chooses the generator count
    assert "num_rollout_workers" not in cfg.rollout.model_fields_set
    again = Run(load_config(ROOT / "configs" / "demo.yaml")).config
    assert "num_rollout_workers" not in again.rollout.model_fields_set


def test_bad_sections_and_callables_with_several_ranks_are_one_line():
    from rollflash import Run

    with pytest.raises(ConfigError, match=r"^trainer: expected a mapping of the section's keys"):
        Run(None, trainer=5)
    with pytest.raises(ConfigError, match=r"^trainer.total_stepz: unknown key"):
        Run(None, trainer={"total_stepz": 5})
    with pytest.raises(ConfigError, match=r"^trainer.num_trainer_workers: reward functions given"):
        Run(None, trainer={"num_trainer_workers": 2}, reward={"functions": [lambda *a: 1.0]})


def test_rows_in_memory_become_the_dataset_task_reading_the_run_directory(tmp_path):
    from rollflash import Run

    rows = [{"question": "1+1=", "answer": "2"}, {"question": "2+2=", "answer": "4"}]
    run = Run(
        ROOT / "configs" / "demo.yaml",  # its task (arithmetic, ops) gives way to the rows
        run={"run_dir": str(tmp_path / "run")},
        dataset=rows,
        eval_dataset=rows[:1],
        task={"params": {"prompt_key": "question"}},
        reward={"functions": ["exact"]},
    )
    task = run.config.task
    assert task.name == "dataset"
    assert task.params == {
        "prompt_key": "question",
        "path": str(tmp_path / "run" / "data" / "train.jsonl"),
        "eval_path": str(tmp_path / "run" / "data" / "eval.jsonl"),
    }
    assert run.status() == {
        "state": "not started",
        "step": 0,
        "total_steps": 150,
        "exit_code": None,
        "run_dir": str(tmp_path / "run"),
    }
    with pytest.raises(Exception, match="has not started"):
        run.wait()
    with pytest.raises(ConfigError, match=r"^task.params.path: 'x.jsonl' and dataset= name two"):
        Run(None, dataset=rows, task={"name": "dataset", "params": {"path": "x.jsonl"}})
    with pytest.raises(ConfigError, match=r"^eval_dataset: needs the training rows too"):
        Run(None, eval_dataset=rows)
    with pytest.raises(ConfigError, match=r"^task.name: 'oneliner' and dataset= name two tasks"):
        Run(None, dataset=[{"prompt": "a", "answer": "b"}], task={"name": "oneliner"})


def test_rows_are_written_once_checked_and_fixed_once_trained(tmp_path):
    from rollflash.rollctl.api_data import write_rows

    path = tmp_path / "run" / "data" / "train.jsonl"
    write_rows([{"prompt": "1+1=", "answer": "2"}], path, "dataset")
    assert path.read_text() == '{"prompt": "1+1=", "answer": "2"}\n'
    before = path.stat().st_mtime_ns
    write_rows([{"prompt": "1+1=", "answer": "2"}], path, "dataset")  # the same rows: kept
    assert path.stat().st_mtime_ns == before
    write_rows([{"prompt": "3+3=", "answer": "6"}], path, "dataset")  # not trained yet: replaced
    assert "3+3=" in path.read_text()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')  # now it has trained
    with pytest.raises(ConfigError, match=r"^dataset: .* holds other rows, which this run has"):
        write_rows([{"prompt": "4+4=", "answer": "8"}], path, "dataset")
    assert "3+3=" in path.read_text()
    bad = [
        ([{"prompt": "a"}, "row"], r"^dataset\[1\]: expected a mapping of columns, got 'row'"),
        ([{"prompt": object()}], r"^dataset\[0\]: not JSON data"),
        ([], r"^dataset: no rows"),
    ]
    for rows, message in bad:
        with pytest.raises(ConfigError, match=message):
            write_rows(rows, tmp_path / "other.jsonl", "dataset")
    assert not list(tmp_path.glob(".*.tmp")) and not (tmp_path / "other.jsonl").exists()


def test_an_empty_dataset_is_no_dataset_left_out_but_an_error_at_start(tmp_path):
    from rollflash import Run

    run = Run(
        None, run={"run_dir": str(tmp_path / "run")}, dataset=[], reward={"functions": ["exact"]}
    )
    assert run.config.task.name == "dataset"
    with pytest.raises(ConfigError, match=r"^dataset: no rows"):
        run.start()
    assert run.status()["state"] == "not started"
