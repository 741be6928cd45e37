"""The collector's duplicate filter with bounded memory (learner/intake/collect.py, learner/intake/recent.py):
ids are forgotten once their prompt's issue step falls below the floor, and a copy arriving after
that is still never trained; counters and acknowledgements stay exact; what a checkpoint keeps."""

import numpy as np

from rollflash.broker.wire.schema import Sample, Trajectory
from rollflash.learner.durability.checkpoint import _merge_consumed
from rollflash.learner.intake.collect import Collector
from rollflash.learner.intake.recent import KEEP_MARGIN

B = 2  # groups per step


class FakeBroker:
    """The calls the collector makes, in memory: a queue of entries to read, and a record of
    every acknowledgement with the traj_ids it finishes and the number of groups it replaces."""

    def __init__(self):
        self.queue: list[tuple[str, Trajectory]] = []
        self.acked: list[str] = []
        self.finished: list[str] = []
        self.replaced = 0
        self.counted: dict[str, int] = {}

    def read_trajectories(self, consumer, count, block_ms, check):
        out, self.queue = self.queue[:count], self.queue[count:]
        return out, []

    def ack_trajectories(self, ids, finished=(), replaced=0):
        self.acked += list(ids)
        self.finished += list(finished)
        self.replaced += replaced

    def refused(self):
        return set()

    def count_in_run(self, name, n):
        self.counted[name] = self.counted.get(name, 0) + n


class NoAdmission:
    batch_size = B

    def top_up(self, broker, step, version):
        return 0


def _traj(traj_id, issued, behavior, group_id=None, samples=1):
    s = Sample(
        response_ids=np.array([5], np.int32),
        logprobs=np.array([-1.0], np.float32),
        token_versions=np.array([behavior], np.int32),
        reward=1.0,
        finished=True,
    )
    return Trajectory(
        traj_id=traj_id,
        prompt_id="p",
        group_id=group_id or traj_id,
        generator="gen",
        behavior_version=behavior,
        issued_version=issued,
        prompt_ids=np.array([1], np.int32),
        samples=[s] * samples,
    )


def _collector(broker, group_size=1, max_staleness=1):
    return Collector(broker, NoAdmission(), group_size, 100, max_staleness, timeout_s=5)


def test_a_copy_arriving_after_its_id_is_forgotten_is_not_trained():
    broker, entry = FakeBroker(), iter(range(10**6))
    c = _collector(broker)
    keep = 1 + KEEP_MARGIN  # max_staleness 1
    trained, stale, dups = [], [], []

    def step(s, extra=()):
        broker.queue += [(f"e{next(entry)}", t) for t in extra]
        broker.queue += [(f"e{next(entry)}", _traj(f"g{s}-{k}", s, s)) for k in range(B)]
        out = c.collect(s)
        trained.extend(g.traj_id for g in out.groups)
        stale.extend(out.stale_ids)
        dups.extend(out.duplicate_ids)
        return out

    step(0)
    # step 5: a regenerated copy of g0-0 (same prompt entry: issued 0, but fresh weights, v5) is
    # recognised by its id: a duplicate, acknowledged, not replaced
    out = step(5, [_traj("g0-0", 0, 5)])
    assert out.duplicate_ids == ["g0-0"] and broker.replaced == 0
    for s in range(6, keep + 3):
        step(s)
    # after step keep + 2 = 35 the floor is 35 - 33 = 2: step 0's ids are forgotten; memory holds
    # those of the steps run since (5 and 6..35), two each: 31 * 2 = 62
    assert c.ids.floor == 2 and "g0-0" not in c.ids.seen and "g0-1" not in c.ids.trained
    assert len(c.ids.seen) == len(c.ids.trained) == 62
    # another fresh-looking copy of g0-0 (issued 0 < floor 2): dropped as stale and replaced,
    # never trained; a copy of g10-1 (issued 10, inside the window) is still a duplicate
    out = step(keep + 3, [_traj("g0-0", 0, keep + 3), _traj("g10-1", 10, keep + 3)])
    assert out.stale_ids == ["g0-0"] and out.duplicate_ids == ["g10-1"]
    assert broker.replaced == 1
    assert len(trained) == len(set(trained)) == 2 * 33  # steps 0, 5 and 6..36
    assert trained.count("g0-0") == 1
    # every dropped entry was acknowledged exactly once; trained ones wait for the checkpoint
    assert len(broker.acked) == len(set(broker.acked)) == len(stale) + len(dups) == 3


def test_incomplete_groups_below_the_floor_are_dropped_and_replaced_once():
    broker = FakeBroker()
    c = _collector(broker, group_size=2, max_staleness=0)  # keep_steps = KEEP_MARGIN
    # one sample of group h (issued at step 0) arrives; its partner never does
    broker.queue += [("h0", _traj("h/0", 0, 0, group_id="h"))]
    broker.queue += [(f"a{k}", _traj(f"a{k}/0", 0, 0, group_id=f"a{k}", samples=2)) for k in (0, 1)]
    c.collect(0)
    assert c.assembler.pending_traj_ids() == ["h/0"]  # its one sample waits
    for s in range(1, KEEP_MARGIN + 2):
        broker.queue += [
            (f"s{s}-{k}", _traj(f"s{s}-{k}/0", s, s, group_id=f"s{s}-{k}", samples=2))
            for k in (0, 1)
        ]
        out = c.collect(s)
        if s == KEEP_MARGIN + 1:  # floor 1 > 0: h is dropped as stale, its entry acknowledged
            assert out.stale_ids == ["h"] and broker.acked == ["h0"] and broker.replaced == 1
    assert c.assembler.pending_traj_ids() == [] and "a0" not in c.assembler.completed
    # its partner finally arrives: below the floor, dropped (and replaced: it could have been
    # a first answer), never trained
    broker.queue += [("h1", _traj("h/1", 0, 40, group_id="h"))]
    broker.queue += [
        (f"t{k}", _traj(f"t{k}/0", 40, 40, group_id=f"t{k}", samples=2)) for k in (0, 1)
    ]
    out = c.collect(KEEP_MARGIN + 2)
    assert out.stale_ids == ["h/1"] and [g.traj_id for g in out.groups] == ["t0", "t1"]
    assert broker.replaced == 2


def test_the_checkpoint_keeps_consumed_ids_but_not_pending_ones():
    broker = FakeBroker()
    c = _collector(broker, group_size=2)
    # group x complete and trained; group y half-way (its entry pending in the stream)
    broker.queue += [("x0", _traj("x/0", 0, 0, group_id="x")), ("x1", _traj("x/1", 0, 0, "x"))]
    broker.queue += [("y0", _traj("y/0", 0, 0, group_id="y"))]
    broker.queue += [("z0", _traj("z/0", 0, 0, group_id="z", samples=2))]
    out = c.collect(0)
    assert [g.traj_id for g in out.groups] == ["x", "z"]
    consumed, pending = c.consumed()
    assert pending == ["y/0"] and consumed == {0: ["x", "x/0", "x/1", "y/0", "z", "z/0"]}
    saved = _merge_consumed([consumed], set(pending))
    assert saved == {0: ["x", "x/0", "x/1", "z", "z/0"]}
    # a learner resumed from it re-reads y/0 from its pending list: accepted, not a duplicate;
    # a copy of x/0 is a duplicate
    resumed = _collector(FakeBroker(), group_size=2)
    resumed.restore(saved)
    resumed.broker.queue += [("y0", _traj("y/0", 0, 0, group_id="y")), ("x0", _traj("x/0", 0, 0))]
    resumed.broker.queue += [("y1", _traj("y/1", 0, 1, group_id="y"))]
    resumed.broker.queue += [("w0", _traj("w/0", 1, 1, group_id="w", samples=2))]
    out = resumed.collect(1)
    assert [g.traj_id for g in out.groups] == ["y", "w"] and out.duplicate_ids == ["x/0"]


def test_an_entry_delivered_again_while_held_is_neither_a_duplicate_nor_acknowledged():
    """Redis delivers an entry again when it lost the delivery (a failover to a replica that
    lacked it): the entry the rank trained but has not acknowledged yet, or holds in an
    incomplete group, is the same entry, not a copy, and waits for its own outcome. A copy under
    another entry id is still a duplicate."""
    broker = FakeBroker()
    c = _collector(broker, group_size=2)
    a, b = (_traj(f"{g}/0", 0, 0, group_id=g, samples=2) for g in "ab")
    h = _traj("h/0", 0, 0, group_id="h")  # one sample of two
    broker.queue += [("h0", h), ("e0", a), ("e1", b)]
    out = c.collect(0)
    c.progress.entry_ids += out.entry_ids  # trained, acknowledged after the checkpoint
    assert out.entry_ids == ["e0", "e1"] and c.assembler.pending_entry_ids() == ["h0"]
    fresh = [
        (f"e{k}", _traj(f"{g}/0", 1, 1, group_id=g, samples=2)) for k, g in ((2, "c"), (3, "d"))
    ]
    broker.queue += [("e9", a), ("e0", a), ("h0", h), ("e1", b), *fresh]
    out = c.collect(1)
    assert [g.group_id for g in out.groups] == ["c", "d"] and out.entry_ids == ["e2", "e3"]
    assert out.duplicate_ids == ["a/0"] and broker.acked == ["e9"]  # only the copy
    assert c.assembler.pending_entry_ids() == ["h0"]
