"""broker/safetensors_stream.py: the file it writes loads with safetensors, and the size and sha256
it returns are those of the bytes on disk (computed while writing, never re-read)."""

import hashlib

import torch
from safetensors.torch import load_file

from rollflash.broker.safetensors_stream import write_safetensors


def test_written_file_loads_and_its_hash_is_of_the_bytes_on_disk(tmp_path):
    tensors = {
        "w": torch.randn(3, 5).bfloat16(),
        "ids": torch.arange(7),
        "scalar": torch.tensor(3.0),
        "flags": torch.tensor([True, False]),
        "empty": torch.zeros(0, 4),
        "half": torch.randn(4, 2, dtype=torch.float16)[:, 0],  # not contiguous
    }
    size, sha = write_safetensors(tensors, tmp_path / "m.safetensors", {"format": "pt"})
    data = (tmp_path / "m.safetensors").read_bytes()
    assert size == len(data) and sha == hashlib.sha256(data).hexdigest()
    # header: 8-byte length, then JSON padded to a multiple of 8
    assert int.from_bytes(data[:8], "little") % 8 == 0
    back = load_file(str(tmp_path / "m.safetensors"))
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
