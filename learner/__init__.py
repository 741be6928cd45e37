"""The learner process (see learner/loop.py). Heavy imports happen only when `run` is called."""


def run(cfg, resume=None):
    """Train until `trainer.total_steps`; returns the summary dict (also in summary.json).
    `resume`: None resumes from the latest checkpoint when there is one (learner/loop.py)."""
    from rollflash.learner.loop import run as _run

    return _run(cfg, resume)
