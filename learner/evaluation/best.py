"""The version with the best held-out accuracy (`eval.keep_best`), kept apart from retention.

Every held-out evaluation (before training, every `eval.every` steps, after training) offers the
version it evaluated. One that beats the best so far is linked into `{run_dir}/best/weights/`
(hard links of its verified-at-publish files and its manifest: no bytes are copied; a version
stored as a delta is rebuilt, verified, and written there whole), a weight
store of its own that holds only that version, so `weights/` retention (`trainer.keep_versions`)
never deletes it and `rollctl export --best` exports it like any version. `best/best.json`
records the version, its step and its accuracy; a resumed learner continues from it. A version
that ties the best does not replace it: the earlier one stays.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from rollflash.broker.weights.weight_chain import verified_tensors
from rollflash.broker.weights.weights import WeightStore, _fsync_dir, _fsync_file

log = logging.getLogger(__name__)

RECORD = "best.json"


class BestVersion:
    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir) / "best"
        self.store = WeightStore(self.dir)  # {run_dir}/best/weights
        record = self.dir / RECORD
        self.record = json.loads(record.read_text()) if record.is_file() else None

    @property
    def accuracy(self) -> float | None:
        return None if self.record is None else float(self.record["heldout_acc"])

    def offer(self, source: WeightStore, version: int, step: int, accuracy: float) -> bool:
        """Keep `version` of `source` (published, its manifest written) if `accuracy` beats the
        best so far; returns whether it did."""
        if self.accuracy is not None and accuracy <= self.accuracy:
            return False
        if source.manifest(version).kind == "delta":  # a delta cannot stand alone: kept whole
            shutil.rmtree(self.store.version_dir(version), ignore_errors=True)
            self.store.publish(verified_tensors(source, version), version, step)
        else:
            self._link(source, version)
        self.record = {"version": version, "step": step, "heldout_acc": accuracy}
        record = self.dir / f".{RECORD}.{os.getpid()}"
        record.write_text(json.dumps(self.record) + "\n")
        _fsync_file(record)
        os.replace(record, self.dir / RECORD)
        for v in self.store.versions():
            if v != version:
                shutil.rmtree(self.store.version_dir(v), ignore_errors=True)
        _fsync_dir(self.store.root)
        log.info("best held-out accuracy so far: %.3f (v%d, step %d)", accuracy, version, step)
        return True

    def _link(self, source: WeightStore, version: int) -> None:
        """Hard links of `version`'s files and manifest (verified when they were published)."""
        src, final = source.version_dir(version), self.store.version_dir(version)
        tmp = self.store.root / f".tmp-v{version:08d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for f in src.iterdir():
            os.link(f, tmp / f.name)
        _fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)

    def latest(self) -> int | None:
        """The best version, or None before any evaluation kept one."""
        return None if self.record is None else int(self.record["version"])
