"""The generator process (see generators/rollout.py). Heavy imports happen only when `run` is called."""


def run(cfg, generator_id: str) -> None:
    """Serve prompts until the learner marks the run done, or SIGTERM / SIGINT."""
    from rollflash.generators.rollout import run as _run

    _run(cfg, generator_id)
