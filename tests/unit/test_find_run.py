"""rollctl/find.py and the connection options of `rollctl redis-cli`: which run directory a
command names, and how redis-cli is pointed at a URL (the password never on its command line)."""

import os

import pytest
import yaml

from rollflash.errors import MissingFile
from rollflash.rollctl.find import find_run_dir
from rollflash.rollctl.operate import redis_cli_argv


def _run(root, name, run_id, mtime):
    d = root / "runs" / name
    d.mkdir(parents=True)
    (d / "run.yaml").write_text(yaml.safe_dump({"run": {"run_id": run_id}}))
    os.utime(d / "run.yaml", (mtime, mtime))
    return d


def test_a_run_by_directory_by_id_or_the_newest(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _run(tmp_path, "demo", "demo", 1000)
    _run(tmp_path, "exp-2", "sweep7", 3000)  # its directory is not named after its id
    _run(tmp_path, "old", "old", 2000)
    assert str(find_run_dir(None, None)) == "runs/exp-2"  # the newest config
    assert str(find_run_dir("demo", None)) == "runs/demo"
    assert str(find_run_dir("sweep7", None)) == "runs/exp-2"
    assert str(find_run_dir("runs/old", None)) == "runs/old"
    assert find_run_dir(None, tmp_path / "runs" / "demo") == tmp_path / "runs" / "demo"


def test_no_run_is_one_line_naming_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MissingFile) as e:
        find_run_dir(None, None)
    assert str(e.value) == (
        "no run under runs/ (no run.yaml or config.yaml): name one with --run-dir DIR or "
        "--run RUN_ID, or --config FILE"
    )
    with pytest.raises(MissingFile, match=r"^runs/nope: not a run directory \(no run.yaml"):
        find_run_dir("nope", None)


@pytest.mark.parametrize(
    "url, argv, env",
    [
        ("unix:///r/redis.sock", ["-s", "/r/redis.sock"], {}),
        (
            "redis://rl-x-learner:p%40ss@host:6380/2",
            ["-h", "host", "-p", "6380", "--user", "rl-x-learner", "-n", "2"],
            {"REDISCLI_AUTH": "p@ss"},
        ),
        (
            "rediss://host:6380/0?ssl_ca_certs=/ca.pem",
            ["-h", "host", "-p", "6380", "-n", "0", "--tls", "--cacert", "/ca.pem"],
            {},
        ),
    ],
)
def test_redis_cli_gets_the_url_with_the_password_in_its_environment(url, argv, env):
    assert redis_cli_argv(url) == (argv, env)
