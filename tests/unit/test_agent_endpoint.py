"""The OpenAI-compatible endpoint agent programs call (envs/agent_server.py, envs/agent_host.py),
answered by the real HF engine on a tiny chat model, called with the official `openai` client;
and the trajectories the generator makes of the episodes (generators/agent_episode.py)."""

import asyncio
from dataclasses import replace

import numpy as np
import openai
import pytest

from rollflash.broker.wire.schema import PromptWork, decode_trajectory, encode_trajectory
from rollflash.broker.wire.wire import WireLimits
from rollflash.envs import Item
from rollflash.envs.agent import Agent, AgentLoadError, Codec, load_agent
from rollflash.envs.agent_host import AgentHost
from rollflash.envs.agent_protocol import Limits
from rollflash.envs.chat import encode_prompt
from rollflash.generators.agent_episode import group_trajectory
from rollflash.generators.hf_engine import HFEngine
from rollflash.generators.sampling import SamplingParams
from tests.helpers.chat_model import build_chat_model

LIMITS = Limits(max_new_tokens=6, max_episode_tokens=120, temperature=1.0, top_p=1.0, max_n=4,
                timeout_s=60.0)  # fmt: skip
ITEM = Item(id="train-0000001", prompt="Tom has 3 apples.", answer="3")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return HFEngine(str(build_chat_model(tmp_path_factory.mktemp("chat"))))


class Recorder:
    """The engine's generate_ids, recording what it was given and what it returned."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __call__(self, prompts, params):
        out = self.engine.generate_ids(
            prompts, SamplingParams(params.n, params.temperature, params.top_p, params.max_tokens)
        )
        self.calls.append((prompts, params, out))
        return out


def play(engine, fn, items=(ITEM,), limits=LIMITS, version=lambda: 0):
    """Run `fn` on each item through a fresh host; returns (runs, recorder)."""
    agent = Agent("test:fn", fn, asyncio.iscoroutinefunction(fn))
    codec = Codec(engine.tokenizer, engine.tokenizer.chat_template, 256)
    host = AgentHost(agent, codec, limits, engine.vocab_size, version=version)
    recorder = Recorder(engine)
    try:
        runs = [host.start(item, i) for i, item in enumerate(items)]
        host.serve(lambda: all(r.done for r in runs), recorder)
    finally:
        host.close()
    return runs, recorder, codec


def trajectory(runs, codec, n=None):
    work = PromptWork("p", "g", n or len(runs), 0, {"id": ITEM.id, "prompt": ITEM.prompt,
                                                    "answer": ITEM.answer})  # fmt: skip
    traj = group_trajectory(work, runs, codec, "gen-0", 0)
    fields = {k.encode(): str(v).encode() if not isinstance(v, bytes) else v
              for k, v in encode_trajectory(traj).items()}  # fmt: skip
    limits = WireLimits(1 << 20, codec.tokenizer.vocab_size + 16, max_samples=len(runs))
    return decode_trajectory(fields, limits)  # the learner's checks pass


def test_chat_and_completions_answer_the_official_client_with_the_engines_ids(engine):
    seen = {}

    def agent(client, item):
        messages = [{"role": "user", "content": item.prompt}]
        chat = client.chat.completions.create(
            model="any", messages=messages, max_tokens=4, extra_body={"return_token_ids": True}
        )
        text = client.completions.create(model="any", prompt="Tom has", max_tokens=3,
                                         extra_body={"return_token_ids": True})  # fmt: skip
        stream = client.chat.completions.create(
            model="any", messages=messages, max_tokens=3, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        seen.update(chat=chat, text=text, models=client.models.list(), stream=list(stream))
        return 1.0

    runs, recorder, _ = play(engine, agent)
    chat, text = seen["chat"], seen["text"]
    assert chat.object == "chat.completion" and text.object == "text_completion"
    assert [m.id for m in seen["models"].data] == ["rollflash"]
    # the chat template applied once, server side, to the messages; then encode_prompt's ids
    rendered = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": ITEM.prompt}], tokenize=False, add_generation_prompt=True
    )
    assert chat.prompt_token_ids == encode_prompt(engine.tokenizer, rendered)
    # what the engine saw and sampled is what the response and the record say
    (chat_prompts, chat_params, chat_out), (text_prompts, _, text_out), _ = recorder.calls
    assert chat_prompts == [chat.prompt_token_ids] and chat_params.max_tokens == 4
    sample = chat_out[0][0]
    assert chat.choices[0].token_ids == sample.response_ids
    record = runs[0].record.calls
    assert record[0].prompt_ids == chat_prompts[0]
    assert record[0].choices[0].ids == sample.response_ids
    assert record[0].choices[0].logprobs == sample.logprobs
    eos = engine.tokenizer.eos_token_id
    body = [t for t in sample.response_ids if t != eos]
    assert chat.choices[0].message.content == engine.tokenizer.decode(body)
    assert chat.choices[0].finish_reason == ("stop" if eos in sample.response_ids else "length")
    assert text_prompts == [encode_prompt(engine.tokenizer, "Tom has")]
    assert text.choices[0].token_ids == text_out[0][0].response_ids
    assert chat.usage.prompt_tokens == len(chat_prompts[0])
    # streamed: the whole answer in one chunk, then the usage
    first, usage = seen["stream"]
    streamed = [t for t in recorder.calls[2][2][0][0].response_ids if t != eos]
    assert first.choices[0].delta.content == engine.tokenizer.decode(streamed)
    assert usage.choices == [] and usage.usage.completion_tokens == len(
        recorder.calls[2][2][0][0].response_ids
    )


def test_three_calls_with_tool_results_make_one_trajectory_masked_on_the_models_tokens(engine):
    def agent(client, item):
        messages = [{"role": "user", "content": item.prompt}]
        for turn in range(3):
            reply = client.chat.completions.create(model="m", messages=messages)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            if turn < 2:
                messages.append({"role": "tool", "content": f"result {turn}"})
        return 1.0

    runs, recorder, codec = play(engine, agent)
    calls = runs[0].record.calls
    assert len(recorder.calls) == 3 and all(c.parent is not None for c in calls[1:])
    traj = trajectory(runs, codec)
    (sample,) = traj.samples
    engine_prompts = [prompts[0] for prompts, _, _ in recorder.calls]
    engine_samples = [out[0][0] for _, _, out in recorder.calls]
    assert list(traj.prompt_ids) == engine_prompts[0]
    # one sequence: the last call's context and its completion
    full = list(traj.prompt_ids) + list(sample.response_ids)
    assert full == engine_prompts[2] + engine_samples[2].response_ids
    # the mask is 1 exactly on the engine's sampled tokens (the template writes <eos> after an
    # assistant turn, so a sampled EOS stays in the context)
    expected = np.zeros(len(sample.response_ids), np.uint8)
    for prompt, s in zip(engine_prompts, engine_samples):
        at = len(prompt) - len(engine_prompts[0])
        assert full[len(prompt) : len(prompt) + len(s.response_ids)] == s.response_ids
        expected[at : at + len(s.response_ids)] = 1
    assert np.array_equal(sample.loss_mask, expected)
    np.testing.assert_allclose(
        sample.logprobs[expected == 1], np.concatenate([s.logprobs for s in engine_samples]),
        rtol=0, atol=0,
    )  # fmt: skip
    # what the mask leaves out is the template's tool turns and generation prompts
    tools = engine.tokenizer.decode(list(sample.response_ids[expected == 0]))
    assert "result 0" in tools and "result 1" in tools and tools.endswith("<|assistant|>")
    assert sample.reward == 1.0 and list(sample.turn_rewards) == [0.0, 0.0, 1.0]
    assert list(sample.turn_starts) == [len(p) - len(engine_prompts[0]) for p in engine_prompts]


def test_an_agent_that_raises_is_an_env_error_and_the_others_go_on(engine):
    def agent(client, item):
        client.completions.create(model="m", prompt=item.prompt, max_tokens=2)
        if item.id.endswith("1"):
            raise KeyError("the parser failed")
        return 0.5

    items = [ITEM, replace(ITEM, id="train-0000002")]
    runs, _, codec = play(engine, agent, items)
    assert runs[0].outcome.failure == "agent_error" and "KeyError" in runs[0].outcome.message
    assert runs[1].outcome.failure == "" and runs[1].outcome.reward == 0.5
    broken, fine = trajectory(runs, codec).samples
    assert (broken.env_errors, broken.reward, broken.reward_failure) == (1, 0.0, "agent_error")
    assert broken.loss_mask.sum() > 0  # its tokens are trained, with reward 0
    assert (fine.env_errors, fine.reward, fine.reward_failure) == (0, 0.5, "")


def test_an_agent_that_makes_no_call_gives_a_sample_with_nothing_to_train(engine):
    def agent(client, item):
        if item.id.endswith("2"):
            client.completions.create(model="m", prompt=item.prompt, max_tokens=2)
        return 1.0

    items = [ITEM, replace(ITEM, id="train-0000002")]
    runs, _, codec = play(engine, agent, items)
    assert runs[0].outcome.failure == "agent_no_call"
    silent, called = trajectory(runs, codec).samples
    assert silent.reward == 1.0 and silent.reward_failure == "agent_no_call"
    assert silent.loss_mask.tolist() == [0] and len(silent.turn_starts) == 0
    assert silent.env_errors == 0 and called.loss_mask.sum() > 0


def test_async_agents_timeouts_and_bad_returns(engine):
    slept = []  # agents that slept to their end

    async def agent(client, item):
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": item.prompt}]
        )
        if item.id.endswith("2"):
            await asyncio.sleep(60)  # cancelled at the timeout
            slept.append(item.id)
        if item.id.endswith("3"):
            return {"reward": "high"}
        return {"reward": 1.0, "metrics": {"length": len(reply.choices[0].message.content)}}

    items = [replace(ITEM, id=f"train-000000{i}") for i in (1, 2, 3)]
    # 10 s: the others' one call each on a loaded machine; the 60 s sleep always outlasts it
    limits = replace(LIMITS, timeout_s=10.0)
    runs, _, _ = play(engine, agent, items, limits)
    assert slept == []  # cancelled, not waited out
    assert [r.outcome.failure for r in runs] == ["", "agent_timeout", "agent_bad_return"]
    assert "length" in runs[0].outcome.metrics


def test_sampling_parameters_within_the_runs_limits(engine):
    seen = {}

    def agent(client, item):
        many = client.completions.create(model="m", prompt="Tom", n=3, max_tokens=1000)
        seen["n"], seen["usage"] = len(many.choices), many.usage.completion_tokens
        for bad in ({"n": 5}, {"temperature": 0}, {"stop": ["a"] * 5}, {"top_p": 1.5}):
            with pytest.raises(openai.BadRequestError):
                client.completions.create(model="m", prompt="Tom", **bad)
        stopped = client.completions.create(model="m", prompt="Tom", stop=["e", "a"],
                                            max_tokens=6)  # fmt: skip
        seen["stopped"] = stopped.choices[0]
        return 0.0

    runs, recorder, _ = play(engine, agent)
    assert seen["n"] == 3 and seen["usage"] <= 3 * LIMITS.max_new_tokens
    assert recorder.calls[0][1].max_tokens == LIMITS.max_new_tokens  # 1000 capped at 6
    text = seen["stopped"].text
    assert "e" not in text and "a" not in text
    sampled = recorder.calls[-1][2][0][0]
    eos = engine.tokenizer.eos_token_id
    full = engine.tokenizer.decode([t for t in sampled.response_ids if t != eos])
    assert full.startswith(text)
    found = [full.find(s) for s in "ea" if s in full]
    if found:  # cut before the first stop string, on a token boundary
        assert seen["stopped"].finish_reason == "stop" and len(text) <= min(found)


def test_per_token_versions_and_closed_episodes(engine):
    loaded = iter([0, 1])  # the host asks once per call: version 0, then 1 after a reload
    seen = {}

    def agent(client, item):
        prompt = item.prompt
        for _ in range(2):
            out = client.completions.create(model="m", prompt=prompt, max_tokens=2)
            prompt += out.choices[0].text + " ok "
        token = str(client.base_url).split("/episodes/")[1].split("/")[0]
        other = openai.OpenAI(base_url=str(client.base_url).replace(token, "0" * 16),
                              api_key="x", max_retries=0)  # fmt: skip
        with pytest.raises(openai.NotFoundError, match="not open"):
            other.completions.create(model="m", prompt="x")
        seen["checked"] = True
        return 1.0

    runs, _, _ = play(engine, agent, version=lambda: next(loaded))
    assert seen["checked"] and runs[0].outcome.failure == ""
    seq = runs[0].record.sequence()
    # the episode crossed a weight version: the first call's tokens 0, the second's 1; the
    # text between them ("ok") the version of the token before it
    model = [v for v, m in zip(seq.versions, seq.loss_mask) if m]
    first = len(runs[0].record.calls[0].choices[0].ids)
    assert model == [0] * first + [1] * (len(model) - first)
    assert set(seq.versions[first : seq.turn_starts[1]]) == {0}


def test_load_agent_errors_are_one_line():
    with pytest.raises(AgentLoadError, match="not 'package.module:function'"):
        load_agent("no_colon")
    with pytest.raises(AgentLoadError, match="cannot import nope.mod:f .ModuleNotFoundError"):
        load_agent("nope.mod:f")
    assert load_agent("tests.unit.test_agent_endpoint:trajectory").is_async is False
