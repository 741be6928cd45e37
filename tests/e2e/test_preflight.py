"""Mistakes found before anything starts (rollctl/preflight.py): `rollctl run` ends with exit
code 2 and one line naming the key and the file, with no redis-server started and no process
(its run directory is not even created); `start-learner` and `start-generator` check what their
role needs before they reach for Redis. The cases are the README's own-data example with one
mistake each (scripts/bench_preflight.py, which also times them: docs/testing.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rollflash.broker.config.config import load_config
from rollflash.rollctl.preflight import preflight
from scripts.bench_preflight import CASES, run_case, write_project


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("project")
    return root, write_project(root, tiny_model_dir)


def test_the_project_itself_passes(project, monkeypatch):
    root, config = project
    monkeypatch.chdir(root)
    monkeypatch.delenv("ROLLFLASH_PREFLIGHT_DONE", raising=False)
    preflight(load_config(config), ("learner", "generator"), children_env={})


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_mistake_is_one_line_before_anything_starts(project, case):
    root, config = project
    mistake, line = CASES[case]
    out, _ = run_case(root, config, mistake)
    assert out.returncode == 2, out.stderr[-3000:]
    (only,) = out.stderr.splitlines()  # once, not once per process
    assert only.startswith(line), only
    assert out.stdout == ""  # not even the layout: nothing was planned
    assert not (root / "runs").exists()  # no redis-server (its socket and dump live there)


def _role(root, config, role: str, mistake: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollflash.rollctl.cli", role, "--config", str(config)]
        + ["--set", mistake, "--redis-url", f"unix://{root}/no-redis.sock"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_each_command_checks_its_role_before_redis(project):
    """The error is the mistake's, not the Redis that is not there: checked first. A generator
    never reads the data rows, so it goes on to Redis."""
    root, config = project
    model, model_line = CASES["missing model"]
    data, data_line = CASES["missing data file"]
    for role in ("start-learner", "start-generator"):
        out = _role(root, config, role, model)
        assert out.returncode == 2 and out.stderr.splitlines()[-1].startswith(model_line)
    learner = _role(root, config, "start-learner", data)
    assert learner.returncode == 2 and learner.stderr.splitlines() == [data_line]
    generator = _role(root, config, "start-generator", data)
    assert generator.returncode == 2
    assert generator.stderr.splitlines()[-1].startswith("rollctl: error: cannot reach Redis")
