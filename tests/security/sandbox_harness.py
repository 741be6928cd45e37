"""What the sandbox attack tests share: the prelude with which hostile code first switches off
the sandbox's Python audit hook (so that what each test meets is the kernel boundary, not the
hook), the skip switch, and a scan of the host's processes.

The sandbox tests are skipped only with ROLLFLASH_SKIP_SANDBOX_TESTS=1 (never set in CI); without
bubblewrap they fail."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP_SANDBOX = pytest.mark.skipif(
    os.environ.get("ROLLFLASH_SKIP_SANDBOX_TESTS") == "1",
    reason="ROLLFLASH_SKIP_SANDBOX_TESTS=1",
)

# Replaces the code of the audit hook (found among the interpreter's objects) with a no-op of the
# same closure shape, then proves the hook is off: listing "/" is something it refuses.
HOOK_OFF = """
import gc, os, json, sys
def _shape():
    inside = readable = None
    def hook(event, args):
        return (inside, readable) and None
    return hook
for _f in gc.get_objects():
    if type(_f) is type(_shape) and _f.__name__ == "hook" and _f.__code__.co_freevars:
        _f.__code__ = _shape().__code__
assert "scratch" in os.listdir("/"), "the audit hook is still on"
"""


# Hostile code's way to make any system call with any arguments: `call(nr, *args)` returns "ok"
# or the errno
RAW_SYSCALL = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return "ok" if r >= 0 else ctypes.get_errno()
"""


def host_processes_with(token: str) -> list[int]:
    """Host pids whose command line contains `token`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if token.encode() in cmdline:
                found.append(int(entry))
    return found
