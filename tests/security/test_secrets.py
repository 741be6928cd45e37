"""The Redis password never reaches the disk or a log (broker/connect/secrets.py).

A real password-protected redis-server and real `rollctl` processes: the password may come from the
URL, a file or the environment; the saved config holds none and is private (0600 in a 0700
directory); the children of `rollctl run` still connect; no log line shows it."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time

import pytest
import redis
import yaml

from rollflash.broker.config.config import ConfigError, load_config
from rollflash.broker.connect.secrets import (
    PASSWORD_ENV,
    make_private_dir,
    private_subdir,
    redact,
    with_password,
)
from rollflash.errors import BadInput

PASSWORD = "S3cret-pw/with:odd@chars"


@pytest.fixture
def protected_socket(tmp_path):
    """A redis-server on a unix socket that requires PASSWORD."""
    sock = tmp_path / "redis.sock"
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--unixsocket", str(sock), "--save", "",
         "--appendonly", "no", "--dir", str(tmp_path), "--requirepass", PASSWORD],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        client = redis.Redis(unix_socket_path=str(sock), password=PASSWORD)
        for _ in range(200):
            try:
                client.ping()
                break
            except (redis.ConnectionError, FileNotFoundError):
                time.sleep(0.05)
        yield sock
    finally:
        proc.kill()
        proc.wait()


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_saved_config_is_private_and_holds_no_password(tmp_path, monkeypatch):
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    url = "redis://learner:pw123@127.0.0.1:6379/0"
    cfg = load_config(None, [f"redis.url={url}", f"run.run_dir={tmp_path / 'run'}"])
    assert cfg.redis.url == url  # in memory, the processes connect with it
    cfg.save(tmp_path / "run" / "config.yaml")
    text = (tmp_path / "run" / "config.yaml").read_text()
    assert "pw123" not in text
    assert yaml.safe_load(text)["redis"]["url"] == "redis://learner@127.0.0.1:6379/0"
    assert _mode(tmp_path / "run") == 0o700 and _mode(tmp_path / "run" / "config.yaml") == 0o600
    # loaded back with the password in the environment, it connects as before
    monkeypatch.setenv(PASSWORD_ENV, "pw123")
    assert load_config(tmp_path / "run" / "config.yaml").redis.url == url


def test_password_file_and_its_errors(tmp_path, monkeypatch):
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    cfg = load_config(None, ["redis.url=redis://h:1", f"redis.password_file={secret}"])
    assert cfg.redis.url == "redis://:from-file@h:1"
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=r"^redis.password_file: cannot read a password from"):
        load_config(None, ["redis.url=redis://h:1", f"redis.password_file={missing}"])
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="the file is empty"):
        load_config(None, ["redis.url=redis://h:1", f"redis.password_file={tmp_path / 'empty'}"])
    with pytest.raises(ConfigError, match="already holds a password"):
        load_config(None, ["redis.url=redis://:x@h:1", f"redis.password_file={secret}"])


def test_redact_hides_every_password_form():
    assert redact("redis://u:p@h:1/0") == "redis://u:***@h:1/0"
    assert (
        redact("rediss://:p@h:1?ssl_ca_certs=/ca.pem") == "rediss://:***@h:1?ssl_ca_certs=/ca.pem"
    )
    assert redact("unix://u:p@/tmp/r.sock") == "unix://u:***@/tmp/r.sock"
    assert redact("redis://h:1") == "redis://h:1"


def _cli(*args, env=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollflash.rollctl.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_an_unreachable_redis_error_shows_no_password():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = _cli(
        "status",
        "--redis-url",
        f"redis://user:{PASSWORD}@127.0.0.1:{port}/0",
        "--set",
        "redis.connect_timeout_s=1",
    )
    assert out.returncode != 0
    assert PASSWORD not in out.stderr + out.stdout
    assert "user:***@127.0.0.1" in out.stderr


def _sim_run(run_dir, run_id: str, *sets: str) -> list[str]:
    """`--set` options of a short `rollctl run` with the simulated engine."""
    sets += (
        f"run.run_dir={run_dir}",
        f"run.run_id={run_id}",
        "rollout.engine=sim",
        "rollout.num_return_sequences=2",
        "rollout.max_new_tokens=8",
        "sim.per_token_s=0.001",
        "sim.length_median=4",
        "sim.learner_step_s=0.05",
        "trainer.rollout_batch_size=2",
        "trainer.total_steps=2",
        "trainer.wait_timeout_s=60",
        "eval.size=1",
    )
    return [f"--set={s}" for s in sets]


def test_rollctl_run_with_a_password_saves_and_logs_none(tmp_path, protected_socket):
    run_dir = tmp_path / "run"
    url = with_password(f"unix://{protected_socket}", PASSWORD)
    args = ["run", "--redis-url", url, "--generators", "1", *_sim_run(run_dir, "secret")]
    out = _cli(*args, env={PASSWORD_ENV: ""}, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert (run_dir / "summary.json").is_file()  # the children connected with the password
    assert _mode(run_dir) == 0o700
    for path in [*run_dir.rglob("*.yaml"), *run_dir.rglob("*.log"), *run_dir.rglob("*.jsonl")]:
        assert PASSWORD not in path.read_text(errors="replace"), path
    assert PASSWORD not in out.stdout + out.stderr


def test_a_shared_run_directory_keeps_its_mode_and_the_private_files_their_own(tmp_path):
    """`run.run_dir` naming a directory others share (here one of mode 1777, as /tmp): rollflash
    never changes its mode, and keeps what must stay private in directories it creates, 0700."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    sets = _sim_run(shared, "shared", "trainer.checkpoint_every=1")
    out = _cli("run", "--generators", "1", *sets, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert _mode(shared) == 0o1777  # sticky bit and all, as it was
    for private in ("weights", "checkpoints", "redis", "logs"):
        assert _mode(shared / private) == 0o700, private
    assert _mode(shared / "config.yaml") == _mode(shared / "run.yaml") == 0o600


def test_private_directories_are_made_0700_and_ones_others_can_write_refused(tmp_path):
    made = make_private_dir(tmp_path / "a" / "b" / "c")
    assert [_mode(tmp_path / p) for p in ("a", "a/b", "a/b/c")] == [0o700] * 3
    os.chmod(tmp_path / "a", 0o755)
    assert make_private_dir(tmp_path / "a") == tmp_path / "a" and _mode(tmp_path / "a") == 0o755
    assert private_subdir(made) == made
    os.chmod(made, 0o777)
    with pytest.raises(BadInput) as e:
        private_subdir(made)
    assert str(e.value) == (
        f"{made}: holds the run's private files but is owned by uid {os.geteuid()} with mode "
        "0777, which others can write or own; remove it, or choose another run.run_dir"
    )
    assert _mode(made) == 0o777  # refused, not changed
