"""A two-guess game written as an agent program (docs/agentic.md, "Agent programs").

The item is an addition ("17+25=", answer "42"). The model guesses; a wrong guess gets a hint
("lower" or "higher") and one more try on the conversation so far:

    17+25=43 lower 17+25=42

Reward: 1 for a right first guess, 0.5 for a right second one, 0 otherwise. The program uses
the official `openai` client's completions API (the tiny demo model has no chat template); each
second prompt repeats the first prompt and the model's guess, so the endpoint trains the two
calls as one sequence. Run it with configs/agent_game.yaml.
"""

from __future__ import annotations


def _number(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def run_episode(client, item) -> float:
    prompt = item.prompt
    for attempt in (1, 2):
        out = client.completions.create(model="policy", prompt=prompt, max_tokens=4)
        guess = out.choices[0].text
        if guess == item.answer:
            return 1.0 if attempt == 1 else 0.5
        number = _number(guess)
        hint = "wrong" if number is None else "lower" if number > int(item.answer) else "higher"
        prompt = f"{prompt}{guess} {hint} {item.prompt}"
    return 0.0
