"""Chat templates (envs/chat.py): the learner renders a prompt once, and the HF engine and the
evaluation turn it into the very ids `apply_chat_template` gives, with a locally trained BPE
tokenizer whose template writes its own BOS (tests/vllm_engine/test_vllm_chat_template.py checks
vLLM against the same ids). Also: `none`, a template file, and the character tokenizer's spaces."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from rollflash.envs import Item, make_task
from rollflash.envs.chat import PromptFormatter, encode_prompts, format_task
from rollflash.envs.reward_functions import RewardFunctions
from rollflash.envs.scored_task import ScoredTask
from rollflash.generators.hf_engine import HFEngine
from rollflash.generators.sampling import SamplingParams
from rollflash.learner.evaluation.eval_generate import heldout_accuracy
from tests.helpers.chat_model import build_chat_model

QUESTION = "Tom has 17 apples and buys 25 more. How many?"


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("chat") / "model")


def _expected(tokenizer, messages) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_rendered_prompt_ids_are_identical_in_learner_engine_and_eval(chat_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    expected = _expected(tokenizer, messages)
    bos = tokenizer.bos_token_id
    assert expected[0] == bos and expected[1] != bos  # one BOS, written by the template

    # learner: a dataset row rendered by the formatter before it is issued
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"q": QUESTION, "answer": "#### 42"}) + "\n")
    task = make_task(
        "dataset",
        {"path": str(rows), "prompt_key": "q", "system_prompt": "Be brief.",
         "cache_dir": str(tmp_path / "c")},
    )  # fmt: skip
    # as the learner builds it: reward functions (task_from_config), then the formatter
    task = format_task(ScoredTask(task, RewardFunctions.load(["math"])), PromptFormatter(tokenizer))
    item = next(task.train_items(0))
    assert item.prompt == "<bos><|system|>Be brief.<eos><|user|>" + QUESTION + "<eos><|assistant|>"
    assert encode_prompts(tokenizer, [item.prompt]) == [expected]

    # HF engine: the prompt ids it reports (and the learner trains on)
    engine = HFEngine(str(chat_dir))
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_new_tokens=3)
    groups = engine.generate([item.prompt, "short"], params)
    assert [s.prompt_ids for s in groups[0]] == [expected, expected]  # left padding removed

    # evaluation: the ids it feeds model.generate, padding stripped
    seen = []
    model = engine.model
    real_generate = model.generate

    def spy(input_ids, attention_mask, **kw):
        seen.extend(ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask))
        return real_generate(input_ids=input_ids, attention_mask=attention_mask, **kw)

    model.generate = spy
    heldout_accuracy(model, tokenizer, task, [item, item], max_new_tokens=2)
    assert seen == [expected, expected]


def test_arithmetic_prompts_get_the_template_and_none_keeps_raw_text(chat_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    arith = make_task("arithmetic", {"ops": ["+"]})
    raw = next(arith.train_items(0))
    auto = format_task(arith, PromptFormatter(tokenizer, "auto"))
    rendered = next(auto.train_items(0))
    assert rendered.prompt == f"<bos><|user|>{raw.prompt}<eos><|assistant|>"
    assert auto.heldout_items()[0].prompt.endswith("<|assistant|>")
    assert auto.score(rendered, raw.answer) == arith.score(raw, raw.answer)  # scoring unchanged
    none = format_task(make_task("arithmetic", {"ops": ["+"]}), PromptFormatter(tokenizer, "none"))
    assert next(none.train_items(0)) == raw
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:")
    assert PromptFormatter(tokenizer, str(path)).render("1+1=") == "Q: 1+1=\nA:"
    with pytest.raises(FileNotFoundError, match="model.chat_template: no file at"):
        PromptFormatter(tokenizer, str(tmp_path / "absent.jinja"))


def test_a_bos_is_never_doubled_nor_dropped(chat_dir):
    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    bos = tokenizer.bos_token_id
    with_bos, plain = encode_prompts(tokenizer, ["<bos>hi", "hi"])
    assert with_bos == plain and plain[0] == bos and plain.count(bos) == 1


def test_the_character_tokenizer_keeps_spaces_after_a_reload(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "it is 5 . ok , a ? b  c"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character, spaces included
    assert tokenizer.decode(ids) == text


def test_item_extra_survives_rendering():
    item = Item(id="a", prompt="p", answer="1", extra={"k": [1, 2]})
    task = format_task(_Single([item]), PromptFormatter(None, "auto"))
    assert next(task.train_items(0)) == item  # no template: unchanged, extra kept


class _Single:
    name = "single"

    def __init__(self, items):
        self.items = items

    def train_items(self, seed):
        return iter(self.items)

    def heldout_items(self):
        return list(self.items)

    def score(self, item, response):
        return 0.0
