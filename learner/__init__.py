"""The learner process (see learner/loop.py). Heavy imports happen only when `run` is called."""


def run(cfg, resume=None, on_step=None, take_over=False):
    """Train until `trainer.total_steps`; returns the summary dict (also in summary.json).
    `resume`: None resumes from the latest checkpoint when there is one; `on_step`: called on
    rank 0 with each step's metrics (learner/loop.py); `take_over`: take the run's lease from a
    learner known to be dead (broker/channels/lease.py)."""
    from rollflash.learner.loop import run as _run

    return _run(cfg, resume, on_step, take_over)
