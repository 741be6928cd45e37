"""reward.functions (envs/reward_functions.py) and the built-in verifiers (envs/verifiers.py):
import errors at load, weights, per-sample errors, timeouts, batched functions, the stop when a
function fails on a whole batch, and the math-verify case table."""

from __future__ import annotations

import sys
import textwrap

import pytest

from rollflash.broker.config.config import ConfigError, config_from_dict
from rollflash.envs import Item, make_task, task_from_config
from rollflash.envs.reward_functions import (
    RewardFunctionError,
    RewardFunctionFailed,
    RewardFunctions,
    function_name,
)
from rollflash.envs.scored import abstained_of, failure_of, parts_of
from rollflash.envs.verifiers import exact, json_schema, math, regex

ITEM = Item(id="r", prompt="2+2=", answer="4", extra={"bonus": 0.5})


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A package `my_rewards` on sys.path with a few reward functions."""
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            import time
            from rollflash.envs.reward_functions import batched

            def format_ok(prompt, response, answer, **row):
                return 1.0 if response.strip().isdigit() else 0.0

            def with_bonus(prompt, response, answer, bonus=0.0, **row):
                return bonus

            def boom(prompt, response, answer, **row):
                if response == "bad":
                    raise ZeroDivisionError("division by zero")
                return 1.0

            def always_fails(prompt, response, answer, **row):
                raise KeyError("label")

            finished = []  # the slow calls that ran to their end

            def slow(prompt, response, answer, **row):
                if response == "slow":
                    time.sleep(60)
                    finished.append(response)
                return 1.0

            def not_a_number(prompt, response, answer, **row):
                return "yes"

            @batched
            def lengths(prompts, responses, answers, bonus=None, **columns):
                return [len(r) + b for r, b in zip(responses, bonus)]

            def prose_abstains(prompt, response, answer, kind="", **row):
                return None if kind == "prose" else 0.5

            @batched
            def fives_abstain(prompts, responses, answers, **columns):
                return [None if r == "5" else 1.0 for r in responses]

            VALUE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def test_weighted_sum_with_extra_columns_as_keywords(user_module):
    fns = RewardFunctions.load(
        [f"{user_module}:format_ok", "exact", f"{user_module}:with_bonus"], [0.1, 1.0, 2.0]
    )
    # "4": format 1, exact 1, bonus 0.5 -> 0.1 * 1 + 1 * 1 + 2 * 0.5 = 2.1
    # "5": format 1, exact 0 -> 0.1 + 0 + 1.0 = 1.1
    assert fns.score_flat([ITEM, ITEM], ["4", "5"]) == pytest.approx([2.1, 1.1])
    assert fns.total_errors == 0


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            "no_such_pkg.rewards:format_ok",
            "reward.functions[0]: cannot import no_such_pkg.rewards:format_ok "
            "(ModuleNotFoundError: No module named 'no_such_pkg')",
        ),
        (
            "my_rewards:missing",
            "reward.functions[0]: cannot import my_rewards:missing "
            "(AttributeError: module 'my_rewards' has no attribute 'missing')",
        ),
        ("my_rewards:VALUE", "reward.functions[0]: my_rewards:VALUE is not callable"),
        (
            "mathh",
            "reward.functions[0]: 'mathh' is neither a built-in verifier (code, exact, json_schema, judge, "
            "math, regex) nor 'package.module:function'",
        ),
    ],
)
def test_import_errors_fail_at_load_in_one_line(user_module, spec, message):
    with pytest.raises(RewardFunctionError) as e:
        RewardFunctions.load([spec])
    assert str(e.value) == message


def test_errors_are_caught_per_sample_and_counted(user_module):
    fns = RewardFunctions.load([f"{user_module}:boom", f"{user_module}:not_a_number", "exact"])
    # not_a_number fails on all 3 samples: the batch raises, whatever the other functions did
    with pytest.raises(RewardFunctionFailed) as e:
        fns.score_flat([ITEM, ITEM, ITEM], ["4", "bad", "4"])
    assert str(e.value) == (
        "reward.functions[1]: my_rewards:not_a_number failed on all 3 samples of a batch; "
        "see the generator log for its first error"
    )
    fns = RewardFunctions.load([f"{user_module}:boom", "exact"])
    # boom: 1, 0 (error), 1; exact: 1, 0, 0 -> 2, 0, 1
    assert fns.score_flat([ITEM] * 3, ["4", "bad", "x"]) == [2.0, 0.0, 1.0]
    assert fns.errors == {"my_rewards:boom": 1}


def test_a_single_sample_batch_never_stops_the_run(user_module):
    fns = RewardFunctions.load([f"{user_module}:always_fails"])
    assert fns.score_flat([ITEM], ["4"]) == [0.0]
    assert fns.errors == {"my_rewards:always_fails": 1}


def test_a_call_over_the_timeout_scores_zero_and_counts(user_module):
    # 2 s: time for the quick call on a loaded machine; the slow one's 60 s always outlast it
    fns = RewardFunctions.load([f"{user_module}:slow"], timeout_s=2.0)
    assert fns.score_flat([ITEM, ITEM], ["slow", "4"]) == [0.0, 1.0]
    assert sys.modules[user_module].finished == []  # interrupted, not waited out and dropped
    assert fns.errors == {"my_rewards:slow": 1}


def test_batched_functions_get_columns_as_lists(user_module):
    other = Item(id="s", prompt="p", answer="a", extra={"bonus": 2.0})
    fns = RewardFunctions.load([f"{user_module}:lengths"])
    # len("abc") + 0.5 = 3.5; len("z") + 2 = 3
    assert fns.score_flat([ITEM, other], ["abc", "z"]) == [3.5, 3.0]


def test_weights_must_match_and_dataset_needs_functions():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"reward": {"functions": ["math"], "weights": [1, 2]}})
    assert str(e.value) == "reward.weights: 2 weights for 1 reward.functions"
    with pytest.raises(ConfigError) as e:
        config_from_dict({"task": {"name": "dataset", "params": {"path": "x.jsonl"}}})
    assert str(e.value).startswith("reward.functions: task 'dataset' has no verifier")


def test_task_from_config_scores_with_the_functions_and_refuses_multi_turn():
    cfg = config_from_dict({"reward": {"functions": ["exact"]}})
    task = task_from_config(cfg)
    assert task.score(ITEM, "4") == 1.0 and task.score(ITEM, "4 ") == 1.0  # exact strips
    assert task.heldout_items() == make_task("arithmetic").heldout_items()
    assert task.score_groups([ITEM, ITEM], [["4", "5"], ["x"]]) == [[1.0, 0.0], [0.0]]
    with pytest.raises(ValueError, match="multi-turn task 'gridworld' is scored by its env"):
        task_from_config(
            config_from_dict({"task": {"name": "gridworld"}, "reward": {"functions": ["exact"]}})
        )


# math-verify: (answer, response, expected reward)
MATH_CASES = [
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "She sold 72 clips in all.\n#### 72", 1.0),
    ("... #### 72", "#### 71", 0.0),
    ("#### 1,234", "The total is 1234.", 1.0),  # GSM8K thousands separator
    ("42", "The answer is \\boxed{42}.", 1.0),
    ("42", "\\boxed{41}", 0.0),
    ("\\frac{1}{2}", "\\boxed{0.5}", 1.0),  # fraction vs decimal
    ("0.75", "$\\frac{3}{4}$", 1.0),
    ("$\\sqrt{2}$", "\\boxed{\\sqrt{2}}", 1.0),  # LaTeX
    ("$x^2+1$", "\\boxed{1+x^2}", 1.0),  # symbolic equality
    ("-3", "so x = \\boxed{-3}", 1.0),
    ("42", "I first thought 40, then 42", 1.0),  # the last number counts
    ("42", "42 apples and 7 pears", 0.0),
    ("42", "no idea", 0.0),
]


@pytest.mark.parametrize("answer, response, expected", MATH_CASES)
def test_math_verifier_case_table(answer, response, expected):
    assert math("q", response, answer) == expected


def test_math_verifier_refuses_an_unparsable_answer():
    with pytest.raises(ValueError, match="math: cannot parse the answer"):
        math("q", "1", "no number here")


def test_exact_regex_and_json_schema():
    assert exact("q", " 42\n", "42") == 1.0 and exact("q", "42.0", "42") == 0.0
    assert regex("q", " 2024-01-05 ", r"\d{4}-\d{2}-\d{2}") == 1.0
    assert regex("q", "2024-1-5", "x", pattern=r"\d{4}-\d{2}-\d{2}") == 0.0
    schema = '{"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}'
    assert json_schema("q", '```json\n{"n": 3}\n```', schema) == 1.0
    assert json_schema("q", '{"n": "3"}', schema) == 0.0  # wrong type
    assert json_schema("q", "{n: 3}", schema) == 0.0  # not JSON
    assert json_schema("q", "[]", "", schema={"type": "array"}) == 1.0


def test_each_functions_score_and_failures_travel_with_the_reward(user_module, caplog):
    """With two functions every sample carries both scores (unweighted); a failure is None there,
    and each function's first failure is logged once, with its traceback and the row's id."""
    fns = RewardFunctions.load([f"{user_module}:boom", "exact"], [2.0, 1.0])
    items = [Item(id=f"train-{i:07d}", prompt="p", answer="4") for i in range(3)]
    with caplog.at_level("WARNING", logger="rollflash.envs.reward_functions"):
        first = fns.score_flat(items, ["4", "bad", "bad"])
        fns.score_flat(items[:2], ["bad", "4"])
    # boom 1, fails, fails; exact 1, 0, 0 -> 2 * 1 + 1 = 3, 0, 0
    assert first == [3.0, 0.0, 0.0]
    assert [parts_of(r) for r in first] == [
        {"boom": 1.0, "exact": 1.0},
        {"boom": None, "exact": 0.0},
        {"boom": None, "exact": 0.0},
    ]
    assert [failure_of(r) for r in first] == ["", "function_error", "function_error"]
    assert fns.errors == {"my_rewards:boom": 3}
    logged = [r for r in caplog.records if "failed on row" in r.getMessage()]
    assert len(logged) == 1  # three failures, one line
    assert (
        "my_rewards:boom failed on row train-0000001: ZeroDivisionError" in logged[0].getMessage()
    )
    assert "reward/error/boom" in logged[0].getMessage()
    assert logged[0].exc_info and "ZeroDivisionError" in caplog.text  # the traceback
    # one function: a plain number unless it failed
    single = RewardFunctions.load([f"{user_module}:boom"])
    out = single.score_flat(items[:2], ["4", "bad"])
    assert parts_of(out[0]) is None and parts_of(out[1]) == {"boom": None}


def test_metric_names_of_functions_are_checked_at_load(user_module):
    assert function_name("pkg.sub:Format-OK2") == "format_ok2"
    assert function_name("math") == "math"
    with pytest.raises(RewardFunctionError) as e:
        RewardFunctions.load(["exact", "other_pkg:exact"])
    assert str(e.value) == (
        "reward.functions[1]: other_pkg:exact and exact share the metric name 'exact'; "
        "rename one of them"
    )
    with pytest.raises(RewardFunctionError, match=r"named 'mean' in metrics \(reward/mean\)"):
        RewardFunctions.load(["pkg:mean"])
    with pytest.raises(RewardFunctionError, match="'code_style'"):
        RewardFunctions.load(["pkg:code_style"])


def test_which_functions_read_the_answer(user_module):
    from rollflash.envs.code_verifier import CodeVerifier

    assert RewardFunctions.load(["math", "exact"]).needs_answer
    assert RewardFunctions.load([f"{user_module}:format_ok"]).needs_answer  # unless it says so
    assert not CodeVerifier.needs_answer
    sys.modules[user_module].format_ok.needs_answer = False
    assert not RewardFunctions.load([f"{user_module}:format_ok"]).needs_answer


def test_per_function_scores_go_from_the_generator_through_the_wire_to_the_learner(user_module):
    """The path production takes for them: the generator's `to_trajectory` (generators/rollout.py)
    puts each sample's scores on the wire, the learner decodes the entry and `reward_breakdown`
    averages and counts them."""
    import dataclasses

    from rollflash.broker.wire.schema import PromptWork, decode_trajectory, encode_trajectory
    from rollflash.broker.wire.wire import WireLimits
    from rollflash.envs.scored_task import ScoredTask
    from rollflash.generators.rollout import to_trajectory
    from rollflash.generators.sampling import GeneratedSample
    from rollflash.learner.metrics.metrics import reward_breakdown

    task = ScoredTask(
        make_task("arithmetic"), RewardFunctions.load(["exact", f"{user_module}:boom"])
    )
    work = PromptWork("train-0000003", "g3", 3, 0, dataclasses.asdict(ITEM))
    samples = [GeneratedSample([1], [2], [-0.5], True, text) for text in ("4", "5", "bad")]
    traj = to_trajectory(work, samples, task, "gen-0", 0)
    raw = {k.encode(): v if isinstance(v, bytes) else str(v).encode()
           for k, v in encode_trajectory(traj).items()}  # fmt: skip
    decoded = decode_trajectory(raw, WireLimits(max_bytes=1 << 20))
    # exact: 1, 0, 0; boom: 1, 1, fails
    assert reward_breakdown([decoded]) == {
        "reward/exact": pytest.approx(1 / 3),
        "reward/boom": 1.0,
        "reward/error/boom": 1,
        "reward/function_error": 1,
    }


def test_a_function_returning_none_abstains_and_the_others_are_summed(user_module):
    """None is no error (TRL's GRPOTrainer sums the functions that did not return None): the
    reward is the weighted sum of the others, the sample names the abstainer, and a function
    that abstains on a whole batch does not stop the run."""
    fns = RewardFunctions.load([f"{user_module}:prose_abstains", "exact"], [2.0, 1.0])
    items = [
        Item(id="a", prompt="p", answer="4", extra={"kind": "sum"}),
        Item(id="b", prompt="p", answer="4", extra={"kind": "prose"}),
        Item(id="c", prompt="p", answer="4", extra={"kind": "prose"}),
    ]
    out = fns.score_flat(items, ["4", "4", "5"])
    # a: 2 * 0.5 + 1 * 1 = 2.0; b: abstains, exact 1 -> 1.0; c: abstains, exact 0 -> 0.0
    assert out == [2.0, 1.0, 0.0]
    assert [abstained_of(r) for r in out] == [(), ("prose_abstains",), ("prose_abstains",)]
    assert [parts_of(r) for r in out] == [
        {"prose_abstains": 0.5, "exact": 1.0},
        {"exact": 1.0},
        {"exact": 0.0},
    ]
    assert [failure_of(r) for r in out] == ["", "", ""] and fns.errors == {}
    # a whole batch of abstentions (unlike a whole batch of failures) goes on
    alone = RewardFunctions.load([f"{user_module}:prose_abstains"])
    out = alone.score_flat(items[1:], ["4", "5"])
    assert out == [0.0, 0.0]  # every function abstained: 0
    assert [abstained_of(r) for r in out] == [("prose_abstains",)] * 2
    assert [parts_of(r) for r in out] == [None, None]
    # a batched function abstains per sample: "5" -> None
    batch = RewardFunctions.load([f"{user_module}:fives_abstain", "exact"])
    out = batch.score_flat(items[:2], ["4", "5"])
    assert out == [2.0, 0.0] and [abstained_of(r) for r in out] == [(), ("fives_abstain",)]


def test_an_abstention_crosses_the_wire_and_is_counted_per_function(user_module):
    """The generator's `to_trajectory` puts the abstainers on the wire (`reward_abstained`), the
    learner decodes them and `reward_breakdown` counts `reward/abstained/<name>` and averages
    `reward/<name>` over the samples the function scored."""
    import dataclasses

    from rollflash.broker.wire.schema import PromptWork, decode_trajectory, encode_trajectory
    from rollflash.broker.wire.wire import WireError, WireLimits
    from rollflash.envs.scored_task import ScoredTask
    from rollflash.generators.rollout import to_trajectory
    from rollflash.generators.sampling import GeneratedSample
    from rollflash.learner.metrics.metrics import merge_rank_metrics, reward_breakdown

    task = ScoredTask(
        make_task("arithmetic"), RewardFunctions.load(["exact", f"{user_module}:fives_abstain"])
    )
    work = PromptWork("train-0000003", "g3", 3, 0, dataclasses.asdict(ITEM))
    samples = [GeneratedSample([1], [2], [-0.5], True, text) for text in ("4", "5", "5")]
    traj = to_trajectory(work, samples, task, "gen-0", 0)

    def wire(t):
        return {k.encode(): v if isinstance(v, bytes) else str(v).encode()
                for k, v in encode_trajectory(t).items()}  # fmt: skip

    decoded = decode_trajectory(wire(traj), WireLimits(max_bytes=1 << 20))
    assert [s.reward_abstained for s in decoded.samples] == [
        (),
        ("fives_abstain",),
        ("fives_abstain",),
    ]
    # exact: 1, 0, 0 (mean 1/3); fives_abstain: 1 on "4", abstains twice (mean 1.0 over one)
    breakdown = reward_breakdown([decoded])
    assert breakdown == {
        "reward/exact": pytest.approx(1 / 3),
        "reward/fives_abstain": 1.0,
        "reward/abstained/fives_abstain": 2,
    }
    # counts add up over the learner's ranks: 2 + 2 = 4
    merged = merge_rank_metrics([(breakdown, 1), (breakdown, 1)])
    assert merged["reward/abstained/fives_abstain"] == 4
    # a name that is not a metric name, or repeats, is refused at the learner
    bad = dataclasses.replace(
        traj, samples=[dataclasses.replace(traj.samples[0], reward_abstained=("a b",))]
    )
    with pytest.raises(WireError, match="reward_abstained"):
        decode_trajectory(wire(bad), WireLimits(max_bytes=1 << 20))
    twice = dataclasses.replace(
        traj, samples=[dataclasses.replace(traj.samples[0], reward_abstained=("x", "x"))]
    )
    with pytest.raises(WireError, match="a name repeats"):
        decode_trajectory(wire(twice), WireLimits(max_bytes=1 << 20))
