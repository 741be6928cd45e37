"""Token bookkeeping of one episode (envs/episode.py), with the tiny models' real tokenizer."""

import sys
from pathlib import Path

import pytest

from rollflash.envs import Episode, chat_encoder, encoder_for, plain_encoder
from rollflash.envs.episode import state_key
from rollflash.envs.gridworld import GridWorld

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from make_tiny_model import build_tokenizer  # noqa: E402

# a chat template in the tokenizer's alphabet: "u=<content>." per user turn, "a=" as the generation
# prompt, "a=<content><eos>." per assistant turn (as Qwen's "<|im_end|>\n" after an answer)
TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}={{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}<eos>{% endif %}.{% endfor %}"
    "{% if add_generation_prompt %}a={% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _episode(tok, encode, max_tokens=200):
    env = GridWorld(size=3, holes=0, max_turns=4)
    return Episode(env=env, seed=0, encode=encode, max_tokens=max_tokens, action_tokens=2)


def _act(ep, tok, letter):
    ids = tok(letter, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ep.act(ids, [-0.5, -0.1], [3, 3], letter)


def test_plain_episode_layout(tok):
    ep = _episode(tok, plain_encoder(tok))
    assert ep.prompt_ids == tok("a../.../..g?")["input_ids"]  # <bos> + the first observation
    _act(ep, tok, "r")
    obs = tok(".a./.../..g?", add_special_tokens=False)["input_ids"]
    assert (
        ep.response_ids
        == tok("r", add_special_tokens=False)["input_ids"] + [tok.eos_token_id] + obs
    )
    assert ep.loss_mask == [1, 1] + [0] * len(obs)
    assert ep.logprobs == [-0.5, -0.1] + [0.0] * len(obs) and ep.versions == [3] * (2 + len(obs))
    for letter in "rdd":
        _act(ep, tok, letter)
    assert ep.done and ep.success and not ep.truncated and ep.reward == 1.0
    assert ep.turn_starts == [0, 2 + len(obs), 4 + 2 * len(obs), 6 + 3 * len(obs)]
    assert ep.response_ids[-1] == tok.eos_token_id and ep.loss_mask[-2:] == [1, 1]  # no final obs
    assert ep.turn_states[0] == state_key("a../.../..g?") and len(set(ep.turn_states)) == 4
    assert ep.actions == ["r", "r", "d", "d"]
    with pytest.raises(RuntimeError, match="finished episode"):
        _act(ep, tok, "u")


def test_chat_template_observations(tok):
    tok.chat_template = TEMPLATE
    try:
        ep = _episode(tok, chat_encoder(tok))
        assert ep.prompt_ids == tok("u=a../.../..g?.a=", add_special_tokens=False)["input_ids"]
        _act(ep, tok, "r")
        # after the action's EOS: the template's "." then the user turn and the generation prompt
        obs = tok(".u=.a./.../..g?.a=", add_special_tokens=False)["input_ids"]
        assert ep.response_ids[2:] == obs
    finally:
        tok.chat_template = None


def test_the_engines_encoder_follows_the_tokenizers_chat_template(tok):
    # hf and vllm engines encode observations with encoder_for(tokenizer)
    assert encoder_for(tok)("a../", True) == tok("a../")["input_ids"]  # plain: with <bos>
    tok.chat_template = TEMPLATE
    try:
        assert (
            encoder_for(tok)("a../", True)
            == tok("u=a../.a=", add_special_tokens=False)["input_ids"]
        )
    finally:
        tok.chat_template = None


def test_token_budget_cuts_the_episode(tok):
    ep = _episode(tok, plain_encoder(tok), max_tokens=2 + 12 + 1)  # room for one turn only
    _act(ep, tok, "u")
    assert ep.done and ep.truncated and not ep.success


def test_the_first_observation_is_the_issued_one_even_when_reset_fails(tok):
    """The learner checks an episode's prompt tokens against the first observation it issued
    (broker/channels/provenance.py), so the episode starts from that text: the same tokens as the
    environment's own reset when it succeeds, and still those when reset raises here (the
    episode then ends at its first action, with the error counted)."""
    encode = plain_encoder(tok)
    issued = "a../.../..g?"  # GridWorld(3, holes=0).reset(0), as the learner issued it
    ep = Episode(GridWorld(size=3, holes=0, max_turns=4), 0, encode, 200, 2,
                 first_observation=issued)  # fmt: skip
    assert ep.prompt_ids == encode(issued, True) == _episode(tok, encode).prompt_ids

    class FailingReset(GridWorld):
        def reset(self, seed):
            raise OSError("no sandbox here")

    broken = Episode(FailingReset(size=3, holes=0, max_turns=4), 0, encode, 200, 2,
                     first_observation=issued)  # fmt: skip
    assert broken.prompt_ids == encode(issued, True) and broken.env_errors == 1
    _act(broken, tok, "r")
    assert broken.done and broken.truncated and broken.turn_rewards == [0.0]
