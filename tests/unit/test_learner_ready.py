"""Which ready groups a step takes (learner/intake/ready.py through learner/intake/collect.py): the
oldest first, overdue groups (still being generated when they reached the age limit) trained instead
of dropped unless `overdue_steps` is 0, the groups due first when the ranks split a step, and the
length-bias metrics (learner/metrics/lengths.py), the same on every rank. A unit test: an in-memory
broker, and ranks as threads exchanging through a barrier instead of torch.distributed."""

import math
import threading

import numpy as np

from rollflash.broker.config.config import load_config
from rollflash.broker.wire.schema import Sample, Trajectory
from rollflash.learner.intake.collect import Collector
from rollflash.learner.metrics.lengths import length_metrics
from rollflash.learner.process.dist import split_quotas
from tests.unit.test_learner_collect import FakeBroker


class Streams(FakeBroker):
    """Entries of several generators: like Redis's COUNT (per stream), one read takes up to
    `count` entries from each generator, so it may return more groups than the step needs."""

    def read_trajectories(self, consumer, count, block_ms, check):
        out, taken = [], {}
        for entry in self.queue:
            gen = entry[1].generator
            if taken.get(gen, 0) < count:
                taken[gen] = taken.get(gen, 0) + 1
                out.append(entry)
        self.queue = [e for e in self.queue if e not in out]
        return out, []


class Admit:
    def __init__(self, batch_size):
        self.batch_size = batch_size

    def top_up(self, broker, step, version):
        return 0


def _group(gid, behavior, lengths=(1,), gen="gen-a", issued=None):
    """A complete group (one entry) whose samples have the given response lengths."""
    samples = [
        Sample(
            response_ids=np.full(n, 5, np.int32),
            logprobs=np.full(n, -1.0, np.float32),
            token_versions=np.full(n, behavior, np.int32),
            reward=1.0,
            finished=True,
        )
        for n in lengths
    ]
    return Trajectory(
        traj_id=gid,
        prompt_id="p",
        group_id=gid,
        generator=gen,
        behavior_version=behavior,
        issued_version=behavior if issued is None else issued,
        prompt_ids=np.array([1], np.int32),
        samples=samples,
    )


def _collector(broker, batch, max_staleness=1, max_overdue=None, group_size=1, dist=None):
    extra = {} if dist is None else {"dist": dist}
    return Collector(
        broker,
        Admit(batch),
        group_size,
        100,
        max_staleness,
        timeout_s=5,
        max_overdue=max_overdue,
        **extra,
    )


def test_a_step_trains_the_oldest_ready_group_first():
    """Ready = [new (v5), old (v4)] from two generators in one read, a quota of one: step 5
    trains the old group, and step 6 the new one, which is only one step old then. Taken in
    arrival order, step 5 would train the new group and step 6 drop the old one as stale."""
    broker = Streams()
    c = _collector(broker, batch=1)
    broker.queue += [("e0", _group("new", 5, gen="gen-a")), ("e1", _group("old", 4, gen="gen-b"))]
    out = c.collect(5)
    assert [g.traj_id for g in out.groups] == ["old"] and [
        r.group.traj_id for r in c.ready.groups
    ] == ["new"]
    out = c.collect(6)
    assert [g.traj_id for g in out.groups] == ["new"] and out.stale_ids == []
    assert broker.replaced == 0 and broker.acked == []  # nothing dropped; trained ones wait


def test_equals_keep_their_arrival_order():
    broker = Streams()
    c = _collector(broker, batch=2)
    gens = ("gen-a", "gen-b", "gen-c")
    broker.queue += [(f"e{k}", _group(f"g{k}", 3, gen=g)) for k, g in enumerate(gens)]
    assert [g.traj_id for g in c.collect(3).groups] == ["g0", "g1"]


def _arrives_overdue(max_overdue):
    """Max staleness 1. At step 6 two groups arrive: `late` started at v4 (age 2: it was still
    being generated when it reached the limit) and `ancient` at v1 (age 5)."""
    broker = Streams()
    c = _collector(broker, batch=1, max_overdue=max_overdue)
    broker.queue += [
        ("e0", _group("late", 4, gen="gen-a")),
        ("e1", _group("ancient", 1, gen="gen-b")),
    ]
    broker.queue += [("e2", _group("fresh", 6, gen="gen-c"))]
    return broker, c.collect(6)


def test_an_overdue_group_is_trained_when_it_arrives():
    broker, out = _arrives_overdue(max_overdue=1 + 4)  # the default: trainer.overdue_steps 4
    # both are at most 5 old: accepted and counted as overdue; the step holds one group, the
    # oldest (`ancient`, 5 old); `late` and `fresh` wait (`late`, due now, is dropped at the
    # next step: more groups were due than the step holds)
    assert [g.traj_id for g in out.groups] == ["ancient"] and out.overdue == 2
    assert out.stale_ids == [] and out.staleness == {5: 1} and broker.replaced == 0


def test_with_overdue_steps_0_an_overdue_group_is_dropped_and_replaced():
    broker, out = _arrives_overdue(max_overdue=1)
    assert [g.traj_id for g in out.groups] == ["fresh"] and out.overdue == 0
    assert sorted(out.stale_ids) == ["ancient", "late"] and broker.replaced == 2
    assert sorted(broker.acked) == ["e0", "e1"]


def test_the_overdue_bound_drops_what_is_older_and_what_waited_past_its_step():
    broker = Streams()
    c = _collector(broker, batch=1, max_overdue=3)
    broker.queue += [("e0", _group("a", 3, gen="gen-a")), ("e1", _group("b", 3, gen="gen-b"))]
    broker.queue += [("e2", _group("c", 2, gen="gen-c"))]
    # step 6: a and b are 3 old (overdue, accepted), c is 4 (> 3: stale); one is trained
    out = c.collect(6)
    assert [g.traj_id for g in out.groups] == ["a"] and out.stale_ids == ["c"]
    assert out.overdue == 2 and broker.replaced == 1
    # step 7: b waited past the step it was due in (4 > 1): dropped as stale and replaced
    broker.queue += [("e3", _group("d", 7))]
    out = c.collect(7)
    assert [g.traj_id for g in out.groups] == ["d"] and out.stale_ids == ["b"]
    assert broker.replaced == 2


def test_the_config_switches_the_overdue_bound():
    """`trainer.overdue_steps` sets the learner's bound (and the generators' restart rule,
    generators/continuous.py); a = 0 stays on-policy whatever it says."""
    bound = lambda *kv: load_config(None, list(kv)).trainer.max_overdue_staleness  # noqa: E731
    assert bound("trainer.async_ratio=1") == 1 + 4
    assert bound("trainer.async_ratio=1", "trainer.overdue_steps=0") == 1
    assert bound("trainer.async_ratio=1.5", "trainer.overdue_steps=2") == math.ceil(1.5) + 2
    assert bound("trainer.async_ratio=0", "trainer.overdue_steps=3") == 0


def test_split_quotas_gives_the_due_groups_first():
    # even as the counts allow: [3, 3] -> [2, 2]; rank 1's 3 due groups first -> [1, 3]
    assert split_quotas([3, 3], 4) == [2, 2]
    assert split_quotas([3, 3], 4, first=[0, 3]) == [1, 3]
    # more due than the step takes: split evenly among them; a rank never takes more than it has
    assert split_quotas([3, 3], 4, first=[3, 3]) == [2, 2]
    assert split_quotas([1, 5], 4, first=[2, 0]) == [1, 3]
    assert split_quotas([5, 0], 4, first=[1, 0]) == [4, 0]


def test_length_metrics_by_hand():
    # rank 0: trained 3 samples of 4 + 2 + 6 = 12 tokens; completed the same; stale none
    # rank 1: trained 1 sample of 8 tokens; completed 2 samples of 8 + 30; stale 1 of 30 tokens
    r0 = [12, 3, 12, 3, 0, 0]
    r1 = [8, 1, 38, 2, 30, 1]
    m = length_metrics([r0, r1])
    # trained (12 + 8) / 4 = 5; completed (12 + 38) / 5 = 10; stale 30 / 1
    assert m == {
        "length/trained_mean": 5.0,
        "length/completed_mean": 10.0,
        "length/completed_samples": 5,
        "length/stale_mean": 30.0,
        "length/stale_samples": 1,
    }
    assert math.isnan(length_metrics([r0])["length/stale_mean"])  # none dropped: no mean


class ThreadDist:
    """Rank `rank` of ranks run as threads: `gather` through a shared barrier."""

    def __init__(self, rank, world, shared):
        self.rank, self.world_size, self.shared = rank, world, shared

    is_main = property(lambda self: self.rank == 0)
    consumer = property(lambda self: f"rank{self.rank}")

    def gather(self, obj):
        barrier, slots = self.shared
        slots[self.rank] = obj
        barrier.wait(timeout=10)
        out = list(slots)
        barrier.wait(timeout=10)
        return out


def _two_ranks(steps, queues):
    """Run both ranks' collectors through `steps`, each reading its own queue; returns each
    rank's Collected per step."""
    shared = (threading.Barrier(2), [None, None])
    brokers = [Streams(), Streams()]
    for broker, queue in zip(brokers, queues, strict=True):
        broker.queue += queue
    outs = [[], []]

    def rank(r):
        c = _collector(brokers[r], batch=2, group_size=2, dist=ThreadDist(r, 2, shared))
        for s in steps:
            outs[r].append(c.collect(s))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    return outs, brokers


def test_with_two_ranks_the_due_groups_are_trained_and_metrics_are_the_steps():
    """B = 2. Rank 0 holds two fresh groups (v5), rank 1 two that are due (v4, one step old):
    an even split (one each) would leave one v4 group to be dropped at step 6; the ranks train
    both v4 groups at step 5 and the fresh ones at step 6, nothing dropped."""
    fresh = [(f"a{k}", _group(f"fresh{k}", 5, lengths=(2, 4), gen=f"gen-{k}")) for k in (0, 1)]
    due = [(f"b{k}", _group(f"due{k}", 4, lengths=(10, 10), gen=f"gen-{k}")) for k in (0, 1)]
    outs, brokers = _two_ranks([5, 6], [fresh, due])
    step5 = [[g.traj_id for g in outs[r][0].groups] for r in (0, 1)]
    step6 = [[g.traj_id for g in outs[r][1].groups] for r in (0, 1)]
    assert step5 == [[], ["due0", "due1"]] and step6 == [["fresh0", "fresh1"], []]
    assert all(b.replaced == 0 and b.acked == [] for b in brokers)
    # step 5 over both ranks: trained the two due groups, 10 tokens a sample -> 10; completed
    # all four: (2 + 4) x 2 + (10 + 10) x 2 = 52 tokens in 8 samples -> 6.5; every rank says so
    for r in (0, 1):
        m = outs[r][0].step_wide
        assert m["length/trained_mean"] == 10.0 and m["length/completed_samples"] == 8
        assert m["length/completed_mean"] == 6.5 and m["async/overdue"] == 0
        assert math.isnan(m["length/stale_mean"]) and m["length/stale_samples"] == 0
        # step 6: trained (2 + 4) x 2 / 4 = 3, nothing completed
        m = outs[r][1].step_wide
        assert m["length/trained_mean"] == 3.0 and m["length/completed_samples"] == 0
