"""Reward functions that stay in the process they were given to: `rollflash.Run` with callables.

A person may give `rollflash.Run` reward functions as Python objects: a lambda, a closure over a
notebook's state. The learner and generator processes that Run starts are fresh interpreters (the
same `rollctl` processes as `rollctl run`), which can neither import such an object nor be sent
it without pickling code. So the functions stay in the caller's process, which serves them on a
private unix socket (in a directory of mode 0700) for as long as the run lasts. In the config
each is the spec `python:NAME`; a child process turns that spec into a proxy that sends each
call's arguments (prompt, response, answer and the row's columns, as JSON: data, never code) and
returns the reward the caller's function computed (a `Scored` failure reason included, and None
when the function abstained).

Why not fork the children from the caller, so that they inherit the objects: a process that has
run torch on several threads cannot fork safely (GNU OpenMP's thread pool deadlocks in the child
once the child uses more than one thread; measured with torch 2.13), and a notebook usually has.

The socket's path travels in the environment (`ROLLFLASH_REWARD_SOCKET`); a process started any
other way (`rollctl start-generator` by hand) has none, and refuses the spec at load with one
line. Costs: one round trip per call (per scoring batch for a `@batched` function), and every
process's calls run in the caller's process, each connection's one at a time: a heavy reward
function belongs in a module, named by an import string, so that each generator runs its own. A
call cut off by `reward.timeout_s` closes its connection; the next call opens another.

Stdlib only, like the rest of envs/.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import socketserver
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rollflash.envs.scored import Scored

SOCKET_ENV = "ROLLFLASH_REWARD_SOCKET"
PREFIX = "python:"  # a reward.functions spec naming a function the caller's process serves


def _encode(value: Any) -> Any:
    """A function's result as JSON data: a number or None (an abstention), or a list of them
    from a batched function, a `Scored` as [value, failure]; anything else as its text, which
    the caller's side refuses as not a finite number."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return {"not_a_number": repr(value)[:200]}
    failure = getattr(value, "failure", "")
    return {"scored": [float(value), failure]} if failure else float(value)


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict) and "scored" in value:
        return Scored(*value["scored"])
    if isinstance(value, dict):
        return value.get("not_a_number")  # not a number: refused by the reward functions
    return value


class _Handler(socketserver.StreamRequestHandler):
    functions: dict[str, Callable[..., Any]] = {}

    def handle(self) -> None:
        for line in self.rfile:
            request = json.loads(line)
            fn = self.functions.get(request.get("fn", ""))
            if fn is None:
                reply: dict[str, Any] = {"unknown": sorted(self.functions)}
            elif request.get("describe"):
                reply = {f: bool(getattr(fn, f, False)) for f in ("batched", "own_deadline")}
            else:
                try:
                    reply = {"value": _encode(fn(*request["args"], **request["kwargs"]))}
                except Exception as e:  # the child counts it as this function's error
                    reply = {"error": f"{e.__class__.__name__}: {str(e)[:500]}"}
            try:
                self.wfile.write(json.dumps(reply).encode() + b"\n")
                self.wfile.flush()
            except OSError:  # the child gave up on the call (its timeout) and closed
                return


@contextmanager
def serve_functions(functions: dict[str, Callable[..., Any]]) -> Iterator[dict[str, str]]:
    """Serve `functions` (spec -> callable) while the block runs; yields the environment the
    child processes need (empty when there is nothing to serve)."""
    if not functions:
        yield {}
        return
    directory = Path(tempfile.mkdtemp(prefix="rollflash-rewards-"))  # mode 0700
    path = directory / "rewards.sock"
    handler = type("Handler", (_Handler,), {"functions": dict(functions)})
    server = socketserver.ThreadingUnixStreamServer(str(path), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="reward-server", daemon=True)
    thread.start()
    try:
        yield {SOCKET_ENV: str(path)}
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(directory, ignore_errors=True)


class RemoteFunction:
    """A proxy, in a child process, of a function the caller's process serves."""

    def __init__(self, spec: str, address: str):
        self.spec, self.address = spec, address
        self._sock: socket.socket | None = None
        self._file: Any = None
        described = self._ask({"fn": spec, "describe": True})
        if "unknown" in described:
            raise LookupError(f"the caller serves {', '.join(described['unknown']) or 'none'}")
        self.batched = described["batched"]
        self.own_deadline = described["own_deadline"]

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._sock.connect(self.address)
                self._file = self._sock.makefile("rwb")
            self._file.write(json.dumps(request).encode() + b"\n")
            self._file.flush()
            line = self._file.readline()
            if not line:
                raise ConnectionError("the caller's process closed the reward connection")
            return json.loads(line)
        except BaseException:  # a timeout mid-call, a lost caller: start afresh next time
            self.close()
            raise

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = self._file = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        reply = self._ask({"fn": self.spec, "args": list(args), "kwargs": kwargs})
        if "error" in reply:
            raise RemoteRewardError(reply["error"])
        return _decode(reply["value"])


class RemoteRewardError(Exception):
    """The caller's function raised; the message is its exception's class and message."""


def remote_function(spec: str) -> RemoteFunction:
    """The proxy of `spec`; OSError or LookupError (with the cause) when it cannot be reached."""
    address = os.environ.get(SOCKET_ENV)
    if not address:
        raise LookupError(f"no {SOCKET_ENV} in this process's environment")
    return RemoteFunction(spec, address)
