"""How an agent episode's calls become one trajectory sample (envs/agent.py), on a character
codec written here so that every id can be worked by hand: a character's id is its code point,
"$" is EOS (id 36), a first prompt starts with BOS (id 1). A unit test of AgentRecord: the
endpoint and the real tokenizers are tests/unit/test_agent_endpoint.py's."""

import pytest

from rollflash.envs.agent import AgentRecord, Call, Choice, Outcome, outcome_of, turn_rewards

EOS = ord("$")


class CharCodec:
    eos_id, eos_text, max_context = EOS, "$", None

    def __init__(self, close_with_eos: bool = True):
        self.close = "$" if close_with_eos else ""

    def render_chat(self, messages, tools):
        return "".join(f"<{m['role'][0]}>{m['content']}{self.close}" for m in messages) + "<a>"

    def encode_prompt(self, text):
        return [1, *map(ord, text)]

    def encode_more(self, text):
        return list(map(ord, text))

    def decode(self, ids):
        return "".join(map(chr, ids))


def ids(text):
    return list(map(ord, text))


def choice(text, eos=True, version=0, logprob=-0.5):
    out = ids(text) + ([EOS] if eos else [])
    return Choice(out, [logprob] * len(out), [version] * len(out), text,
                  "stop" if eos else "length", eos)  # fmt: skip


def play(record, messages, reply):
    """One call: render, take the context, record `reply` as its only choice."""
    text = record.codec.render_chat(messages, None)
    context, parent = record.context(text, None)
    record.calls.append(Call(text, context, [reply], parent))
    return context


def test_three_calls_with_tool_results_are_one_sequence_masked_on_the_model_tokens():
    record = AgentRecord(CharCodec())
    msgs = [{"role": "user", "content": "hi"}]
    first = play(record, msgs, choice("ab", version=3))
    assert first == [1, *ids("<u>hi$<a>")]
    msgs += [{"role": "assistant", "content": "ab"}, {"role": "tool", "content": "7"}]
    second = play(record, msgs, choice("c", version=4))
    # the template writes "$" (EOS) after the assistant's text: the sampled EOS stays, and the
    # new text after it is "<t>7$<a>"
    assert second == first + ids("ab$") + ids("<t>7$<a>")
    msgs += [{"role": "assistant", "content": "c"}, {"role": "tool", "content": "8"}]
    play(record, msgs, choice("d", eos=False, version=4))
    seq = record.sequence()
    assert seq.prompt_ids == first
    assert seq.response_ids == ids("ab$<t>7$<a>c$<t>8$<a>d")
    # model tokens: a b $ (0-2), c $ (11-12), d (21)
    assert seq.loss_mask == [1, 1, 1] + [0] * 8 + [1, 1] + [0] * 8 + [1]
    assert seq.turn_starts == [0, 11, 21] and seq.turn_calls == [0, 1, 2]
    assert seq.logprobs == [-0.5] * 3 + [0.0] * 8 + [-0.5] * 2 + [0.0] * 8 + [-0.5]
    # each token's version: its own; a tool token's, the model token's before it
    assert seq.versions == [3] * 11 + [4] * 11
    assert seq.finished is False  # the last call was cut at max_tokens
    assert record.chains == 1 and record.dropped_calls == 0


def test_eos_the_template_does_not_write_is_dropped_from_the_context():
    record = AgentRecord(CharCodec(close_with_eos=False))
    msgs = [{"role": "user", "content": "hi"}]
    first = play(record, msgs, choice("ab"))
    msgs += [{"role": "assistant", "content": "ab"}, {"role": "user", "content": "go"}]
    second = play(record, msgs, choice("c"))
    # "<u>hi<a>ab<u>go<a>": the context keeps a, b but not the EOS sampled after them
    assert second == first + ids("ab<u>go<a>")
    seq = record.sequence()
    assert seq.response_ids == ids("ab<u>go<a>c$")
    assert seq.loss_mask == [1, 1] + [0] * 8 + [1, 1]  # "<u>go<a>" is 8 tokens
    assert seq.finished is True


def test_an_edited_history_starts_a_new_chain_and_the_last_chain_is_trained():
    record = AgentRecord(CharCodec())
    play(record, [{"role": "user", "content": "hi"}], choice("ab"))
    # the agent rewrites the first answer: no extension, a fresh tokenisation
    edited = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "AB"},
              {"role": "user", "content": "?"}]  # fmt: skip
    context = play(record, edited, choice("c"))
    assert context == [1, *ids("<u>hi$<a>AB$<u>?$<a>")]
    assert record.calls[1].parent is None
    seq = record.sequence()
    assert seq.prompt_ids == context and seq.response_ids == ids("c$")
    assert record.chains == 2 and record.dropped_calls == 1


def test_completions_extend_a_call_when_the_new_prompt_repeats_its_text():
    record = AgentRecord(CharCodec())
    text = "Q:"
    context, _ = record.context(text, None)
    record.calls.append(Call(text, context, [choice("12")], None))
    # a ReAct loop appends the model's text and an observation; the EOS is not in the text
    context2, parent = record.context("Q:12 obs Q:", None)
    assert parent == (0, 0, 2) and context2 == context + ids("12 obs Q:")
    # token prompts: the previous ids and the choice's, with or without its EOS
    context3, parent3 = record.context(None, context + ids("12$") + [5])
    assert parent3 == (0, 0, 3) and context3 == context + ids("12$") + [5]


def test_no_call_gives_no_sequence():
    assert AgentRecord(CharCodec()).sequence() is None


@pytest.mark.parametrize(
    "value, calls, reward, failure",
    [
        (0.5, 1, 0.5, ""),
        ({"reward": 2, "metrics": {"steps": 3}}, 1, 2.0, ""),
        ({"turn_rewards": [0.25, 0.5]}, 2, 0.75, ""),  # reward = sum of the turns' 0.25 + 0.5
        ({"turn_rewards": [1.0]}, 2, 0.0, "agent_bad_return"),  # one per call
        ({"rewards": 1}, 1, 0.0, "agent_bad_return"),
        (float("nan"), 1, 0.0, "agent_bad_return"),
        (True, 1, 0.0, "agent_bad_return"),
        ("1.0", 1, 0.0, "agent_bad_return"),
    ],
)
def test_returns(value, calls, reward, failure):
    out = outcome_of(value, calls)
    assert (out.reward, out.failure) == (reward, failure)


def test_turn_rewards_follow_the_trained_calls():
    record = AgentRecord(CharCodec())
    play(record, [{"role": "user", "content": "hi"}], choice("ab"))
    play(record, [{"role": "user", "content": "new"}], choice("c"))
    seq = record.sequence()
    # per-call rewards: the trained chain is call 1 alone
    assert turn_rewards(Outcome(1.0, [0.25, 0.75]), seq) == [0.75]
    assert turn_rewards(Outcome(1.0), seq) == [1.0]
