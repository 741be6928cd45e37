"""merge_rank_metrics: how one step's per-rank metrics become one row."""

from rollflash.learner.metrics import merge_rank_metrics


def test_counts_add_up_and_rank0_only_redis_counters_are_not_averaged():
    rank0 = {"async/duplicates": 1, "redis/lost_trajectory_writes": 3, "reward/mean": 1.0}
    rank1 = {"async/duplicates": 2, "redis/lost_trajectory_writes": 0, "reward/mean": 0.0}
    out = merge_rank_metrics([(rank0, 3), (rank1, 1)])
    assert out["async/duplicates"] == 3  # 1 + 2
    # only rank 0 counts what Redis forgot: a mean (3 * 3 + 0 * 1) / 4 = 2.25 would hide it
    assert out["redis/lost_trajectory_writes"] == 3
    assert out["reward/mean"] == 0.75  # (1.0 * 3 + 0.0 * 1) / 4
