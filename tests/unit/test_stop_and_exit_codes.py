"""How a process ends when it is asked to stop or the disk is full: learner/process/stop.py's signal
handling, and `rollctl`'s exit codes and one-line messages (rollctl/cli_base.py `guarded`)."""

from __future__ import annotations

import errno
import os
import signal
import time
import traceback

import pytest
import typer

from rollflash.errors import Stopped
from rollflash.learner.process.stop import StopSignals
from rollflash.rollctl.cli_base import EXIT_DISK_FULL, disk_full, guarded


def _deliver(sig: int) -> None:
    """Send `sig` to this process and give Python the moment it takes to run the handler."""
    os.kill(os.getpid(), sig)
    for _ in range(100):
        time.sleep(0.01)


def test_the_first_signal_asks_for_a_stop_and_the_second_stops_at_once():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    asked = []
    with StopSignals() as signals:
        signals.on_request(lambda: asked.append("stop waiting"))
        _deliver(signal.SIGTERM)
        assert signals.signum == signal.SIGTERM and asked == ["stop waiting"]
        with pytest.raises(Stopped) as e:
            _deliver(signal.SIGINT)
        assert e.value.signum == signal.SIGINT and e.value.exit_code == 130
        late = []
        signals.on_request(lambda: late.append(1))  # after the signal: called at once
        assert late == [1]
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_stopped_is_no_exception_an_except_exception_swallows():
    def step() -> None:
        try:
            raise Stopped("stopped at once by a second SIGTERM", signal.SIGTERM)
        except Exception:  # what the interrupted code may hold
            pytest.fail("caught")

    with pytest.raises(Stopped):
        step()


def _checkpoint_failure(cause: BaseException) -> BaseException:
    """What torch.distributed.checkpoint raises when a rank's write fails."""
    from torch.distributed.checkpoint.api import CheckpointException

    stack = traceback.extract_stack()
    return CheckpointException("save failed", {0: (cause, stack)})


def test_disk_full_is_found_anywhere_in_the_chain():
    full = OSError(errno.ENOSPC, "No space left on device", "runs/x/ledger.jsonl")
    assert disk_full(full) == "runs/x/ledger.jsonl"
    quota = OSError(errno.EDQUOT, "Disk quota exceeded", "runs/x/metrics.jsonl")
    assert disk_full(quota) == "runs/x/metrics.jsonl"
    try:
        try:
            raise full
        except OSError as e:
            raise RuntimeError("publishing v3 failed") from e
    except RuntimeError as wrapped:
        assert disk_full(wrapped) == "runs/x/ledger.jsonl"
    assert disk_full(_checkpoint_failure(full)) == "runs/x/ledger.jsonl"
    rust = Exception(  # safetensors' error: the OS error in its message only
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
        'left on device" })'
    )
    assert disk_full(rust) == ""
    assert disk_full(OSError(errno.EACCES, "Permission denied", "x")) is None
    assert disk_full(ValueError("shapes do not broadcast")) is None


def test_guarded_ends_a_full_disk_and_a_stop_with_one_line_and_their_codes(capsys):
    def full_disk() -> None:
        raise _checkpoint_failure(OSError(errno.ENOSPC, "No space left", "runs/x/ckpt/state.json"))

    with pytest.raises(typer.Exit) as e:
        guarded(full_disk)
    assert e.value.exit_code == EXIT_DISK_FULL == 4
    assert capsys.readouterr().err.splitlines() == [
        "rollctl: error: disk full: no space left on the device writing runs/x/ckpt/state.json; "
        "free space and run the same command (nothing is lost: the run resumes from its last "
        "checkpoint)"
    ]

    def stopped() -> None:
        raise Stopped("stopped by SIGTERM after step 4: checkpointed", signal.SIGTERM)

    with pytest.raises(typer.Exit) as e:
        guarded(stopped)
    assert e.value.exit_code == 143
    assert capsys.readouterr().err == "rollctl: stopped by SIGTERM after step 4: checkpointed\n"

    def bug() -> None:
        raise OSError(errno.EACCES, "Permission denied", "x")

    with pytest.raises(PermissionError):  # not ours to explain: its traceback
        guarded(bug)
