"""The `judge` reward (envs/judge.py) against the reward worker (generators/judge_server.py)
serving the tiny model: the score is the parse of the judge's greedy text, a judge that cannot
be reached or parsed is a counted 0, and the worker refuses malformed requests."""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request

import pytest

from rollflash.broker.config.config import config_from_dict
from rollflash.envs import Item
from rollflash.envs.reward_functions import RewardFunctions
from rollflash.envs.scored import failure_of
from rollflash.generators.judge_server import JudgeModel, make_server


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    judge = JudgeModel(tiny_model_dir)
    server = make_server(judge, port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield judge, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _functions(url: str, **judge: object) -> RewardFunctions:
    cfg = config_from_dict({"reward": {"judge": {"url": url, "max_new_tokens": 4, **judge}}})
    return RewardFunctions.load(["judge"], options=cfg.reward)


ITEMS = [Item("a", "3+4=", "7"), Item("b", "10+20=", "30")]
RESPONSES = ["7", "5"]


def test_the_reward_is_the_parse_of_the_judges_greedy_text(worker):
    judge, url = worker
    # the template makes the arithmetic model add the answer and the response: "7+7=", "30+5="
    fns = _functions(url, template="{answer}+{response}=", score_pattern="([0-9]+)", max_score=100)
    got = fns.score_flat(ITEMS, RESPONSES)
    texts = judge.complete(["7+7=", "30+5="], 4, 0.0)  # the same greedy texts, asked directly
    # the parse rule by hand: the first run of digits, clipped to [0, 100], divided by 100
    matches = [re.search("[0-9]+", t) for t in texts]
    expected = [min(int(m.group(0)), 100) / 100 if m else 0.0 for m in matches]
    assert [float(r) for r in got] == pytest.approx(expected)
    assert [failure_of(r) for r in got] == ["" if m else "judge_unparsed" for m in matches]
    assert fns.total_errors == 0


def test_unparsed_and_unreachable_judges_are_counted_zeros(worker):
    _, url = worker
    fns = _functions(url, score_pattern="never")
    got = fns.score_flat(ITEMS, RESPONSES)
    assert [(float(r), failure_of(r)) for r in got] == [(0.0, "judge_unparsed")] * 2
    dead = _functions("http://127.0.0.1:9", timeout_s=2)  # port 9: nothing listens
    got = dead.score_flat(ITEMS, RESPONSES)
    assert [(float(r), failure_of(r)) for r in got] == [(0.0, "judge_unreachable")] * 2


def test_the_worker_refuses_malformed_requests(worker):
    _, url = worker
    for body in ({"prompt": 3}, {"prompt": ["1+1="], "max_tokens": 0}, {"prompt": []}):
        request = urllib.request.Request(
            url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=10)
        assert e.value.code == 400
    with urllib.request.urlopen(url + "/health", timeout=10) as reply:
        assert json.loads(reply.read()) == {"status": "ok"}
