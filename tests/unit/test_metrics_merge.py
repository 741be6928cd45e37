"""How metrics reduce (learner/metrics/metric_sums.py): over micro-batches, updates and ranks the same
way, so that the split of a step's data does not change them; and merge_rank_metrics, how one
step's per-rank sample statistics become one row."""

import pytest
import torch

from rollflash.learner.metrics.metric_sums import MetricSums, merged, micro_batch_weights
from rollflash.learner.metrics.metrics import merge_rank_metrics


def test_counts_add_up_and_rank0_only_redis_counters_are_not_averaged():
    rank0 = {"async/duplicates": 1, "redis/lost_trajectory_writes": 3, "reward/mean": 1.0}
    rank1 = {"async/duplicates": 2, "redis/lost_trajectory_writes": 0, "reward/mean": 0.0}
    out = merge_rank_metrics([(rank0, 3), (rank1, 1)])
    assert out["async/duplicates"] == 3  # 1 + 2
    # only rank 0 counts what Redis forgot: a mean (3 * 3 + 0 * 1) / 4 = 2.25 would hide it
    assert out["redis/lost_trajectory_writes"] == 3
    assert out["reward/mean"] == 0.75  # (1.0 * 3 + 0.0 * 1) / 4


def _micro_batch(tokens: int, rows: int, clipped: int, row_loss_sum: float) -> MetricSums:
    """A micro-batch's metrics as the learner adds them (learner/step/train.py `_backward`), with the
    seq-mean-token-mean loss: weighted by rows, the token means by tokens."""
    metrics = {
        "policy/clip_frac": clipped / max(tokens, 1),
        "loss/policy": row_loss_sum / max(rows, 1),
        "policy/ratio_max": 1.0 + clipped / 10,
    }
    return MetricSums().add(metrics, micro_batch_weights(tokens, rows))


def test_one_reduction_does_not_depend_on_the_split():
    # three micro-batches: (tokens, rows, clipped tokens, sum of per-row losses)
    parts = [(2, 1, 1, 0.9), (3, 2, 1, 0.6), (4, 1, 4, 0.3)]
    # over everything: clip_frac = (1 + 1 + 4) / (2 + 3 + 4) = 0.6667; loss = (0.9 + 0.6 + 0.3)
    # / 4 rows = 0.45; ratio_max = 1 + 4 / 10 = 1.4
    whole = {"policy/clip_frac": 6 / 9, "loss/policy": 0.45, "policy/ratio_max": 1.4}
    one_rank = merged([_micro_batch(*p) for p in parts]).values()
    # two ranks: micro-batches 0 and 1 on rank 0 (one update), 2 on rank 1, each sent as floats
    rank0 = _micro_batch(*parts[0]).merge(_micro_batch(*parts[1])).to_host()
    two_ranks = merged([rank0, _micro_batch(*parts[2]).to_host()]).values()
    assert one_rank == pytest.approx(whole) and two_ranks == pytest.approx(whole)
    # the ranks' means merged with equal weights would read clip_frac (2 / 5 + 4 / 4) / 2 = 0.7
    # and loss (1.5 / 3 + 0.3) / 2 = 0.4


def test_counts_sum_maxima_max_wall_times_from_rank_0():
    a = MetricSums().add({"optim/updates": 4.0, "perf/step_s": 2.0, "policy/ratio_max": 1.5})
    b = MetricSums().add({"optim/updates": 0.0, "perf/step_s": 3.0, "policy/ratio_max": 2.5})
    assert merged([a, b]).values() == {
        "optim/updates": 4.0,  # counted on rank 0 only: a count every rank shares
        "perf/step_s": 2.0,  # rank 0's
        "policy/ratio_max": 2.5,
    }


def test_a_mean_with_no_weight_is_zero_and_device_sums_read_back_at_once():
    sums = MetricSums().add({"policy/clip_frac": torch.tensor(0.5)}, 0.0)
    assert sums.values() == {"policy/clip_frac": 0.0}
    sums.add({"policy/clip_frac": torch.tensor(0.25), "optim/grad_norm": 3.0}, 4.0)
    # (0.5 * 0 + 0.25 * 4) / 4 = 0.25; a float and a tensor mix
    assert sums.values() == {"policy/clip_frac": 0.25, "optim/grad_norm": 3.0}
    assert all(isinstance(v, float) for v in sums.to_host().sums.values())
