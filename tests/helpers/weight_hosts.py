"""The learner and generators of `weights.transport: http` on one host, built as the processes
build them: the learner's `VersionWriter` (what its publishing process runs) serving its store
with v1 announced in Redis, and generators' `HttpSource`s (what `rollctl start-generator` makes),
each registering its weights key through its own `GeneratorBroker`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rollflash.broker.config.config import load_config
from rollflash.broker.sides.generator_side import GeneratorBroker
from rollflash.broker.weights.digest import CHUNK_BYTES
from rollflash.generators.fetch import Announced
from rollflash.generators.http_source import HttpSource
from rollflash.generators.sim_engine import SimEngine
from rollflash.learner.durability.publish_process import NewVersion, VersionWriter

TOKEN = "t0ken-for-the-test"
ROWS = (CHUNK_BYTES + CHUNK_BYTES // 2) // 4096  # 48 MiB of float32 rows of 1024: 2 chunks


class HostTensors(SimEngine):
    """The sim engine, but keeping what it is given on the host (to compare it)."""

    def new_weights(self, layout):
        return {name: torch.empty(shape, dtype=dtype) for name, shape, dtype in layout}


def host_cfg(tmp_path, host: str, *extra: str):
    return load_config(None, [f"run.run_dir={tmp_path / host}", "weights.transport=http", *extra])


def source(cfg, brokers: Callable[[str], GeneratorBroker], generator_id: str) -> HttpSource:
    """`generator_id`'s HttpSource, registering its key through `brokers(generator_id)` (the
    `brokers` fixture: as `rollctl start-generator` makes it)."""
    return HttpSource(cfg, generator_id, brokers(generator_id))


def learner(tmp_path, learner_broker, *extra: str) -> tuple[VersionWriter, Announced]:
    """The learner's writer (`extra`: config overrides) with v1 published and announced."""
    writer = VersionWriter(host_cfg(tmp_path, "learner", *extra), learner_broker)
    info = writer.write({"w": torch.arange(ROWS * 1024.0).view(ROWS, 1024)}, NewVersion(1, 1))
    announced = learner_broker._registry.weights()
    assert announced["http_url"] == writer.http_url and announced["version"] == "1"
    return writer, Announced(1, info.sha256, writer.http_url)


def fetch(source: HttpSource, announced: Announced) -> torch.Tensor:
    staged = source.fetch(announced, HostTensors(load_config(None).sim, 0), set())
    assert staged.tensors is not None
    return staged.tensors["w"]
