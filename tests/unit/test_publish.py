"""learner/durability/publish.py with `trainer.background_publish: false` (the step writes the version; the
helper process is tests/integration/test_publish_process.py). A version

- is announced (the `weights` hash, then zmq) only once its manifest is durable: while it is being
  written it is neither listed, nor loadable, nor announced;
- holds the weights of the step that published it, cast to `trainer.publish_dtype`;
- if its write fails, is never announced, leaves nothing in the store, and the error reaches the
  caller.

Also: a checkpoint never gathers the full weights (only publishing does, once per step), and an
announcement repeated by the audit cannot take the `weights` hash back to an older version.
The broker is a stand-in that checks, at the moment of each announcement, that the version is
complete and verifies against the digest announced."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from rollflash.broker.channels.registry import RunRegistry
from rollflash.broker.config.config import load_config
from rollflash.broker.weights import weights as weights_module
from rollflash.broker.weights.weight_chain import verified_tensors
from rollflash.broker.weights.weights import MODEL_FILE, CorruptWeights, WeightStore
from rollflash.learner.durability.checkpoint import CheckpointStore, LearnerState
from rollflash.learner.durability.checkpoint_io import Trainables
from rollflash.learner.durability.publish import Publisher, publish
from rollflash.learner.durability.publish_process import NewVersion
from rollflash.learner.models import lora as lora_module

WAIT_S = 30  # only ever reached when the code under test is broken


class _Broker:
    """The learner's broker as the publisher uses it; every announcement is checked then."""

    def __init__(self, store: WeightStore) -> None:
        self.store = store
        self.announced: list[tuple[int, str]] = []

    def announce_weights(
        self, version: int, path: str, sha256: str, zmq_endpoint: str, http_url: str = ""
    ) -> None:
        assert version in self.store.versions() and self.store.latest() == version
        verified_tensors(self.store, version, expect_sha256=sha256)  # complete and intact
        self.announced.append((version, sha256))

    def loaded_versions(self) -> set[int]:
        return set()

    def check_lease(self) -> None:  # the run's lease: held by this learner throughout
        pass


class _GatedWrites:
    """Wraps the store's file writer: records how many writes overlap, and can hold a version's
    write until released: after its tensors are written, before its manifest (`hold`), or before
    anything is written (`hold_before`)."""

    def __init__(
        self,
        monkeypatch,
        hold: set[int] = frozenset(),
        hold_before: set[int] = frozenset(),
        fail: set[int] = frozenset(),
    ):
        self.real = weights_module.write_safetensors
        self.hold, self.hold_before, self.fail = hold, hold_before, fail
        self.written = {v: threading.Event() for v in hold}
        self.release = {v: threading.Event() for v in hold | hold_before}
        self.in_flight = self.most_in_flight = 0
        self.started: list[int] = []
        self.lock = threading.Lock()
        monkeypatch.setattr(weights_module, "write_safetensors", self)

    def __call__(self, tensors, path, metadata=None):
        version = int(path.parent.name.split("-")[1][1:])  # .tmp-v00000003-<pid>
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self.started.append(version)
        try:
            if version in self.fail:
                raise OSError(28, "No space left on device")
            if version in self.hold_before:
                assert self.release[version].wait(WAIT_S)
            out = self.real(tensors, path, metadata)
            if version in self.hold:
                self.written[version].set()
                assert self.release[version].wait(WAIT_S)
            return out
        finally:
            with self.lock:
                self.in_flight -= 1


# full files (the gate holds a model file's write; deltas: tests/unit/test_delta.py), no probe
# (the models here are bare modules; tests/unit/test_probe.py)
WHOLE = ["weights.anchor_every=1", "weights.probe=false"]


def _publisher(tmp_path) -> tuple[Publisher, _Broker]:
    cfg = load_config(None, [f"run.run_dir={tmp_path}", "trainer.background_publish=false", *WHOLE])
    store = WeightStore(tmp_path)
    broker = _Broker(store)
    return Publisher(cfg, broker, resuming=False), broker


def _learner(tmp_path, model: torch.nn.Module, dtype: str = "auto") -> SimpleNamespace:
    """The parts `publish` takes: the model, rank 0's publisher, the rank and the config."""
    publisher, broker = _publisher(tmp_path)
    return SimpleNamespace(
        cfg=load_config(
            None, [f"run.run_dir={tmp_path}", f"trainer.publish_dtype={dtype}", *WHOLE]
        ),
        models=SimpleNamespace(model=model),
        dist=SimpleNamespace(is_main=True, device=torch.device("cpu")),
        publisher=publisher,
        broker=broker,
    )


def test_a_version_being_written_is_invisible_until_its_manifest_is_durable(tmp_path, monkeypatch):
    gate = _GatedWrites(monkeypatch, hold={2})
    publisher, broker = _publisher(tmp_path)
    store = publisher.store
    publisher.publish({"w": torch.full((4,), 1.0)}, NewVersion(1, 1))
    # the step publishing v2, in a thread of the test, held after its tensors are written
    second = threading.Thread(
        target=publisher.publish, args=({"w": torch.full((4,), 2.0)}, NewVersion(2, 2)), daemon=True
    )
    second.start()
    assert gate.written[2].wait(WAIT_S)  # v2's tensors are on disk, its manifest is not
    # what a generator can see of v2 meanwhile: nothing
    assert [v for v, _ in broker.announced] == [1]
    assert store.versions() == [1] and store.latest() == 1
    with pytest.raises(CorruptWeights, match="no manifest"):
        store.open_version(2)
    gate.release[2].set()
    second.join(WAIT_S)
    publisher.publish({"w": torch.full((4,), 3.0)}, NewVersion(3, 3))
    publisher.close()
    assert [v for v, _ in broker.announced] == [1, 2, 3] and gate.most_in_flight == 1
    assert store.versions() == [1, 2, 3] and store.latest() == 3
    for v in (1, 2, 3):  # each version holds its own tensors
        assert load_file(str(store.version_dir(v) / MODEL_FILE))["w"].tolist() == [float(v)] * 4


def test_a_failed_write_is_never_announced_and_leaves_nothing(tmp_path, monkeypatch):
    gate = _GatedWrites(monkeypatch, fail={2})
    publisher, broker = _publisher(tmp_path)
    publisher.publish({"w": torch.zeros(4)}, NewVersion(1, 1))
    with pytest.raises(OSError, match="No space"):
        publisher.publish({"w": torch.ones(4)}, NewVersion(2, 2))
    publisher.close()
    assert [v for v, _ in broker.announced] == [1] and gate.started == [1, 2]
    store = publisher.store
    assert store.versions() == [1] and store.latest() == 1
    assert sorted(p.name for p in store.root.iterdir()) == ["LATEST", "v00000001"]  # no temp dir


@pytest.mark.parametrize("publish_dtype", ["float32", "bfloat16"])
def test_each_version_holds_its_steps_weights_in_the_publish_dtype(tmp_path, publish_dtype):
    steps = 3
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    ln = _learner(tmp_path, model, publish_dtype)
    for step in range(1, steps + 1):
        with torch.no_grad():  # an optimiser step: the parameters change in place
            for p in model.parameters():
                p.add_(1.0)
        publish(
            ln.models.model, ln.publisher, ln.dist, ln.cfg, version=step, step=step, probe=False
        )
    ln.publisher.close()
    store = ln.publisher.store
    assert [v for v, _ in ln.broker.announced] == [1, 2, 3]
    # version v holds the parameters after v in-place updates of +1 from zero: all v
    for v in range(1, steps + 1):
        loaded = load_file(str(store.version_dir(v) / MODEL_FILE))
        assert loaded["weight"].dtype == getattr(torch, publish_dtype)
        assert loaded["weight"].float().tolist() == [[float(v)] * 3] * 2
        assert loaded["bias"].float().tolist() == [float(v)] * 2


def test_a_checkpoint_step_gathers_the_full_weights_once(tmp_path, monkeypatch):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    gathered = []
    real = lora_module.full_state_dict

    def counting(*args, **kwargs):
        gathered.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(lora_module, "full_state_dict", counting)
    ln = _learner(tmp_path / "run", model)
    publish(ln.models.model, ln.publisher, ln.dist, ln.cfg, version=1, step=1, probe=False)
    assert len(gathered) == 1
    # the checkpoint writes each rank's shards (DCP): it never builds the full host copy
    CheckpointStore(tmp_path / "ckpt").save(LearnerState(step=1), Trainables(model, optimizer))
    assert len(gathered) == 1
    ln.publisher.close()


def test_a_repeated_announcement_never_takes_the_weights_hash_back(monkeypatch):
    """The audit repeats the last announcement (main thread) while the publisher announces the
    next version: the hash must end at the newer one."""
    writes: list[int] = []
    first_write_started, release_first = threading.Event(), threading.Event()

    def hset(key, mapping):
        if not writes and not first_write_started.is_set():
            first_write_started.set()
            assert release_first.wait(WAIT_S)
        writes.append(mapping["version"])

    def execute(commands, what=""):  # the learner's fenced writes (broker/channels/lease.py)
        for _, key, *flat in commands:
            hset(key, dict(zip(flat[::2], flat[1::2])))

    io = SimpleNamespace(keys=SimpleNamespace(weights="weights"))
    registry = RunRegistry(io, lease=SimpleNamespace(execute=execute))
    registry.announced = {"version": 4}
    repeat = threading.Thread(target=registry.announce_again, daemon=True)
    repeat.start()  # writes v4 again and is held inside the write
    assert first_write_started.wait(WAIT_S)
    newer = threading.Thread(
        target=registry.announce_weights, args=(5, "/w/v5", "sha", "tcp://x"), daemon=True
    )
    newer.start()
    newer.join(0.2)  # v5 waits for the repetition to finish
    release_first.set()
    repeat.join(WAIT_S)
    newer.join(WAIT_S)
    assert writes == [4, 5] and registry.announced["version"] == 5
