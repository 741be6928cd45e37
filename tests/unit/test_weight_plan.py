"""Who fetches a version from whom (broker/weights/weight_plan.py), worked by hand: a breadth-first tree
rooted at the learner, each relay serving at most `weights.fanout` generators, and a failed relay
replaced by an earlier holder or the learner."""

import tracemalloc
from collections import Counter

from rollflash.broker.weights.weight_plan import SourcePlanner

L = "http://learner"


def _url(name: str) -> str:
    return f"http://{name}"


def _tree(planner: SourcePlanner, names: list[str]) -> dict[str, str]:
    return {n: planner.assign(1, n, _url(n), []) for n in names}


def test_fanout_two_sends_one_copy_from_the_learner():
    # g0: no holder yet -> learner; g1, g2 -> g0 (its load 1, 2); g3, g4: g0 full -> g1, the
    # earliest with room; g5 -> g2. Depth 2 below g0 for 6 generators
    planner = SourcePlanner(L, fanout=2)
    assert _tree(planner, ["g0", "g1", "g2", "g3", "g4", "g5"]) == {
        "g0": L,
        "g1": _url("g0"),
        "g2": _url("g0"),
        "g3": _url("g1"),
        "g4": _url("g1"),
        "g5": _url("g2"),
    }
    assert planner.learner_load(1) == 1


def test_fanout_one_is_a_chain():
    planner = SourcePlanner(L, fanout=1)
    assert _tree(planner, ["a", "b", "c"]) == {"a": L, "b": _url("a"), "c": _url("b")}


def test_a_generator_that_relays_nothing_is_never_a_source():
    planner = SourcePlanner(L, fanout=2)
    assert planner.assign(1, "quiet", None, []) == L  # weights.relay false
    assert planner.assign(1, "next", _url("next"), []) == L
    assert planner.learner_load(1) == 2


def test_a_failed_relay_is_replaced_by_an_earlier_holder_or_the_learner():
    planner = SourcePlanner(L, fanout=1)
    _tree(planner, ["a", "b", "c"])  # a <- learner, b <- a, c <- b
    # b died: c is sent to an earlier live holder with room (a serves b already: full) -> learner
    assert planner.assign(1, "c", _url("c"), [_url("b")]) == L
    # a newcomer never gets the dead b, nor c's own downstream position reversed: c has room
    assert planner.assign(1, "d", _url("d"), []) == _url("c")


def test_versions_are_planned_apart_and_old_ones_forgotten():
    planner = SourcePlanner(L, fanout=2, keep=2)
    for v in (1, 2, 3):
        assert planner.assign(v, "a", _url("a"), []) == L
        assert planner.assign(v, "b", _url("b"), []) == _url("a")
    assert planner.learner_load(1) == 0 and planner.learner_load(3) == 1  # v1 was forgotten


def test_the_plan_is_bounded_however_many_ask():
    """30,000 registrations, as many names, over 3 versions: with keep 2 and 100 holders per
    version the plan holds at most 2 x 100 = 200 of them, and every asker still gets a source."""
    planner = SourcePlanner(L, fanout=2, keep=2, max_holders=100)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    sources = Counter(
        planner.assign(1 + i // 10_000, f"g{i}", _url(f"g{i}"), []) for i in range(30_000)
    )
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert planner.holders() == 2 * 100  # versions 2 and 3, 100 holders each
    # per version, the 100 holders (the first 100 askers) take 2 generators each, in order:
    # 200 askers are sent to relays, the other 10,000 - 200 to the learner
    assert sum(sources.values()) == 30_000
    assert all(url == L or url.startswith("http://g") for url in sources)
    assert planner.learner_load(3) == 10_000 - 200
    # the counter of sources holds ~300 short strings; the plan itself 200 holders: far under 1 MB
    assert grown < 1 << 20
