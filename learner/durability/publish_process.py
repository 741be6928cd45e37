"""Publishing in a process of its own (`trainer.background_publish: process`).

The learner copies a version's tensors from the device straight into views of one shared-memory
block (`buffers`: allocated at the first publish, again only if the tensors' names, shapes or
dtypes change; registered as pinned memory on a GPU host, so the copies are asynchronous) and
hands the version to a helper process, which writes it to the weight store, announces it (the
`weights` hash, then zmq: the helper binds the PUB socket), applies retention (`VersionWriter.write`,
the same work a publish does in the learner) and, with `weights.transport: http`, serves the
store (broker/weights/weight_server.py). The learner's step is left with one copy of the weights, on
their way to the host; the writing, hashing, fsyncs and Redis round trips run on another core.
The helper is a process, not a thread: a thread's Python work would hold the GIL the training
step needs.

Rules (learner/durability/publish.py):
- at most one version in flight: `Publisher.publish` waits for the previous version to be
  announced before it submits the next, so the buffers are never overwritten while they are
  written out;
- a version is announced only once its manifest is durable;
- a failure in the helper reaches the learner at its next `submit` or `wait`: one of the
  project's errors (`RunLost`, `LeaseLost`: rollflash/errors.py) as itself, any other as
  `PublishFailed` with the helper's one-line reason; a helper that died (killed, out of memory)
  is reported the same way. The helper dies with the learner (PR_SET_PDEATHSIG), and what it
  left half-written is removed by the next learner's `WeightStore.clean_temp`.
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing as mp

from rollflash.broker.config.config import ConfigError
from rollflash.broker.config.config_weights import server_limits, split_listen
from rollflash.broker.connect.secrets import weights_token
from rollflash.broker.sides.learner_side import LearnerBroker
from rollflash.broker.weights.delta_write import VersionChain
from rollflash.broker.weights.notify import VersionPublisher
from rollflash.broker.weights.weights import VersionInfo, WeightStore
from rollflash.errors import RollflashError

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from rollflash.broker.config.config import Config
    from rollflash.broker.weights.weight_server import WeightServer

START_TIMEOUT_S = 120.0  # the helper imports torch and connects to Redis


@dataclass(frozen=True)
class NewVersion:
    """A version to publish, but for its tensors, which travel apart (to the helper process
    through shared memory, this through its pipe)."""

    version: int
    step: int  # the trainer step that made it
    # a LoRA adapter's config (broker/weights/weights.py); None: the full weights
    adapter_config: dict[str, Any] | None = None


class VersionWriter:
    """Writes a version to the weight store, records it in Redis and announces it over zmq, then
    applies retention: the work of one publish, wherever it runs (the learner's step, or the
    helper process)."""

    def __init__(self, cfg: Config, broker: LearnerBroker):
        self.store = WeightStore(cfg.run.run_dir)
        self.broker = broker
        self.keep = cfg.trainer.keep_versions
        every = cfg.weights.anchor_every  # deltas against the last version this process wrote
        state = Path(cfg.run.run_dir) / "publishing"
        self.chain = VersionChain(state, every) if every > 1 else None
        http = cfg.weights.transport == "http"
        self.server = serve_store(cfg, self.store, broker) if http else None
        host = split_listen(cfg.weights.listen)[0] if self.server is not None else "127.0.0.1"
        self.zmq = VersionPublisher(f"tcp://{host}:*")
        self.http_url = self.server.url if self.server is not None else ""

    def write(self, weights: dict[str, torch.Tensor], new: NewVersion) -> VersionInfo:
        fence = self.broker.check_lease  # a learner that lost the run publishes nothing
        fence()  # before the store looks: the run's new learner may have this version already
        # the manifest is written last, after `fence`
        info = self.store.publish(
            weights, new.version, new.step, new.adapter_config, fence, self.chain
        )
        self.broker.announce_weights(
            new.version, info.path, info.sha256, self.zmq.endpoint, self.http_url
        )
        self.zmq.announce(new.version, info.path, info.sha256)
        doomed = self.store.retain(self.keep, in_use=self.broker.loaded_versions())
        if self.server is not None:
            self.server.forget(doomed)
        return info

    def close(self) -> None:
        self.zmq.close()
        if self.server is not None:
            self.server.close()
        if self.chain is not None:
            self.chain.close()


def serve_store(cfg: Config, store: WeightStore, broker: LearnerBroker) -> WeightServer:
    """The learner's HTTP server of `store` (`weights.transport: http`), started; it names
    sources to the generators whose keys `broker` reads in Redis (broker/weights/weight_auth.py)."""
    from rollflash.broker.weights.weight_auth import registered
    from rollflash.broker.weights.weight_server import WeightServer, server_context

    w = cfg.weights
    try:
        token = weights_token(w.token_file)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    host, port = split_listen(w.listen)
    server = WeightServer(
        token,
        host,
        port,
        server_context(w.ssl_certfile, w.ssl_keyfile),
        store=store,
        fanout=w.fanout,
        registrations=lambda generator: registered(broker.io, generator),
        limits=server_limits(w),
    )
    server.start()
    return server


class PublishFailed(RuntimeError):
    """The helper process could not publish a version (or died)."""


class PublishProcess:
    """The learner's end: `submit` a version, `wait` for it, `close`."""

    def __init__(self, cfg: Config, lease_token: str):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        args = (cfg, child, lease_token)  # the helper's writes are fenced by the learner's lease
        self._proc = ctx.Process(target=_serve, args=args, name="publish", daemon=True)
        self._proc.start()
        child.close()
        self._buffers: dict[str, torch.Tensor] = {}
        self._layout: Layout = []  # the buffers' names, shapes and dtypes
        self._block: torch.Tensor | None = None
        self._pinned: int | None = None  # the block's address once registered with CUDA
        self._in_flight = False
        self._started = False  # the helper starts while the learner does (`ready`)

    def buffers(self, layout: Layout) -> dict[str, torch.Tensor]:
        """Shared-memory tensors of `layout` for the next version (learner/process/dist.py `host_copies`
        copies into them); the previous version must be announced (`wait`) first."""
        assert not self._in_flight, "one version at a time"
        self.ready()
        if layout != self._layout:
            self._release()
            self._block, self._buffers = _shared_buffers(layout, self._send)
            self._layout = layout
            self.pin()
        return self._buffers

    def submit(self, weights: dict[str, torch.Tensor], new: NewVersion) -> None:
        """Hand the version to the helper; `weights` are copied into the shared buffers unless
        they are those buffers already (`buffers`)."""
        buffers = self.buffers(_layout(weights))
        for name, t in weights.items():
            if t.data_ptr() != buffers[name].data_ptr():
                buffers[name].copy_(t)
        self._send(("publish", new))
        self._in_flight = True

    def _release(self) -> None:
        if self._pinned is not None:
            torch.cuda.cudart().cudaHostUnregister(self._pinned)
            self._pinned = None
        self._block = None

    def pin(self) -> None:
        """Register the block as pinned memory (a GPU host): device copies into it are then
        asynchronous. Where CUDA cannot, the copies stay synchronous."""
        if self._block is None or self._pinned is not None or not torch.cuda.is_available():
            return
        ptr = self._block.data_ptr()
        if torch.cuda.cudart().cudaHostRegister(ptr, self._block.numel(), 0) == 0:
            self._pinned = ptr

    def ready(self) -> None:
        """Until the helper is up (it imports torch and connects to Redis meanwhile)."""
        if not self._started:
            self._receive("started", START_TIMEOUT_S)
            self._started = True

    def _send(self, message: tuple) -> None:
        try:
            self._conn.send(message)
        except OSError:  # a broken pipe: the helper is gone
            raise self._died() from None

    def _died(self) -> PublishFailed:
        self._proc.join(timeout=5)
        return PublishFailed(f"the publishing process died (exit code {self._proc.exitcode})")

    def wait(self) -> tuple[int, str, str, str, str] | None:
        """Until the version in flight is announced; returns its announcement (version, path,
        sha256, zmq endpoint, http url), None if there was none in flight; its failure is
        raised here."""
        if not self._in_flight:
            return None
        self._in_flight = False
        return self._receive("published", None)

    def _receive(self, expected: str, timeout_s: float | None) -> Any:
        if not self._conn.poll(timeout_s):
            raise PublishFailed(f"the publishing process did not answer in {timeout_s:.0f}s")
        try:
            kind, value = self._conn.recv()
        except (EOFError, OSError):
            raise self._died() from None
        if kind == "failed":
            raise value  # the helper's own one-line error (a RollflashError)
        if kind == "error":
            raise PublishFailed(f"publishing failed: {value}")
        assert kind == expected, (kind, expected)
        return value

    def close(self) -> None:
        try:
            self.wait()
        finally:
            try:
                self._conn.send(("stop",))
            except OSError:  # it is gone already
                pass
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
            self._conn.close()
            self._release()


Layout = list[tuple[str, tuple[int, ...], torch.dtype]]
ALIGN = 64  # bytes: each tensor's view starts on a cache line


def _layout(weights: dict[str, torch.Tensor]) -> Layout:
    return [(n, tuple(t.shape), t.dtype) for n, t in weights.items()]


def _shared_buffers(
    layout: Layout, send: Callable[[tuple], None]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One shared-memory block holding a view per tensor of `layout` (one file descriptor, however
    many tensors), handed to the helper with the layout so that it builds the same views."""
    size = sum(_offsets(layout)[-1:]) or 1
    try:
        block = torch.empty(size, dtype=torch.uint8).share_memory_()
    except RuntimeError as e:
        raise PublishFailed(
            f"trainer.background_publish: process needs {size / 2**20:.0f} MiB of shared memory "
            f"(/dev/shm) and could not get it ({e!s:.80}); use background_publish: false"
        ) from None
    send(("buffers", block, layout))
    return block, _views(block, layout)


def _offsets(layout: Layout) -> list[int]:
    """Where each tensor starts in the block, and (last) the block's size."""
    out, at = [], 0
    for _, shape, dtype in layout:
        out.append(at)
        at += -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
    return [*out, at]


def _views(block: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    starts = _offsets(layout)
    return {
        name: block[at : at + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
        for (name, shape, dtype), at in zip(layout, starts)
    }


def _serve(cfg: Config, conn: Connection, lease_token: str) -> None:
    """The helper: publish each version handed over, answer ("published", version) or
    ("error", reason)."""
    from rollflash.broker.connect.redis_server import die_with_parent

    die_with_parent(signal.SIGKILL)
    torch.set_num_threads(1)
    try:
        writer = _writer(cfg, lease_token)
    except Exception as e:  # e.g. Redis unreachable: the learner reports it
        conn.send(("error", f"{e.__class__.__name__}: {e}"))
        return
    try:
        conn.send(("started", None))
        _answer(writer, conn)
    except (EOFError, ConnectionError):  # the learner is gone (closed, or died mid-message)
        pass
    writer.close()
    os._exit(0)  # nothing is left to flush; tearing down torch's interpreter is slow


def _answer(writer: VersionWriter, conn: Connection) -> None:
    """Publish each version handed over until the learner says stop."""
    buffers: dict[str, torch.Tensor] = {}
    while (message := conn.recv())[0] != "stop":
        if message[0] == "buffers":
            buffers = _views(message[1], message[2])
            continue
        new: NewVersion = message[1]
        try:
            info = writer.write(buffers, new)
        except Exception as e:
            _send_failure(conn, new.version, e)
            continue
        announced = (new.version, info.path, info.sha256, writer.zmq.endpoint, writer.http_url)
        conn.send(("published", announced))


def _send_failure(conn: Connection, version: int, e: Exception) -> None:
    """One of the project's errors (RunLost, LeaseLost) goes to the learner as itself, to stop it
    with its own line; any other error, or one that does not pickle, as its one-line text."""
    if isinstance(e, RollflashError):
        try:
            conn.send(("failed", e))  # pickled whole before anything is written
            return
        except Exception:
            pass
    conn.send(("error", f"v{version}: {e.__class__.__name__}: {e}"))


def _writer(cfg: Config, lease_token: str) -> VersionWriter:
    """The helper's writer, with a broker of its own (the learner's password is in `cfg`)."""
    broker = LearnerBroker.for_config(cfg)
    broker.use_lease(lease_token)
    return VersionWriter(cfg, broker)
