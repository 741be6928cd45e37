"""Delta versions on the writing side and the applying side (broker/weights/delta.py, delta_write.py,
delta_apply.py, manifest_delta.py), with a real weight store on disk."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
import torch

from rollflash.broker.weights.delta import (
    BadDelta,
    decode_bitmap,
    decode_gaps,
    encode_bitmap,
    encode_change,
    encode_gaps,
)
from rollflash.broker.weights.delta_apply import apply_delta
from rollflash.broker.weights.delta_write import VersionChain
from rollflash.broker.weights.manifest import DELTA_FILE, MODEL_FILE, CorruptWeights
from rollflash.broker.weights.weight_chain import verified_tensors
from rollflash.broker.weights.weight_stream import (
    FileSink,
    TensorSink,
    host_tensors,
)
from rollflash.broker.weights.weights import WeightStore


def test_gaps_by_hand():
    # positions 0, 5, 200: gaps 0, 5-0-1 = 4, 200-5-1 = 194 = 0b1_1000010 -> varint 0xC2 0x01
    encoded = encode_gaps(np.array([0, 5, 200]))
    assert encoded.tolist() == [0, 4, 0xC2, 0x01]
    assert decode_gaps(encoded, 3, 201).tolist() == [0, 5, 200]
    with pytest.raises(BadDelta, match="outside"):
        decode_gaps(encoded, 3, 200)  # 200 is past a tensor of 200 elements
    with pytest.raises(BadDelta, match="declared"):
        decode_gaps(encoded, 2, 201)
    with pytest.raises(BadDelta, match="declared"):
        decode_gaps(encoded[:-1], 3, 201)  # the last varint unterminated


def test_bitmap_by_hand():
    # positions 1 and 9 of 12 elements: byte 0 bit 1 = 0x02, byte 1 bit 1 = 0x02
    encoded = encode_bitmap(np.array([1, 9]), 12)
    assert encoded.tolist() == [0x02, 0x02]
    assert decode_bitmap(encoded, 2, 12).tolist() == [1, 9]
    with pytest.raises(BadDelta, match="sets 3"):
        decode_bitmap(np.array([0x02, 0x12], np.uint8), 2, 12)  # bit 12 is past the tensor


def test_the_smaller_encoding_is_chosen():
    old = np.zeros(1000, np.uint16)
    sparse = old.copy()
    # gaps 3 (1 byte) and 500 - 3 - 1 = 496 (2 bytes: 0xF0 0x03): 3 bytes < bitmap 1000 / 8 = 125
    sparse[[3, 500]] = 1
    change = encode_change(old, sparse)
    assert change is not None and change.encoding == "gaps"
    assert change.positions.tolist() == [3, 0xF0, 0x03]
    dense = old.copy()
    dense[::2] = 7  # 500 changes: gaps 500 bytes > bitmap 125
    change = encode_change(old, dense)
    assert change is not None and change.encoding == "bitmap" and change.count == 500
    assert change.values.tolist() == [7] * 500
    assert encode_change(old, old.copy()) is None


def test_bits_not_values_are_compared():
    old = np.frombuffer(np.array([0.0, np.nan], np.float32).tobytes(), np.uint32)
    new = np.frombuffer(np.array([-0.0, np.nan], np.float32).tobytes(), np.uint32)
    change = encode_change(old, new)  # -0.0 == 0.0 as floats, not as bits
    assert change is not None and change.count == 1


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "b.bias": torch.randn(32, generator=g).to(torch.bfloat16),
        "norm.weight": torch.ones(32, dtype=torch.bfloat16),
    }


def _step(state: dict[str, torch.Tensor], share: float, seed: int) -> dict[str, torch.Tensor]:
    """Change about `share` of a.weight and b.bias, leave norm.weight alone."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        t = t.clone()
        if name != "norm.weight":
            hit = torch.rand(t.shape, generator=g) < share
            t[hit] = t[hit] + 1.0
        out[name] = t
    return out


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def test_versions_are_deltas_between_anchors(tmp_path):
    store, chain = WeightStore(tmp_path / "run"), VersionChain(tmp_path / "chain", 3)
    state, kinds = _model(0), []
    for v in range(1, 8):
        info = store.publish(state, v, v, chain=chain)
        m = store.manifest(v, info.sha256)
        kinds.append((m.kind, m.forms))
        state = _step(state, 0.02, v)
    # v1: the chain's first (full only); v3, v6: anchors (full and delta); the rest deltas
    assert kinds == [
        ("full", ("full",)),
        ("delta", ("delta",)),
        ("full", ("full", "delta")),
        ("delta", ("delta",)),
        ("delta", ("delta",)),
        ("full", ("full", "delta")),
        ("delta", ("delta",)),
    ]
    m = store.manifest(5)
    assert (
        m.delta is not None
        and m.delta.base == 4
        and m.delta.base_sha256 == store.manifest(4).digest
    )
    tensors = {t.name: t for t in m.delta.tensors}
    assert tensors["norm.weight"].change is None  # unchanged: no entry in the delta file
    assert m.form_size("delta") < m.delta.numel * 2 / 4  # far below the full bf16 bytes


def test_a_delta_rebuilds_the_full_version_bit_for_bit(tmp_path):
    full, deltas = WeightStore(tmp_path / "full"), WeightStore(tmp_path / "deltas")
    chain = VersionChain(tmp_path / "chain", 100)
    states = [_model(0)]
    for v in range(1, 4):
        full.publish(states[-1], v, v)
        deltas.publish(states[-1], v, v, chain=chain)
        states.append(_step(states[-1], 0.05, v))
    # rebuild v2 then v3 from v1's full file, each from the file the step before wrote
    base = deltas.version_dir(1) / MODEL_FILE
    for v in (2, 3):
        opened = deltas.open_version(v, deltas.manifest(v).digest, form="delta")
        out = tmp_path / f"rebuilt-{v}"
        out.mkdir()
        sink = TensorSink(host_tensors)
        base_fd = os.open(base, os.O_RDONLY)
        try:
            apply_delta(opened.manifest, opened.fds[DELTA_FILE], base_fd, [FileSink(out), sink])
        finally:
            os.close(base_fd)
            opened.close()
        assert (out / MODEL_FILE).read_bytes() == (full.version_dir(v) / MODEL_FILE).read_bytes()
        expected = verified_tensors(full, v)
        assert {n: _sha(t) for n, t in sink.result().items()} == {
            n: _sha(t) for n, t in expected.items()
        }
        base = out / MODEL_FILE


def _apply(store: WeightStore, v: int, base, tmp_path) -> dict[str, torch.Tensor]:
    opened = store.open_version(v, form="delta")
    sink = TensorSink(host_tensors)
    fd = os.open(base, os.O_RDONLY)
    try:
        apply_delta(opened.manifest, opened.fds[DELTA_FILE], fd, [sink])
    finally:
        os.close(fd)
        opened.close()
    return sink.result()


def test_a_wrong_base_or_a_changed_delta_is_refused(tmp_path):
    store = WeightStore(tmp_path / "run")
    chain = VersionChain(tmp_path / "chain", 100)
    a, b = _model(0), _step(_model(0), 0.05, 1)
    store.publish(a, 1, 1, chain=chain)
    store.publish(b, 2, 2, chain=chain)
    store.publish(_step(b, 0.05, 2), 3, 3, chain=chain)
    with pytest.raises(CorruptWeights, match="sha256 mismatch in a.weight after applying"):
        _apply(store, 3, store.version_dir(1) / MODEL_FILE, tmp_path)  # v1 is not v3's base
    # values changed in delta.bin, and the manifest's entry rewritten to match: the chunk check
    # passes, the tensor's check after applying does not
    d = store.version_dir(2)
    data = bytearray((d / DELTA_FILE).read_bytes())
    data[-1] ^= 0x40
    (d / DELTA_FILE).write_bytes(bytes(data))
    from rollflash.broker.weights.digest import file_digest

    manifest = json.loads((d / "manifest.json").read_text())
    manifest["files"][DELTA_FILE] = file_digest(bytes(data)).manifest_entry()
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptWeights, match="sha256 mismatch in b.bias after applying"):
        _apply(store, 2, store.version_dir(1) / MODEL_FILE, tmp_path)


def test_a_delta_that_is_not_smaller_is_not_written(tmp_path):
    store = WeightStore(tmp_path / "run")
    chain = VersionChain(tmp_path / "chain", 100)
    state = _model(0)
    store.publish(state, 1, 1, chain=chain)
    # every element changes: positions + values > the full bytes
    store.publish({n: t + 1.0 for n, t in state.items()}, 2, 2, chain=chain)
    m = store.manifest(2)
    assert m.kind == "full" and m.forms == ("full",)
    assert not (store.version_dir(2) / DELTA_FILE).exists()
    # and the version after is a delta against it again
    store.publish(_step({n: t + 1.0 for n, t in state.items()}, 0.01, 3), 3, 3, chain=chain)
    assert store.manifest(3).kind == "delta"


def test_a_failed_publish_makes_the_next_version_full(tmp_path):
    store = WeightStore(tmp_path / "run")
    chain = VersionChain(tmp_path / "chain", 100)
    store.publish(_model(0), 1, 1, chain=chain)

    def lost():
        raise RuntimeError("lease lost")

    with pytest.raises(RuntimeError):
        store.publish(_step(_model(0), 0.01, 1), 2, 2, fence=lost, chain=chain)
    # the state file was half updated by the failed write: v3 must not be a delta against it
    store.publish(_step(_model(0), 0.01, 2), 3, 3, chain=chain)
    assert store.manifest(3).kind == "full"


def test_retention_keeps_the_chain_back_to_a_full_version(tmp_path):
    store = WeightStore(tmp_path / "run")
    chain = VersionChain(tmp_path / "chain", 4)
    state = _model(0)
    for v in range(1, 11):
        store.publish(state, v, v, chain=chain)
        state = _step(state, 0.02, v)
    # v1 full; v4, v8 anchors; keep 2 -> v9, v10 and the deltas v9 stands on back to v8 (full)
    assert store.retain(2, in_use=set()) == [1, 2, 3, 4, 5, 6, 7]
    assert store.versions() == [8, 9, 10]
