"""Fault points: named places in the learner where a fault test stops it, to kill -9 it inside
that exact window. The learner holds one `FaultHooks` (`Learner.hooks`), built at start-up by
`hooks_from_env`; without `$ROLLFLASH_LEARNER_HOOK` it holds no hook and a point does nothing.
A fault test's harness sets that variable to "module:function" (tests/faults/learner_pause.py),
and the function is called as `function(point, step)` at every point:

- after_lease (step 0): the run's lease taken, the run registered and the config saved, nothing
  published (learner/build.py);
- after_start: the learner built and its first version published or handed to the publishing
  process: v0, or the resumed version (learner/build.py);
- after_read: a step's groups read, not trained (learner/intake/collect.py);
- after_update: trained, published and its ledger row written, not checkpointed
  (learner/durability/ledger.py);
- after_checkpoint: durable, its entries not yet acknowledged (learner/rank.py `checkpoint`);
- before_ack: dropped entries recorded in the ledger, not yet acknowledged (learner/intake/drops.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from rollflash.errors import BadInput

HOOK_ENV = "ROLLFLASH_LEARNER_HOOK"
POINTS = ("after_lease", "after_start", "after_read", "after_update", "after_checkpoint",
          "before_ack")  # fmt: skip

Hook = Callable[[str, int], None]  # (point, learner step)


@dataclass(frozen=True)
class FaultHooks:
    """The hooks a learner runs at its fault points (none in production)."""

    hooks: tuple[Hook, ...] = ()

    def at(self, point: str, step: int) -> None:
        """The learner is at `point` of `step`: run every hook."""
        assert point in POINTS, point
        for hook in self.hooks:
            hook(point, step)


def hooks_from_env(environ: Mapping[str, str]) -> FaultHooks:
    """The hook `$ROLLFLASH_LEARNER_HOOK` names ("module:function"), or none."""
    spec = environ.get(HOOK_ENV, "")
    if not spec:
        return FaultHooks()
    module, _, name = spec.partition(":")
    try:
        hook = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise BadInput(
            f"${HOOK_ENV}={spec}: no function {name!r} in module {module!r} ({e})"
        ) from e
    return FaultHooks((hook,))
