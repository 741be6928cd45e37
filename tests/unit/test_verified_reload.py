"""Verified reloads (broker/weights.py, generators/reload.py): a generator loads exactly the bytes it
hashed, refuses links and anything outside the store, and survives a version its engine cannot load
by keeping the weights it has. The broker is a stand-in that only answers the `weights` hash."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from rollflash.broker import weights as weights_module
from rollflash.broker.digest import CHUNK_BYTES
from rollflash.broker.weights import MODEL_FILE, CorruptWeights, WeightStore
from rollflash.generators.reload import WeightFollower


class _Hash:
    """The `weights` hash as the learner announces it."""

    def __init__(self) -> None:
        self.info: dict[str, str] = {}

    def weights(self) -> dict[str, str]:
        return self.info

    def announce(self, version: int, sha256: str) -> None:
        self.info = {"version": str(version), "sha256": sha256}


class _Engine:
    """Records what it loaded; `fail` makes a version's load raise (a loader error)."""

    def __init__(self, fail: set[int] = frozenset()) -> None:
        self.loaded: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.paths: list[str] = []
        self.fail = fail

    def load_weights(self, model_file, version: int) -> None:
        self.paths.append(str(model_file))
        if version in self.fail:
            raise RuntimeError(f"cannot load v{version}")
        self.loaded.append((version, load_file(str(model_file))))


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), value)}


def _publish(store: WeightStore, hash_: _Hash, version: int, value: float) -> None:
    info = store.publish(_state(value), version=version, step=version)
    hash_.announce(version, info.sha256)


@pytest.fixture
def setup(tmp_path):
    store, hash_, engine = WeightStore(tmp_path / "run"), _Hash(), _Engine()
    follower = WeightFollower(hash_, store, engine, poll_interval_s=0.0)
    yield store, hash_, engine, follower
    follower.close()


def test_a_file_swapped_after_hashing_is_never_loaded(setup, monkeypatch):
    store, hash_, engine, follower = setup
    _publish(store, hash_, 1, 1.0)
    model = store.version_dir(1) / MODEL_FILE
    evil = store.root.parent / "evil.safetensors"
    WeightStore(store.root.parent / "other").publish(_state(666.0), 1, 1)
    shutil.copy(store.root.parent / "other" / "weights" / "v00000001" / MODEL_FILE, evil)

    real_sha256 = hashlib.sha256

    def sha256_then_swap(*data: bytes):
        if evil.exists():  # an attacker (or a bug) replaces the file right after it was read
            os.replace(evil, model)
        return real_sha256(*data)

    monkeypatch.setattr(weights_module.hashlib, "sha256", sha256_then_swap)
    assert follower.maybe_reload() is True
    monkeypatch.undo()
    ((version, state),) = engine.loaded
    assert version == 1 and follower.loaded_version == 1
    torch.testing.assert_close(state["w"], torch.full((4,), 1.0))  # the hashed bytes, not 666
    assert load_file(str(model))["w"][0].item() == 666.0  # the swap did happen in the store
    assert not engine.paths[0].startswith(str(store.root))  # loaded from the private copy
    assert not os.path.exists(engine.paths[0])  # which is removed once loaded


def test_a_symlinked_weights_file_is_refused(setup, tmp_path):
    store, hash_, engine, follower = setup
    _publish(store, hash_, 1, 1.0)
    model = store.version_dir(1) / MODEL_FILE
    outside = tmp_path / "outside.safetensors"
    shutil.copy(model, outside)  # same bytes: the sha256 would match, the link must not
    model.unlink()
    model.symlink_to(outside)
    assert follower.maybe_reload() is False
    assert follower.loaded_version == 0 and follower.reload_refused == 1 and engine.paths == []
    with pytest.raises(CorruptWeights, match="symbolic link"):
        store.verified_bytes(1)


def test_a_version_directory_linked_outside_the_store_is_refused(setup, tmp_path):
    store, hash_, engine, follower = setup
    _publish(store, hash_, 1, 1.0)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(store.version_dir(1), elsewhere)
    store.version_dir(1).symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(CorruptWeights, match="link or lies outside the weight store"):
        store.verified_bytes(1)
    assert follower.maybe_reload() is False and follower.reload_refused == 1


def test_a_loader_error_keeps_the_old_weights_and_is_counted_once(setup):
    store, hash_, _, follower = setup
    engine = follower.engine = _Engine(fail={2})
    _publish(store, hash_, 1, 1.0)
    assert follower.maybe_reload() is True
    _publish(store, hash_, 2, 2.0)
    assert follower.maybe_reload() is False  # logged and counted, not raised
    assert follower.maybe_reload() is False  # the same version is not tried (nor counted) again
    assert follower.loaded_version == 1 and follower.reload_refused == 1
    _publish(store, hash_, 3, 3.0)
    assert follower.maybe_reload() is True  # a newer version loads as usual
    assert [v for v, _ in engine.loaded] == [1, 3] and follower.reloads == 2


def test_verified_bytes_are_the_manifest_checked_file(tmp_path):
    store = WeightStore(tmp_path)
    info = store.publish(_state(5.0), 1, 1)
    data = store.verified_bytes(1, expect_sha256=info.sha256)
    # one chunk: digest = sha256("sha256-chunks {chunk} {size}\n{sha256 of the file}\n")
    listing = f"sha256-chunks {CHUNK_BYTES} {len(data)}\n{hashlib.sha256(data).hexdigest()}\n"
    assert hashlib.sha256(listing.encode()).hexdigest() == info.sha256
    assert data == (store.version_dir(1) / MODEL_FILE).read_bytes()
    copy = store.verified_copy(1, tmp_path / "private.safetensors")
    assert copy.read_bytes() == data and (copy.stat().st_mode & 0o777) == 0o600


def test_hf_engine_refuses_a_file_that_does_not_fit_before_touching_a_weight(
    tiny_model_dir, tmp_path
):
    from safetensors.torch import save_file

    from rollflash.generators.hf_engine import HFEngine

    engine = HFEngine(str(tiny_model_dir))
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    state = {k: v + 1.0 for k, v in before.items() if k != "lm_head.weight"}
    name = next(k for k in state if k.endswith("mlp.up_proj.weight"))
    state[name] = state[name][:-1]  # one tensor of the wrong shape among all the others
    save_file(state, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match="wrong shape"):
        engine.load_weights(tmp_path / "bad.safetensors", 1)
    for k, v in engine.model.state_dict().items():
        torch.testing.assert_close(v, before[k], atol=0, rtol=0)  # nothing was copied
