"""Generators for broker-level tests: a `GeneratorBroker` as `rollctl start-generator` builds
it, and its admission by the learner's rank 0 (broker/roster.py), done step by step so that a
single-threaded test can drive both sides."""

from __future__ import annotations

from rollflash.broker.connection import connect
from rollflash.broker.generator_side import GeneratorBroker
from rollflash.broker.learner_side import LearnerBroker


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
