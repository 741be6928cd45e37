"""The `delta` section of a weight version's manifest (broker/weights/manifest.py): what a reader needs to
turn the version before into this one, and to check the result.

    "delta": {
      "base": 11, "base_sha256": "<the digest announced for v11>",
      "metadata": {"format": "pt"},            # the full file's safetensors metadata
      "tensors": [                             # every tensor, in the full file's order (by name)
        {"name": "model.norm.weight", "dtype": "BF16", "shape": [896],
         "sha256": "<sha256 of its bytes after applying>", "change": null},      # unchanged
        {"name": "...", "dtype": "BF16", "shape": [896, 896], "sha256": "...",
         "change": {"encoding": "gaps", "count": 8021, "offset": 0,
                    "positions": 10530, "values": 16042}}, ...]}

A change's bytes lie at `offset` in `delta.bin`: `positions` bytes of encoded positions, then
`values` bytes of new elements (broker/weights/delta.py); the changes tile the file in tensor order.
`parse_delta` accepts a section only when every field has its type and every size agrees with the
others (a bitmap covers the tensor, a value per change, the changes fill the file exactly), so a
reader sizes nothing from a number it has not checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rollflash.broker.weights.delta import ENCODINGS, MAX_VARINT

ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1,
}  # fmt: skip


@dataclass(frozen=True)
class ChangeSpec:
    encoding: str  # "gaps" or "bitmap"
    count: int  # changed elements
    offset: int  # in delta.bin
    positions: int  # bytes of encoded positions
    values: int  # bytes of new values

    @property
    def end(self) -> int:
        return self.offset + self.positions + self.values


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # safetensors' name: "BF16", "F32", ...
    shape: tuple[int, ...]
    sha256: str  # of its bytes after applying
    change: ChangeSpec | None  # None: the same bytes as in the base

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class DeltaSpec:
    base: int
    base_sha256: str
    metadata: dict[str, str]
    tensors: tuple[TensorSpec, ...]

    @property
    def changed(self) -> int:
        """Elements changed against the base."""
        return sum(t.change.count for t in self.tensors if t.change is not None)

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)


def _hex64(x: Any) -> bool:
    return isinstance(x, str) and len(x) == 64 and all(c in "0123456789abcdef" for c in x)


def _int(x: Any, low: int = 0) -> bool:
    return type(x) is int and x >= low


def parse_delta(version: int, data: Any, delta_size: int) -> DeltaSpec:
    """The checked `delta` section of version `version`'s manifest, whose delta file is
    `delta_size` bytes; ValueError naming what is wrong."""
    if not isinstance(data, dict) or set(data) != {"base", "base_sha256", "metadata", "tensors"}:
        raise ValueError("the delta section does not have its four fields")
    if data["base"] != version - 1 or not _hex64(data["base_sha256"]):
        raise ValueError(f"a delta's base must be v{version - 1}, named with its digest")
    metadata = data["metadata"]
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise ValueError("the delta's metadata is not a mapping of strings")
    entries = data["tensors"]
    if not isinstance(entries, list) or not entries:
        raise ValueError("the delta lists no tensors")
    tensors: list[TensorSpec] = []
    at = 0
    for entry in entries:
        t = _tensor(entry)
        if tensors and t.name <= tensors[-1].name:
            raise ValueError(f"tensor {t.name!r} out of order (the full file's order: by name)")
        if t.change is not None:
            if t.change.offset != at:
                raise ValueError(f"tensor {t.name!r}: its change starts at {t.change.offset}, "
                                 f"expected {at}")  # fmt: skip
            at = t.change.end
        tensors.append(t)
    if at != delta_size:
        raise ValueError(f"the changes fill {at} bytes of a delta file of {delta_size}")
    return DeltaSpec(data["base"], data["base_sha256"], dict(metadata), tuple(tensors))


def _tensor(e: Any) -> TensorSpec:
    if not isinstance(e, dict) or set(e) != {"name", "dtype", "shape", "sha256", "change"}:
        raise ValueError("a tensor entry does not have its five fields")
    name, dtype, shape = e["name"], e["dtype"], e["shape"]
    if (
        not isinstance(name, str)
        or not name
        or dtype not in ITEMSIZE
        or not isinstance(shape, list)
        or not all(_int(d) for d in shape)
        or not _hex64(e["sha256"])
    ):
        raise ValueError(f"tensor {str(name)[:100]!r}: a malformed entry")
    spec = TensorSpec(name, dtype, tuple(shape), e["sha256"], None)
    if e["change"] is None:
        return spec
    c = e["change"]
    if not isinstance(c, dict) or set(c) != {"encoding", "count", "offset", "positions", "values"}:
        raise ValueError(f"tensor {name!r}: a malformed change")
    change = ChangeSpec(c["encoding"], c["count"], c["offset"], c["positions"], c["values"])
    numel = spec.numel
    if (
        change.encoding not in ENCODINGS
        or not all(_int(x) for x in (change.offset, change.positions, change.values))
        or not _int(change.count, 1)
        or change.count > numel
        or change.values != change.count * ITEMSIZE[dtype]
        or (change.encoding == "bitmap" and change.positions != -(-numel // 8))
        or (
            change.encoding == "gaps"
            and not change.count <= change.positions <= MAX_VARINT * change.count
        )
    ):
        raise ValueError(f"tensor {name!r}: its change's sizes do not fit its {numel} elements")
    return TensorSpec(name, dtype, tuple(shape), e["sha256"], change)


def delta_section(
    base: int, base_sha256: str, metadata: dict[str, str], tensors: list[TensorSpec]
) -> dict[str, Any]:
    """The section as the writer puts it in the manifest (what `parse_delta` reads back)."""
    return {
        "base": base,
        "base_sha256": base_sha256,
        "metadata": metadata,
        "tensors": [
            {
                "name": t.name,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "sha256": t.sha256,
                "change": None
                if t.change is None
                else {
                    "encoding": t.change.encoding,
                    "count": t.change.count,
                    "offset": t.change.offset,
                    "positions": t.change.positions,
                    "values": t.change.values,
                },
            }
            for t in tensors
        ],
    }
