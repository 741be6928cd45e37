"""Admission and staleness under random generator speeds, with the real Redis broker and the
learner's real `Admission` and `collect`. Simulated generators (threads) claim prompts, hold them
for a random time, and answer with weights somewhere between the prompt's issued version and the
newest published one, as real generators may."""

import math
import random
import threading
import time

import numpy as np
import pytest

from rollflash.broker.config.config import load_config
from rollflash.broker.wire.schema import Sample, Trajectory
from rollflash.envs import Item
from rollflash.learner.intake.admission import Admission
from rollflash.learner.intake.collect import Collector

B, N, STEPS = 4, 2, 10


def _items():
    i = 0
    while True:
        yield Item(id=f"train-{i}", prompt="1+1=", answer="2")
        i += 1


class SimGenerators(threading.Thread):
    def __init__(self, broker, published, rng, slow_frac):
        super().__init__(daemon=True)
        self.broker, self.published, self.rng, self.slow_frac = broker, published, rng, slow_frac
        self.stop = threading.Event()
        self.answered: dict[str, int] = {}  # group id -> the version its tokens came from

    def run(self):
        held = []  # (due time, entry id, work)
        while not self.stop.is_set():
            for entry_id, work in self.broker.claim_prompts(count=8, block_ms=5):
                delay = (
                    self.rng.uniform(0.05, 0.4)
                    if self.rng.random() < self.slow_frac
                    else self.rng.uniform(0, 0.02)
                )
                held.append((time.monotonic() + delay, entry_id, work))
            now = time.monotonic()
            for due, entry_id, work in [h for h in held if h[0] <= now]:
                held.remove((due, entry_id, work))
                # the generator loaded some version >= issued (the rule) and <= newest published
                v = self.rng.randint(
                    work.issued_version, max(work.issued_version, self.published[0])
                )
                self.answered[work.group_id] = v
                s = Sample(
                    response_ids=np.array([5], np.int32),
                    logprobs=np.array([-1], np.float32),
                    token_versions=np.array([v], np.int32),
                    reward=self.rng.random(),
                    finished=True,
                )
                self.broker.add_trajectory(
                    Trajectory(
                        traj_id=work.group_id,
                        prompt_id=work.prompt_id,
                        group_id=work.group_id,
                        generator="gen-0",
                        behavior_version=v,
                        issued_version=work.issued_version,
                        prompt_ids=np.array([1], np.int32),
                        samples=[s] * N,
                        mac=work.mac,
                    ),
                    entry_id,
                )


@pytest.mark.parametrize("ratio", [0, 0.5, 1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("overdue_steps", [0, 2])
def test_staleness_and_admission_bounds_hold(
    learner_broker, generator_broker, ratio, seed, overdue_steps
):
    rng = random.Random(seed)
    admission = Admission(_items(), B, ratio, N)
    published = [0]
    gens = SimGenerators(generator_broker, published, rng, slow_frac=0.3)
    gens.start()
    trainer = load_config(
        None, [f"trainer.async_ratio={ratio}", f"trainer.overdue_steps={overdue_steps}"]
    ).trainer
    bound, overdue_bound = math.ceil(ratio), trainer.max_overdue_staleness
    trained, stale, overdue, trained_overdue = [], [], 0, 0
    collector = Collector(
        learner_broker,
        admission,
        N,
        vocab_size=10,
        max_staleness=bound,
        timeout_s=10,
        max_overdue=overdue_bound,
    )
    try:
        for version in range(STEPS):
            got = collector.collect(version)
            assert len(got.groups) == B
            assert admission.issued <= (
                math.floor((version + 1 + ratio) * B) + learner_broker.replaced_groups()
            )
            # The staleness filter checked against the versions the generators really used
            # (recorded on their side, not read back from what the learner kept): every trained
            # group is at most ceil(a) versions old, or at most the overdue bound and counted as
            # overdue, and every dropped one is older than ceil(a), so a filter off by one
            # either way, or one that trusts the wrong field, fails here.
            ages = [version - gens.answered[g.group_id] for g in got.groups]
            for g, age in zip(got.groups, ages, strict=True):
                assert 0 <= age <= overdue_bound, (version, g.group_id, age)
                assert version - int(min(s.token_versions.min() for s in g.samples)) == age
            overdue += got.overdue
            trained_overdue += sum(age > bound for age in ages)
            for group_id in got.stale_ids:
                assert version - gens.answered[group_id] > bound, (version, group_id)
            if ratio == 0:
                # on-policy by admission alone: B prompts per version, so nothing is ever stale
                assert got.stale_ids == []
            trained += [g.group_id for g in got.groups]
            stale += got.stale_ids
            learner_broker.ack_trajectories(got.entry_ids)  # after the step's checkpoint
            time.sleep(rng.uniform(0, 0.05))  # a training step
            published[0] = version + 1
    finally:
        gens.stop.set()
        gens.join()
    # every group is trained at most once, and a dropped group is never trained
    assert len(trained) == len(set(trained)) == STEPS * B
    assert set(trained).isdisjoint(stale)
    # each stale group was replaced by a fresh prompt
    assert learner_broker.replaced_groups() == len(stale)
    # an overdue group is trained in the step it arrives in (or dropped: more were due than B)
    assert trained_overdue <= overdue and (overdue_bound > bound or overdue == 0)


def test_a_group_with_any_old_token_is_stale(learner_broker, generator_broker):
    """Per-token versions are what counts: a group started on v0 and finished on v2 is as old as v0.
    (Its behavior_version must say so: an entry claiming v2 is dead-lettered by the wire check,
    tests/security/test_wire.py.)"""
    admission = Admission(_items(), 1, 1.0, 1)
    admission.top_up(learner_broker, step=2)
    for entry_id, work in generator_broker.claim_prompts(10, 10):
        s = Sample(
            response_ids=np.array([5, 6], np.int32),
            logprobs=np.array([-1, -1], np.float32),
            token_versions=np.array([0, 2] if work.group_id.endswith("0") else [2, 2], np.int32),
            reward=0.0,
            finished=True,
        )
        generator_broker.add_trajectory(
            Trajectory(
                traj_id=work.group_id,
                prompt_id=work.prompt_id,
                group_id=work.group_id,
                generator="gen-0",
                behavior_version=int(s.token_versions.min()),
                issued_version=2,
                prompt_ids=np.array([1], np.int32),
                samples=[s],
                mac=work.mac,
            ),
            entry_id,
        )
    got = Collector(
        learner_broker, admission, 1, vocab_size=10, max_staleness=1, timeout_s=5
    ).collect(step=2)
    assert got.stale_ids == ["g000000000"]  # oldest token v0 < 2 - 1
    assert [g.traj_id for g in got.groups] == ["g000000001"]
    assert learner_broker.replaced_groups() == 1


def test_filtered_groups_are_replaced_so_a_step_still_gets_b_groups(
    learner_broker, generator_broker
):
    """DAPO dynamic sampling through collect: groups the filter rejects are acknowledged, counted
    and replaced by fresh prompts until B groups pass (here every other group is rejected)."""
    admission = Admission(_items(), 2, 0.0, N)  # prompts ask for the N samples answered
    published = [0]
    gens = SimGenerators(generator_broker, published, random.Random(0), slow_frac=0.0)
    gens.start()
    try:
        got = Collector(
            learner_broker,
            admission,
            N,
            vocab_size=10,
            max_staleness=0,
            timeout_s=10,
            drop=lambda g: "dynamic_sampling" if int(g.group_id[1:]) % 2 else None,
        ).collect(step=0)
    finally:
        gens.stop.set()
        gens.join()
    assert [g.group_id for g in got.groups] == ["g000000000", "g000000002"]
    assert got.filtered_ids == ["g000000001"] and got.filtered["dynamic_sampling"] == 1
    assert learner_broker.replaced_groups() == 1 and admission.issued == 3
