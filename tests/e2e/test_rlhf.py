"""Short CI versions of the documented RLHF runs (README, "RLHF with a learned
reward model"), with real processes: scripts/make_preferences.py, `rollctl train-rm` (also on two
gloo ranks under torchrun), and `rollctl run` (its own redis-server, a learner, two generators
scoring with the reward model).

- A reward model trained briefly on the "correct sum beats a wrong one" preferences ranks held-out
  pairs well above chance (the documented 2000-step run reaches the >= 90% of the acceptance).
- GRPO against that reward model raises held-out greedy accuracy, measured by the task's verifier
  that the reward model never saw, and no guard fires on this healthy run.
- Against a reward model trained on an exploitable preference ("longer is better"), a policy
  pushed hard (lr 1e-3, no KL penalty) hacks it, and a guard stops the run: lengths pile up at
  the limit and the scores collapse to one value (tests/unit/test_guards.py covers each guard,
  the KL rise included, on hand-made numbers).

The reward model starts from its own backbone, a short SFT on exact answers (`rm_base_dir`), as in
configs/rm.yaml: starting from the policy's warm start (trained on an off-by-one teacher) gave a
reward model that RL exploited (README).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _cli(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    return proc


def _sets(overrides: dict) -> list[str]:
    return [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]


def _train_rm(
    tmp: Path, model: Path, prop: str, pairs: int, steps: int, pretrain: Path | None = None
) -> tuple[Path, dict]:
    prefs, out = tmp / f"{prop}.jsonl", tmp / f"rm-{prop}"
    _cli(
        [
            "scripts/make_preferences.py",
            "--out",
            str(prefs),
            "--pairs",
            str(pairs),
            "--property",
            prop,
        ]
    )
    proc = _cli(
        [
            "-m",
            "rollflash.rollctl.cli",
            "train-rm",
            "--config",
            "configs/rm.yaml",
            *_sets(
                {
                    "model.path": model,
                    "rm.pretrain": pretrain or model,
                    "rm.dataset": prefs,
                    "rm.save_path": out,
                    "run.run_dir": tmp / f"rm-run-{prop}",
                    "rm.max_steps": steps,
                    "rm.eval_every": 0,
                }
            ),
        ]
    )
    return out, json.loads(proc.stdout.strip().splitlines()[-1])


def _rl(tmp: Path, model: Path, rm: Path, steps: int, **overrides) -> tuple[dict, list[dict]]:
    run_dir = tmp / "run"
    _cli(
        [
            "-m",
            "rollflash.rollctl.cli",
            "run",
            "--config",
            "configs/rlhf.yaml",
            *_sets(
                {
                    "model.path": model,
                    "reward.model_path": rm,
                    "run.run_dir": run_dir,
                    "run.run_id": tmp.name,
                    "trainer.total_steps": steps,
                    **overrides,
                }
            ),
        ]
    )
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return json.loads((run_dir / "summary.json").read_text()), metrics


@pytest.fixture(scope="module")
def rm_base_dir(tmp_path_factory) -> Path:
    """The reward model's backbone: SFT on exact answers (configs/rm.yaml's models/rm-base, here
    800 instead of 1200 steps: 0.835 held-out accuracy as a policy, measured)."""
    out = tmp_path_factory.mktemp("rm-base") / "model"
    _cli(
        [
            "scripts/make_tiny_model.py",
            "--out",
            str(out),
            "--task-params",
            '{"ops": ["+"]}',
            "--sft-steps",
            "800",
            "--sft-lr",
            "1e-3",
            "--seed",
            "1",
            "--no-eval",
        ]
    )
    return out


@pytest.fixture(scope="module")
def correct_rm(tmp_path_factory, warm_model_dir, rm_base_dir):
    return _train_rm(
        tmp_path_factory.mktemp("rm"),
        warm_model_dir,
        "correct",
        5000,
        STEPS_RM,
        pretrain=rm_base_dir,
    )


# measured 0.898 held-out pairwise accuracy (0.864 at 500 steps; documented 2000-step run: README)
STEPS_RM = 1000
STEPS_RL = 40  # 0.335 -> 0.60 (local); at 30 steps +0.12 and +0.135 under CI load, < +0.15


@pytest.mark.slow
@pytest.mark.timeout(1500)  # with the module's reward model: 800 SFT + 1000 RM steps first
def test_reward_model_ranks_heldout_pairs_well_above_chance(correct_rm):
    path, summary = correct_rm
    assert summary["eval_pairs"] == 500 and summary["steps"] == STEPS_RM
    assert summary["eval_pairwise_acc"] >= 0.7, summary
    assert summary["eval_pairwise_acc"] >= summary["eval_pairwise_acc_before"] + 0.15, summary
    # a standard Hugging Face directory with a one-label head
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"]
    assert config.get("num_labels", len(config.get("id2label", {}))) == 1
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()


@pytest.mark.slow
@pytest.mark.timeout(1500)  # with the module's reward model: 800 SFT + 1000 RM steps first
def test_grpo_against_the_reward_model_improves_the_ground_truth(
    correct_rm, tmp_path, warm_model_dir
):
    summary, metrics = _rl(tmp_path, warm_model_dir, correct_rm[0], STEPS_RL)
    assert summary["steps"] == STEPS_RL and summary["stopped_by_guard"] is None
    # Measured gains with this reward model (0.898 pairwise): +0.265, +0.355, +0.28, +0.325, then
    # +0.225, +0.265, +0.235, +0.315, +0.245, +0.32 and, once, +0.135 in a CI run under load. Weaker
    # ones are exploited: at 0.864 pairwise (500 steps) six runs gained +0.07 to +0.205, and at 0.84
    # RL gave 0.525, 0.305 and 0.30 (README). Margin: 30 of 200 problems.
    assert summary["heldout_acc_after"] >= summary["heldout_acc_before"] + 0.15, summary
    # healthy run: every guard was computed every step, and none fired often. The documented
    # 100-step run was quiet throughout. In these short runs the KL climbs from 0 (the
    # reference) past kl_target 0.2 by steps 6-8: measured from 0 that rise peaked at 0.27-0.55
    # over six runs against kl_max_rise 0.5; kl_rise counts only what lies above the target,
    # which the run asks the policy to reach.
    # Under CI load (more staleness) one guard once fired on two steps in a row (steps 8-9), so
    # the bound is three in a row per guard: what stop_on_guard with patience 3 would act on.
    fired = {
        k.removeprefix("guard/fired_"): [m["step"] for m in metrics if m[k]]
        for k in metrics[0]
        if k.startswith("guard/fired_")
    }
    for steps in fired.values():
        assert not any(c == b + 1 == a + 2 for a, b, c in zip(steps, steps[1:], steps[2:])), fired
    assert sum(map(len, fired.values())) <= 3, fired
    assert all("guard/score_std" in m and "kl/coef" in m for m in metrics)


@pytest.fixture(scope="module")
def longer_rm(tmp_path_factory, warm_model_dir):
    path, summary = _train_rm(
        tmp_path_factory.mktemp("rm-longer"), warm_model_dir, "longer", 2000, 100
    )
    assert summary["eval_pairwise_acc"] >= 0.9, summary  # length is easy to learn
    return path


NO_KL = {"algo.kl_coef": 0, "algo.kl_target": "null", "algo.use_kl_in_reward": "false"}


# The signs of this hack: longer answers, so lengths pile up at the limit, and the scores of a
# group collapse to one value once every answer is as long as allowed; a policy pushed this hard
# may also degenerate to near-empty answers. Which guard passes its patience first varies from run
# to run (measured: score_collapse, length_at_limit, length_collapse).
HACK_GUARDS = ("score_collapse", "length_at_limit", "length_collapse", "kl_rise")


@pytest.mark.slow
def test_guards_stop_a_run_that_hacks_an_exploitable_reward(tmp_path, warm_model_dir, longer_rm):
    summary, metrics = _rl(
        tmp_path,
        warm_model_dir,
        longer_rm,
        40,
        **{
            "trainer.actor_lr": 1.0e-3,
            "guards.stop_on_guard": "true",
            "guards.patience": 2,
            "eval.every": 0,
            "trainer.rollout_batch_size": 16,
            "eval.size": 100,
            **NO_KL,
        },
    )
    assert summary["stopped_by_guard"], summary
    guard = summary["stopped_by_guard"].split(":")[0]
    assert guard in HACK_GUARDS, summary
    assert summary["steps"] < 40 and len(metrics) == summary["steps"]
    fired = [m["step"] for m in metrics if m[f"guard/fired_{guard}"]]
    assert fired[-2:] == [summary["steps"] - 1, summary["steps"]], fired  # patience 2
    assert summary["heldout_acc_after"] < summary["heldout_acc_before"]  # the hack cost accuracy
    if guard == "score_collapse":  # longer answers scored ever higher, then all the same
        assert metrics[-1]["guard/length_mean"] > metrics[0]["guard/length_mean"]
        assert metrics[-1]["guard/score_std"] < 0.05 * metrics[0]["guard/score_std"]


def test_train_rm_on_two_gloo_ranks_matches_one_process(tmp_path, tiny_model_dir):
    """torchrun with 2 CPU ranks (gloo, DDP): each rank takes half of every batch and gradients
    are averaged, so the saved model equals the one-process model up to float rounding."""
    import torch
    from safetensors.torch import load_file

    prefs = tmp_path / "prefs.jsonl"
    _cli(["scripts/make_preferences.py", "--out", str(prefs), "--pairs", "200"])
    summaries, weights = [], []
    for world in (1, 2):
        out = tmp_path / f"rm{world}"
        proc = _cli(
            [
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(world),
                "-m",
                "rollflash.rollctl.cli",
                "train-rm",
                "--config",
                "configs/rm.yaml",
                *_sets(
                    {
                        "model.path": tiny_model_dir,
                        "rm.pretrain": tiny_model_dir,
                        "rm.dataset": prefs,
                        "rm.save_path": out,
                        "run.run_dir": tmp_path / f"run{world}",
                        "rm.max_steps": 3,
                        "rm.train_batch_size": 32,
                        "rm.micro_train_batch_size": 8,
                        "rm.eval_every": 0,
                    }
                ),
            ],
            timeout=300,
        )
        summaries.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        weights.append(load_file(str(out / "model.safetensors")))
    assert [s["world_size"] for s in summaries] == [1, 2]
    assert summaries[0]["eval_pairwise_acc"] == summaries[1]["eval_pairwise_acc"]
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    assert weights[0].keys() == weights[1].keys() and "score.weight" in weights[0]
    for name, w1 in weights[0].items():
        torch.testing.assert_close(weights[1][name], w1, atol=1e-5, rtol=1e-4)
    # training moved the backbone (shared names with the causal LM), not only the new head
    assert any(not torch.equal(w, base[name]) for name, w in weights[0].items() if name in base)
