"""Weight store faults with real processes.

- A process publishing versions in a loop through the learner's `Publisher` (in the step:
  `trainer.background_publish: false`) is killed with SIGKILL at several points of a publish: no
  partial version is ever listed or loadable, every listed version verifies against its
  manifest, every version it announced verifies against the digest announced and the
  announcements only go up, and `clean_temp` at the next start removes what the killed publisher
  left; publishing then continues.
- Retention never deletes a version that a live generator reports as loaded: a real learner with
  `keep_versions: 1` runs while a generator heartbeat reports v0.
"""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import redis
from harness import start, stop_all, trained_ids, wait_until, write_config

from rollflash.broker.weights.weight_chain import verified_tensors
from rollflash.broker.weights.weights import WeightStore

PUBLISHER = textwrap.dedent("""
    import sys, torch
    from rollflash.broker.config.config import load_config
    from rollflash.learner.durability.publish import Publisher
    from rollflash.learner.durability.publish_process import NewVersion

    class Broker:  # the weights hash: one line per announcement, in the order made
        def announce_weights(self, version, path, sha256, zmq_endpoint, http_url=""):
            with open(sys.argv[2], "a") as log:
                log.write(f"{version} {sha256}\\n")
        def loaded_versions(self):
            return set()
        def check_lease(self):  # the run's lease: this process is the only publisher
            pass

    # bare tensors, no probe: this broker has no Redis side to judge generators' reports with
    overrides = [
        "trainer.background_publish=false", "trainer.keep_versions=1000", "weights.probe=false"
    ]
    cfg = load_config(None, [f"run.run_dir={sys.argv[1]}", *overrides])
    publisher = Publisher(cfg, Broker(), resuming=True)  # removes a killed run's temp dirs
    v = max(publisher.store.versions(), default=0)
    print("ready", flush=True)
    while True:
        v += 1
        # ~32 MB: a publish (write, fsync, hash, rename) takes long enough to be hit mid-way
        publisher.publish({"w": torch.full((2048, 4096), float(v))}, NewVersion(v, step=v))
        print(v, flush=True)
""")


def _check_store(store: WeightStore, announcements: Path) -> None:
    for v in store.versions():
        verified_tensors(store, v)  # raises CorruptWeights for anything partial
    if store.latest() is not None:
        verified_tensors(store, store.latest())
    lines = announcements.read_text().splitlines() if announcements.exists() else []
    announced = [(int(v), sha) for v, sha in (line.split() for line in lines)]
    assert [v for v, _ in announced] == sorted({v for v, _ in announced})  # only ever up
    for v, sha in announced:  # announced only once durable: each loads as announced
        verified_tensors(store, v, expect_sha256=sha)


def _stopped_inside_a_publish(proc: subprocess.Popen, store: WeightStore) -> bool:
    """Stop the publisher (SIGSTOP) and say whether it is inside a publish: its temp dir is on
    disk, and stays there while it is stopped. Resumed otherwise, to be looked at again."""
    if not list(store.root.glob(".tmp-*")):
        return False
    os.kill(proc.pid, signal.SIGSTOP)
    wait_until(lambda: _state(proc.pid) == "T", 60, "the publisher to stop")
    if list(store.root.glob(".tmp-*")):
        return True
    os.kill(proc.pid, signal.SIGCONT)
    return False


def _state(pid: int) -> str:
    """The process state /proc shows (after the command's parentheses): T when stopped."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def test_publisher_killed_mid_publish_leaves_nothing_loadable_and_is_cleaned(
    tmp_path, fault_report
):
    store = WeightStore(tmp_path)
    announcements = tmp_path / "announced.txt"
    leftovers = 0
    # the kill points, each reached by an event, not a delay: at once after start-up; held
    # inside a publish (a temp dir on disk while the process is stopped); after a publish the
    # store lists
    points = ["at start-up", "inside a publish", "after a listed version"] * 2
    for k, point in enumerate(points):
        # stderr to a file, not a pipe: nobody reads a pipe while the publisher runs, and a
        # full one would block it
        err = tmp_path / f"publisher-{k}.stderr"
        with open(err, "wb") as err_file:
            proc = subprocess.Popen(
                [sys.executable, "-c", PUBLISHER, str(tmp_path), str(announcements)],
                stdout=subprocess.PIPE,
                stderr=err_file,
            )
        assert proc.stdout.readline() == b"ready\n", err.read_text()[-2000:]
        listed = store.versions()
        if point == "inside a publish":
            wait_until(lambda p=proc: _stopped_inside_a_publish(p, store), 300, "a held publish")
        elif point == "after a listed version":
            wait_until(lambda v=listed: store.versions() != v, 300, "a publish the store lists")
        proc.kill()
        proc.wait()
        proc.stdout.close()
        assert proc.returncode == -9, err.read_text()[-2000:]
        _check_store(store, announcements)
        partial = list(store.root.glob(".tmp-*")) + list(store.root.glob(".LATEST.*"))
        assert partial or point != "inside a publish"  # killed while it was held there
        leftovers += bool(partial)
        assert all(
            p.name.startswith((".tmp-", ".LATEST."))
            for p in store.root.iterdir()
            if not p.name.startswith("v") and p.name != "LATEST"
        )
        # the next start (a fresh publisher process) cleans up before it publishes
        assert store.clean_temp() == len(partial)
        assert list(store.root.glob(".*")) == []
    assert len(store.versions()) >= 2  # one per "after a listed version" at least
    fault_report(
        "publisher kill -9 mid-publish (6 points)",
        injected=len(points),
        recovered=len(points),
        lost=0,
        reported=f"{leftovers} cleaned",
        duplicated=0,
        dropped_duplicates=0,
    )


def test_retention_spares_a_version_a_live_generator_has_loaded(tmp_path, redis_url, run_id):
    steps = 6
    config = write_config(tmp_path, redis_url, run_id, steps, 2, trainer={"keep_versions": 1})
    r = redis.Redis.from_url(redis_url)
    # a generator still running on v0 (its heartbeat, as generators/rollout.py writes it, and
    # its request to join)
    r.hset(f"rl:{run_id}:gen:slow-gen", mapping={"loaded_version": 0, "state": "up"})
    r.expire(f"rl:{run_id}:gen:slow-gen", 3600)  # live throughout the run, however slow
    r.sadd(f"rl:{run_id}:joined", "slow-gen")
    gen = start("start-generator", config, "--id", "gen-0")
    learner = start("start-learner", config)
    try:
        assert learner.wait(timeout=600) == 0, learner.stderr_text()[-3000:]
        assert gen.wait(timeout=300) == 0
    finally:
        stop_all([learner, gen])
    versions = WeightStore(tmp_path / "run").versions()
    assert 0 in versions  # spared: a live generator reports it loaded
    assert steps in versions
    assert len(versions) < steps + 1  # retention did delete the others
    assert len(trained_ids(tmp_path / "run")) == steps * 2
