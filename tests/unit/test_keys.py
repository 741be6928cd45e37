"""The run's key names, spelled once (broker/connect/keys.py) and used by the ACL rules."""

import pytest

from rollflash.broker.connect.acl import describe, generator_acl, learner_acl
from rollflash.broker.connect.keys import RunKeys, valid_name


def test_every_key_lives_under_the_run_prefix():
    k = RunKeys("demo")
    assert k.prefix == "rl:demo:"
    shared = (k.prompts, k.dlq, k.dlq_reasons, k.weights, k.run, k.lease, k.mac_key, k.inflight)
    assert (*shared, k.generators, k.joined) == (
        "rl:demo:prompts",
        "rl:demo:dlq",
        "rl:demo:dlq_reasons",
        "rl:demo:weights",
        "rl:demo:run",
        "rl:demo:lease",
        "rl:demo:mac_key",
        "rl:demo:inflight",
        "rl:demo:generators",
        "rl:demo:joined",
    )
    assert RunKeys.joined.__doc__.startswith("Set: ids of generators")  # each key's own doc
    # what one generator may write carries its id
    assert k.trajectories("gen-0") == "rl:demo:traj:gen-0"
    assert k.generator_dlq("gen-0") == "rl:demo:dlq:gen-0"
    assert k.gen("gen-0") == "rl:demo:gen:gen-0"
    assert k.generator_of(k.trajectories("gen-0")) == "gen-0"


@pytest.mark.parametrize(
    "name, ok",
    [("demo", True), ("run_1.b-2", True), ("x" * 64, True), ("x" * 65, False), ("", False),
     ("exp*", False), ("a?b", False), ("a[b]", False), ("a:b", False), ("a b", False)],
)  # fmt: skip
def test_names_that_go_into_acl_patterns_have_no_glob_characters(name, ok):
    assert valid_name(name) is ok


def test_acl_rules_name_the_same_keys():
    k = RunKeys("demo")
    rules = generator_acl("demo", "gen-0", "pw")
    assert f"(+xreadgroup +xautoclaim +xack ~{k.prompts})" in rules
    own = f"%W~{k.trajectories('gen-0')} %W~{k.generator_dlq('gen-0')}"
    assert f"(+xadd {own})" in rules  # its own streams only, write-only
    assert f"(+hset +pexpire ~{k.gen('gen-0')})" in rules  # its own heartbeat only
    assert f"(+hget +hgetall +hmget %R~{k.run} %R~{k.weights} %R~{k.generators})" in rules
    assert not any("dlq_reasons" in r or "*" in r for r in rules)
    learner = learner_acl("demo", "pw")
    assert learner[-1] == "~rl:demo:*" and "-@all" in learner
    assert not {"+scan", "+keys", "+select", "+function|flush", "+function|delete"} & set(learner)


def test_the_printed_powers_list_every_selector():
    lines = describe(generator_acl("demo", "gen-0", "pw"))
    assert "#   XADD on rl:demo:traj:gen-0 (write-only) rl:demo:dlq:gen-0 (write-only)" in lines
    assert len(lines) == 1 + 6  # the loose commands, then one line per selector
