"""`task: reasoning_gym` (envs/reasoning_gym.py): items, scoring, the held-out split and
mixtures, against the real reasoning-gym package."""

import itertools
import sys
from collections import Counter

import pytest
import reasoning_gym

from rollflash.envs import make_task, train_stream
from rollflash.envs.chat import PromptFormatter, format_task
from rollflash.envs.scored import failure_of

ONE_DIGIT = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def rg_task(**params):
    params.setdefault("datasets", {"chain_sum": {"config": ONE_DIGIT}})
    params.setdefault("system_prompt", None)
    return make_task("reasoning_gym", params)


def test_items_are_the_datasets_problems_with_ids_per_dataset():
    task = rg_task(size=50, seed=7, heldout_size=10)
    ds = reasoning_gym.create_dataset("chain_sum", seed=7, size=50, **ONE_DIGIT)
    items = list(itertools.islice(task.train_items(0), 5))
    for it in items:
        domain, _, inner = it.id.partition("/")
        split, _, index = inner.partition("-")
        assert (domain, split) == ("chain_sum", "train")
        entry = ds[int(index)]
        assert it.prompt == entry["question"] and it.answer == entry["answer"]
    # held-out problems come from seed 7 + size = 57, indices 0..9
    held = reasoning_gym.create_dataset("chain_sum", seed=57, size=10, **ONE_DIGIT)
    assert [it.prompt for it in task.heldout_items()] == [held[j]["question"] for j in range(10)]
    assert task.heldout_items()[3].id == "chain_sum/heldout-0000003"


def test_scoring_is_score_answer_of_the_last_answer_tag_plus_format_reward():
    task = rg_task(size=20, heldout_size=5, format_reward=0.1)
    item = task.heldout_items()[0]
    right = f"<answer>{item.answer}</answer>"
    # right: 1.0 + 0.1 (tag present)
    assert task.score(item, f"thinking <answer>x</answer> then {right}") == pytest.approx(1.1)
    # no tag: nothing extracted, score_answer(None) = 0, no format reward
    assert task.score(item, item.answer) == 0.0
    # a wrong number in the tag: 0 + 0.1
    assert task.score(item, "<answer>1000</answer>") == pytest.approx(0.1)


def test_partial_credit_and_raw_answers():
    task = rg_task(size=20, heldout_size=5, answer_tag=None)
    item = next(it for it in task.heldout_items() if len(it.answer) == 1)
    # compute_decimal_reward: not equal, but the oracle is inside "1<a>": len 1 / len 2 = 0.5
    assert task.score(item, f" 1{item.answer} ") == pytest.approx(0.5)
    assert task.score(item, f"  {item.answer}\n") == 1.0  # answer_tag null: the stripped response


def test_system_prompt_by_name_or_text_and_chat_template(tiny_chat_tokenizer):
    named = rg_task(size=20, heldout_size=2, system_prompt="direct")
    from reasoning_gym.utils import SYSTEM_PROMPTS

    item = named.heldout_items()[0]
    assert item.prompt.startswith(SYSTEM_PROMPTS["direct"] + "\n\n")
    literal = rg_task(size=20, heldout_size=2, system_prompt="Be brief.")
    rendered = format_task(literal, PromptFormatter(tiny_chat_tokenizer, "auto"))
    prompt = rendered.heldout_items()[0].prompt
    # the chat template of tests/helpers/chat_model.py: system, then user, then the generation prompt
    assert prompt.startswith("<bos><|system|>Be brief.<eos><|user|>State the final answer")
    assert prompt.endswith("<eos><|assistant|>")


def test_heldout_questions_never_appear_in_training():
    """One-digit sums: 2 x 10 x 10 = 200 distinct problems, so 1,000 train seeds repeat many of
    the 40 held-out questions: the ones that do are left out of training."""
    task = rg_task(size=1000, seed=3, heldout_size=40)
    held = {it.prompt for it in task.heldout_items()}
    inner = task.components[0].task
    epoch = list(itertools.islice(task.train_items(0), len(inner._kept_train_rows())))
    assert held.isdisjoint(it.prompt for it in epoch)
    ds = reasoning_gym.create_dataset("chain_sum", seed=3, size=1000, **ONE_DIGIT)
    expected_left_out = sum(ds[i]["question"] in held for i in range(1000))
    assert inner.repeats == expected_left_out > 0
    # the first epoch visits each kept train problem exactly once
    assert sorted(int(it.id.rsplit("-", 1)[1]) for it in epoch) == inner._kept_train_rows()


def test_resume_continues_the_stream_exactly():
    task = rg_task(size=30, heldout_size=5)
    first = [it.id for it in itertools.islice(task.train_items(5), 100)]
    resumed = [it.id for it in itertools.islice(train_stream(task, 5, start=61), 39)]
    assert resumed == first[61:]  # across the epoch boundary (about 25 kept per epoch)


def test_mixture_weights_limits_and_per_dataset_scoring():
    task = rg_task(
        size=200,
        heldout_size=4,
        datasets={
            "chain_sum": {"weight": 3, "config": ONE_DIGIT},
            "products": {"weight": 1, "config": ONE_DIGIT, "max_new_tokens": 5},
        },
    )
    counts = Counter(it.id.split("/")[0] for it in itertools.islice(task.train_items(0), 1024))
    # one multinomial block of 1024 at weights 0.75 / 0.25: 768 +- 3 sd (sd = sqrt(1024*.75*.25)
    # = 13.9)
    assert abs(counts["chain_sum"] - 768) < 42 and counts["products"] == 1024 - counts["chain_sum"]
    held = task.heldout_items()
    assert [it.id.split("/")[0] for it in held[:4]] == ["chain_sum", "products"] * 2
    products = held[1]
    assert task.response_limit(products) == 5 and task.response_limit(held[0]) is None
    assert task.score(products, f"<answer>{products.answer}</answer>") == 1.0


def test_errors_name_the_key():
    with pytest.raises(ValueError, match="no dataset 'chain_summ'.*similar: chain_sum"):
        rg_task(datasets={"chain_summ": {}})
    with pytest.raises(ValueError, match=r"datasets.chain_sum.config: unknown key 'terms'"):
        rg_task(datasets={"chain_sum": {"config": {"terms": 2}}})
    with pytest.raises(ValueError, match=r"config.seed: set task.params.seed instead"):
        rg_task(datasets={"chain_sum": {"config": {"seed": 2}}})
    with pytest.raises(ValueError, match=r"chain_sum refuses it"):
        rg_task(datasets={"chain_sum": {"config": {"min_terms": 3, "max_terms": 2}}})
    with pytest.raises(ValueError, match=r"datasets.chain_sum: unknown key 'weigth'"):
        rg_task(datasets={"chain_sum": {"weigth": 2}})
    with pytest.raises(ValueError, match=r"task.params.size: must be a positive integer"):
        rg_task(size=0)
    with pytest.raises(ValueError, match=r"format_reward: must be a finite number, got nan"):
        rg_task(format_reward=float("nan"))


def test_missing_package_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import raises ImportError
    with pytest.raises(ValueError, match=r"pip install 'rollflash\[reasoning-gym\]'"):
        rg_task()


def test_regenerated_answer_mismatch_and_score_errors(monkeypatch):
    task = rg_task(size=20, heldout_size=2)
    item = task.heldout_items()[0]
    import dataclasses

    with pytest.raises(ValueError, match="different reasoning-gym releases"):
        task.score(dataclasses.replace(item, answer="not it"), "<answer>1</answer>")
    inner = task.components[0].task
    monkeypatch.setattr(inner._datasets["heldout"], "score_answer", lambda a, e: 1 / 0)
    reward = task.score(item, "<answer>1</answer>")
    assert reward == 0.0 and failure_of(reward) == "function_error"


@pytest.fixture(scope="module")
def tiny_chat_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.helpers.chat_model import build_chat_model

    return AutoTokenizer.from_pretrained(build_chat_model(tmp_path_factory.mktemp("chat")))
