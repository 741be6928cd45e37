"""Preference files for `rollctl train-rm` (learner/tools/rm_training.py): every bad line is rejected
with its line number before any training; the split and the lr schedule by hand."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollflash.learner.tools.preferences import (
    PreferenceFileError,
    PreferencePair,
    load_preferences,
    split_pairs,
)
from rollflash.learner.tools.rm_training import lr_schedule

ROOT = Path(__file__).resolve().parents[2]
GOOD = json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "3"})


def _write(tmp_path, lines) -> Path:
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_loads_pairs_and_skips_blank_lines(tmp_path):
    path = _write(tmp_path, [GOOD, "", json.dumps({"prompt": "", "chosen": "a", "rejected": "b"})])
    assert load_preferences(path) == [
        PreferencePair("1+1=", "2", "3"),
        PreferencePair("", "a", "b"),
    ]


@pytest.mark.parametrize(
    "bad, message",
    [
        ('{"prompt": "1+1=", "chosen": "2"', "not valid JSON"),
        (json.dumps({"prompt": "1+1=", "chosen": "2"}), "missing field 'rejected'"),
        (json.dumps({"chosen": "2", "rejected": "3"}), "missing field 'prompt'"),
        (json.dumps({"prompt": "1+1=", "chosen": "", "rejected": "3"}), "field 'chosen' is empty"),
        (
            json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "  "}),
            "field 'rejected' is empty",
        ),
        (
            json.dumps({"prompt": "1+1=", "chosen": 2, "rejected": "3"}),
            "field 'chosen' must be a string",
        ),
        (json.dumps(["1+1=", "2", "3"]), "expected a JSON object"),
        (
            json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "2"}),
            "'chosen' and 'rejected' are the same text",
        ),
    ],
)
def test_bad_line_names_file_and_line(tmp_path, bad, message):
    path = _write(tmp_path, [GOOD, GOOD, bad, GOOD])
    with pytest.raises(PreferenceFileError) as e:
        load_preferences(path)
    assert str(e.value).startswith(f"{path}:3: {message}")
    assert "\n" not in str(e.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="rm.dataset: no preference file"):
        load_preferences(tmp_path / "nope.jsonl")
    with pytest.raises(PreferenceFileError, match="no preference pairs"):
        load_preferences(_write(tmp_path, ["", ""]))


def test_split_and_lr_schedule():
    pairs = [PreferencePair("p", str(i), "x") for i in range(10)]
    train, held = split_pairs(pairs, 0.25)  # ceil(2.5) = 3 held out, the last three
    assert [p.chosen for p in held] == ["7", "8", "9"] and len(train) == 7
    assert len(split_pairs(pairs[:2], 0.9)[0]) == 1  # at least one left to train on
    # total 100 -> warm-up 10 steps. LambdaLR step k is optimiser step k + 1:
    # k = 4 -> 5/10; k = 9 -> 10/10; k = 10 starts the cosine at 1.0;
    # k = 55: p = 45/90 = 0.5 -> 0.1 + 0.9 * 0.5 * (1 + cos(pi/2)) = 0.55; k = 100: p = 1 -> 0.1
    f = lr_schedule(100)
    assert (f(0), f(4), f(9), f(10)) == (0.1, 0.5, 1.0, 1.0)
    assert f(55) == pytest.approx(0.55, abs=1e-12) and f(100) == pytest.approx(0.1, abs=1e-12)


def test_cli_rejects_a_bad_file_with_its_line_number(tmp_path):
    path = _write(tmp_path, [GOOD, json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": ""})])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollflash.rollctl.cli",
            "train-rm",
            "--set",
            f"rm.dataset={path}",
            "--set",
            f"run.run_dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().splitlines()[-1]
        == f"rollctl: error: {path}:2: field 'rejected' is empty"
    )


@pytest.mark.parametrize(
    "data, message",
    [
        ({"reward": {"type": "model"}}, "reward.model_path: reward.type 'model' needs"),
        (
            {"reward": {"model_path": "models/rm"}},
            "reward.model_path: set, but reward.type is 'rule'",
        ),
        ({"reward": {"type": "rm"}}, "reward.type: must be one of ['rule', 'model', 'mixed']"),
        ({"reward": {"weight_model": -1}}, "reward.weight_model: must be >= 0"),
        ({"rm": {"eval_split": 1.0}}, "rm.eval_split: must be in (0, 1)"),
        (
            {"rm": {"train_batch_size": 48, "micro_train_batch_size": 32}},
            "rm.train_batch_size: must be a multiple",
        ),
        ({"rm": {"learnin_rate": 1}}, "rm.learnin_rate: unknown key"),
        (
            {"algo": {"kl_target": 0.1}},
            "algo.kl_coef: algo.kl_target 0.1 needs > 0.0",
        ),
        ({"algo": {"kl_coef": 0.1, "kl_target": -1}}, "algo.kl_target: must be > 0 or null"),
        ({"guards": {"patience": 0}}, "guards.patience: must be > 0"),
    ],
)
def test_rlhf_config_errors_name_the_key(data, message):
    from rollflash.broker.config.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert str(e.value).startswith(message), str(e.value)
