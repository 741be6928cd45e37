"""The optional multi-turn fields of a sample on the wire (broker/wire/schema.py): what they are and
how a reader checks them."""

from __future__ import annotations

import numpy as np

from rollflash.broker.wire.wire import WireError

TURN_FIELDS = (
    ("loss_mask", "|u1"),
    ("turn_starts", "<i4"),
    ("turn_rewards", "<f4"),
    ("turn_states", "<i8"),
)
TURN_NAMES = tuple(name for name, _ in TURN_FIELDS)


def check_turns(turns: dict[str, np.ndarray], length: int, what: str) -> dict[str, np.ndarray]:
    """The optional multi-turn arrays: all four or none; loss_mask is 0/1 over the response, turn
    starts strictly increase inside it and each starts on a model token (at least one turn
    unless no token is the model's), rewards are finite."""
    if not turns:
        return {}
    if len(turns) != len(TURN_NAMES):
        missing = [n for n in TURN_NAMES if n not in turns]
        raise WireError(
            f"{what}: multi-turn fields incomplete, missing {', '.join(missing)}", "schema"
        )
    mask, starts = turns["loss_mask"], turns["turn_starts"]
    if mask.shape != (length,) or np.any(mask > 1):
        raise WireError(f"{what}.loss_mask: must be 0/1 with the response's shape", "bad_shape")
    k = starts.shape
    # K = 0 only for a sample with no model token (an agent episode with nothing to train)
    if (
        k[0] < (1 if mask.any() else 0)
        or turns["turn_rewards"].shape != k
        or turns["turn_states"].shape != k
    ):
        raise WireError(
            f"{what}: turn_starts, turn_rewards and turn_states must be [K], K >= 1 "
            "(0 when the loss mask is all 0)",
            "bad_shape",
        )
    if k[0] and (
        np.any(np.diff(starts) <= 0)
        or starts[0] < 0
        or starts[-1] >= length
        or not np.all(mask[starts] == 1)
    ):
        raise WireError(f"{what}.turn_starts: not increasing model-token positions", "bad_shape")
    if not np.all(np.isfinite(turns["turn_rewards"])):
        raise WireError(f"{what}.turn_rewards: not finite", "out_of_range")
    return turns
