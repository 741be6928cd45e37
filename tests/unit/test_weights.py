import json

import pytest
import torch
from safetensors.torch import load_file

from rollflash.broker.weights import CorruptWeights, WeightStore


def _state(seed: float) -> dict[str, torch.Tensor]:
    emb = torch.full((4, 3), seed)
    return {"embed.weight": emb, "lm_head.weight": emb, "layer.bias": torch.arange(3.0) + seed}


def test_publish_then_load_round_trip(tmp_path):
    store = WeightStore(tmp_path)
    info = store.publish(_state(1.0), version=1, step=1)
    path = store.verified_path(1, expect_sha256=info.sha256)
    loaded = load_file(str(path))
    # lm_head aliases embed (tied): stored once, as save_pretrained does
    assert set(loaded) == {"embed.weight", "layer.bias"}
    torch.testing.assert_close(loaded["layer.bias"], torch.tensor([1.0, 2.0, 3.0]))
    assert store.latest() == 1 and store.versions() == [1]
    manifest = json.loads((store.version_dir(1) / "manifest.json").read_text())
    assert (
        manifest["version"] == 1 and manifest["files"]["model.safetensors"]["sha256"] == info.sha256
    )


def test_republishing_a_version_is_refused(tmp_path):
    store = WeightStore(tmp_path)
    store.publish(_state(1.0), 1, 1)
    with pytest.raises(FileExistsError):
        store.publish(_state(2.0), 1, 1)


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda p: p.write_bytes(p.read_bytes()[:-7]), "wrong size"),
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
        store.verified_path(1)


def test_sha_from_the_announcement_must_match(tmp_path):
    store = WeightStore(tmp_path)
    store.publish(_state(1.0), 1, 1)
    with pytest.raises(CorruptWeights, match="sha256"):
        store.verified_path(1, expect_sha256="0" * 64)


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
