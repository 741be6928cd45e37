"""The learner's provenance check (broker/channels/provenance.py): a trajectory is trained only if it
answers a prompt the learner issued, with versions the learner has published, from the stream
of the generator it names."""

import hashlib
import hmac

import numpy as np
import pytest

from rollflash.broker.channels.provenance import check, mac, sign
from rollflash.broker.wire.schema import PromptWork, Sample, Trajectory
from rollflash.broker.wire.wire import WireError

KEY = b"k" * 32


def _traj(work: PromptWork, n: int, version: int = 3, prompt=(1,), **over) -> Trajectory:
    s = Sample(np.array([5], np.int32), np.array([-1.0], np.float32),
               np.array([version], np.int32), 1.0, True)  # fmt: skip
    t = Trajectory.for_work(work, [s] * n, list(prompt), "gen-0", version)
    for k, v in over.items():
        setattr(t, k, v)
    return t


def _ref(message: bytes) -> str:
    """HMAC-SHA256 of `message`, its first 128 bits in hex: the slow reference of one tag."""
    return hmac.new(KEY, message, hashlib.sha256).hexdigest()[:32]


def test_the_mac_is_two_hmac_sha256_tags_fields_then_fields_and_prompt_tokens():
    # the fields joined by newlines; then the same with the sha256 of the prompt tokens as
    # little-endian int32 (1, 2 -> bytes 01 00 00 00 02 00 00 00), or "unchecked" without them
    fields = b"g7\np7\n2\n4\n-1"
    digest = hashlib.sha256(bytes([1, 0, 0, 0, 2, 0, 0, 0])).hexdigest().encode()
    assert mac(KEY, "g7", "p7", 2, 4, -1, [1, 2]) == _ref(fields) + _ref(fields + b"\n" + digest)
    assert mac(KEY, "g7", "p7", 2, 4, -1) == _ref(fields) + _ref(fields + b"\nunchecked")
    w = sign(KEY, PromptWork("p7", "g7", 4, 2, {}, prompt_ids=[1, 2]))
    assert w.mac == mac(KEY, "g7", "p7", 2, 4, -1, [1, 2]) and len(w.mac) == 64


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
        ({"mac": "é" * 64}, "not_issued"),  # not ASCII: compared as bytes, refused
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


def test_a_group_is_trained_only_with_the_prompt_tokens_the_learner_issued():
    """The second tag signs the learner's own prompt tokens: other tokens under a genuine MAC
    (the finding: 40 copies of one token), one token more or less, or the right tokens of
    another prompt are refused as `wrong_prompt`; the issued tokens pass, for a whole group and
    for each replicated sample."""
    w = sign(KEY, PromptWork("p7", "g7", 4, 2, {}, prompt_ids=[11, 12, 13]))
    check(KEY, _traj(w, 4, prompt=[11, 12, 13]), "gen-0", group_size=4, max_version=3)
    for forged in ([5] * 40, [11, 12], [11, 12, 13, 14], [12, 11, 13], [1]):
        with pytest.raises(WireError, match="not those of the prompt the learner") as e:
            check(KEY, _traj(w, 4, prompt=forged), "gen-0", group_size=4, max_version=3)
        assert e.value.code == "wrong_prompt"
    for k in range(3):
        one = sign(KEY, PromptWork("p7", "g7", 1, 2, {}, sample_index=k, prompt_ids=[11, 12]))
        check(KEY, _traj(one, 1, prompt=[11, 12]), "gen-0", group_size=4, max_version=3)
        with pytest.raises(WireError) as e:
            check(KEY, _traj(one, 1, prompt=[11, 99]), "gen-0", group_size=4, max_version=3)
        assert e.value.code == "wrong_prompt"
    # the second half of another prompt's MAC does not carry over
    other = sign(KEY, PromptWork("p8", "g8", 4, 2, {}, prompt_ids=[11, 12, 13]))
    spliced = w.mac[:32] + other.mac[32:]
    with pytest.raises(WireError) as e:
        check(KEY, _traj(w, 4, prompt=[11, 12, 13], mac=spliced), "gen-0", 4, 3)
    assert e.value.code == "wrong_prompt"


def test_a_prompt_issued_without_tokens_takes_the_generators():
    """An agent program composes its own prompts: the learner signs `unchecked` and takes any
    prompt tokens; a generator cannot turn a checked prompt into an unchecked one."""
    w = sign(KEY, PromptWork("p7", "g7", 4, 2, {}))
    for prompt in ([1], [5] * 40):
        check(KEY, _traj(w, 4, prompt=prompt), "gen-0", group_size=4, max_version=3)
    checked = sign(KEY, PromptWork("p7", "g7", 4, 2, {}, prompt_ids=[1]))
    assert checked.mac[:32] == w.mac[:32] and checked.mac[32:] != w.mac[32:]
    with pytest.raises(WireError) as e:
        check(KEY, _traj(checked, 4, prompt=[2]), "gen-0", group_size=4, max_version=3)
    assert e.value.code == "wrong_prompt"
