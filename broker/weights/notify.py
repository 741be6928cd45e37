"""Weight-version notifications over zmq PUB/SUB.

The learner binds a PUB socket and announces every published version; generators SUB to the
endpoint recorded in the `weights` hash. Notifications only make reloads prompt: PUB drops messages
for slow or late subscribers, so generators also read the hash on start and on a slow poll, and a
lost message delays a reload but never breaks it. Messages are msgpack, never pickle.
"""

from __future__ import annotations

import msgpack
import zmq


class VersionPublisher:
    def __init__(self, bind: str = "tcp://127.0.0.1:*"):
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(bind)
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def announce(self, version: int, path: str, sha256: str) -> None:
        msg = msgpack.packb({"version": version, "path": path, "sha256": sha256})
        self._sock.send(msg, zmq.NOBLOCK)

    def close(self) -> None:
        self._sock.close()


class VersionSubscriber:
    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)

    def latest(self, timeout_ms: int = 0) -> int | None:
        """Newest version announced since the last call, or None; waits at most `timeout_ms`."""
        newest = None
        while self._sock.poll(timeout_ms):
            timeout_ms = 0
            try:
                msg = msgpack.unpackb(
                    self._sock.recv(zmq.NOBLOCK),
                    max_str_len=4096,
                    max_bin_len=0,
                    max_array_len=16,
                    max_map_len=16,
                )
                version = int(msg["version"])
            except (ValueError, KeyError, TypeError, zmq.Again, msgpack.UnpackException):
                continue  # a garbled notification only delays the reload until the next poll
            newest = version if newest is None else max(newest, version)
        return newest

    def close(self) -> None:
        self._sock.close()
