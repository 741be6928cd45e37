"""broker/weights/safetensors_stream.py and broker/weights/digest.py: the file written loads with
safetensors, and the size and chunked digest returned are those of the bytes on disk (hashed while
writing, never re-read), with chunk boundaries falling anywhere in the header and the tensors."""

import hashlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file

from rollflash.broker.weights import digest
from rollflash.broker.weights.digest import ChunkHasher, file_digest, tree_digest
from rollflash.broker.weights.safetensors_stream import write_safetensors


def _by_hand(data: bytes, chunk: int) -> str:
    """The digest as broker/weights/digest.py defines it, computed the slow way."""
    chunks = [hashlib.sha256(data[i : i + chunk]).hexdigest() for i in range(0, len(data), chunk)]
    listing = f"sha256-chunks {chunk} {len(data)}\n" + "".join(c + "\n" for c in chunks)
    return hashlib.sha256(listing.encode()).hexdigest()


@pytest.mark.parametrize("chunk", [48, 1000, 1 << 20])  # mid-header, mid-tensor, one chunk
def test_written_file_loads_and_its_digest_is_of_the_bytes_on_disk(tmp_path, chunk):
    tensors = {
        "w": torch.randn(3, 5).bfloat16(),
        "ids": torch.arange(70),
        "scalar": torch.tensor(3.0),
        "flags": torch.tensor([True, False]),
        "empty": torch.zeros(0, 4),
        "half": torch.randn(4, 2, dtype=torch.float16)[:, 0],  # not contiguous
    }
    written = write_safetensors(tensors, tmp_path / "m.safetensors", {"format": "pt"}, chunk)
    data = (tmp_path / "m.safetensors").read_bytes()
    assert written.size == len(data) and written.digest == _by_hand(data, chunk)
    assert len(written.chunks) == -(-len(data) // chunk)  # ceil: the last chunk is shorter
    assert (
        written.chunks[-1] == hashlib.sha256(data[(len(written.chunks) - 1) * chunk :]).hexdigest()
    )
    # header: 8-byte length, then JSON padded to a multiple of 8
    assert int.from_bytes(data[:8], "little") % 8 == 0
    back = load_file(str(tmp_path / "m.safetensors"))
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_the_digest_does_not_depend_on_how_the_bytes_are_handed_over():
    data = bytes(range(256)) * 5  # 1280 bytes
    whole = file_digest(data, 100)
    pieces = ChunkHasher(100, threads=3)
    cuts = (0, 0, 1, 99, 100, 101, 650, 1280)  # pieces of 0, 1, 98, 1, 1, 549 and 630 bytes
    for a, b in zip(cuts, cuts[1:]):
        pieces.update(memoryview(data)[a:b])
    assert pieces.result() == whole
    assert whole.digest == _by_hand(data, 100) and len(whole.chunks) == 13  # ceil(1280 / 100)


def test_the_digest_binds_size_and_chunking():
    data = b"x" * 200
    # same bytes, other chunk size: other listing, other digest
    assert file_digest(data, 100).digest != file_digest(data, 200).digest
    # the listing's header holds the size: one chunk of 200 bytes is not one of 100
    assert tree_digest(100, 200, ["a"]) != tree_digest(100, 100, ["a"])
    with pytest.raises(ValueError, match="chunk_bytes"):
        ChunkHasher(0)


def test_a_stream_of_one_chunk_is_hashed_without_a_thread(monkeypatch):
    """A small model's weights are one chunk: hashed in the calling thread, with the digest a
    pool would give; the second chunk starts the pool."""
    started = []
    real = ThreadPoolExecutor

    def counting(*args, **kwargs):
        started.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(digest, "ThreadPoolExecutor", counting)
    data = bytes(range(100))
    assert file_digest(data, 100).digest == _by_hand(data, 100) and started == []
    assert file_digest(data + b"!", 100).digest == _by_hand(data + b"!", 100)
    assert len(started) == 1
    assert file_digest(b"", 100).chunks == [] and len(started) == 1  # nothing to hash
