"""Generators for broker-level tests: a `GeneratorBroker` as `rollctl start-generator` builds
it, and its admission by the learner's rank 0 (broker/channels/roster.py), done step by step so that a
single-threaded test can drive both sides; and a whole `Generator` joining a learner's broker
built for its config (`joined`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rollflash.broker.connect.connection import connect
from rollflash.broker.sides.generator_side import GeneratorBroker
from rollflash.broker.sides.learner_side import LearnerBroker


def generator(url: str, run_id: str, generator_id: str = "gen-0") -> GeneratorBroker:
    return GeneratorBroker(connect(url, 5.0), run_id, generator_id, max_payload_bytes=1_000_000)


def admit(learner: LearnerBroker, *generators: GeneratorBroker) -> None:
    """Let `generators` join the run of `learner`."""
    for g in generators:
        g.ask_to_join({"state": "up"}, ttl_s=600)
    learner.roster.admit_joined()
    for g in generators:
        g.wait_admitted(5)
    learner.maintain_now()


@contextmanager
def joined(cfg: Any, generator_id: str) -> Iterator[tuple[LearnerBroker, Any]]:
    """The learner's rank 0 for `cfg` (its lease, the run registered) and a `Generator` that
    joined it and was admitted (the admission runs beside the generator's wait, as in a run)."""
    from rollflash.generators.rollout import Generator

    learner = LearnerBroker.for_config(cfg)
    learner.take_lease()
    learner.ensure_groups()
    learner.register_run(cfg.fingerprint())
    learner.track_trajectory_writes()
    done = threading.Event()

    def admit() -> None:
        while not done.is_set() and not learner.roster.admit_joined():
            done.wait(0.1)

    admitter = threading.Thread(target=admit, daemon=True)
    admitter.start()
    try:
        gen = Generator(cfg, generator_id)  # joins, and waits until it is admitted
    finally:
        done.set()
        admitter.join()
    learner.maintain_now()  # the ranks read its stream from now on
    try:
        yield learner, gen
    finally:
        gen.follower.close()
        learner.release()
