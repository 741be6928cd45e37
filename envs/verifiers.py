"""Built-in reward functions, named in `reward.functions` by a bare name: `math`, `exact`,
`regex`, `json_schema`. Each is `fn(prompt, response, answer, **row) -> float` and returns 1.0
(correct) or 0.0, like any user reward function (envs/reward_functions.py).

- `math`: math-verify (Hugging Face's verifier, as used by open-r1 and TRL) compares the final
  answer of `response` with `answer` symbolically: `\\boxed{1/2}`, `\\frac{1}{2}`, `0.5` and `$1/2$`
  are equal. A GSM8K answer ("...reasoning... #### 1,234") is cut to what follows its last `####`,
  and so is a response that uses the same marker; otherwise math-verify takes the response's
  `\\boxed{}` or its last number. Its own signal-based timeouts are off: the caller's per-call
  timeout (`reward.timeout_s`) bounds it instead, so the two alarms cannot interfere.
- `exact`: the stripped response equals the stripped answer.
- `regex`: the stripped response fully matches the pattern in the row's `pattern` column, or in
  `answer` when the row has none.
- `json_schema`: the response (a ```json fence removed) is JSON that validates against the schema
  in the row's `schema` column, or in `answer`: a JSON string or an already decoded mapping.

Heavy imports (math_verify pulls in sympy, jsonschema) happen on first use.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from typing import Any

GSM8K_MARKER = "####"
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)
_BOXED = "\\boxed{"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_answer(text: str) -> str:
    """What follows the last `####` (thousands separators removed), else the whole text."""
    if GSM8K_MARKER in text:
        return text.rsplit(GSM8K_MARKER, 1)[1].strip().replace(",", "")
    return text


def math_answer(text: str) -> str:
    """The final answer of a response as the `math` verifier finds it, as text, for comparing
    responses with each other (envs/answers.py), not for scoring: what follows the last `####`,
    else the content of the last `\\boxed{}`, else the last number (thousands separators
    removed), else the stripped text. math-verify reads LaTeX further (`\\frac{1}{2}` = `0.5`);
    this reads the text as written."""
    if GSM8K_MARKER in text:
        return final_answer(text)
    start = text.rfind(_BOXED)
    if start >= 0:
        depth, i = 1, start + len(_BOXED)
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i:j].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else text.strip()


def math(prompt: str, response: str, answer: str, **row: Any) -> float:
    """1.0 if the response's final answer equals `answer` mathematically (math-verify)."""
    from math_verify import parse, verify

    # every call with its own timeouts off would log a warning: the caller bounds the time
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    gold = parse(final_answer(str(answer)), parsing_timeout=None)
    if not gold:
        raise ValueError(f"math: cannot parse the answer {str(answer)[:80]!r}")
    guess = parse(final_answer(response), parsing_timeout=None)
    return float(bool(guess) and verify(gold, guess, timeout_seconds=None))


def exact(prompt: str, response: str, answer: str, **row: Any) -> float:
    """1.0 if the stripped response equals the stripped answer."""
    return float(response.strip() == str(answer).strip())


def regex(prompt: str, response: str, answer: str, **row: Any) -> float:
    """1.0 if the stripped response fully matches row["pattern"] (default: `answer`)."""
    pattern = row.get("pattern", answer)
    return float(re.fullmatch(str(pattern), response.strip(), flags=re.DOTALL) is not None)


def json_schema(prompt: str, response: str, answer: str, **row: Any) -> float:
    """1.0 if the response is JSON valid under row["schema"] (default: `answer`)."""
    import jsonschema

    schema = row.get("schema", answer)
    if isinstance(schema, str):
        schema = json.loads(schema)  # a malformed schema is the row's error, counted as such
    text = response.strip()
    fenced = _FENCE.match(text)
    try:
        value = json.loads(fenced.group(1) if fenced else text)
    except ValueError:
        return 0.0
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return 0.0
    return 1.0


VERIFIERS: dict[str, Callable[..., float]] = {
    "math": math,
    "exact": exact,
    "regex": regex,
    "json_schema": json_schema,
}
