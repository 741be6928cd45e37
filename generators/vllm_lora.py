"""LoRA adapter versions in the vLLM engine: one vLLM adapter per weight version.

vLLM attaches an adapter to a request when the request is added, and the request keeps it to its
end; so a request started on version v is sampled from base + adapter v at every token, even after
newer versions load, and every token of its sample carries version v. Adapters are told apart by
`lora_int_id = version` (version 0 is the base model itself: no adapter). An adapter stays
registered, with its private copy on disk (vLLM reloads from that path if it evicts the adapter
from its CPU cache), while a request that started with it is running; the others are removed at
the next load. The engine is started with `max_loras` slots (`adapter_kwargs`), enough for the
versions that can be in flight together (`trainer.max_overdue_staleness` + 2: a group still being
generated may be that old, learner/intake/ready.py); more would only queue requests.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# vLLM's allowed values of max_lora_rank (vllm.config.lora.MaxLoRARanks)
_VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def adapter_kwargs(rank: int, max_loras: int) -> dict[str, Any]:
    """The `vllm.LLM` arguments that enable adapters of rank <= `rank`."""
    max_rank = next(r for r in _VLLM_RANKS if r >= rank)
    return {
        "enable_lora": True,
        "max_lora_rank": max_rank,
        "max_loras": max_loras,
        "max_cpu_loras": max_loras,
    }


class AdapterVersions:
    """Which adapter new requests start with, and which version each running request has."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="rollflash-adapters-"))
        self.current = 0  # the version new requests start with (0: the base, no adapter)
        self._running: dict[str, int] = {}  # request id -> its version
        self._loaded: set[int] = set()

    def load(self, engine: Any, adapter_dir: Path, version: int) -> None:
        """Register the verified adapter in `adapter_dir` as `version` (a private copy of it) and
        make it the one new requests start with."""
        own = self.root / f"v{version:08d}"
        shutil.copytree(adapter_dir, own)
        try:
            if not engine.add_lora(self._request(version)):
                raise ValueError(f"vLLM did not load the adapter of weights v{version}")
        except BaseException:
            shutil.rmtree(own, ignore_errors=True)
            raise
        self._loaded.add(version)
        self.current = version
        self._prune(engine)

    def start(self, request_ids: Iterable[str]) -> Any:
        """Record that these requests start now; returns the LoRARequest to add them with."""
        for request_id in request_ids:
            self._running[request_id] = self.current
        return self._request(self.current) if self.current else None

    def finish(self, request_id: str) -> int:
        """The version `request_id` ran with; it no longer holds its adapter."""
        return self._running.pop(request_id, self.current)

    def base_reloaded(self) -> None:
        """Full weights were loaded: new requests run on them without an adapter."""
        self.current = 0

    def _request(self, version: int) -> Any:
        from vllm.lora.request import LoRARequest

        path = str(self.root / f"v{version:08d}")
        return LoRARequest(lora_name=f"v{version}", lora_int_id=version, lora_path=path)

    def _prune(self, engine: Any) -> None:
        in_use = {self.current, *self._running.values()}
        for version in sorted(self._loaded - in_use):
            engine.remove_lora(version)
            shutil.rmtree(self.root / f"v{version:08d}", ignore_errors=True)
            self._loaded.discard(version)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
