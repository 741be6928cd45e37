"""Poison entries injected into a real run (learner and generator processes, simulated engine):
each kind goes to a dead-letter stream with its reason and original id (poison trajectories to
the learner's `dlq`, poison prompts to the generator's own `dlq:{id}`), is acknowledged, is
counted (learner metric `async/rejected` and `rollctl status`'s dead letters, generator heartbeat
`dead_letters`), and training finishes with every step complete."""

import json
import math

import msgpack
import numpy as np
import redis
from harness import (
    start,
    status_text,
    steps_done,
    stop_all,
    trained_ids,
    wait_until,
    write_config,
)

from rollflash.broker.wire.schema import Sample, Trajectory, encode_trajectory

STEPS, B, LIMIT = 6, 4, 20_000


def _traj_fields(mutate=None, sample=None) -> dict:
    s = sample or Sample(
        np.array([5, 6], np.int32),
        np.array([-0.5, -1.0], np.float32),
        np.array([0, 0], np.int32),
        1.0,
        True,
    )
    fields = encode_trajectory(
        Trajectory("poison", "p", "poison", "evil", 0, 0, np.array([1, 2], np.int32), [s, s])
    )
    if mutate:
        body = msgpack.unpackb(fields["data"])
        mutate(body)
        fields["data"] = msgpack.packb(body)
    return fields


def _set_sample(key, value):
    return lambda body: body["samples"][0].__setitem__(key, value)


def _array(key, values, dtype):
    return lambda body: body["samples"][0][key].__setitem__(
        "data", np.array(values, dtype).tobytes()
    )


PROMPT_POISON = {
    "corrupt msgpack": (
        {
            "schema": 2,
            "prompt_id": "x",
            "group_id": "x",
            "n": 2,
            "issued_version": 0,
            "data": b"\xc1\xff",
        },
        "corrupt msgpack",
    ),
    "wrong schema": ({"schema": 99, "data": msgpack.packb({"item": {}})}, "schema"),
    "oversize": ({"schema": 2, "data": b"\x00" * (LIMIT + 1)}, "exceeds the limit"),
    "wrong types": (
        {
            "schema": 2,
            "prompt_id": "x",
            "group_id": "x",
            "n": "two",
            "issued_version": 0,
            "data": msgpack.packb({"item": {"prompt": "1+1="}}),
        },
        "bad scalar field",
    ),
}
TRAJECTORY_POISON = {
    "corrupt msgpack": ({**_traj_fields(), "data": b"\xc1garbage"}, "corrupt msgpack"),
    "wrong schema": ({**_traj_fields(), "schema": 99}, "schema"),
    "NaN reward": (_traj_fields(_set_sample("reward", math.nan)), "reward: not finite"),
    "inf reward": (_traj_fields(_set_sample("reward", math.inf)), "reward: not finite"),
    "inf logprob": (
        _traj_fields(_array("logprobs", [-0.5, -math.inf], np.float32)),
        "logprobs: not finite",
    ),
    "NaN logprob": (
        _traj_fields(_array("logprobs", [math.nan, -1.0], np.float32)),
        "logprobs: not finite",
    ),
    "token outside vocabulary": (
        _traj_fields(_array("response_ids", [5, 10_000], np.int32)),
        "outside the vocabulary",
    ),
    "wrong types": (_traj_fields(_set_sample("reward", "high")), "wrong type str"),
    "oversize": ({**_traj_fields(), "data": b"\x00" * (LIMIT + 1)}, "exceeds the limit"),
    # crafted to raise past a decoder that only checked the byte count against the shape
    "crafted shape": (
        _traj_fields(
            lambda b: b.__setitem__(
                "prompt_ids", {"dtype": "<i4", "shape": [2**62, 0], "data": b""}
            )
        ),
        "shape",
    ),
    "unknown key": (_traj_fields(lambda b: b.__setitem__("extra", [[]] * 1000)), "unknown key"),
    "behaviour version lie": ({**_traj_fields(), "behavior_version": 5}, "oldest token"),
}


def test_poison_on_both_streams_is_dead_lettered_acked_counted_and_training_goes_on(
    tmp_path, run_id, redis_url, fault_report
):
    config = write_config(tmp_path, redis_url, run_id, STEPS, B, redis={"max_payload_bytes": LIMIT})
    run_dir = tmp_path / "run"
    r = redis.Redis.from_url(redis_url)
    prefix = f"rl:{run_id}:"
    gen = start("start-generator", config, "--id", "gen-0")
    learner = start("start-learner", config)
    try:
        wait_until(lambda: steps_done(run_dir) >= 1, 60, "the first learner step")
        injected = {}
        for stream, poison in (("prompts", PROMPT_POISON), ("traj:gen-0", TRAJECTORY_POISON)):
            for name, (fields, reason) in poison.items():
                injected[(stream, r.xadd(prefix + stream, fields).decode())] = (name, reason)
        assert learner.wait(timeout=120) == 0, learner.stderr_text()[-3000:]
        assert gen.wait(timeout=30) == 0, gen.stderr_text()[-3000:]
    finally:
        stop_all([learner, gen])
    trained = trained_ids(run_dir)
    assert len(trained) == len(set(trained)) == STEPS * B
    dead = {
        (f[b"source"].decode().removeprefix(prefix), f[b"original_id"].decode()): f
        for dlq in ("dlq", "dlq:gen-0")
        for _, f in r.xrange(prefix + dlq)
    }
    for key, (name, reason) in injected.items():
        assert key in dead, f"{key[0]} {name} was not dead-lettered"
        assert reason in dead[key][b"reason"].decode(), (name, dead[key][b"reason"])
    for stream, group in (("prompts", "gen"), ("traj:gen-0", "learner")):
        pending = {
            p["message_id"].decode()
            for p in r.xpending_range(prefix + stream, group, min="-", max="+", count=1000)
        }
        assert not pending & {i for s, i in injected if s == stream}, f"poison pending in {stream}"
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["async/rejected"] for m in metrics) == len(TRAJECTORY_POISON)
    gen_hash = {k.decode(): v.decode() for k, v in r.hgetall(prefix + "gen:gen-0").items()}
    assert int(gen_hash["dead_letters"]) == len(PROMPT_POISON)
    # rollctl status counts the learner's by reason code, e.g. "dead letters: 12 (bad_shape=1,
    # ...)": no generator can add to that count (each reports its own in its heartbeat)
    line = next(x for x in status_text(config).splitlines() if x.startswith("dead letters:"))
    by_code = dict(part.split("=") for part in line.split("(", 1)[1].rstrip(")").split(", "))
    assert sum(map(int, by_code.values())) == len(TRAJECTORY_POISON), line
    assert {"corrupt", "too_large", "schema", "unknown_key", "out_of_range"} <= by_code.keys()
    # a malformed entry is no forgery: the generator whose stream held it is not quarantined
    assert r.hget(prefix + "generators", "gen-0") == b"active"
    for stream, poison in (("prompts", PROMPT_POISON), ("traj:gen-0", TRAJECTORY_POISON)):
        fault_report(
            f"poison {stream} ({len(poison)} kinds)",
            injected=len(poison),
            lost=0,
            recovered=sum(1 for s, _ in injected if s == stream and (s, _) in dead),
            reported=len(poison),
            duplicated=len(trained) - len(set(trained)),
            dropped_duplicates=0,
        )
