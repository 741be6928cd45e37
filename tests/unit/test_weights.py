import json

import pytest
import torch
from safetensors.torch import load_file

from rollflash.broker.weights.weight_chain import verified_tensors
from rollflash.broker.weights.weights import CorruptWeights, WeightStore


def _state(seed: float) -> dict[str, torch.Tensor]:
    emb = torch.full((4, 3), seed)
    return {"embed.weight": emb, "lm_head.weight": emb, "layer.bias": torch.arange(3.0) + seed}


def test_publish_then_load_round_trip(tmp_path):
    store = WeightStore(tmp_path)
    info = store.publish(_state(1.0), version=1, step=1)
    loaded = verified_tensors(store, 1, expect_sha256=info.sha256)
    assert load_file(str(store.version_dir(1) / "model.safetensors")).keys() == loaded.keys()
    # lm_head aliases embed (tied): stored once, as save_pretrained does
    assert set(loaded) == {"embed.weight", "layer.bias"}
    torch.testing.assert_close(loaded["layer.bias"], torch.tensor([1.0, 2.0, 3.0]))
    assert store.latest() == 1 and store.versions() == [1]
    manifest = json.loads((store.version_dir(1) / "manifest.json").read_text())
    assert (
        manifest["version"] == 1 and manifest["files"]["model.safetensors"]["digest"] == info.sha256
    )


def test_distinct_views_of_one_block_are_all_published(tmp_path):
    """The publishing process hands the store views of one shared block: one storage, distinct
    tensors, each of which is kept (only one tensor under two names is stored once)."""
    block = torch.arange(8.0)
    state = {"a": block[:4].view(2, 2), "b": block[4:], "a_tied": None}
    state["a_tied"] = state["a"]
    store = WeightStore(tmp_path)
    store.publish(state, version=1, step=1)
    loaded = verified_tensors(store, 1)
    assert set(loaded) == {"a", "b"}
    assert loaded["a"].tolist() == [[0.0, 1.0], [2.0, 3.0]] and loaded["b"].tolist() == [
        4.0,
        5.0,
        6.0,
        7.0,
    ]


def test_republishing_a_version_is_refused(tmp_path):
    store = WeightStore(tmp_path)
    store.publish(_state(1.0), 1, 1)
    with pytest.raises(FileExistsError):
        store.publish(_state(2.0), 1, 1)


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda p: p.write_bytes(p.read_bytes()[:-7]), "truncated"),
        (lambda p: p.write_bytes(bytes([p.read_bytes()[0] ^ 1]) + p.read_bytes()[1:]), "sha256"),
        (lambda p: (p.parent / "manifest.json").unlink(), "no manifest"),
        (lambda p: (p.parent / "manifest.json").write_text("{"), "unreadable manifest"),
        (lambda p: p.unlink(), "missing"),
    ],
)
def test_damaged_versions_are_never_returned(tmp_path, damage, reason):
    store = WeightStore(tmp_path)
    store.publish(_state(1.0), 1, 1)
    damage(store.version_dir(1) / "model.safetensors")
    with pytest.raises(CorruptWeights, match=reason):
        verified_tensors(store, 1)


def test_sha_from_the_announcement_must_match(tmp_path):
    store = WeightStore(tmp_path)
    store.publish(_state(1.0), 1, 1)
    with pytest.raises(CorruptWeights, match="sha256"):
        verified_tensors(store, 1, expect_sha256="0" * 64)


def test_retention_keeps_newest_and_in_use(tmp_path):
    store = WeightStore(tmp_path)
    for v in range(6):
        store.publish(_state(float(v)), v, v)
    deleted = store.retain(keep=2, in_use={1})
    assert deleted == [0, 2, 3]
    assert store.versions() == [1, 4, 5]


def test_temp_dirs_of_a_crashed_publisher_are_invisible_and_cleaned(tmp_path):
    store = WeightStore(tmp_path)
    store.publish(_state(1.0), 1, 1)
    partial = store.root / ".tmp-v00000002-999"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    assert store.versions() == [1]
    assert store.clean_temp() == 1 and not partial.exists()


def _rewrite_manifest(store: WeightStore, version: int, change) -> None:
    path = store.version_dir(version) / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest["files"]["model.safetensors"])
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "change",
    [
        lambda e: e.update(chunk_bytes=e["chunk_bytes"] // 2),  # listing no longer fits
        lambda e: e.update(chunk_bytes=1, chunk_sha256=e["chunk_sha256"] * e["size"]),
        lambda e: e.update(chunk_sha256=["0" * 64]),  # digest no longer of this listing
        lambda e: e.update(chunk_bytes="8"),
        lambda e: e.update(chunk_sha256="0" * 64),
    ],
)
def test_a_chunk_listing_that_does_not_fit_the_file_is_refused(tmp_path, change):
    store = WeightStore(tmp_path)
    info = store.publish(_state(1.0), 1, 1)
    _rewrite_manifest(store, 1, change)
    with pytest.raises(CorruptWeights, match="sha256 mismatch"):
        verified_tensors(store, 1, expect_sha256=info.sha256)


def test_a_version_whose_write_fails_leaves_nothing_behind(tmp_path, monkeypatch):
    from rollflash.broker.weights import weights as weights_module

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    store = WeightStore(tmp_path)
    monkeypatch.setattr(weights_module, "write_safetensors", disk_full)
    with pytest.raises(OSError, match="No space"):
        store.publish(_state(1.0), 1, 1)
    assert store.versions() == [] and store.latest() is None
    assert list(store.root.iterdir()) == []  # the temp directory is gone too
