"""The simulated engine's two ways of being driven: whole batches and continuous batching."""

import pytest

from rollflash.broker.config.config import ConfigError, SimConfig, config_from_dict
from rollflash.generators.rollout import Generator
from rollflash.generators.sampling import SamplingParams
from rollflash.generators.sim_engine import SimEngine

PARAMS = SamplingParams(n=3, temperature=1.0, top_p=1.0, max_new_tokens=40)


def _engine(seed=0):
    return SimEngine(SimConfig(per_token_s=0.0001, length_median=8, length_sigma=1.0), seed=seed)


def test_generate_returns_n_samples_per_prompt_with_the_lengths_it_drew():
    engine = _engine()
    groups = engine.generate(["a", "b"], PARAMS)
    assert [len(g) for g in groups] == [3, 3]
    # the same seed draws the same lengths, in prompt-then-sample order, through add_request
    twin = _engine()
    for i in range(2):
        twin.add_request(str(i), "x", PARAMS)
    drawn = [s.length for s in twin._active]
    assert [len(s.response_ids) for g in groups for s in g] == drawn
    for s in (s for g in groups for s in g):
        assert len(s.logprobs) == len(s.token_versions) == len(s.response_ids)
        assert s.finished == (len(s.response_ids) < PARAMS.max_new_tokens)


def test_continuous_requests_join_between_steps_and_record_the_version_of_every_token():
    engine = _engine(seed=1)
    engine.add_request("first", "p", PARAMS)
    done: dict[str, list] = {"first": [], "second": []}
    for key, sample in engine.step():  # a one-token sample finishes here
        done[key].append(sample)
    engine.swap_weights({}, 1)
    engine.add_request("second", "p", PARAMS)  # joins the running batch
    assert engine.num_active == 3 - len(done["first"]) + 3
    while engine.num_active:
        for key, sample in engine.step():
            done[key].append(sample)
    assert len(done["first"]) == len(done["second"]) == 3
    for s in done["first"]:  # the first token came from v0, every later one from v1 (interrupt)
        assert s.token_versions == [0] + [1] * (len(s.response_ids) - 1)
    for s in done["second"]:
        assert set(s.token_versions) == {1}


def test_abort_stops_the_unfinished_samples_of_one_request_only():
    engine = _engine(seed=2)
    engine.add_request("keep", "p", PARAMS)
    engine.add_request("drop", "p", PARAMS)
    engine.abort("drop")
    assert engine.num_active == 3
    keys = set()
    while engine.num_active:
        keys |= {key for key, _ in engine.step()}
    assert keys == {"keep"}


def test_continuous_batching_refuses_a_multi_turn_task_before_touching_redis():
    """The episode runner drives multi-turn tasks; the key is refused with one line naming it
    (the Redis URL points nowhere: the check comes first)."""
    cfg = config_from_dict(
        {
            "rollout": {"engine": "sim", "inflight_samples": 8},
            "task": {"name": "sim_env"},
            "redis": {"url": "redis://127.0.0.1:1/0"},
        }
    )
    with pytest.raises(
        ConfigError, match="^rollout.inflight_samples: task 'sim_env' is multi-turn"
    ):
        Generator(cfg, "gen-0")


def test_prompt_ids_are_what_the_learner_derives_and_checks(tiny_model_dir, tmp_path):
    """The sim engine reports a prompt's ids as the learner derives them for the MAC
    (envs/chat.py `prompt_encoder`, broker/channels/provenance.py): one id per character without a
    model directory, the model's tokenizer with one (a sim generator in a run that trains
    `model.path`)."""
    from rollflash.envs.chat import encode_prompt, prompt_encoder

    # "ab": id 1, then 3 + ord(c) % (64 - 3): 97 % 61 = 36 -> 39, 98 % 61 = 37 -> 40
    (group,) = _engine().generate(["ab"], PARAMS)
    assert [s.prompt_ids for s in group] == [[1, 39, 40]] * 3
    assert prompt_encoder(None, False, 64)("ab") == [1, 39, 40]
    missing = config_from_dict(
        {"model": {"path": str(tmp_path / "none")}, "rollout": {"engine": "sim"}}
    )
    assert SimEngine.from_config(missing, 0).generate(["ab"], PARAMS)[0][0].prompt_ids == [
        1,
        39,
        40,
    ]
    cfg = config_from_dict({"model": {"path": str(tiny_model_dir)}, "rollout": {"engine": "sim"}})
    engine = SimEngine.from_config(cfg, 0)
    text = "12+30="
    tokenizer = engine._tokenizer
    assert tokenizer is not None
    expected = encode_prompt(tokenizer, text)
    assert engine.generate([text], PARAMS)[0][0].prompt_ids == expected
    assert prompt_encoder(tokenizer, False, 64)(text) == expected
    engine.add_request("k", text, PARAMS)
    while not (done := engine.step()):
        pass
    assert done[0][1].prompt_ids == expected  # continuous batching reports the same
