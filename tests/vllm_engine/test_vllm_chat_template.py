"""vLLM sees the same prompt ids as the learner, the HF engine and evaluation for a chat-rendered
prompt (tests/unit/test_chat_template.py checks the others against the same expectation):
`apply_chat_template(..., add_generation_prompt=True)`, one BOS though the template writes one
and the tokenizer adds one. Both vLLM paths: a batch (`generate`) and continuous batching
(`add_request` / `step`)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from transformers import AutoTokenizer  # noqa: E402

from rollflash.envs.chat import PromptFormatter  # noqa: E402
from rollflash.generators.sampling import SamplingParams  # noqa: E402
from rollflash.generators.vllm_engine import VLLMEngine  # noqa: E402
from tests.helpers.chat_model import build_chat_model  # noqa: E402


def test_vllm_prompt_ids_equal_the_chat_template_ids(tmp_path_factory):
    model_dir = build_chat_model(tmp_path_factory.mktemp("chat") / "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "6 x 4?"}]
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = list(out["input_ids"] if hasattr(out, "keys") else out)
    prompt = PromptFormatter(tokenizer, "auto").render("6 x 4?", system_prompt="Be brief.")
    engine = VLLMEngine(str(model_dir), dtype="float32", seed=0)
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_new_tokens=3)
    group = engine.generate([prompt], params)[0]
    assert [s.prompt_ids for s in group] == [expected, expected]
    engine.add_request("k", prompt, params)
    finished = []
    for _ in range(50):
        finished += engine.step()
        if len(finished) == 2:
            break
    assert [s.prompt_ids for _, s in finished] == [expected, expected]
