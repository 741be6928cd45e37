"""The learner's provenance check (broker/provenance.py): a trajectory is trained only if it
answers a prompt the learner issued, with versions the learner has published, from the stream
of the generator it names."""

import hashlib
import hmac

import numpy as np
import pytest

from rollflash.broker.provenance import check, mac, sign
from rollflash.broker.schema import PromptWork, Sample, Trajectory
from rollflash.broker.wire import WireError

KEY = b"k" * 32


def _traj(work: PromptWork, n: int, version: int = 3, **over) -> Trajectory:
    s = Sample(np.array([5], np.int32), np.array([-1.0], np.float32),
               np.array([version], np.int32), 1.0, True)  # fmt: skip
    t = Trajectory.for_work(work, [s] * n, [1], "gen-0", version)
    for k, v in over.items():
        setattr(t, k, v)
    return t


def test_the_mac_is_hmac_sha256_of_the_prompts_fields():
    # a slow reference: the fields joined by newlines, HMAC-SHA256, the first 128 bits in hex
    expected = hmac.new(KEY, b"g7\np7\n2\n4\n-1", hashlib.sha256).hexdigest()[:32]
    assert mac(KEY, "g7", "p7", 2, 4, -1) == expected
    w = sign(KEY, PromptWork("p7", "g7", 4, 2, {}))
    assert w.mac == expected


def test_an_answer_to_an_issued_prompt_passes():
    w = sign(KEY, PromptWork("p7", "g7", 4, 2, {}))
    check(KEY, _traj(w, 4), "gen-0", group_size=4, max_version=3)
    replicated = sign(KEY, PromptWork("p7", "g7", 1, 2, {}, sample_index=5))
    check(KEY, _traj(replicated, 1), "gen-0", group_size=4, max_version=3)  # traj_id g7/5


@pytest.mark.parametrize(
    "change, code",
    [
        ({"issued_version": 1}, "not_issued"),  # an issued version it was not issued with
        ({"group_id": "g8", "traj_id": "g8"}, "not_issued"),  # a group never issued
        ({"prompt_id": "p9"}, "not_issued"),
        ({"mac": ""}, "not_issued"),
        ({"generator": "gen-1"}, "wrong_generator"),  # from gen-0's stream
        ({"traj_id": "g7/x"}, "invalid"),
    ],
)
def test_a_forged_field_is_refused(change, code):
    w = sign(KEY, PromptWork("p7", "g7", 4, 2, {}))
    with pytest.raises(WireError) as e:
        check(KEY, _traj(w, 4, **change), "gen-0", group_size=4, max_version=3)
    assert e.value.code == code


def test_versions_newer_than_the_learners_are_refused():
    w = sign(KEY, PromptWork("p7", "g7", 4, 2, {}))
    # tokens of v4 while the learner has published v3: no generator can have sampled them
    with pytest.raises(WireError, match="version 4 is newer than the learner's 3") as e:
        check(KEY, _traj(w, 4, version=4), "gen-0", group_size=4, max_version=3)
    assert e.value.code == "future_version"
    issued_late = sign(KEY, PromptWork("p7", "g7", 4, 5, {}))  # a genuine MAC, issued at v5
    with pytest.raises(WireError, match="version 5"):
        check(KEY, _traj(issued_late, 4), "gen-0", group_size=4, max_version=3)


def test_a_group_must_hold_exactly_the_samples_its_prompt_asked_for():
    w = sign(KEY, PromptWork("p7", "g7", 4, 2, {}))
    with pytest.raises(WireError, match="3 samples, its prompt asked for 4") as e:
        check(KEY, _traj(w, 3), "gen-0", group_size=4, max_version=3)
    assert e.value.code == "out_of_range"
