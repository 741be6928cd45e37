"""Delta versions end to end on one host (real redis-server, real HTTP on loopback): the learner's
`VersionWriter` (what its publishing process runs) publishes bf16 versions with
`weights.anchor_every`, and generators built as `rollctl start-generator` builds them
(`version_source`, `WeightFollower`) follow the `weights` hash. The engine is the sim engine
keeping on the host what it swapped in, to compare it bit for bit with a full version of the same
weights (a second store, every version full)."""

from __future__ import annotations

import hashlib
import time
from contextlib import ExitStack, contextmanager

import torch

from rollflash.broker.config.config import load_config
from rollflash.broker.weights.manifest import DELTA_FILE
from rollflash.broker.weights.weight_chain import StoreReader, verified_tensors
from rollflash.broker.weights.weight_path import Held, path_bytes, plan
from rollflash.broker.weights.weights import WeightStore
from rollflash.generators.reload import WeightFollower, version_source
from rollflash.learner.durability.publish_process import NewVersion, VersionWriter
from tests.helpers.weight_hosts import HostTensors


class Recording(HostTensors):
    """Keeps every version it swapped in (a digest per tensor)."""

    def __init__(self) -> None:
        super().__init__(load_config(None).sim, 0)
        self.loaded: dict[int, dict[str, str]] = {}

    def swap_weights(self, weights, version):
        self.loaded[version] = digests(weights)
        super().swap_weights(weights, version)


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for n, t in tensors.items()
    }


def states(count: int, share: float = 0.01):
    """`count` versions of a small bf16 model, each changing about `share` of the elements of
    the previous one (an optimiser step at a small learning rate), the norm never."""
    g = torch.Generator().manual_seed(0)
    state = {
        "embed.weight": torch.randn(512, 64, generator=g).bfloat16(),
        "layer.0.weight": torch.randn(64, 64, generator=g).bfloat16(),
        "norm.weight": torch.ones(64).bfloat16(),
    }
    out = [state]
    for _ in range(count - 1):
        state = {
            n: t
            if n == "norm.weight"
            else torch.where(torch.rand(t.shape, generator=g) < share, t * 1.01 + 0.01, t)
            for n, t in state.items()
        }
        out.append(state)
    return out


def cfg_for(tmp_path, host: str, *extra: str):
    return load_config(None, [f"run.run_dir={tmp_path / host}", *extra])


@contextmanager
def learner(tmp_path, learner_broker, *extra: str):
    writer = VersionWriter(
        cfg_for(tmp_path, "learner", "weights.anchor_every=10", *extra), learner_broker
    )
    try:
        yield writer
    finally:
        writer.close()


@contextmanager
def generator(tmp_path, brokers, gid: str, *extra: str):
    # shared_fs: the learner's run_dir (its own files under local/{id}); http: a host of its own
    cfg = cfg_for(tmp_path, gid if "weights.transport=http" in extra else "learner", *extra)
    broker = brokers(gid)
    engine = Recording()
    follower = WeightFollower(
        broker, version_source(cfg, gid, broker), engine, poll_interval_s=0.02
    )
    try:
        yield follower, engine
    finally:
        follower.close()


def full_digests(tmp_path, versions) -> dict[int, dict[str, str]]:
    """Every version written whole (no chain), read back: the reference."""
    store = WeightStore(tmp_path / "reference")
    out = {}
    for v, state in versions.items():
        store.publish(state, v, v)
        out[v] = digests(verified_tensors(store, v))
    return out


def _follow(tmp_path, learner_broker, brokers, n_gens: int, *extra: str):
    """Publish v1 .. v22 (v1 is read whole, then 21 deltas alone);
    returns the writer, the followers and each version's delta size."""
    versions = dict(enumerate(states(22), start=1))
    sizes = {}
    with learner(tmp_path, learner_broker, *extra) as writer, ExitStack() as stack:
        gens = [
            stack.enter_context(generator(tmp_path, brokers, f"g{i}", *extra))
            for i in range(n_gens)
        ]
        for v, state in versions.items():
            writer.write(state, NewVersion(v, v))
            m = writer.store.manifest(v)
            sizes[v] = m.form_size("delta") if "delta" in m.forms else 0
            for follower, _ in gens:
                follower.wait_for(v, timeout_s=120)
                if v >= 2:  # holding v - 1: the delta alone
                    assert follower.reload_bytes == sizes[v]
        expected = full_digests(tmp_path, versions)
        for _, engine in gens:
            assert sorted(engine.loaded) == list(versions)
            for v in versions:  # every version it served, bit for bit the full version's
                assert engine.loaded[v] == expected[v], v
        return writer, [f for f, _ in gens], sizes


def test_twenty_deltas_over_shared_fs_are_bit_exact(tmp_path, learner_broker, brokers):
    writer, _, _ = _follow(tmp_path, learner_broker, brokers, 1)
    # retention (trainer.keep_versions 3) kept v20 .. v22: v20 (an anchor, full and delta) is
    # what a generator that joins now starts from
    assert writer.store.versions() == [20, 21, 22]
    assert [writer.store.manifest(v).forms for v in (20, 21, 22)] == [
        ("full", "delta"),
        ("delta",),
        ("delta",),
    ]


def test_twenty_deltas_over_http_through_a_relay_are_bit_exact(
    weights_token, tmp_path, learner_broker, brokers
):
    http = ("weights.transport=http", "weights.fanout=1")
    writer, followers, sizes = _follow(tmp_path, learner_broker, brokers, 2, *http)
    assert writer.server is not None
    # each delta left the learner once: the second generator was sent to the first's relay
    for v in range(3, 23):
        assert writer.server.served[v] == sizes[v], v
    # and the other copy from whichever generator asked first, as its relay
    relays = [f.source.server for f in followers]
    for v in range(3, 23):
        assert sum(r.served[v] for r in relays) == sizes[v], v


def _options(store: WeightStore, target: int, held: int | None = None) -> dict[str, int]:
    """Every way to reach `target` and its bytes, by hand from the manifests: a version with a
    full file plus the deltas above it, or (holding `held`) the deltas above `held`."""
    m = {v: store.manifest(v) for v in store.versions()}

    def deltas(after: int) -> int:
        return sum(m[u].form_size("delta") for u in range(after + 1, target + 1))

    out = {
        f"v{a} full": m[a].form_size("full") + deltas(a)
        for a in m
        if "full" in m[a].forms and a <= target
    }
    if held is not None:
        out[f"deltas from v{held}"] = deltas(held)
    return out


def test_a_generator_joining_at_37_takes_the_fewest_bytes(tmp_path, learner_broker, brokers):
    versions = dict(enumerate(states(37, share=0.02), start=1))
    with learner(tmp_path, learner_broker, "trainer.keep_versions=100") as writer:
        for v, state in versions.items():
            info = writer.write(state, NewVersion(v, v))
        store = writer.store
        options = _options(store, 37)
        # anchors every 10 (and v1, the first a process writes): four ways in
        assert sorted(options) == ["v1 full", "v10 full", "v20 full", "v30 full"]
        with generator(tmp_path, brokers, "late") as (follower, engine):
            follower.wait_for(37, timeout_s=120)
            assert follower.reload_bytes == min(options.values()) == options["v30 full"]
            assert engine.loaded[37] == full_digests(tmp_path, {37: versions[37]})[37]
        # one that holds v33 and missed v34 .. v37 takes the four deltas, not v30's full file
        sha33 = store.manifest(33).digest
        steps = plan(StoreReader(store).manifest, 37, info.sha256, Held(33, sha33))
        options = _options(store, 37, held=33)
        assert [(s.version, s.form) for s in steps] == [(v, "delta") for v in (34, 35, 36, 37)]
        assert path_bytes(steps) == min(options.values()) == options["deltas from v33"]


def _damaged(writer: VersionWriter, broker, v: int, state, damage) -> None:
    """Publish `v` as the writer does, but `damage` its delta file before announcing it."""
    info = writer.store.publish(state, v, v, chain=writer.chain)
    damage(writer.store.version_dir(v) / DELTA_FILE)
    broker.announce_weights(v, info.path, info.sha256, writer.zmq.endpoint, writer.http_url)


def _flip(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path) -> None:
    path.write_bytes(path.read_bytes()[:-3])


def _until(predicate, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_bad_delta_is_refused_and_the_anchor_read_instead(tmp_path, learner_broker, brokers):
    """A delta that does not check out (a flipped byte, a truncated file) never reaches the
    engine: the generator reads the version's full file when it has one (an anchor), else keeps
    its weights and refuses the version (and those that stand on it) until the next anchor;
    every version it loaded is bit for bit the learner's."""
    versions = dict(enumerate(states(10), start=1))
    expected = full_digests(tmp_path, versions)
    extra = ("weights.reload_attempts=2",)
    with learner(tmp_path, learner_broker, "weights.anchor_every=5") as writer:
        with generator(tmp_path, brokers, "g0", *extra) as (follower, engine):
            for v in range(1, 5):
                writer.write(versions[v], NewVersion(v, v))
                follower.wait_for(v, timeout_s=120)
            _damaged(writer, learner_broker, 5, versions[5], _flip)  # an anchor: full + delta
            follower.wait_for(5, timeout_s=120)
            assert follower.reload_bytes == writer.store.manifest(5).form_size("full")
            for v in (6, 7):
                writer.write(versions[v], NewVersion(v, v))
                follower.wait_for(v, timeout_s=120)
            _damaged(writer, learner_broker, 8, versions[8], _truncate)  # a delta only
            _until(lambda: follower.reload_refused == 1)
            writer.write(versions[9], NewVersion(9, 9))  # stands on v8: no way to it either
            _until(lambda: follower.reload_refused == 2)
            assert follower.loaded_version == 7
            writer.write(versions[10], NewVersion(10, 10))  # the next anchor
            follower.wait_for(10, timeout_s=120)
            assert follower.reload_bytes == writer.store.manifest(10).form_size("full")
            assert follower.source.held.refused >= 3  # v5's delta, v8's (for v8 and for v9)
    assert sorted(engine.loaded) == [1, 2, 3, 4, 5, 6, 7, 10]
    for v, loaded in engine.loaded.items():
        assert loaded == expected[v], v


def test_anchor_every_1_publishes_every_version_whole(tmp_path, learner_broker):
    with learner(tmp_path, learner_broker, "weights.anchor_every=1") as writer:
        for v, state in enumerate(states(4), start=1):
            writer.write(state, NewVersion(v, v))
        assert writer.chain is None
        assert [writer.store.manifest(v).forms for v in writer.store.versions()] == [("full",)] * 3
