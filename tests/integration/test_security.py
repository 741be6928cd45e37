"""Security on the wire, checked for real.

- TLS: a redis-server with `--tls-port` and certificates made by openssl here; a learner and a
  generator process run a short training over `rediss://` as least-privilege ACL users (user and
  password in the URL), and `rollctl status` reads it. Plain TCP and a wrong password are refused
  with one clear line, fast.
- The embedded redis-server opens no TCP socket: only a unix socket with mode 700.
- No pickle: decoding wire entries and loading weights never reaches pickle (it is made to fail
  while they run), msgpack is always called with explicit limits, and a pickled "weights" file is
  refused.
"""

import pickle
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
import redis
import torch

from rollflash.broker.connect.acl import generator_acl, learner_acl
from rollflash.broker.connect.connection import BrokerUnavailable, connect
from tests.helpers.certs import make_certs

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def tls_redis(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make test certificates")
    make_certs(tmp_path)
    port = _free_port()
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            "0",
            "--bind",
            "127.0.0.1",
            "--tls-port",
            str(port),
            "--tls-cert-file",
            "server.pem",
            "--tls-key-file",
            "server.key",
            "--tls-ca-cert-file",
            "ca.pem",
            "--tls-auth-clients",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        cwd=tmp_path,
        stdout=open(tmp_path / "redis.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    ca = tmp_path / "ca.pem"
    admin_url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}"
    try:
        admin = connect(admin_url, 10)
    except BrokerUnavailable:
        proc.kill()
        proc.wait()
        log = (tmp_path / "redis.log").read_text(errors="replace")
        if "tls" in log.lower() and ("directive" in log or "not supported" in log.lower()):
            pytest.skip("this redis-server was built without TLS support")
        raise
    yield port, ca, admin
    proc.kill()
    proc.wait()


def test_a_run_over_tls_with_acl_users(tmp_path, tls_redis, run_id):
    port, ca, admin = tls_redis
    admin.execute_command("ACL", "SETUSER", "gen", *generator_acl(run_id, "gen-0", "g-pw"))
    admin.execute_command("ACL", "SETUSER", "lrn", *learner_acl(run_id, "l-pw"))
    url = f"rediss://{{user}}:{{pw}}@127.0.0.1:{port}/0?ssl_ca_certs={ca}"
    common = [
        "--set",
        f"run.run_id={run_id}",
        "--set",
        f"run.run_dir={tmp_path / 'run'}",
        "--set",
        "rollout.engine=sim",
        "--set",
        "rollout.num_return_sequences=2",
        "--set",
        "sim.learner_step_s=0.05",
        "--set",
        "sim.length_median=8",
        "--set",
        "trainer.rollout_batch_size=2",
        "--set",
        "trainer.total_steps=3",
        "--set",
        "eval.size=1",
        "--set",
        "redis.connect_timeout_s=10",
    ]
    cli = [sys.executable, "-m", "rollflash.rollctl.cli"]
    # the generator's stderr to a file: a pipe nobody reads during the run could fill and block it
    gen_err = tmp_path / "gen-0.stderr"
    with open(gen_err, "wb") as err_file:
        gen = subprocess.Popen(
            [
                *cli,
                "start-generator",
                *common,
                "--id",
                "gen-0",
                "--redis-url",
                url.format(user="gen", pw="g-pw"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=err_file,
        )
    learner = subprocess.run(
        [*cli, "start-learner", *common, "--redis-url", url.format(user="lrn", pw="l-pw")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    try:
        assert learner.returncode == 0, learner.stderr[-3000:]
        assert gen.wait(timeout=30) == 0, gen_err.read_text()[-3000:]
    finally:
        if gen.poll() is None:
            gen.kill()
    status = subprocess.run(
        [*cli, "status", *common, "--json", "--redis-url", url.format(user="lrn", pw="l-pw")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0 and '"state": "done"' in status.stdout, status.stderr
    # what is refused, in one line and without 30 s of retries
    wrong = subprocess.run(
        [*cli, "status", *common, "--redis-url", url.format(user="gen", pw="nope")],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert wrong.returncode == 2
    assert "refused the credentials" in wrong.stderr and "nope" not in wrong.stderr
    with pytest.raises(BrokerUnavailable):
        connect(f"redis://127.0.0.1:{port}/0", 1.0)  # plaintext to the TLS port
    with pytest.raises(BrokerUnavailable, match="ssl_ca_certs"):
        connect(f"rediss://127.0.0.1:{port}/0", 10.0)  # a CA the client does not trust


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().as_posix()
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def test_embedded_redis_listens_on_a_private_unix_socket_only():
    from rollflash.broker.connect.redis_server import EmbeddedRedis

    with EmbeddedRedis() as server:
        inodes = _socket_inodes(server.proc.pid)
        tcp = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if cols[9] in inodes:
                    tcp.append((table, cols[1], cols[3]))
        assert tcp == [], f"embedded redis-server has TCP sockets: {tcp}"
        assert stat.S_IMODE(server.socket.stat().st_mode) & 0o077 == 0
        assert redis.Redis.from_url(server.url).config_get("port") == {"port": "0"}


def test_nothing_on_the_wire_or_in_weights_reaches_pickle(tmp_path, monkeypatch):
    from rollflash.broker.weights.notify import VersionPublisher, VersionSubscriber  # noqa: F401 (imports work)
    from rollflash.broker.weights.weight_chain import verified_tensors
    from rollflash.broker.weights.weights import CorruptWeights, WeightStore
    from rollflash.broker.wire.schema import (
        PromptWork,
        Sample,
        Trajectory,
        decode_prompt,
        decode_trajectory,
        encode_prompt,
        encode_trajectory,
    )
    from rollflash.broker.wire.wire import WireLimits
    from rollflash.generators.sim_engine import SimEngine  # noqa: F401

    calls = []
    real_unpacker = msgpack.Unpacker

    def checked_unpacker(*args, **kw):
        calls.append(kw)
        return real_unpacker(*args, **kw)

    def forbidden(*a, **k):
        raise AssertionError("pickle was called")

    monkeypatch.setattr(msgpack, "Unpacker", checked_unpacker)
    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    monkeypatch.setattr(torch, "load", forbidden)

    def fields(d):
        return {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in d.items()}

    w = PromptWork("p", "g", 2, 0, {"id": "p", "prompt": "1+1=", "answer": "2"})
    assert decode_prompt(fields(encode_prompt(w)), 10_000) == w
    s = Sample(
        np.array([5], np.int32), np.array([-1.0], np.float32), np.array([0], np.int32), 1.0, True
    )
    t = Trajectory("g", "p", "g", "gen", 0, 0, np.array([1], np.int32), [s])
    assert decode_trajectory(fields(encode_trajectory(t)), WireLimits(10_000, 10)).traj_id == "g"
    store = WeightStore(tmp_path)
    store.publish({"w": torch.ones(3)}, 1, 1)
    assert verified_tensors(store, 1)["w"].sum() == 3
    assert calls and all(
        kw.get("max_bin_len")
        and kw.get("max_str_len")
        and kw.get("max_array_len")
        and kw.get("max_map_len")
        for kw in calls
    )
    # a pickle posing as weights, with a manifest that matches it, is still refused
    monkeypatch.undo()
    model = store.version_dir(1) / "model.safetensors"
    torch.save({"w": torch.ones(3)}, model)
    import json

    from rollflash.broker.weights.digest import file_digest

    manifest = json.loads((model.parent / "manifest.json").read_text())
    manifest["files"]["model.safetensors"] = file_digest(model.read_bytes()).manifest_entry()
    (model.parent / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptWeights, match="(?i)header"):
        verified_tensors(store, 1)
