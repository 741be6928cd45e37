"""The weight store across processes: a reader polling while a writer publishes never gets a
half-written version, and every version it does get verifies and loads."""

import multiprocessing as mp

import torch

from rollflash.broker.weights.weight_chain import verified_tensors
from rollflash.broker.weights.weights import WeightStore

VERSIONS = 12


def _reader(root: str, queue) -> None:
    store = WeightStore(root)
    seen, problems = set(), []
    while len(seen) < VERSIONS:
        for v in store.versions():  # only versions with a manifest are listed
            if v in seen:
                continue
            try:
                t = verified_tensors(store, v)["w"]
                if not torch.all(t == float(v)):
                    problems.append(f"v{v} has wrong content")
            except Exception as e:  # any failure on a listed version is a bug
                problems.append(f"v{v}: {e!r}")
            seen.add(v)
    queue.put(problems)


def test_reader_never_sees_a_partial_version(tmp_path):
    store = WeightStore(tmp_path)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    reader = ctx.Process(target=_reader, args=(str(tmp_path), queue))
    reader.start()
    for v in range(VERSIONS):
        # large enough that writing takes a while, so the reader polls mid-write
        store.publish({"w": torch.full((512, 1024), float(v))}, version=v, step=v)
    reader.join(timeout=120)
    assert reader.exitcode == 0
    assert queue.get(timeout=5) == []
