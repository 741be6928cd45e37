"""Reading a W&B offline run back: its transaction log, without W&B's own reader (not public)."""

import struct

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path):
    """The protobuf records of a W&B transaction log (`run-<id>.wandb`): a 7-byte file header
    (':W&B', magic, version), then LevelDB log framing: 32 KiB blocks of records, each with a
    7-byte header (crc32, length, type), a record split over blocks as FIRST, MIDDLE..., LAST."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    ident, _magic, _version = struct.unpack("<4sHB", data[:HEADER])
    assert ident == b":W&B", ident
    pos, parts, out = HEADER, b"", []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        body = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            break
        parts = body if kind in (FULL, FIRST) else parts + body
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(parts)
            out.append(record)
    return out
