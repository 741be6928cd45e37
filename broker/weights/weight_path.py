"""Which versions, in which form, a generator reads to reach an announced version: the fewest
bytes.

A version may be readable whole (`full`, or an `adapter`), as a `delta` against the version
before it, or both (an anchor, broker/weights/delta_write.py). A generator that holds version h (the
verified full file of what it loaded, generators/held.py) and is told of version v reads the
manifests from v down (each authenticated: v's by the digest the learner announced, every other
by the `base_sha256` of the manifest above it) until it reaches h, or a version with no delta, or
one that is gone (retention); then it picks, version by version from the lowest, the cheaper way
to have each: its full file, or the way to the version before plus its delta. Reaching v costs
the bytes of the files on the chosen path: the delta from h when h = v - 1; after a gap, the
deltas from h or the latest anchor's full file plus the deltas after it, whichever is fewer;
for a generator that holds nothing, an anchor plus its deltas. A (version, form) that failed its
check is left out (`refused`), so a bad delta makes the plan fall back to a full version below
it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from rollflash.broker.weights.manifest import CorruptWeights, Manifest

# (version, its digest) -> its checked manifest; None if the store does not have the version,
# CorruptWeights if what it has is not that version
ManifestReader = Callable[[int, str | None], Manifest | None]


@dataclass(frozen=True)
class Held:
    """The version a generator holds the verified full file of."""

    version: int
    sha256: str


@dataclass(frozen=True)
class Step:
    manifest: Manifest  # authenticated
    form: str  # "full", "delta" or "adapter"

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def size(self) -> int:
        return self.manifest.form_size(self.form)


def _connects(m: Manifest, held: Held | None) -> bool:
    """Whether `m` is a delta against exactly the version `held` is."""
    return (
        held is not None
        and m.delta is not None
        and m.delta.base == held.version
        and m.delta.base_sha256 == held.sha256
    )


def chain_down(
    read: ManifestReader, version: int, sha256: str | None, held: Held | None
) -> list[Manifest]:
    """The manifests from `version` down to where a plan can start (module docstring), lowest
    first."""
    top = read(version, sha256)
    if top is None:
        raise CorruptWeights(f"weights v{version}: not in the store (deleted by retention?)")
    chain = [top]
    while (m := chain[-1]).delta is not None and not _connects(m, held):
        try:
            below = read(m.delta.base, m.delta.base_sha256)
        except CorruptWeights:  # a damaged version below: plan from above it
            below = None
        if below is None:
            break
        chain.append(below)
    return chain[::-1]


def plan(
    read: ManifestReader,
    version: int,
    sha256: str | None,
    held: Held | None,
    refused: Collection[tuple[int, str]] = (),
) -> list[Step]:
    """The steps (lowest version first) that reach `version` with the fewest bytes; a plan
    starting with a delta applies it to `held`."""
    chain = chain_down(read, version, sha256, held)
    inf = float("inf")
    before = 0.0 if _connects(chain[0], held) else inf  # the cost of holding the base
    best: list[tuple[float, str]] = []
    for m in chain:
        options: list[tuple[float, str]] = [
            (m.form_size(form), form)
            for form in m.forms
            if form != "delta" and (m.version, form) not in refused
        ]
        if "delta" in m.forms and (m.version, "delta") not in refused and before < inf:
            options.append((before + m.form_size("delta"), "delta"))
        cost, form = min(options, key=lambda o: (o[0], o[1] == "delta"), default=(inf, ""))
        best.append((cost, form))
        before = cost
    if best[-1][0] == inf:
        tried = ", ".join(f"v{v} {f}" for v, f in sorted(refused)) or "none"
        raise CorruptWeights(
            f"weights v{version}: no readable path to it (the versions below it are gone or "
            f"failed; refused: {tried})"
        )
    steps, i = [], len(chain) - 1
    while True:
        steps.append(Step(chain[i], best[i][1]))
        if best[i][1] != "delta" or i == 0:
            break
        i -= 1
    return steps[::-1]


def path_bytes(steps: list[Step]) -> int:
    return sum(s.size for s in steps)
