"""The run's key names, spelled once (broker/keys.py) and used by the ACL rules."""

from rollflash.broker.acl import generator_acl, learner_acl
from rollflash.broker.keys import RunKeys


def test_every_key_lives_under_the_run_prefix():
    k = RunKeys("demo")
    assert k.prefix == "rl:demo:"
    assert (k.prompts, k.trajectories, k.dlq, k.weights, k.run) == (
        "rl:demo:prompts",
        "rl:demo:trajectories",
        "rl:demo:dlq",
        "rl:demo:weights",
        "rl:demo:run",
    )
    assert k.gen("gen-0") == "rl:demo:gen:gen-0" and k.gen_pattern == "rl:demo:gen:*"
    assert k.generator_id(k.gen("gen:odd")) == "gen:odd"  # only the prefix is removed


def test_acl_rules_name_the_same_keys():
    k = RunKeys("demo")
    rules = generator_acl("demo", "pw")
    assert f"(+xreadgroup +xautoclaim +xack ~{k.prompts})" in rules
    assert f"(+xadd %W~{k.trajectories} %W~{k.dlq})" in rules
    assert f"(+hget +hgetall +hmget %R~{k.run} %R~{k.weights})" in rules
    assert f"(+hset +pexpire ~{k.gen_pattern})" in rules
    assert learner_acl("demo", "pw")[-1] == "~rl:demo:*"
