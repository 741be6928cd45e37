"""The changed elements of a tensor between two weight versions, and their compact encoding.

Two versions of a tensor in the published dtype are compared bit for bit, as unsigned integers of
the dtype's width (so -0.0 against +0.0, or two NaN payloads, are changes like any other bits). A
tensor's change is the positions of the elements that differ (flat, ascending) and their new
values; the positions are stored the smaller of two ways:
- `gaps`: for each position, its distance from the previous one minus 1 (the first: the position
  itself), as an LEB128 varint (7 bits a byte, the high bit set on every byte but a number's
  last): 1 byte per change while changes lie less than 128 elements apart, 2 below 16,384;
- `bitmap`: one bit per element of the tensor, set where it changed (numpy's `packbits`, bit 0 of
  byte 0 is element 0: little bit order).
Gaps cost about 1.3 bytes a change at the ~1% of bf16 elements an RL step changes at lr 1e-6 (the
bitmap 12.5); the bitmap wins once more than about one element in ten changes. The values are the
new elements' bytes (little-endian), in position order.

Everything here works on numpy arrays in slices of `SLICE` elements, so a tensor of any size costs
a bounded amount of memory beyond its changed positions. Decoding checks everything it reads (an
encoded change is authenticated by the manifest's digests before it gets here, but a check costs
nothing next to the work): positions strictly ascending and inside the tensor, the count as
declared, no bytes left over.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SLICE = 1 << 24  # elements compared or decoded at a time
MAX_VARINT = 9  # bytes of one gap: 63 bits, above any tensor's element count
ENCODINGS = ("gaps", "bitmap")


class BadDelta(ValueError):
    """Encoded positions that do not describe a change of the tensor."""


def as_bits(buf: bytes | bytearray | memoryview | np.ndarray, itemsize: int) -> np.ndarray:
    """The tensor bytes `buf` as a flat array of unsigned integers of `itemsize` bytes."""
    return np.frombuffer(buf, dtype=np.dtype(f"<u{itemsize}"))


def changed_positions(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Flat positions (int64, ascending) where `old` and `new` (as_bits views) differ."""
    if old.shape != new.shape:
        raise ValueError(f"cannot compare {old.shape} with {new.shape}")
    parts = [
        np.flatnonzero(old[a : a + SLICE] != new[a : a + SLICE]) + a
        for a in range(0, len(new), SLICE)
    ]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _varint_lengths(gaps: np.ndarray) -> np.ndarray:
    lengths = np.ones(len(gaps), np.int64)
    for k in range(1, MAX_VARINT):
        lengths += gaps >= (1 << (7 * k))
    return lengths


def gaps_size(positions: np.ndarray) -> int:
    """Bytes of `positions` encoded as varint gaps."""
    return int(_varint_lengths(_gaps(positions)).sum())


def _gaps(positions: np.ndarray) -> np.ndarray:
    gaps = np.empty(len(positions), np.uint64)
    if len(positions):
        gaps[0] = positions[0]
        gaps[1:] = np.diff(positions) - 1
    return gaps


def encode_gaps(positions: np.ndarray) -> np.ndarray:
    """`positions` (ascending int64) as varint gaps (uint8)."""
    gaps = _gaps(positions)
    lengths = _varint_lengths(gaps)
    starts = np.cumsum(lengths) - lengths
    out = np.empty(int(lengths.sum()), np.uint8)
    for k in range(MAX_VARINT):
        here = lengths > k
        if not here.any():
            break
        byte = (gaps[here] >> np.uint64(7 * k)) & np.uint64(0x7F)
        more = (lengths[here] > k + 1).astype(np.uint64) << np.uint64(7)
        out[starts[here] + k] = (byte | more).astype(np.uint8)
    return out


def decode_gaps(data: np.ndarray, count: int, numel: int) -> np.ndarray:
    """The positions that `encode_gaps` wrote into `data` (uint8), checked."""
    ends = np.flatnonzero((data & 0x80) == 0)
    if len(ends) != count or (count and ends[-1] != len(data) - 1):
        raise BadDelta(f"{len(ends)} varints in {len(data)} bytes where {count} were declared")
    if count == 0:
        return np.zeros(0, np.int64)
    starts = np.concatenate(([0], ends[:-1] + 1))
    if int((ends - starts).max()) >= MAX_VARINT:
        raise BadDelta(f"a varint longer than {MAX_VARINT} bytes")
    shift = (np.arange(len(data)) - np.repeat(starts, ends - starts + 1)) * 7
    parts = (data & 0x7F).astype(np.uint64) << shift.astype(np.uint64)
    gaps = np.add.reduceat(parts, starts)
    if int(gaps.max()) >= numel:  # each gap below numel: the sum below cannot wrap
        raise BadDelta(f"a position outside the tensor's {numel} elements")
    positions = np.cumsum(gaps.astype(np.int64) + 1) - 1
    if positions[-1] >= numel:
        raise BadDelta(f"a position outside the tensor's {numel} elements")
    return positions


def encode_bitmap(positions: np.ndarray, numel: int) -> np.ndarray:
    """`positions` as one bit per element (uint8, little bit order)."""
    out = np.zeros(-(-numel // 8), np.uint8)
    np.bitwise_or.at(out, positions >> 3, (1 << (positions & 7)).astype(np.uint8))
    return out


def decode_bitmap(data: np.ndarray, count: int, numel: int) -> np.ndarray:
    """The positions set in the bitmap `data`, checked."""
    if len(data) != -(-numel // 8):
        raise BadDelta(f"a bitmap of {len(data)} bytes for {numel} elements")
    step = SLICE // 8
    parts = [
        np.flatnonzero(np.unpackbits(data[a : a + step], bitorder="little")) + 8 * a
        for a in range(0, len(data), step)
    ]
    positions = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if len(positions) != count or (count and positions[-1] >= numel):
        raise BadDelta(f"the bitmap sets {len(positions)} elements where {count} were declared")
    return positions


@dataclass(frozen=True)
class Change:
    """A tensor's change, encoded: `positions` (uint8) then `values` (the new elements)."""

    encoding: str  # "gaps" or "bitmap"
    count: int  # changed elements
    positions: np.ndarray  # uint8
    values: np.ndarray  # as_bits of the new elements

    @property
    def nbytes(self) -> int:
        return self.positions.nbytes + self.values.nbytes


def encode_change(old: np.ndarray, new: np.ndarray) -> Change | None:
    """The change from `old` to `new` (as_bits views of one shape), the smaller encoding of its
    positions; None when nothing changed."""
    positions = changed_positions(old, new)
    if not len(positions):
        return None
    values = new[positions]
    if gaps_size(positions) <= -(-len(new) // 8):
        return Change("gaps", len(positions), encode_gaps(positions), values)
    return Change("bitmap", len(positions), encode_bitmap(positions, len(new)), values)


def decode_positions(encoding: str, data: np.ndarray, count: int, numel: int) -> np.ndarray:
    if encoding == "gaps":
        return decode_gaps(data, count, numel)
    if encoding == "bitmap":
        return decode_bitmap(data, count, numel)
    raise BadDelta(f"unknown encoding {encoding!r}")
