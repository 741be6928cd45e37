"""Streamed, verified reads of a weight version (broker/weights/weight_stream.py): every chunk is checked
against the manifest before its bytes are used, so a flipped byte in the middle of a file, a
truncated file and a swapped file are refused, and a file replaced after it was opened is never
read; the tensors come out as written, whatever the chunk boundaries; and a read holds a few
chunk buffers, never a second copy of the version (peak RSS of a real process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rollflash.broker.weights.digest import CHUNK_BYTES
from rollflash.broker.weights.manifest import MODEL_FILE
from rollflash.broker.weights.weight_chain import verified_tensors
from rollflash.broker.weights.weight_stream import (
    FileSink,
    TensorSink,
    host_tensors,
    read_version,
)
from rollflash.broker.weights.weights import CorruptWeights, WeightStore

# 3 chunks of 32 MiB: one tensor spans the first two chunk boundaries, a small one sits between
ROWS = (2 * CHUNK_BYTES + CHUNK_BYTES // 2) // (4 * 1024)  # 80 MiB of float32 rows of 1024


def _state(value: float) -> dict[str, torch.Tensor]:
    return {
        "a.big": torch.full((ROWS, 1024), value),
        "b.small": torch.arange(7, dtype=torch.bfloat16) + value,
        "c.scalar": torch.tensor(int(value)),
    }


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    store = WeightStore(tmp_path_factory.mktemp("run"))
    info = store.publish(_state(1.0), 1, 1)
    store.publish(_state(2.0), 2, 2)  # same names and shapes: the same size, other bytes
    store.announced = info.sha256
    return store


def _model(store: WeightStore, version: int):
    return store.version_dir(version) / MODEL_FILE


def test_a_three_chunk_version_reads_back_exactly(store):
    spec = store.manifest(1).files[MODEL_FILE]
    assert len(spec.chunks) == 3  # the test crosses chunk boundaries inside a tensor
    got = verified_tensors(store, 1, expect_sha256=store.announced)
    for name, t in _state(1.0).items():
        torch.testing.assert_close(got[name], t, atol=0, rtol=0)


def _damaged(store, tmp_path, damage) -> WeightStore:
    """A copy of the store whose v1 model file `damage(bytearray)` changes."""
    copy = WeightStore(tmp_path)
    copy.version_dir(1).mkdir()
    for f in store.version_dir(1).iterdir():
        data = bytearray(f.read_bytes())
        if f.name == MODEL_FILE:
            damage(data)
        (copy.version_dir(1) / f.name).write_bytes(data)
    return copy


def _flip_middle(data: bytearray) -> None:
    data[CHUNK_BYTES + CHUNK_BYTES // 2] ^= 0x01  # one bit, in the middle of chunk 1


def test_a_flipped_byte_in_the_middle_is_refused_and_nothing_is_returned(store, tmp_path):
    damaged = _damaged(store, tmp_path, _flip_middle)
    placed = []
    sink = TensorSink(lambda layout: placed.append(layout) or host_tensors(layout))
    opened = damaged.open_version(1, store.announced)
    with pytest.raises(CorruptWeights, match="sha256 mismatch in model.safetensors, chunk 1"):
        read_version(opened.manifest, opened.fds, [sink])
    opened.close()
    with pytest.raises(CorruptWeights, match="incomplete"):
        sink.result()


def test_a_truncated_file_is_refused_before_it_is_read(store, tmp_path):
    damaged = _damaged(store, tmp_path, lambda data: data.__delitem__(slice(-100, None)))
    with pytest.raises(CorruptWeights, match="truncated"):
        damaged.open_version(1, store.announced)


def test_a_file_swapped_for_another_version_is_refused(store, tmp_path):
    other = _model(store, 2).read_bytes()  # a valid file of the same size

    def swap(data: bytearray) -> None:
        data[:] = other

    damaged = _damaged(store, tmp_path, swap)
    with pytest.raises(CorruptWeights, match="sha256 mismatch in model.safetensors, chunk 0"):
        verified_tensors(damaged, 1, expect_sha256=store.announced)


def test_a_file_swapped_after_it_was_opened_is_never_read(store, tmp_path):
    copy = _damaged(store, tmp_path, lambda data: None)
    opened = copy.open_version(1, store.announced)
    evil = tmp_path / "evil"
    evil.write_bytes(_model(store, 2).read_bytes())
    os.replace(evil, _model(copy, 1))  # the path now names version 2's bytes
    sink = TensorSink(host_tensors)
    read_version(opened.manifest, opened.fds, [sink])
    opened.close()
    assert sink.result()["a.big"][-1, -1].item() == 1.0  # the bytes that were opened and hashed


def test_a_file_sink_writes_the_verified_bytes_privately(store, tmp_path):
    dest = tmp_path / "copy"
    dest.mkdir(mode=0o700)
    opened = store.open_version(1, store.announced)
    read_version(opened.manifest, opened.fds, [FileSink(dest)])
    opened.close()
    assert (dest / MODEL_FILE).read_bytes() == _model(store, 1).read_bytes()
    assert (dest / MODEL_FILE).stat().st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):  # never over a file that is there
        FileSink(dest).open(store.manifest(1).files[MODEL_FILE])


PEAK = textwrap.dedent("""
    import json, sys
    from rollflash.broker.config.config import SimConfig
    from rollflash.broker.weights.weights import WeightStore
    from rollflash.generators.fetch import Announced, SharedStoreSource
    from rollflash.generators.sim_engine import SimEngine

    def kib(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1])

    store, engine = WeightStore(sys.argv[1]), SimEngine(SimConfig(), 0)
    source = SharedStoreSource(store, store.root.parent / "copies")
    before = kib("VmRSS:")
    staged = source.fetch(Announced(1, sys.argv[2]), engine, set())
    assert engine.version == 0 and set(staged.tensors) == {"w"}
    print(json.dumps({"before": before, "peak": kib("VmHWM:")}))
""")


def test_reading_a_version_holds_a_few_chunks_not_a_copy(tmp_path):
    """The generator's side of the benchmark's RSS figure, loosely: loading a 512 MiB version
    for an engine that keeps its weights off the host (the sim engine, like a GPU's) raises the
    process's peak RSS by its chunk buffers (at most 4 x 32 MiB = 128 MiB), far below it."""
    store = WeightStore(tmp_path / "run")
    info = store.publish({"w": torch.zeros(128 << 20)}, 1, 1)  # 512 MiB
    out = subprocess.run(
        [sys.executable, "-c", PEAK, str(tmp_path / "run"), info.sha256],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rss = json.loads(out.stdout)
    growth_mib = (rss["peak"] - rss["before"]) / 1024
    assert growth_mib < 256, rss  # half the version: a second copy would be 512 MiB
