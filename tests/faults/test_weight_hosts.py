"""Weights across hosts that share nothing but the network (`weights.transport: http`).

Each "host" is a network namespace made here (`ip netns`, one bridge between them) and a process
tree that sees only its own directory (bubblewrap mounts the host's directory at one common path
and hides the others): the learner, its publishing process and redis-server (password set, bound
to the learner's address) on one host, a generator on each of two others. The test itself never
connects to any of their addresses: it reads what they leave in their directories.

- Versions reach both generators over HTTP, and one generator relays a version to the other.
- kill -9 of the relaying generator while the other fetches from it (the relay stops itself in
  that request: tests/faults/relay_pause.py): the other fetches from the learner instead, and
  the run trains to its end with nothing lost and nothing trained twice.
Skipped, with the reason, where network namespaces cannot be made (not root, no `ip`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from harness import Child, stop_all, trained_ids, wait_until, write_config

HERE = Path(__file__).resolve().parent
SUBNET = "10.213.0"  # inside the namespaces only: nothing routes there from anywhere else
HOSTS = {"learner": 1, "gen-a": 2, "gen-b": 3}
STEPS, BATCH = 8, 2


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Network:
    """A switch namespace with a bridge, and one namespace per host plugged into it."""

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex[:6]
        self.switch = f"rf{self.token}sw"
        self.names = {host: f"rf{self.token}{i}" for host, i in HOSTS.items()}

    def make(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for host, i in HOSTS.items():
            ns = self.names[host]
            _ip("netns", "add", ns)
            _ip(
                "-n",
                self.switch,
                "link",
                "add",
                f"p{i}",
                "type",
                "veth",
                "peer",
                "eth0",
                "netns",
                ns,
            )
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def address(self, host: str) -> str:
        return f"{SUBNET}.{HOSTS[host]}"

    def remove(self) -> None:
        for ns in [*self.names.values(), self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@pytest.fixture
def network():
    why = None
    if os.geteuid() != 0:
        why = "not root"
    elif shutil.which("ip") is None or shutil.which("bwrap") is None:
        why = "`ip` (iproute2) or `bwrap` is not installed"
    net = Network()
    if why is None:
        try:
            net.make()
        except (subprocess.CalledProcessError, OSError) as e:
            err = getattr(e, "stderr", b"") or b""
            why = f"{e} {err.decode(errors='replace').strip()}"
    if why is not None:
        net.remove()
        print(f"network namespaces cannot be made here: {why}")
        pytest.skip(f"network namespaces cannot be made here: {why}")
    yield net
    net.remove()


class Hosts:
    """Each host's own directory, seen by its processes (and only it) at `mnt`."""

    def __init__(self, root: Path, net: Network):
        self.root, self.net = root, net
        self.mnt = root / "mnt"
        self.mnt.mkdir()
        (root / "hosts").mkdir()

    def dir(self, host: str) -> Path:
        return self.root / "hosts" / host

    def start(self, host: str, name: str, argv: list[str], env: dict[str, str]) -> Child:
        sandbox = [
            "ip", "netns", "exec", self.net.names[host],
            "bwrap", "--dev-bind", "/", "/", "--bind", str(self.dir(host)), str(self.mnt),
            "--tmpfs", str(self.root / "hosts"), "--die-with-parent", "--",
        ]  # fmt: skip
        log = self.dir(host) / f"{name}.stderr"
        return Child([*sandbox, *argv], log, {**os.environ, **env})


def _config(hosts: Hosts, host: str, password: str) -> None:
    """The run's config, the same on every host but for the address this host listens on."""
    d = hosts.dir(host)
    d.mkdir()
    redis_url = f"redis://{hosts.net.address('learner')}:6379/0"
    path = write_config(
        d,
        redis_url,
        "hosts",
        STEPS,
        BATCH,
        trainer={"checkpoint_every": 0},
        rollout={"reclaim_idle_s": 3, "heartbeat_ttl_s": 600},
    )
    cfg = yaml.safe_load(path.read_text())
    cfg["run"]["run_dir"] = str(hosts.mnt / "run")
    cfg["model"]["path"] = str(hosts.mnt / "no-model")  # the same on every host, as the run's keys
    cfg["weights"] = {"transport": "http", "listen": f"{hosts.net.address(host)}:0"}
    path.write_text(yaml.safe_dump(cfg))


def _stopped(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except FileNotFoundError:
        return False


def _python_pid(child: Child) -> int | None:
    """The generator itself: bubblewrap's child (None until bubblewrap has started it)."""
    try:
        children = Path(f"/proc/{child.pid}/task/{child.pid}/children").read_text().split()
    except FileNotFoundError:
        return None
    return int(children[0]) if children else None


def test_a_run_across_hosts_survives_kill_9_of_the_relaying_generator(tmp_path, network):
    hosts, password = Hosts(tmp_path, network), uuid.uuid4().hex
    for host in HOSTS:
        _config(hosts, host, password)
    env = {"ROLLFLASH_REDIS_PASSWORD": password, "ROLLFLASH_WEIGHTS_TOKEN": uuid.uuid4().hex}
    learner_ip = network.address("learner")
    redis_cmd = [
        "redis-server", "--bind", learner_ip, "--port", "6379", "--requirepass", password,
        "--save", "", "--appendonly", "no", "--dir", str(hosts.mnt),
    ]  # fmt: skip
    cli = [sys.executable, "-m", "rollflash.rollctl.cli"]
    pause = [sys.executable, str(HERE / "relay_pause.py")]
    config = ["--config", str(hosts.mnt / "run.yaml")]
    procs = [hosts.start("learner", "redis", redis_cmd, {})]
    try:
        procs.append(hosts.start("learner", "learner", [*cli, "start-learner", *config], env))
        paused = {**env, "RELAY_PAUSE_FROM": "2"}
        gens = {
            g: hosts.start(g, "generator", [*pause, "start-generator", *config, "--id", g], paused)
            for g in ("gen-a", "gen-b")
        }
        procs += list(gens.values())
        learner = procs[1]

        def relay_stopped() -> str | None:
            return next((g for g, c in gens.items() if _stopped(_python_pid(c))), None)

        wait_until(lambda: relay_stopped() or learner.poll() is not None, 300, "a relay to stop")
        relay = relay_stopped()
        assert relay is not None, learner.stderr_text()[-3000:]
        survivor = next(g for g in gens if g != relay)
        pid = _python_pid(gens[relay])
        assert pid is not None
        os.kill(pid, 9)  # mid-fetch: the survivor's request to it is waiting inside it
        assert learner.wait(timeout=300) == 0, learner.stderr_text()[-3000:]
        assert gens[survivor].wait(timeout=60) == 0, gens[survivor].stderr_text()[-3000:]
    finally:
        stop_all(procs)
    run_dir = hosts.dir("learner") / "run"
    ids = trained_ids(run_dir)
    assert len(ids) == len(set(ids)) == STEPS * BATCH  # every group trained, none twice
    logs = {g: c.stderr_text() for g, c in gens.items()}
    urls = {g: re.search(r"relaying weight versions at (\S+)", logs[g]).group(1) for g in gens}
    assert all(urls[g].startswith(f"http://{network.address(g)}:") for g in gens)
    # one generator loaded a version that the other relayed to it ...
    relayed = [
        line
        for g, other in (("gen-a", "gen-b"), ("gen-b", "gen-a"))
        for line in logs[g].splitlines()
        if "loaded weights" in line and f"B from {urls[other]})" in line
    ]
    assert relayed, logs
    # ... and the survivor fetched the version it was fetching from the killed relay from the
    # learner instead
    weight_lines = {g: [ln for ln in logs[g].splitlines() if "weights" in ln] for g in gens}
    assert f"relay {urls[relay]} failed" in logs[survivor], weight_lines
    failed = logs[survivor].index(f"relay {urls[relay]} failed")
    learner_url = rf"http://{learner_ip}:\d+"
    assert re.search(
        rf"B from {learner_url}; failed over from {urls[relay]}", logs[survivor][failed:]
    )
    # nothing but the network was shared: no host wrote into another's directory
    assert not any(hosts.mnt.iterdir())
    assert {p.name for p in (hosts.dir("gen-a") / "run").iterdir()} == {"local"}
