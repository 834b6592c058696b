"""The software aggregator (PS fallback): the aggregation engine behind a UDP socket.

It speaks the same wire protocol as the switch. Differences from the switch: workers
are admitted by their source IPv4 address and UDP port (not an ingress port), and the
multicast of a RESULT is a unicast to each worker's address.

Admission is configured from a JSON file or at run time over a ZeroMQ control socket
(JSON requests, see docs/protocol.md), which also serves counters on demand. For
tests it can drop, duplicate and reorder packets with a seeded generator.

Each job has its own lane count (``lanes`` of its job object; by default the aggregator's
``lanes``), up to ``max_lanes``: the largest packet it takes, which ``ping`` states so that a
controller can size a group's packets to it and to the path MTU (docs/control.md).

Two engines serve the same protocol: ``engine="native"`` runs the whole UDP data path in C
(host/csrc/server.c) in a thread of its own, while this thread answers the control socket;
``engine="numpy"`` runs it here, in Python (the specification). ``"auto"``: native where
the library loads.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import signal
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from passing_protocol import rpc

from .. import native, wire
from ..keys import AggregatorKeys, serve_curve
from ..transport import BatchSocket, SendError, TransportStats, parse_endpoint
from .control_channel import MAX_DATAGRAM, job_from_json, job_to_json
from .engine import ConfigError, Emission, JobSpec
from .jobs import ROLES
from .native_engine import NativeAggregationEngine, make_engine

log = logging.getLogger("passing.aggregator")

DEFAULT_SLOTS = 4096
SEND_TIMEOUT = 1.0  # s a full send buffer may hold up a batch of RESULTs (server.c: SEND_TIMEOUT_MS)
# The largest packet a software aggregator takes by default: 1024 lanes (4 112-byte packets) was the
# fastest 8 MiB allreduce on loopback here (docs/benchmarks.md); memory: slots x 2 x lanes x 4 bytes,
# touched only where jobs use it.
DEFAULT_MAX_LANES = 1024


@dataclass
class Impairment:
    """Seeded packet drop / duplication / reordering on one direction."""

    drop: float = 0.0
    duplicate: float = 0.0
    reorder: bool = False
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    dropped: int = 0
    duplicated: int = 0

    def __post_init__(self) -> None:
        for name in ("drop", "duplicate"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{name} probability must be in [0, 1), got {p}")

    @property
    def active(self) -> bool:
        return bool(self.drop or self.duplicate or self.reorder)

    def apply(self, count: int) -> np.ndarray:
        """Indices of the packets that survive, in the order they go on."""
        keep = np.flatnonzero(self.rng.random(count) >= self.drop)
        self.dropped += count - keep.size
        if self.duplicate:
            extra = keep[self.rng.random(keep.size) < self.duplicate]
            self.duplicated += extra.size
            keep = np.concatenate([keep, extra])
        if self.reorder:
            self.rng.shuffle(keep)
        return keep


class NativeDataPath:
    """The C data path (host/csrc/server.c): the engine behind the UDP socket, served by a thread
    that spends its time in C (ctypes releases the GIL) and sleeps in poll() when idle."""

    BATCH = 256  # messages per recvmmsg, each a GRO-coalesced buffer at most

    def __init__(self, engine: NativeAggregationEngine, sock: BatchSocket, ingress: Impairment, egress: Impairment,
                 gso: bool) -> None:
        self._lib = native.lib()
        self._engine = engine  # the server uses the engine: keep it alive at least as long
        handle = self._lib.pn_server_new(engine.handle, sock.fd, self.BATCH, int(gso))
        if not handle:
            raise OSError("cannot set up the native data path (out of memory?)")
        self.handle: int | None = handle
        # Frees a server that was never closed; a running one is not garbage (its thread holds it).
        self._free = weakref.finalize(self, self._lib.pn_server_free, handle)
        self._free.atexit = False
        for direction, impairment in enumerate((ingress, egress)):
            if impairment.active:  # its seed comes from the impairment's own seeded generator
                seed = int(impairment.rng.integers(0, 1 << 63))
                native.check(self._lib.pn_server_impair(handle, direction, impairment.drop, impairment.duplicate,
                                                        int(impairment.reorder), seed), "pn_server_impair")
        self.thread: threading.Thread | None = None
        self.result: int | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="passing-aggregator-data", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.result = self._lib.pn_server_run(self.handle)

    @property
    def failed(self) -> bool:
        """The data path stopped by itself (a socket error)."""
        return self.thread is not None and not self.thread.is_alive() and self.result != native.PN_OK

    def stats(self) -> native.ServerStats:
        stats = native.ServerStats()
        if self.handle is not None:
            self._lib.pn_server_get_stats(self.handle, ctypes.byref(stats))
        return stats

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread, wait for it, free the server."""
        if self.handle is None:
            return
        self._lib.pn_server_stop(self.handle)
        if self.thread is not None:
            self.thread.join(timeout)  # bounded: the loop looks at the stop flag between batches
            if self.thread.is_alive():
                log.error("the native data path did not stop within %s s; leaving it", timeout)
                return  # freeing it under the running thread would be worse than a leak
        self._free()
        self.handle = None


class SoftwareAggregator:
    """A UDP aggregation service. ``serve()`` runs until ``stop()`` or a signal.

    ``lanes``: the lane count of a job that states none; ``max_lanes``: the largest it takes (at
    least ``lanes``)."""

    def __init__(
        self,
        listen: str | tuple[str, int] = ("0.0.0.0", wire.UDP_PORT),
        control: str | None = "tcp://127.0.0.1:9878",
        slots: int = DEFAULT_SLOTS,
        lanes: int = wire.DEFAULT_LANES,
        jobs: list[JobSpec] | None = None,
        ingress: Impairment | None = None,
        egress: Impairment | None = None,
        offload: bool = True,
        engine: str = "auto",
        keys: AggregatorKeys | None = None,
        max_lanes: int = DEFAULT_MAX_LANES,
        io: str = "auto",
    ) -> None:
        """``keys``: the control socket's CURVE key pair and the controller's public key, the only
        client it admits (default: the key directory's, docs/security.md). ``io``: the I/O path, AF_XDP beside
        the socket where it can run ("auto"), or forced ("udp", "xdp"): passing.xdp."""
        if lanes < 1 or wire.packet_size(max(lanes, max_lanes)) > MAX_DATAGRAM:
            raise ConfigError(f"lanes {lanes}, max_lanes {max_lanes}: a packet must fit one UDP datagram "
                              f"({MAX_DATAGRAM} bytes: at most {(MAX_DATAGRAM - wire.HEADER_SIZE) // 4} lanes)")
        if control and keys is None:
            keys = AggregatorKeys.load()  # before anything is bound: a clear error, nothing to undo
        self.lanes = lanes
        self.engine = make_engine(slots, max(lanes, max_lanes), engine=engine)
        for spec in jobs or []:
            self.add_job(spec)
        if isinstance(listen, str):
            listen = parse_endpoint(listen, wire.UDP_PORT)
        self.socket = BatchSocket(listen, lanes=self.engine.lanes, offload=offload)
        self.ingress = ingress or Impairment()
        self.egress = egress or Impairment()
        self.native: NativeDataPath | None = None
        if isinstance(self.engine, NativeAggregationEngine):
            try:
                self.native = NativeDataPath(self.engine, self.socket, self.ingress, self.egress, gso=offload)
                self.socket.open_io(io, True, clip=True)
                if self.socket.xsk is not None:
                    native.check(native.lib().pn_server_use_xsk(self.native.handle, self.socket.xsk.handle),
                                 "pn_server_use_xsk")
            except (OSError, RuntimeError):
                if self.native is not None:
                    self.native.close()
                self.socket.close()
                raise
        else:
            self.socket.open_io(io, False)
        self._zmq = zmq.Context()  # its own: its ZAP handler admits the controller only
        self._auth = None
        self.control: zmq.Socket | None = None
        self.control_endpoint: str | None = None
        self.control_refused = 0  # control messages refused (malformed, invalid): counted, answered
        self.control_internal_errors = 0  # of them, failures of ours (logged with the error)
        if control:
            assert keys is not None
            self.control = self._zmq.socket(zmq.REP)
            self.control.setsockopt(zmq.LINGER, 0)
            self.control.setsockopt(zmq.MAXMSGSIZE, rpc.MAX_MESSAGE_BYTES)  # a bigger one drops its sender
            try:
                self._auth = serve_curve(self._zmq, self.control, keys)
                self.control.bind(control)
            except zmq.ZMQError as e:
                self.close()
                raise OSError(f"cannot bind control socket {control}: {e}") from None
            self.control_endpoint = self.control.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        # The numpy engine is driven by the serving thread; a metrics scrape reads it from another.
        self._lock = threading.RLock()
        self._serving_thread: threading.Thread | None = None  # for its CPU time
        self.batches = self.send_errors = self.last_errno = 0  # the numpy data path's (native: its own)

    @property
    def address(self) -> tuple[str, int]:
        return self.socket.address

    def add_job(self, spec: JobSpec) -> JobSpec:
        """Admit a job; one without lanes gets this aggregator's ``lanes``."""
        if spec.lanes is None:
            spec.lanes = self.lanes
        return self.engine.add_job(spec)

    @property
    def engine_name(self) -> str:
        return "numpy" if self.native is None else "native"

    def stop(self, *_: object) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGINT, self.stop)
        signal.signal(signal.SIGTERM, self.stop)

    def close(self) -> None:
        if self.native is not None:
            self.native.close()  # first: its thread reads the socket
        self.socket.close()
        if self.control is not None:
            self.control.close()
            self.control = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._zmq.term()

    # ---- serving ---------------------------------------------------------------------

    def serve(self) -> None:
        self._serving_thread = threading.current_thread()
        if self.native is not None:
            self._serve_native()
            return
        poller = zmq.Poller()
        poller.register(self.socket.fd, zmq.POLLIN)
        if self.control is not None:
            poller.register(self.control, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(100))
                if self.socket.fd in events:
                    self.pump()
                if self.control is not None and self.control in events:
                    self._answer_control()
        finally:
            self.close()

    def _serve_native(self) -> None:
        """The data path runs in C in its own thread; this one answers the control socket and
        wakes up at least every 100 ms to notice stop() (a signal handler's too)."""
        self.native.start()
        try:
            while not self._stop.is_set():
                if self.native.failed:
                    err = self.native.stats().last_errno
                    raise OSError(err, f"the native data path stopped: {os.strerror(err)}")
                if self.control is None:
                    self._stop.wait(0.1)
                elif self.control.poll(100):
                    self._answer_control()
        finally:
            self.close()

    def pump(self, max_batches: int = 64) -> int:
        """Process what is queued (up to max_batches batches); returns packets taken (numpy engine)."""
        if self.native is not None:
            raise RuntimeError("pump() drives the numpy data path; the native one runs in serve()")
        taken = 0
        for _ in range(max_batches):
            # under the lock from the receive on, as the C data path does: a stats() read meanwhile never
            # finds a datagram the transport counted that the engine has not (a non-blocking receive)
            with self._lock:
                view, lengths, sources = self.socket.recv_packets()
                if len(lengths) == 0:
                    break
                taken += len(lengths)
                self.batches += 1
                if self.ingress.active:
                    keep = self.ingress.apply(len(lengths))
                    view, lengths, sources = view[keep], lengths[keep], sources[keep]
                self.send(self.engine.process(view, sources, lengths))
        return taken

    def send(self, out: Emission) -> None:
        """Send an emission as server.c does: by destination, each worker's packets in the engine's order
        (a stable sort: one run per worker, which GSO sends as one message), one send per run of one
        packet size in that order, never one per size: an ACK (a header) must not overtake an earlier
        RESULT to the same worker. A send the kernel refuses skips the rest of its destination (its
        workers retransmit); a buffer that stays full loses the rest of the batch. Both are counted,
        never fatal for the shared service."""
        if len(out) == 0:
            return
        rows = self.egress.apply(len(out)) if self.egress.active else np.arange(len(out))
        rows = rows[np.argsort(out.dest[rows], kind="stable")]
        dest, sizes = out.dest[rows], out.lengths[rows]
        ends = np.r_[np.flatnonzero(sizes[1:] != sizes[:-1]) + 1, len(rows)]  # where each run of one size ends
        at = 0
        while at < len(rows):
            end = int(ends[np.searchsorted(ends, at, side="right")])
            try:
                self.socket.send_batch(out.packets, dest[at:end], rows[at:end], timeout=SEND_TIMEOUT,
                                       size=int(sizes[at]))
                at = end
            except TimeoutError as e:
                self._send_failed(e.errno or errno.ETIMEDOUT)
                return
            except SendError as e:
                self._send_failed(e.errno)
                failed = at + e.sent
                at = failed + 1
                while at < len(rows) and dest[at] == dest[failed]:
                    at += 1

    def _send_failed(self, err: int) -> None:
        self.send_errors += 1
        self.last_errno = err

    # ---- control -----------------------------------------------------------------------

    def stats(self, job: int | None = None) -> dict[str, Any]:
        with self._lock:
            return self._stats(job)

    def metrics(self) -> dict[str, Any]:
        """What `--metrics` exports: the counters of ``stats``, the admitted jobs and their slots,
        and the CPU time of the data-path and control threads."""
        with self._lock:
            out = self._stats(None)
            out["admitted"] = [job_to_json(s) for s in self.engine.jobs()]
        out["slots"] = self.engine.slots
        if self.native is not None:
            threads = {"control": self._serving_thread, "data": self.native.thread}
        else:
            threads = {"data": self._serving_thread}  # one thread does both
        out["cpu_seconds"] = {name: thread_cpu_seconds(t) for name, t in threads.items()
                              if t is not None and t.is_alive()}
        return out

    def _stats(self, job: int | None) -> dict[str, Any]:
        # The native data path's transport counts a batch once the engine has counted it: read it
        # first, so that every datagram it counts is under its outcome in the engine's counters.
        server = self.native.stats() if self.native is not None else None
        jobs = [job] if job is not None else [s.job for s in self.engine.jobs()]
        reply: dict[str, Any] = {
            "totals": self.engine.counters(),
            "jobs": {str(j): job_counters(self.engine.counters(j)) for j in jobs},
        }
        if self.native is None:
            reply["injected"] = {
                "ingress_dropped": self.ingress.dropped, "ingress_duplicated": self.ingress.duplicated,
                "egress_dropped": self.egress.dropped, "egress_duplicated": self.egress.duplicated,
            }
            reply["transport"] = self.socket.stats.as_dict()
            reply["server"] = {"batches": self.batches, "send_errors": self.send_errors,
                               "last_errno": self.last_errno}
        else:
            assert server is not None
            reply["injected"] = {name: getattr(server, name) for name in (
                "ingress_dropped", "ingress_duplicated", "egress_dropped", "egress_duplicated")}
            reply["transport"] = TransportStats(  # the same keys as the numpy path's socket stats
                packets_sent=server.packets_sent, bytes_sent=server.bytes_sent,
                packets_received=server.packets_received, bytes_received=server.bytes_received,
                gso_fallbacks=server.gso_fallbacks,
            ).as_dict()
            reply["server"] = {"batches": server.batches, "send_errors": server.send_errors,
                               "last_errno": server.last_errno}
        reply["engine"] = self.engine_name
        reply["io"] = {"path": self.socket.io_path, "reason": self.socket.io_reason,
                       **({"xsk": self.socket.xsk_stats()} if self.socket.io_path == "xdp" else {})}
        return reply

    def handle(self, request: Any) -> dict[str, Any]:
        """One control request -> its reply. Never raises: errors become replies."""
        with self._lock:
            try:
                return self._handle(request)
            except (ConfigError, rpc.MessageError, KeyError, TypeError, ValueError) as e:
                self.control_refused += 1
                return {"ok": False, "error": str(e)}
            except Exception as e:  # a bug must not end a shared service: the sender learns, the log says
                self.control_refused += 1
                self.control_internal_errors += 1
                log.exception("control request failed")
                return {"ok": False, "error": f"internal error: {type(e).__name__}: {e}"}

    def _handle(self, request: Any) -> dict[str, Any]:
        if not isinstance(request, dict):
            raise ConfigError("a request must be a JSON object")
        if request.get("version") != rpc.AGGREGATOR_VERSION:
            raise ConfigError(f"unsupported control version {str(request.get('version'))[:20]!r} "
                              f"(want {rpc.AGGREGATOR_VERSION})")
        cmd = request.get("cmd")
        if cmd == "ping":
            # max_lanes: the largest packet it takes (a controller sizes groups by it)
            return {"ok": True, "lanes": self.lanes, "max_lanes": self.engine.lanes,
                    "max_datagram": wire.packet_size(self.engine.lanes), "slots": self.engine.slots,
                    "engine": self.engine_name, "roles": list(ROLES),  # the tree roles it serves
                    "control": {"refused": self.control_refused, "internal_errors": self.control_internal_errors}}
        if cmd == "stats":
            job = rpc.integer(request, "job", 0, (1 << 16) - 1, default=None)
            if job is not None and job not in {s.job for s in self.engine.jobs()}:
                raise ConfigError(f"no job {job} here")
            return {"ok": True, **self.stats(job)}
        if cmd == "jobs":
            return {"ok": True, "jobs": [job_to_json(s) for s in self.engine.jobs()]}
        if cmd == "add_job":
            spec = self.add_job(job_from_json(request.get("job")))
            log.info("admitted job %d generation %d: slots %d..%d, %d workers, %d lanes", spec.job,
                     spec.generation, spec.base, spec.base + spec.pool - 1, spec.workers, spec.lanes)
            return {"ok": True, "job": job_to_json(spec)}
        if cmd == "remove_job":
            spec = self.engine.remove_job(rpc.integer(request, "job", 0, (1 << 16) - 1))
            log.info("removed job %d", spec.job)
            return {"ok": True, "job": job_to_json(spec)}
        raise ConfigError(f"unknown command {str(cmd)[:40]!r}")

    def _answer_control(self) -> None:
        """One request, one reply, always (a REP socket that does not answer is stuck for good)."""
        frames = self.control.recv_multipart()
        if len(frames) != 1:
            self.control_refused += 1
            reply = {"ok": False, "error": f"a request is one frame, not {len(frames)}"}
        else:
            try:
                request = rpc.parse(frames[0])
            except rpc.MessageError as e:
                self.control_refused += 1
                reply = {"ok": False, "error": str(e)}
            else:
                reply = self.handle(request)
        self.control.send(rpc.encode(reply))


# Every packet of an admitted job ends in exactly one of these (overflow is part of aggregated; a GATHER
# or NACK that is admitted is relayed; what comes down to a leaf is answered or late): docs/protocol.md, Counters.
OUTCOMES = ("rejected", "aggregated", "duplicate", "duplicate_answered", "stale", "relayed", "answered",
            "late_answer")


def job_counters(counters: dict[str, int]) -> dict[str, int]:
    """A job's counters with its ``received`` filled in: the engines count arrivals in their totals
    only (a packet's job is known after it is parsed), so a job's arrivals are its outcomes."""
    return {**counters, "received": sum(counters[k] for k in OUTCOMES)}


def thread_cpu_seconds(thread: threading.Thread) -> float:
    """CPU time of a running thread of this process (call it only while the thread is alive:
    the clock of an ended thread is undefined)."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
