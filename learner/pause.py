"""Fault points: named places in a learner step where a fault test stops the learner, to kill -9
it inside that exact window. The learner calls `pause_point(name, step)` there; every hook
installed with `on_pause_point` runs, and none is installed in production (the fault tests'
harness installs one in the learner process it starts: tests/faults/learner_pause.py). Points:
after_read (a step's groups read, not trained), after_update (trained and published, not
checkpointed), after_checkpoint (durable, its entries not yet acknowledged), before_ack (the
first dropped entries of the step recorded in the ledger, not yet acknowledged)."""

from __future__ import annotations

from collections.abc import Callable

Hook = Callable[[str, int], None]  # (point, learner step)

_hooks: list[Hook] = []


def on_pause_point(hook: Hook) -> None:
    """Run `hook(name, step)` at every pause point of this process."""
    _hooks.append(hook)


def pause_point(name: str, step: int) -> None:
    """The learner is at point `name` of `step`: run the installed hooks (none in production)."""
    for hook in _hooks:
        hook(name, step)
