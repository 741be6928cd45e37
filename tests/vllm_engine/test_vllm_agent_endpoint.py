"""The agent endpoint backed by vLLM (its CPU build): a chat agent's three calls with tool
results between them, answered by `VLLMEngine.generate_ids`, become one sequence whose ids and
log-probabilities are vLLM's own (tests/unit/test_agent_endpoint.py does the same on the hf
engine)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from transformers import AutoTokenizer  # noqa: E402

from rollflash.envs import Item  # noqa: E402
from rollflash.envs.agent import Agent, Codec  # noqa: E402
from rollflash.envs.agent_host import AgentHost  # noqa: E402
from rollflash.envs.agent_protocol import Limits  # noqa: E402
from rollflash.generators.agent_episode import max_context  # noqa: E402
from rollflash.generators.sampling import SamplingParams  # noqa: E402
from rollflash.generators.vllm_engine import VLLMEngine  # noqa: E402
from tests.helpers.chat_model import build_chat_model  # noqa: E402


def test_a_chat_agent_on_vllm_trains_on_vllms_tokens(tmp_path_factory):
    model_dir = build_chat_model(tmp_path_factory.mktemp("chat") / "model")
    engine = VLLMEngine(str(model_dir), dtype="float32", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    seen = []

    def generate(prompts, p):
        out = engine.generate_ids(prompts, SamplingParams(p.n, p.temperature, p.top_p,
                                                          p.max_tokens))  # fmt: skip
        seen.append((prompts[0], out[0][0]))
        return out

    def agent(client, item):
        messages = [{"role": "user", "content": item.prompt}]
        for turn in range(3):
            reply = client.chat.completions.create(model="m", messages=messages, max_tokens=4)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "tool", "content": f"result {turn}"}]  # fmt: skip
        return 1.0

    codec = Codec(tokenizer, tokenizer.chat_template, max_context(engine))
    assert codec.max_context == 256  # vLLM's max_model_len: the model's positions
    host = AgentHost(Agent("t", agent, False), codec, Limits(4, 200, 1.0, 1.0, 1, 120.0))
    try:
        run = host.start(Item("i", "6 x 4?", "24"), 0)
        host.serve(lambda: run.done, generate)
    finally:
        host.close()
    assert run.outcome.failure == "" and len(seen) == 3
    seq = run.record.sequence()
    (p0, _), (_, _), (p2, last) = seen
    assert seq.prompt_ids == p0 and seq.prompt_ids + seq.response_ids == p2 + last.response_ids
    model_logprobs = [lp for lp, m in zip(seq.logprobs, seq.loss_mask) if m]
    assert model_logprobs == [lp for _, s in seen for lp in s.logprobs]
    assert len(seq.turn_starts) == 3
