"""Verified reloads off the sampling path (generators/reload.py, generators/fetch.py): the reload
thread fetches and verifies a version while the engine keeps sampling, and the swap loads exactly
the bytes it hashed; links and anything outside the store are refused; a failed version is tried
again with backoff (`weights.reload_attempts`) before it is skipped, and one that fails every
time leaves the old weights in place. The broker is a stand-in that only answers the `weights`
hash; the engines are the real sim and hf engines."""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from rollflash.broker.config.config import SimConfig
from rollflash.broker.weights import weight_stream
from rollflash.broker.weights.manifest import MODEL_FILE
from rollflash.broker.weights.weights import WeightStore
from rollflash.generators.fetch import SharedStoreSource
from rollflash.generators.reload import WeightFollower
from rollflash.generators.sampling import SamplingParams
from rollflash.generators.sim_engine import SimEngine


class _Hash:
    """The `weights` hash as the learner announces it."""

    def __init__(self) -> None:
        self.info: dict[str, str] = {}

    def weights(self) -> dict[str, str]:
        return self.info

    def announce(self, version: int, sha256: str) -> None:
        self.info = {"version": str(version), "sha256": sha256}


class _Recording(SimEngine):
    """The sim engine, recording what it swapped in; `fail`: versions whose swap raises."""

    def __init__(self, fail: frozenset[int] = frozenset()) -> None:
        super().__init__(SimConfig(per_token_s=0.0005, length_median=4), seed=0)
        self.swapped: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.fail = fail

    def new_weights(self, layout):
        return {name: torch.empty(shape, dtype=dtype) for name, shape, dtype in layout}

    def swap_weights(self, weights, version):
        if version in self.fail:
            raise RuntimeError(f"cannot load v{version}")
        self.swapped.append((version, {k: v.clone() for k, v in weights.items()}))
        super().swap_weights(weights, version)


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), value)}


def _publish(store: WeightStore, hash_: _Hash, version: int, value: float) -> None:
    info = store.publish(_state(value), version=version, step=version)
    hash_.announce(version, info.sha256)


def _until(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _follower(store, hash_, engine, attempts: int = 3) -> WeightFollower:
    source = SharedStoreSource(store, store.root.parent / "copies")
    return WeightFollower(hash_, source, engine, poll_interval_s=0.01, attempts=attempts)


@contextmanager
def _following(tmp_path, attempts: int, engine: _Recording | None = None):
    store, hash_, engine = WeightStore(tmp_path / "run"), _Hash(), engine or _Recording()
    follower = _follower(store, hash_, engine, attempts)
    try:
        yield store, hash_, engine, follower
    finally:
        follower.close()


@pytest.fixture
def setup(tmp_path):
    store, hash_, engine = WeightStore(tmp_path / "run"), _Hash(), _Recording()
    follower = _follower(store, hash_, engine)
    yield store, hash_, engine, follower
    follower.close()


def test_sampling_goes_on_while_a_version_is_fetched(tmp_path):
    """The fetch of v1 is held inside the reload thread (in the engine's `new_weights`, which
    the fetch calls once the header is verified); the engine samples meanwhile, and v1 is
    swapped in only when the rollout loop asks for it."""
    store, hash_ = WeightStore(tmp_path / "run"), _Hash()
    entered, gate = threading.Event(), threading.Event()

    class Gated(_Recording):
        def new_weights(self, layout):
            entered.set()
            gate.wait()
            return super().new_weights(layout)

    engine = Gated()
    follower = _follower(store, hash_, engine)
    try:
        _publish(store, hash_, 1, 1.0)
        assert entered.wait(60), "the reload thread never started the fetch"
        produced = 0
        for _ in range(3):  # the fetch is held: every batch is sampled with v0
            for group in engine.generate(
                ["p"] * 2, SamplingParams(n=2, max_new_tokens=8, temperature=1.0, top_p=1.0)
            ):
                produced += len(group)
                assert all(set(s.token_versions) == {0} for s in group)
            assert follower.maybe_reload() is False
        assert produced == 3 * 2 * 2  # 3 batches x 2 prompts x 2 samples, all during the fetch
        gate.set()
        follower.wait_for(1, timeout_s=60)
        assert [v for v, _ in engine.swapped] == [1] and follower.reload_pause_s >= 0
    finally:
        gate.set()
        follower.close()


def test_a_file_swapped_after_hashing_is_never_loaded(setup, monkeypatch):
    store, hash_, engine, follower = setup
    info = store.publish(_state(1.0), 1, 1)  # announced once the swap below is in place
    model = store.version_dir(1) / MODEL_FILE
    evil = store.root.parent / "evil.safetensors"
    WeightStore(store.root.parent / "other").publish(_state(666.0), 1, 1)
    shutil.copy(store.root.parent / "other" / "weights" / "v00000001" / MODEL_FILE, evil)
    real_sha256 = hashlib.sha256

    def sha256_then_swap(*data):
        if evil.exists():  # an attacker (or a bug) replaces the file right after it was read
            os.replace(evil, model)
        return real_sha256(*data)

    # the chunks' sha256, computed once the files are open (the manifest's is not)
    monkeypatch.setattr(weight_stream, "hashlib", SimpleNamespace(sha256=sha256_then_swap))
    hash_.announce(1, info.sha256)
    follower.wait_for(1, timeout_s=60)
    monkeypatch.undo()
    ((version, state),) = engine.swapped
    assert version == 1 and follower.loaded_version == 1
    torch.testing.assert_close(state["w"], torch.full((4,), 1.0))  # the hashed bytes, not 666
    assert not evil.exists()  # the swap did happen in the store


def test_a_symlinked_weights_file_is_refused(tmp_path):
    with _following(tmp_path, 1) as (store, hash_, engine, follower):
        info = store.publish(_state(1.0), 1, 1)
        model = store.version_dir(1) / MODEL_FILE
        outside = tmp_path / "outside.safetensors"
        shutil.copy(model, outside)  # same bytes: the digests would match, the link must not
        model.unlink()
        model.symlink_to(outside)
        hash_.announce(1, info.sha256)
        _until(lambda: follower.reload_refused == 1, "the refusal")
        assert follower.loaded_version == 0 and engine.swapped == []


def test_a_version_directory_linked_outside_the_store_is_refused(tmp_path):
    with _following(tmp_path, 1) as (store, hash_, engine, follower):
        info = store.publish(_state(1.0), 1, 1)
        elsewhere = tmp_path / "elsewhere"
        shutil.move(store.version_dir(1), elsewhere)
        store.version_dir(1).symlink_to(elsewhere, target_is_directory=True)
        hash_.announce(1, info.sha256)
        _until(lambda: follower.reload_refused == 1, "the refusal")
        assert follower.loaded_version == 0 and engine.swapped == []


def _break(store: WeightStore, version: int) -> bytes:
    """Flip a byte of the version's model file; returns the good bytes."""
    model = store.version_dir(version) / MODEL_FILE
    good = model.read_bytes()
    model.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    return good


def test_a_refused_version_is_tried_again_and_loads_once_it_verifies(tmp_path):
    """A hiccup of the shared filesystem: the first attempt reads a damaged file; it is
    repaired before the attempts (10 here: about 26 s of backoff) run out, and loads."""
    with _following(tmp_path, 10) as (store, hash_, engine, follower):
        info = store.publish(_state(1.0), 1, 1)
        good = _break(store, 1)
        hash_.announce(1, info.sha256)
        _until(lambda: follower.reload_retries >= 1, "a failed first attempt")
        (store.version_dir(1) / MODEL_FILE).write_bytes(good)
        follower.wait_for(1, timeout_s=60)
        assert follower.reload_refused == 0 and [v for v, _ in engine.swapped] == [1]


def test_with_one_attempt_a_failed_version_is_skipped_and_a_newer_one_loads(tmp_path):
    with _following(tmp_path, 1) as (store, hash_, engine, follower):
        info = store.publish(_state(1.0), 1, 1)
        good = _break(store, 1)
        hash_.announce(1, info.sha256)
        _until(lambda: follower.reload_refused == 1, "the refusal")
        (store.version_dir(1) / MODEL_FILE).write_bytes(good)
        time.sleep(0.5)  # observation window: v1 is not tried again, although it verifies now
        assert follower.loaded_version == 0 and follower.reload_retries == 0
        _publish(store, hash_, 2, 2.0)
        follower.wait_for(2, timeout_s=60)
        assert [v for v, _ in engine.swapped] == [2]


def test_a_loader_error_keeps_the_old_weights_and_is_counted_once(tmp_path):
    with _following(tmp_path, 2, _Recording(fail={2})) as (store, hash_, engine, follower):
        _publish(store, hash_, 1, 1.0)
        follower.wait_for(1, timeout_s=60)
        _publish(store, hash_, 2, 2.0)
        # the swap runs in the rollout loop's thread: drive it as the loop does
        _until(lambda: not follower.maybe_reload() and follower.reload_refused == 1, "v2's refusal")
        assert follower.reload_retries == 1  # 2 attempts: one retried, then refused
        assert follower.loaded_version == 1
        _publish(store, hash_, 3, 3.0)
        follower.wait_for(3, timeout_s=60)  # a newer version loads as usual
        assert [v for v, _ in engine.swapped] == [1, 3] and follower.reloads == 2


def test_hf_engine_refuses_weights_that_do_not_fit_before_touching_a_weight(tiny_model_dir):
    from rollflash.generators.hf_engine import HFEngine

    engine = HFEngine(str(tiny_model_dir))
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    layout = [(k, tuple(v.shape), v.dtype) for k, v in before.items() if k != "lm_head.weight"]
    name = next(n for n, _, _ in layout if n.endswith("mlp.up_proj.weight"))
    layout = [(n, (s[0] - 1, *s[1:]) if n == name else s, d) for n, s, d in layout]
    with pytest.raises(ValueError, match="wrong shape"):
        engine.new_weights(layout)  # one tensor of the wrong shape among all the others
    for k, v in engine.model.state_dict().items():
        torch.testing.assert_close(v, before[k], atol=0, rtol=0)  # nothing was copied


def test_hf_engine_swaps_in_the_verified_tensors(tiny_model_dir, tmp_path):
    """float32 tensors become the parameters themselves; bfloat16 ones (trainer.publish_dtype)
    are copied into the float32 parameters; a tied head follows its embedding either way."""
    from rollflash.generators.hf_engine import HFEngine

    engine = HFEngine(str(tiny_model_dir))
    store, hash_ = WeightStore(tmp_path / "run"), _Hash()
    follower = _follower(store, hash_, engine)
    try:
        for version, dtype in ((1, torch.float32), (2, torch.bfloat16)):
            state = {k: (v + version).to(dtype) for k, v in engine.model.state_dict().items()}
            hash_.announce(version, store.publish(state, version, version).sha256)
            follower.wait_for(version, timeout_s=60)
            for k, v in engine.model.state_dict().items():
                assert v.dtype == torch.float32
                torch.testing.assert_close(v, state[k].float(), atol=0, rtol=0)
            if engine.model.config.tie_word_embeddings:
                head, embed = engine.model.lm_head.weight, engine.model.model.embed_tokens.weight
                assert head.data_ptr() == embed.data_ptr()
    finally:
        follower.close()


def test_waiting_for_a_version_of_a_lost_run_stops_with_the_runs_error(tmp_path):
    """Redis came back empty while a generator waited for the version its prompts need: the
    wait ends with the run's own error (what `run_state` raises), long before its timeout."""
    from rollflash.broker.connect.redis_io import RunLost

    looks = []

    def run_state():
        looks.append(1)
        if len(looks) >= 3:
            raise RunLost("Redis no longer holds run rl:t: the run hash")

    with _following(tmp_path, 3) as (_, _, engine, follower):
        started = time.monotonic()
        with pytest.raises(RunLost, match="no longer holds run"):
            follower.wait_for(1, timeout_s=3600, run_alive=run_state)
        # 3 looks, each after at most one 0.5 s reload wait; the hour is never reached
        assert len(looks) == 3 and time.monotonic() - started < 3600
        assert engine.swapped == []


def test_a_generator_waiting_for_weights_keeps_heartbeating(tmp_path):
    """`wait_for` beats while it waits: here the version is published only after the third
    heartbeat, so the wait returns only if the generator went on beating (else it times out)."""
    with _following(tmp_path, attempts=3) as (store, hash_, _, follower):
        beats = []

        def beat():
            beats.append(time.monotonic())
            if len(beats) == 3:
                _publish(store, hash_, 1, 1.0)

        follower.wait_for(1, timeout_s=60, beat=beat)
        assert follower.loaded_version == 1 and len(beats) >= 3


class _SlowSwap(_Recording):
    """Swaps take 0.3 s: thirty of the follower's polls (every 0.01 s) happen during each."""

    def swap_weights(self, weights, version):
        time.sleep(0.3)
        super().swap_weights(weights, version)


def test_a_version_being_swapped_in_is_not_fetched_again(tmp_path, monkeypatch):
    fetched: list[int] = []
    fetch = SharedStoreSource.fetch

    def counting(self, announced, engine, in_use):
        fetched.append(announced.version)
        return fetch(self, announced, engine, in_use)

    monkeypatch.setattr(SharedStoreSource, "fetch", counting)
    with _following(tmp_path, 1, _SlowSwap()) as (store, hash_, engine, follower):
        for v in (1, 2, 3):
            _publish(store, hash_, v, float(v))
            follower.wait_for(v, timeout_s=60)
        time.sleep(0.1)  # the follower's polls after the last swap
        # each version fetched once, none refused: while v was swapped in the follower saw the
        # hash announce v with v - 1 still loaded, and left it alone
        assert fetched == [1, 2, 3] and follower.reload_refused == 0
        assert [v for v, _ in engine.swapped] == [1, 2, 3]
