"""scripts/make_word_problems.py writes GSM8K-format rows the math verifier scores, and the tiny
model's --chat tokenizer renders and reloads them with the same ids."""

import itertools
import json

from transformers import AutoTokenizer

from rollflash.envs import make_task
from rollflash.envs.chat import PromptFormatter, encode_prompt, format_task
from rollflash.envs.verifiers import math
from scripts.make_tiny_model import CHAT_CHARS, build_tokenizer, sft_items
from scripts.make_word_problems import main


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rows_are_gsm8k_format_distinct_and_split(tmp_path, capsys):
    main(["--out", str(tmp_path), "--train", "300", "--test", "50", "--seed", "3"])
    assert json.loads(capsys.readouterr().out) == {"out": str(tmp_path), "train": 300, "test": 50}
    train, test = _rows(tmp_path / "train.jsonl"), _rows(tmp_path / "test.jsonl")
    assert len(train) == 300 and len(test) == 50
    questions = [r["question"] for r in train + test]
    assert len(set(questions)) == 350  # distinct, so no test question is trained on
    for r in train + test:
        work, final = r["answer"].split("\n#### ")
        a, op, b, _, c = work.split()  # "3 + 4 = 7"
        assert int(c) == (int(a) + int(b) if op == "+" else int(a) - int(b)) == int(final) >= 0
        assert f" {a} " in r["question"] and f" {b}" in r["question"]
        # the verifier reads the number after ####; a bare-number response is what the model says
        assert math(r["question"], final, r["answer"]) == 1.0
        assert math(r["question"], str(int(final) + 1), r["answer"]) == 0.0
    main(["--out", str(tmp_path / "again"), "--train", "300", "--test", "50", "--seed", "3"])
    assert _rows(tmp_path / "again" / "train.jsonl") == train  # deterministic for a seed


def test_chat_tokenizer_renders_and_reloads_and_sft_targets_the_final_number(tmp_path, capsys):
    main(["--out", str(tmp_path), "--train", "20", "--test", "5"])
    tok = build_tokenizer(CHAT_CHARS, 96, chat=True)
    tok.save_pretrained(tmp_path / "tok")
    params = {"path": str(tmp_path / "train.jsonl"), "eval_path": str(tmp_path / "test.jsonl"),
              "prompt_key": "question"}  # fmt: skip
    task = format_task(make_task("dataset", params), PromptFormatter(tok, "auto"))
    item = task.heldout_items()[0]
    question = _rows(tmp_path / "test.jsonl")[0]["question"]
    assert item.prompt == f"<|user|>{question}<|assistant|>"
    ids = encode_prompt(tok, item.prompt)
    # <bos>, one id for the role token, one per character, one for the generation prompt
    assert len(ids) == 1 + 1 + len(question) + 1 and tok.unk_token_id not in ids
    assert encode_prompt(AutoTokenizer.from_pretrained(tmp_path / "tok"), item.prompt) == ids
    items = list(itertools.islice(task.train_items(0), 20))
    targets = list(itertools.islice(sft_items(task, 0, 0.0), 20))
    assert [t.answer for t in targets] == [it.answer.rsplit("#### ", 1)[1] for it in items]
