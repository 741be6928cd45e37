"""`rollctl inspect` on a real Redis: a trajectory decoded for a person (its prompt and responses
detokenised with the model's tokenizer from the token ids, not the generator's text), a hostile
entry shown as refused with its reason, and a dead letter with its reason and original fields."""

import json

import msgpack
import numpy as np
import redis
from transformers import AutoTokenizer

from rollflash.broker.config.config import config_from_dict
from rollflash.broker.connect.keys import RunKeys
from rollflash.broker.wire.schema import Sample, Trajectory, encode_trajectory
from rollflash.rollctl.inspect import show_entries


def _config(tiny_model_dir, redis_url, run_id):
    return config_from_dict(
        {
            "run": {"run_id": run_id},
            "model": {"path": str(tiny_model_dir)},
            "redis": {"url": redis_url},
            "rollout": {"num_return_sequences": 2},
        }
    )


def _trajectory(tok) -> dict:
    def ids(text):
        return np.array(tok.encode(text, add_special_tokens=False), np.int32)

    a, b = ids("46"), ids("47")  # 2 tokens each: the tiny model's tokenizer has one per character
    samples = [
        Sample(a, np.array([-0.5, -0.25], np.float32), np.array([3, 4], np.int32), 1.0, True,
               text="what the generator says it wrote"),
        Sample(b, np.array([-1.0, -1.0], np.float32), np.array([3, 3], np.int32), 0.0, False),
    ]  # fmt: skip
    return encode_trajectory(
        Trajectory("g7", "train-7", "g7", "gen-0", 3, 3, ids("12+34="), samples)
    )


def test_entries_decoded_for_a_person_and_a_hostile_one_refused(
    tiny_model_dir, redis_url, run_id, capsys
):
    cfg, keys = _config(tiny_model_dir, redis_url, run_id), RunKeys(run_id)
    r = redis.Redis.from_url(redis_url)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    r.hset(keys.generators, "gen-0", "active")  # what the learner's admission writes
    good = r.xadd(keys.trajectories("gen-0"), _trajectory(tok)).decode()
    body = msgpack.unpackb(_trajectory(tok)["data"])
    body["prompt_ids"] = {"dtype": "<i4", "shape": [2**62, 0], "data": b""}  # a hostile shape
    bad = r.xadd(
        keys.trajectories("gen-0"), {**_trajectory(tok), "data": msgpack.packb(body)}
    ).decode()
    r.hset(keys.weights, "version", 5)

    show_entries(cfg, "trajectories", None, 2, as_json=False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        f"trajectories {good}  g7 from gen-0  behaviour v3, issued v3, staleness 2 (weights now)"
    )  # staleness: weights v5 now - behaviour v3
    assert lines[1] == "  prompt: '12+34='"
    assert lines[2] == "  [0] reward 1.000  eos  2 tokens v3-v4  logp -0.75: '46'"
    assert lines[3] == "  [1] reward 0.000  cut  2 tokens v3  logp -2.00: '47'"
    assert lines[4].startswith(f"trajectories {bad}  REFUSED (bad_shape): ")
    assert len(lines) == 5

    show_entries(cfg, "trajectories", good, None, as_json=True)
    (view,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert view["id"] == good and view["prompt"] == "12+34=" and view["staleness"] == 2
    assert [s["response"] for s in view["samples"]] == ["46", "47"]


def test_a_dead_letter_shows_its_reason_and_original_fields(
    tiny_model_dir, redis_url, run_id, capsys
):
    cfg, keys = _config(tiny_model_dir, redis_url, run_id), RunKeys(run_id)
    r = redis.Redis.from_url(redis_url)
    r.xadd(
        keys.dlq,
        {
            "reason": "trajectory: bad scalar field n (b'x')",
            "code": "bad_type",
            "source": keys.trajectories("gen-0"),
            "original_id": "1-0",
            "orig_traj_id": "g9",
            "orig_data": b"\xc1",  # never decoded for display: shown as refused
        },
    )
    show_entries(cfg, "dlq", None, 1, as_json=True)
    (view,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (view["reason"], view["code"], view["original_id"]) == (
        "trajectory: bad scalar field n (b'x')",
        "bad_type",
        "1-0",
    )
    assert view["original"] == {"traj_id": "g9"}
    assert "refused" in view["decoded"]
