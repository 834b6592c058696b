"""The controller's transport (docs/control.md): one ROUTER socket, authenticated with CURVE
(docs/security.md), its framing, and the threads that answer.

The serving thread reads every request, checks its envelope, who sent it (the role of the
client's key) and its protocol version, and hands it to ``handle`` (the controller's dispatch),
which answers what it can at once. Whatever waits on an aggregator runs in a pool of threads
(``in_pool``), so a hanging PS delays nobody else; their replies (``reply``, from any thread)
go back through a queue and a wake-up pipe, and the serving thread sends them.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq

from passing_protocol import rpc
from passing_protocol.keys import serve_curve

from . import schema
from .keys import CONTROLLER_DOMAIN, ServerKeys
from .p4runtime import SwitchError
from .schema import RequestError, Unauthorized
from .topology import TopologyError

log = logging.getLogger("passing_controller")

POOL_THREADS = 8  # requests that wait on aggregators at once

Handle = Callable[[bytes, dict, str], None]  # (identity, request, role): answers through Server.reply
Reply = Callable[[bytes, dict], None]  # Server.reply: queue an answer to a client (any thread)
InPool = Callable[..., None]  # Server.in_pool: run a function on a pool thread


class Server:
    def __init__(self, listen: str, keys: ServerKeys, handle: Handle, tick: Callable[[], None],
                 stalled: Callable[[], None], refused: dict[str, int]) -> None:
        """``handle``: called on the serving thread for every request that passed the checks
        here (RequestError, TopologyError: an error reply); ``tick``: after every batch of
        requests; ``stalled``: when a batch took long; ``refused``: the counts of refused
        requests, by why."""
        self.keys, self.handle, self.tick, self.stalled, self.refused = keys, handle, tick, stalled, refused
        self._ctx = zmq.Context()  # the service's own: its ZAP handler admits its own clients only
        self._outbox: queue.SimpleQueue[tuple[bytes, dict]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()  # a pool thread's reply wakes the serving thread
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._pool = ThreadPoolExecutor(POOL_THREADS, thread_name_prefix="passing-controller")
        self._stop = threading.Event()
        self.socket = self._ctx.socket(zmq.ROUTER)
        try:
            self.socket.setsockopt(zmq.LINGER, 0)
            self.socket.setsockopt(zmq.MAXMSGSIZE, rpc.MAX_MESSAGE_BYTES)  # a bigger one drops its sender
            self._auth = serve_curve(self._ctx, self.socket, keys.public, keys.secret, keys.clients, CONTROLLER_DOMAIN)
            self.socket.bind(listen)
        except BaseException:
            self._close_transport()
            raise
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def serve(self) -> None:
        """Serve until ``stop``."""
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(100))
            if self._wake_r in events:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            began = time.monotonic()
            if self.socket in events:
                for _ in range(256):  # a batch, then the replies of the pool go out too
                    try:
                        frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._receive(frames)
            self._flush()
            self.tick()
            self._flush()
            if time.monotonic() - began > 0.5:  # heartbeats queued meanwhile: no one's fault
                self.stalled()

    def stop(self, *_: object) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGINT, self.stop)
        signal.signal(signal.SIGTERM, self.stop)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._close_transport()

    def _close_transport(self) -> None:
        if getattr(self, "_closed_transport", False):
            return
        self._closed_transport = True
        self.socket.close()
        if getattr(self, "_auth", None) is not None:
            self._auth.stop()
        self._ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def reply(self, identity: bytes, reply: dict) -> None:
        """Queue a reply (any thread); the serving thread sends it."""
        self._outbox.put((identity, reply))
        try:
            os.write(self._wake_w, b"!")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (already awake) or closed (stopping)

    def _flush(self) -> None:
        while True:
            try:
                identity, reply = self._outbox.get_nowait()
            except queue.Empty:
                return
            try:
                self.socket.send_multipart([identity, b"", rpc.encode(reply)], zmq.NOBLOCK)
            except zmq.ZMQError as e:  # a peer gone or not reading: its reply is dropped, others go on
                log.info("reply not sent: %s", e)

    def in_pool(self, fn: Any, *args: Any) -> None:
        """Run ``fn`` on a pool thread; an exception there is logged, never lost silently."""
        def run() -> None:
            try:
                fn(*args)
            except Exception:
                log.exception("controller task %s failed", getattr(fn, "__name__", fn))
        self._pool.submit(run)

    def answer_later(self, identity: bytes, fn: Any, *args: Any) -> None:
        """(pool thread) Answer with what ``fn`` returns, or with the error it raised."""
        try:
            reply = {"ok": True, **fn(*args)}
        except (RequestError, SwitchError, OSError) as e:
            reply = {"ok": False, "error": str(e)}
        self.reply(identity, reply)

    def _receive(self, frames: list[zmq.Frame]) -> None:
        """One message off the ROUTER socket: framing, then who sent it, then what it asks."""
        # A REQ client sends [identity, empty delimiter, body]: anything else is not ours to answer.
        if len(frames) != 3 or frames[1].bytes != b"":
            self.refused["malformed"] += 1
            log.debug("dropped a message of %d frames (not a request)", len(frames))
            return
        identity, body = frames[0].bytes, frames[2]
        try:
            role = self.keys.clients.get(body.get("User-Id").encode())  # ZAP admitted it: the key is known
        except zmq.ZMQError:  # no user id: not through the CURVE handshake (cannot happen on tcp)
            role = None
        if role is None:
            self.refused["unauthorized"] += 1
            return
        try:
            request = schema.parse(body.bytes)
            if request.get("version") != rpc.CONTROLLER_VERSION:
                raise RequestError(f"unsupported protocol version {rpc.show(request.get('version'))} "
                                   f"(this controller speaks {rpc.CONTROLLER_VERSION})")
            self.handle(identity, request, role)
        except (RequestError, TopologyError) as e:
            self.refused["unauthorized" if isinstance(e, Unauthorized) else "invalid"] += 1
            self.reply(identity, {"ok": False, "error": str(e)})
        except Exception as e:  # a bug must not end a shared service: the sender learns, the log says
            self.refused["internal"] += 1
            log.exception("request %r failed", body.bytes[:200])
            self.reply(identity, {"ok": False, "error": f"internal error: {type(e).__name__}: {e}"})
