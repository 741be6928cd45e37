"""The learner process (see learner/loop.py). Heavy imports happen only when `run` is called."""


def run(cfg):
    """Train until `trainer.total_steps`; returns the summary dict (also in summary.json)."""
    from learner.loop import run as _run

    return _run(cfg)
