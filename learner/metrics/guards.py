"""Reward-hacking guards, and the learner-side state of the adaptive KL coefficient.

A policy optimised against a learned reward finds the reward model's blind spots (Gao et al. 2023,
"Scaling Laws for Reward Model Overoptimization"; Skalse et al. 2022). The signs this module watches,
once per learner step, from the step's samples and metrics:

- `kl_rise`: KL(behaviour ‖ ref) now minus its minimum over the last `kl_window` steps, or minus
  `algo.kl_target` when the adaptive controller aims higher than that minimum (`guard/kl_rise`);
  fires when > `kl_max_rise`. A policy starts at KL 0 from its reference, and climbing to the KL
  the run asks for is the intended departure, not a rise: measured from 0, a healthy run's first
  steps would warn as its KL climbs to the target.
- `score_collapse`: std of the batch's rewards (`guard/score_std`), only with `reward.type` model /
  mixed; fires when < `score_std_min`, or < `score_std_drop` x the first step's std.
- `length_collapse`: mean response length in tokens, EOS included (`guard/length_mean`); fires
  when < `min_length`.
- `length_at_limit`: share of responses cut at `max_new_tokens` (`guard/truncated_frac`); fires
  when > `max_truncated_frac`.
- `repeated_ngrams`: mean share of a response's n-grams that repeat an earlier one
  (`guard/ngram_repeat`); fires when > `max_ngram_repeat`.
- `mismatch_kl`: the largest over generators of KL(behaviour || learner) on that generator's
  tokens (`mismatch/kl/<generator>`, learner/metrics/mismatch.py; `guard/mismatch_kl_max`); fires when >
  `max_mismatch_kl`, naming the generator: an engine whose log-probs are not the learner's
  (wrong weights, a stale adapter, another sampler) stands out from the others.

Every value is logged every step with `guard/fired_<name>` (0 or 1) and `guard/fired` (how many
fired); a firing guard logs a warning and is written to the run hash (`guard_warnings`), which
`rollctl status` shows. With `guards.stop_on_guard` the run ends once one guard has fired for
`guards.patience` consecutive steps (`stopped_by_guard` in summary.json).

The check functions are pure; `GuardMonitor` holds the history they need and the KL coefficient
that `algos.next_kl_coef` adapts (fixed unless `algo.kl_target` is set).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rollflash.algos.kl_control import next_kl_coef
from rollflash.broker.config.config import Config, GuardsConfig
from rollflash.broker.wire.schema import Trajectory
from rollflash.learner.metrics.mismatch import TOKENS, per_generator

log = logging.getLogger(__name__)

KL_METRIC = "kl/behav_ref_kl"  # per-token KL of the sampled responses to the reference (prepare.py)
PER_GENERATOR = "mismatch/kl/"  # + a generator's id (learner/metrics/mismatch.py)


@dataclass(frozen=True)
class GuardResult:
    name: str  # e.g. "length_at_limit"
    metric: str  # e.g. "guard/truncated_frac"
    value: float
    fired: bool
    message: (
        str  # one line for logs and `rollctl status`, e.g. "82% of responses hit max_new_tokens"
    )


def kl_rise(kl_history: Sequence[float], floor: float = 0.0) -> float:
    """KL now (the last entry) minus the smallest KL before it in `kl_history`, or minus `floor`
    (the KL target) if that is higher (0 with < 2 entries); the caller keeps the last
    `kl_window` + 1 steps."""
    if len(kl_history) < 2:
        return 0.0
    return kl_history[-1] - max(min(kl_history[:-1]), floor)


def score_std(scores: Sequence[float]) -> float:
    """Population std of one batch's rewards (0 for fewer than 2)."""
    if len(scores) < 2:
        return 0.0
    mean = sum(scores) / len(scores)
    return math.sqrt(sum((s - mean) ** 2 for s in scores) / len(scores))


def ngram_repeat_frac(ids: Sequence[int], n: int) -> float:
    """Share of the n-grams of `ids` that already occurred earlier in `ids` (0 with none):
    [1, 1, 1, 1] with n = 2 has n-grams (1,1) x 3, two of them repeats -> 2/3."""
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return (len(grams) - len(set(grams))) / len(grams) if grams else 0.0


def guard_values(groups: Sequence[Trajectory], ngram_n: int) -> dict[str, float]:
    """The sample statistics the guards read, from one step's groups (on one learner rank; ranks'
    values are averaged by merge_rank_metrics): `guard/score_std`, `guard/length_mean`,
    `guard/truncated_frac`, `guard/ngram_repeat`."""
    samples = [s for g in groups for s in g.samples]
    if not samples:
        return {}
    return {
        "guard/score_std": score_std([s.reward for s in samples]),
        "guard/length_mean": sum(len(s.response_ids) for s in samples) / len(samples),
        "guard/truncated_frac": sum(not s.finished for s in samples) / len(samples),
        "guard/ngram_repeat": sum(
            ngram_repeat_frac(s.response_ids.tolist(), ngram_n) for s in samples
        )
        / len(samples),
    }


def evaluate_guards(
    values: dict[str, float],
    kl_history: Sequence[float],
    g: GuardsConfig,
    model_reward: bool,
    first_score_std: float = 0.0,
    kl_target: float | None = None,
) -> list[GuardResult]:
    """Compare one step's `guard_values` (and the KL history, when a reference model gives one)
    with the thresholds of `guards:`. `model_reward`: the rewards come from a reward model (the
    score-collapse guard applies only then: a verifier's rewards are all equal on a solved batch);
    `first_score_std`: the first step's reward std, the scale a relative collapse is measured on;
    `kl_target`: `algo.kl_target`, below which the KL's climb is not counted as a rise."""
    std_floor, out = max(g.score_std_min, g.score_std_drop * first_score_std), []
    if kl_history:
        rise = kl_rise(kl_history, kl_target or 0.0)
        out.append(
            GuardResult(
                "kl_rise",
                "guard/kl_rise",
                rise,
                rise > g.kl_max_rise,
                f"KL to the reference rose by {rise:.3g} within {g.kl_window} "
                f"steps (> {g.kl_max_rise:g})",
            )
        )
    checks = [
        (
            "score_collapse",
            "guard/score_std",
            lambda v: model_reward and v < std_floor,
            lambda v: f"reward std {v:.3g} < {std_floor:.3g}: scores collapsed to one value",
        ),
        (
            "length_collapse",
            "guard/length_mean",
            lambda v: v < g.min_length,
            lambda v: f"mean response length {v:.3g} < {g.min_length:g} tokens",
        ),
        (
            "length_at_limit",
            "guard/truncated_frac",
            lambda v: v > g.max_truncated_frac,
            lambda v: f"{v:.0%} of responses hit max_new_tokens (> {g.max_truncated_frac:.0%})",
        ),
        (
            "repeated_ngrams",
            "guard/ngram_repeat",
            lambda v: v > g.max_ngram_repeat,
            lambda v: (
                f"{v:.0%} of {g.ngram_n}-grams repeat within a response "
                f"(> {g.max_ngram_repeat:.0%})"
            ),
        ),
    ]
    for name, metric, fires, message in checks:
        if metric in values:
            v = float(values[metric])
            out.append(GuardResult(name, metric, v, bool(fires(v)), message(v)))
    return out + [r for r in [mismatch_guard(values, g.max_mismatch_kl)] if r is not None]


def mismatch_guard(values: dict[str, float], limit: float) -> GuardResult | None:
    """`mismatch_kl`: the largest `mismatch/kl/<generator>` of the step, naming the generator;
    0, not fired, in a step none of whose samples was drawn with the learner's weights (None
    without the per-generator sums: the simulated policy's steps)."""
    by_generator = {
        k[len(PER_GENERATOR) :]: float(v) for k, v in values.items() if k.startswith(PER_GENERATOR)
    }
    if not by_generator:
        judged = any(k.startswith(TOKENS) for k in values)  # the sums are there, all stale
        why = "no sample of the step was drawn with the learner's weights"
        return (
            GuardResult("mismatch_kl", "guard/mismatch_kl_max", 0.0, False, why) if judged else None
        )
    worst = max(by_generator, key=lambda k: by_generator[k])
    v = by_generator[worst]
    why = (
        f"generator {worst}: KL(behaviour || learner) {v:.3g} > {limit:g}: its engine's "
        "log-probs are not the learner's"
    )
    return GuardResult("mismatch_kl", "guard/mismatch_kl_max", v, v > limit, why)


@dataclass
class GuardMonitor:
    """The learner's guard and KL-coefficient state between steps (one per learner rank; every
    rank decides the same from the same merged metrics)."""

    cfg: Config
    kl_coef: float = 0.0  # the coefficient the next step uses (algo.kl_coef at start)
    kl_history: list[float] = field(default_factory=list)  # the last kl_window + 1 steps
    streaks: dict[str, int] = field(default_factory=dict)  # consecutive steps each guard fired
    first_score_std: float | None = None  # the first step's reward std (score_std_drop's scale)
    stop_reason: str | None = None  # set once stop_on_guard decides to stop

    def __post_init__(self) -> None:
        self.kl_coef = self.cfg.algo.kl_coef

    @property
    def stop_requested(self) -> bool:
        return self.stop_reason is not None

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (plain JSON values). `stop_reason` is not kept: a resumed run
        decides again from the saved streaks."""
        return {
            "kl_coef": self.kl_coef,
            "kl_history": list(self.kl_history),
            "streaks": dict(self.streaks),
            "first_score_std": self.first_score_std,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict`; a key missing or unknown is an error."""
        expected = sorted(self.state_dict())
        if sorted(state) != expected:
            raise ValueError(f"guard state: keys {sorted(state)}, expected {expected}")
        self.kl_coef = float(state["kl_coef"])
        self.kl_history = [float(v) for v in state["kl_history"]]
        self.streaks = {str(k): int(v) for k, v in state["streaks"].items()}
        self.first_score_std = state["first_score_std"]

    def step_config(self, cfg: Config) -> Config:
        """`cfg` with the current (adaptive) kl_coef; `cfg` itself when the coefficient is fixed."""
        if cfg.algo.kl_target is None:
            return cfg
        return cfg.model_copy(
            update={"algo": cfg.algo.model_copy(update={"kl_coef": self.kl_coef})}
        )

    def after_step(
        self, metrics: dict[str, float], n_samples: int, broker: Any = None
    ) -> dict[str, float]:
        """From a finished step's merged metrics (with `guard_values`) and the number of samples it
        trained on: adapt the KL coefficient, evaluate the guards; returns `kl/coef`,
        `guard/fired_<name>` and `guard/fired`, and writes warnings to the run hash through
        `broker` (if given: rank 0)."""
        out: dict[str, float] = {}
        algo, guards = self.cfg.algo, self.cfg.guards
        kl = metrics.get(KL_METRIC)
        if kl is not None and math.isfinite(kl):
            self.kl_history = (self.kl_history + [kl])[-(guards.kl_window + 1) :]
            out["kl/coef"] = self.kl_coef  # the coefficient this step trained with
            self.kl_coef = next_kl_coef(
                self.kl_coef, kl, algo.kl_target, algo.kl_horizon, n_samples
            )
        out.update(per_generator(metrics))  # mismatch/kl/<generator>, from the step's sums
        if not guards.enabled:
            return out
        if self.first_score_std is None and "guard/score_std" in metrics:
            self.first_score_std = metrics["guard/score_std"]
        results = evaluate_guards(
            {**metrics, **out},
            self.kl_history,
            guards,
            self.cfg.reward.type != "rule",
            self.first_score_std or 0.0,
            algo.kl_target,
        )
        fired = [r for r in results if r.fired]
        for r in results:
            out[r.metric] = r.value
            out[f"guard/fired_{r.name}"] = float(r.fired)
            self.streaks[r.name] = self.streaks.get(r.name, 0) + 1 if r.fired else 0
        out["guard/fired"] = float(len(fired))
        for r in fired:
            log.warning("guard %s: %s", r.name, r.message)
        persistent = [r for r in fired if self.streaks[r.name] >= guards.patience]
        if guards.stop_on_guard and persistent and self.stop_reason is None:
            self.stop_reason = f"{persistent[0].name}: {persistent[0].message}"
            log.error("stopping (guards.stop_on_guard): %s", self.stop_reason)
        if broker is not None:
            broker.set_run_fields(
                guard_warnings="; ".join(f"{r.name}: {r.message}" for r in fired) or "none",
                guard_stop=self.stop_reason or "",
            )
        return out
