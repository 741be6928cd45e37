"""`mismatch/kl` per generator (learner/metrics/mismatch.py) and its guard
(learner/metrics/guards.py): the split
by hand, its sums through micro-batches in another row order (learner/step/batch.py `take`) and the
metric reduction, and the guard naming the generator."""

import numpy as np
import torch

from rollflash.broker.config.config import config_from_dict
from rollflash.broker.wire.schema import Sample, Trajectory
from rollflash.learner.metrics.guards import GuardMonitor
from rollflash.learner.metrics.metric_sums import MetricSums
from rollflash.learner.metrics.mismatch import generator_mismatch, per_generator
from rollflash.learner.step.batch import pad_groups, take
from rollflash.learner.step.losses import mismatch_metrics


def _group(generator: str, logp: list[list[float]], version: int = 0) -> Trajectory:
    samples = [
        Sample(
            np.arange(3, 3 + len(lp), dtype=np.int32),
            np.array(lp, np.float32),
            np.zeros(len(lp), np.int32),
            1.0,
            True,
        )
        for lp in logp
    ]
    ids = np.array([1, 2], np.int32)
    return Trajectory("t", "p", "g", generator, version, version, ids, samples)


def test_the_split_by_hand():
    # row 0 from "a": d = learner - behaviour = +0.5 -> e^0.5 - 1 - 0.5 = 0.14872 (1 token)
    # row 1 from "b": d = -1.0, -1.0 -> e^-1 - 1 + 1 = 0.36788 each (2 tokens)
    logp = torch.tensor([[-1.0, 0.0], [-2.0, -2.0]])
    behav = torch.tensor([[-1.5, 0.0], [-1.0, -1.0]])
    mask = torch.tensor([[True, False], [True, True]])
    m = generator_mismatch(logp, behav, mask, torch.tensor([0, 1]), ("a", "b"))
    torch.testing.assert_close(m["mismatch/sum/kl/a"], torch.tensor(0.14872), atol=1e-5, rtol=0)
    torch.testing.assert_close(m["mismatch/sum/kl/b"], torch.tensor(0.73576), atol=1e-5, rtol=0)
    assert float(m["mismatch/sum/tokens/a"]) == 1 and float(m["mismatch/sum/tokens/b"]) == 2
    by = per_generator({k: float(v) for k, v in m.items()})
    assert by == {
        "mismatch/kl/a": m["mismatch/sum/kl/a"].item(),
        "mismatch/kl/b": m["mismatch/sum/kl/b"].item() / 2,
    }
    # the token mean over all of them is mismatch/kl: (0.14872 + 0.73576) / 3 = 0.29483
    torch.testing.assert_close(
        mismatch_metrics(logp, behav, mask)["mismatch/kl"], torch.tensor(0.29483), atol=1e-5, rtol=0
    )


def test_the_sums_follow_the_rows_through_micro_batches():
    # "b" is sampled far from the learner, "a" close; the micro-batches take rows out of order
    groups = [_group("b", [[-3.0], [-3.0, -3.0]]), _group("a", [[-1.0], [-1.0, -1.0, -1.0]])]
    full = pad_groups(groups)
    assert full.generators == ("a", "b") and full.generator.tolist() == [1, 1, 0, 0]
    learner = torch.where(full.mask, torch.tensor(-1.0), torch.tensor(0.0))  # learner logp -1
    sums = MetricSums()
    for rows in (torch.tensor([3, 0]), torch.tensor([2, 1])):
        mb = take(full, rows)
        logp = learner[rows, : mb.mask.shape[1]]
        sums.add(generator_mismatch(logp, mb.behav_logp, mb.mask, mb.generator, mb.generators))
    by = per_generator(sums.values())
    # "a": d = 0 on its 4 tokens -> 0; "b": d = -1 - (-3) = 2 on its 3 tokens -> e^2 - 1 - 2 = 4.38906
    assert by["mismatch/kl/a"] == 0.0
    assert abs(by["mismatch/kl/b"] - 4.38906) < 1e-4
    assert sums.values()["mismatch/sum/tokens/b"] == 3


def test_only_samples_drawn_with_the_learners_weights_count():
    # the learner holds v4: "a" sampled with v4, "b" with v3 (the policy has moved since: that
    # gap is asynchrony's, not b's engine's), so b's row is left out and only a is judged
    stale, fresh = _group("b", [[-3.0]], version=3), _group("a", [[-1.0]], version=4)
    full = pad_groups([stale, fresh], version=4)
    assert full.generators == ("a", "b") and full.generator.tolist() == [-1, 0]
    learner = torch.where(full.mask, torch.tensor(-1.0), torch.tensor(0.0))
    m = generator_mismatch(learner, full.behav_logp, full.mask, full.generator, full.generators)
    assert float(m["mismatch/sum/tokens/a"]) == 1 and float(m["mismatch/sum/tokens/b"]) == 0
    assert per_generator({k: float(v) for k, v in m.items()}) == {"mismatch/kl/a": 0.0}
    # without a version every row counts: b's d = -1 - (-3) = 2 -> e^2 - 1 - 2 = 4.38906
    every = pad_groups([stale, fresh])
    m = generator_mismatch(learner, every.behav_logp, every.mask, every.generator, every.generators)
    assert abs(float(m["mismatch/sum/kl/b"]) - 4.38906) < 1e-4


def test_the_guard_names_the_generator_and_its_threshold_switches():
    metrics = {
        "mismatch/sum/kl/honest": 0.002, "mismatch/sum/tokens/honest": 100.0,  # 2e-5
        "mismatch/sum/kl/stale": 12.0, "mismatch/sum/tokens/stale": 100.0,  # 0.12
    }  # fmt: skip
    out = GuardMonitor(config_from_dict({})).after_step(metrics, 8)
    assert out["mismatch/kl/honest"] == 2e-5 and out["mismatch/kl/stale"] == 0.12
    assert out["guard/mismatch_kl_max"] == 0.12 and out["guard/fired_mismatch_kl"] == 1.0  # > 0.05
    loose = config_from_dict({"guards": {"max_mismatch_kl": 0.2}})
    assert GuardMonitor(loose).after_step(metrics, 8)["guard/fired_mismatch_kl"] == 0.0
    # a step whose samples were all drawn with older weights judges no generator, and still
    # logs the guard (keys stable from step to step)
    stale = {"mismatch/sum/kl/honest": 0.0, "mismatch/sum/tokens/honest": 0.0}
    out = GuardMonitor(config_from_dict({})).after_step(stale, 8)
    assert out["guard/mismatch_kl_max"] == 0.0 and out["guard/fired_mismatch_kl"] == 0.0
    assert "mismatch/kl/honest" not in out
