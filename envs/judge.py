"""The `judge` reward: a generative model grades each response (LLM-as-judge).

The judge runs in its own process, a reward worker: `rollctl start-reward-worker --config run.yaml`
serves `reward.judge.model_path` with the HF engine (generators/judge_server.py), and any server
of the same OpenAI-style completions API (`vllm serve MODEL`) works as well. Generators (and the
learner's evaluation) reach it at `reward.judge.url`, so a large judge is loaded once, on its own
GPU, instead of in every generator, and this module stays a stdlib HTTP client.

Per scoring batch: every sample's judge prompt is `reward.judge.template` filled with {prompt},
{response}, {answer} and the row's other columns (an unknown {name} stays as written); one POST
to `{url}/v1/completions` asks for all of them, greedy (temperature 0), `max_new_tokens` each.
The score is the first match of `score_pattern` in the judge's text (its group 1 when it has
one), and the reward is clip(score, 0, max_score) / max_score, in [0, 1].

Failures score 0 with a counted reason (`reward/<reason>` in the learner, envs/reward_functions.py),
never an exception: `judge_unreachable` (no answer within `timeout_s`, an HTTP error, a reply that
is not the API's JSON: every sample of the batch) and `judge_unparsed` (no number in the judge's
text).
"""

from __future__ import annotations

import json
import logging
import math
import re
import urllib.error
import urllib.request
from typing import Any

from rollflash.envs.scored import Scored

log = logging.getLogger(__name__)


class _Keep(dict):
    """format_map's mapping: an unknown {name} is left as written."""

    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


class JudgeReward:
    """The `judge` reward function (batched: one request per scoring batch)."""

    batched = True
    own_deadline = True  # bounded by its request's timeout_s

    def __init__(self, options: Any) -> None:
        """`options`: the `reward.judge` section (broker/config/config_reward.py)."""
        self.url = options.url.rstrip("/") + "/v1/completions"
        self.template, self.max_score = options.template, float(options.max_score)
        self.needs_answer = "{answer}" in self.template  # a row without one is bad only then
        self.pattern = re.compile(options.score_pattern)
        self.max_new_tokens, self.timeout_s = options.max_new_tokens, float(options.timeout_s)
        self._logged: set[str] = set()

    def render(self, prompt: str, response: str, answer: str, row: dict[str, Any]) -> str:
        values = _Keep({**row, "prompt": prompt, "response": response, "answer": answer})
        return self.template.format_map(values)

    def parse(self, text: str) -> Scored:
        """The reward a judge's text gives (module docstring)."""
        match = self.pattern.search(text)
        try:
            score = float(match.group(1) if match.re.groups else match.group(0))  # type: ignore[union-attr]
        except (AttributeError, TypeError, ValueError):
            return Scored(0.0, "judge_unparsed")
        if not math.isfinite(score):
            return Scored(0.0, "judge_unparsed")
        return Scored(min(max(score, 0.0), self.max_score) / self.max_score)

    def ask(self, prompts: list[str]) -> list[str]:
        """The judge's text for each prompt (raises on any transport or format problem)."""
        body = {"model": "judge", "prompt": prompts, "max_tokens": self.max_new_tokens}
        body["temperature"] = 0.0
        request = urllib.request.Request(
            self.url, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
            choices = json.loads(reply.read())["choices"]
        texts = {int(c["index"]): str(c["text"]) for c in choices}
        return [texts[i] for i in range(len(prompts))]

    def __call__(
        self, prompts: list[str], responses: list[str], answers: list[str], **columns: Any
    ) -> list[Scored]:
        rows = [{k: v[i] for k, v in columns.items()} for i in range(len(prompts))]
        asks = [self.render(*args) for args in zip(prompts, responses, answers, rows)]
        try:
            texts = self.ask(asks)
        except (OSError, urllib.error.URLError, ValueError, KeyError, TypeError) as e:
            if "unreachable" not in self._logged:
                self._logged.add("unreachable")
                log.warning("judge reward: no usable answer from %s: %s", self.url, e)
            return [Scored(0.0, "judge_unreachable") for _ in prompts]
        return [self.parse(t) for t in texts]
