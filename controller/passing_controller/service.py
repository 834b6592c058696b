"""The controller service: hosts join and leave job groups over ZeroMQ (docs/control.md).

One ROUTER socket, authenticated with CURVE (docs/security.md): every client presents a key
the controller knows, as an operator or as a worker. A worker acts only on its own job: a
join proves it knows the job's secret, and the answer gives each worker a token that its
later requests (leave, alive, stuck, report) carry.

Threads: the serving thread reads every request, checks it and answers what it can at once
(heartbeats, status, reports, joins of incomplete groups). Whatever talks to an aggregator
(admitting a complete group, tearing one down, checking a silent one, reading counters) runs
in a pool of worker threads, so a hanging PS or a move's check delays nobody else. One lock
guards the state (the in-memory view and the SQLite store) and is never held while waiting
on an aggregator; the switch's session has a lock of its own. A group under way is marked
(admitting, ending, moving) so that no request sees it half-done.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from . import admission, aggregator_address, counters, l2_forward, result_rewrite, rpc, schema
from .allocation import MAX_JOB_ID, Allocation, Worker
from .allocator import SlotAllocator, SlotsExhausted
from .keys import CONTROLLER_DOMAIN, ClientKeys, ServerKeys, digest, matches, new_secret, serve_curve
from .p4runtime import Pipeline, SwitchError, Tls, connect
from .schema import RequestError
from .store import Record, Store, StoreError
from .topology import PsEndpoint, Topology, TopologyError, ps_pool

if TYPE_CHECKING:
    from .session import Switch

log = logging.getLogger("passing_controller")

PROTOCOL_VERSION = 3  # 3: authenticated (CURVE), job secrets and worker tokens; 2: generations
PS_CONTROL_VERSION = 3  # the software aggregator's control channel (docs/protocol.md)
UDP_PORT = 9877  # docs/protocol.md: the aggregator's PASSING port
MAX_WORKERS = 32
MAX_GROUP = 1023  # group indices (a server's local rank)
MAX_PENDING = 4096  # groups waiting for their workers at once
PS_SLOTS = 4096  # the controller's view of a software aggregator's slots
MAX_POOL = 65536
SWITCH_RETRY_SECONDS = 30.0  # a switch that was unavailable is tried again at a join after this long
AGGREGATOR_RETRY_SECONDS = 30.0  # a PS that failed goes last in the order for this long
AGGREGATOR_CHOICES = ("any", "ps")  # a join's "aggregator": the PS and PSRing baselines ask for "ps"
FINISHED_RETENTION = 300.0  # s a finished group stays in `metrics`, so a scrape sees its final counters
REPORT_FIELDS = ("packets_sent", "bytes_sent", "packets_received", "bytes_received", "retransmissions",
                 "early_retransmissions", "calls", "call_seconds")  # what a worker reports (docs/control.md)
DEAD_AFTER_BEATS = 3  # a worker whose heartbeats stopped this many intervals ago is presumed dead
CHECK_TIMEOUT = 2.0  # seconds the liveness check of a silent aggregator may take
DECISIONS_KEPT_SECONDS = 600.0  # a move's decision is answered to late reporters this long
POOL_THREADS = 8  # requests that wait on aggregators at once
# who may send what: a worker acts on its own group only (with its token)
WORKER_COMMANDS = frozenset({"join", "leave", "alive", "stuck", "report"})
OPERATOR_COMMANDS = WORKER_COMMANDS | {"status", "stats", "metrics"}


class Unauthorized(RequestError):
    """A request this client's role may not make."""


class AggregatorFailed(RuntimeError):
    """One aggregator could not take a group (the text says which and why); the next one is tried."""


@dataclass
class PendingGroup:
    workers: int
    pool: int | None  # None: the job asked for none, the aggregator's default (ps_pool on a PS)
    deadline: float
    aggregator: str  # "any": the switch when it can serve, else a PS; "ps": a PS in any case
    secret: str = ""  # digest of the job secret the first joiner gave: the others must know it
    members: dict[int, tuple[bytes, dict]] = field(default_factory=dict)  # worker -> (identity, request)


class Controller:
    def __init__(self, topology: Topology, pipeline: Pipeline | None, store: str | Path, listen: str,
                 keys: ServerKeys, aggregator_key: bytes | None = None, join_timeout: float = 60.0,
                 default_pool: int = 256, switch_timeout: float = 5.0) -> None:
        """``keys``: the controller's key pair and the clients it admits, with their roles;
        ``aggregator_key``: the public key of the software aggregators that the topology does
        not give one for."""
        self.topo = topology
        self.pipeline = pipeline
        self.keys, self.aggregator_key = keys, aggregator_key
        if not 1 <= default_pool <= MAX_POOL:
            raise ValueError(f"default pool {default_pool} outside 1..{MAX_POOL}")
        self.join_timeout, self.default_pool, self.switch_timeout = join_timeout, default_pool, switch_timeout
        self.lock = threading.RLock()  # the state below and the store; never held while waiting on I/O
        self.switch_lock = threading.Lock()  # the P4Runtime session: one request at a time
        self.store = Store(store)
        self.allocator = SlotAllocator(topology.slots)
        self.ps_allocators = {ps.control: SlotAllocator(PS_SLOTS) for ps in topology.ps}
        self.switch: Switch | None = None
        self.switch_error: str | None = None
        self._switch_retry_at = 0.0
        self.records: dict[tuple[str, int], Record] = {}  # running groups (the store's, in memory)
        self.pending: dict[tuple[str, int], PendingGroup] = {}
        self.admitting: set[tuple[str, int]] = set()  # complete groups being placed on an aggregator
        self.claimed: set[int] = set()  # job ids of those, not in the store yet
        self.ending: set[int] = set()  # job ids being torn down
        self.leaving: dict[int, set[int]] = {}  # job id -> workers that left (the group goes when all have)
        # For `metrics` (memory only: counters restart with the controller, as Prometheus expects):
        self.reports: dict[int, dict[int, dict[str, float]]] = {}  # job id -> worker -> its latest report
        self.finished: list[dict[str, Any]] = []  # groups torn down lately, with their final counters
        self.admitted = {"switch": 0, "ps": 0}  # groups allocated since start (joins and moves), by mode
        self.joins_failed = 0  # groups no aggregator could take since start (joins and moves)
        # requests refused, by why ("internal": a bug of ours, logged with its request)
        self.refused = {"malformed": 0, "unauthorized": 0, "invalid": 0, "internal": 0}
        # failover (docs/control.md): heartbeats, the reports of silent groups, and what was decided
        self.started = self.stalled_until = time.monotonic()  # heartbeats count from the later of these
        self.last_seen: dict[tuple[str, int, int], tuple[float, float]] = {}  # worker -> (when, interval)
        self.stuck: dict[tuple[str, int, int], dict[int, int]] = {}  # (job, group, generation) -> worker -> call
        self.decided: dict[tuple[str, int, int], tuple[float, dict]] = {}  # same key -> (when, decision)
        self.moving: dict[tuple[str, int, int], list[tuple[bytes, int]]] = {}  # same key -> who waits for it
        self.moving_tokens: dict[tuple[str, int, int], list[str]] = {}  # same key -> its workers' token digests
        self.suspect: set[str] = set()  # aggregators being checked: tried last meanwhile
        for r in self.store.all():
            self.records[(r.job_name, r.group)] = r
            (self.allocator if r.mode == "switch" else self.ps_allocators.setdefault(
                r.aggregator["control"], SlotAllocator(PS_SLOTS))).reserve(r.base, r.pool)
        self.connect_switch()
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
            self.socket.setsockopt(zmq.MAXMSGSIZE, schema.MAX_MESSAGE_BYTES)  # a bigger one drops its sender
            self._auth = serve_curve(self._ctx, self.socket, keys, CONTROLLER_DOMAIN)
            self.socket.bind(listen)
        except BaseException:
            self._close_transport()
            raise
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)

    # ---- the switch ----------------------------------------------------------------------

    def connect_switch(self) -> None:
        """Connect, then either load the pipeline (a fresh switch) or reconcile with it."""
        if self.topo.p4runtime is None:
            self.switch, self.switch_error = None, "no switch in the topology (PS only)"
            self._switch_retry_at = float("inf")
            return
        try:
            tls = None if self.topo.tls is None else Tls(**{k: Path(v) for k, v in self.topo.tls.items()})
            sw = connect(self.topo.p4runtime, self.topo.device_id, timeout=self.switch_timeout, tls=tls)
        except SwitchError as e:
            self._switch_down(str(e))
            log.warning("switch unavailable, PS fallback only: %s", e)
            return
        try:
            try:
                sw.fetch_pipeline()
                running = sw.p4info is not None and admission.TABLE in sw.p4info.tables
            except SwitchError:
                running = False
            if not running:
                if self.pipeline is None:
                    raise SwitchError("the switch runs no PASSING pipeline and none was given (--p4info/--bmv2-json)")
                sw.set_pipeline(self.pipeline)
                log.info("pipeline loaded on %s", self.topo.p4runtime)
            self._reconcile(sw)
        except SwitchError as e:
            sw.close()
            self._switch_down(str(e))
            log.warning("switch unusable, PS fallback only: %s", e)
            return
        self.switch, self.switch_error = sw, None
        with self.lock:
            self.store.mark_up("switch")

    def _switch_down(self, error: str) -> None:
        self.switch, self.switch_error = None, error
        self._switch_retry_at = time.monotonic() + SWITCH_RETRY_SECONDS
        with self.lock:
            self.store.mark_down("switch", error, time.time(), SWITCH_RETRY_SECONDS)

    def _reconcile(self, sw: Switch) -> None:
        """Make the switch's tables exactly what the store says (registers stay as they are)."""
        deletes = []
        for table in (admission.TABLE, result_rewrite.TABLE, l2_forward.TABLE, aggregator_address.TABLE):
            deletes += [sw.update("delete", e) for e in sw.read_table(table)]
        deletes += [sw.update("delete", e) for e in sw.read_multicast_groups()]
        sw.write(deletes)
        l2_forward.install(sw, self.topo)
        aggregator_address.install(sw, self.topo)
        with self.lock:
            records = [r for r in self.records.values() if r.mode == "switch"]
        for r in records:
            a = self._allocation(r)
            admission.install(sw, a)
            result_rewrite.install(sw, a)
        log.info("switch reconciled: %d switch allocations", len(records))

    def _allocation(self, r: Record) -> Allocation:
        workers = tuple(Worker(w["index"], self.topo.host(w["host"]), w["udp_port"]) for w in r.workers)
        return Allocation(r.job_id, r.generation, r.base, r.pool, workers)

    # ---- serving -------------------------------------------------------------------------

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
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
                with self.lock:
                    self._expire()
                self._flush()
                if time.monotonic() - began > 0.5:  # heartbeats queued meanwhile: no one's fault
                    self.stalled_until = time.monotonic()
        finally:
            self.close()

    def stop(self, *_: object) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGINT, self.stop)
        signal.signal(signal.SIGTERM, self.stop)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._close_transport()
        with self.switch_lock:
            if self.switch is not None:
                self.switch.close()
                self.switch = None
        with self.lock:
            self.store.close()

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

    def _reply(self, identity: bytes, reply: dict) -> None:
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

    def _in_pool(self, fn: Any, *args: Any) -> None:
        """Run ``fn`` on a pool thread; an exception there is logged, never lost silently."""
        def run() -> None:
            try:
                fn(*args)
            except Exception:
                log.exception("controller task %s failed", getattr(fn, "__name__", fn))
        self._pool.submit(run)

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
            if request.get("version") != PROTOCOL_VERSION:
                raise RequestError(f"unsupported protocol version {schema._show(request.get('version'))} "
                                   f"(this controller speaks {PROTOCOL_VERSION})")
            cmd = request.get("cmd")
            if not isinstance(cmd, str) or cmd not in OPERATOR_COMMANDS:
                raise RequestError(f"unknown command {schema._show(cmd)}")
            if cmd not in (OPERATOR_COMMANDS if role == "operator" else WORKER_COMMANDS):
                raise Unauthorized(f"{cmd} is for operators; this key is a {role}'s")
            self._dispatch(identity, cmd, request, role)
        except (RequestError, TopologyError) as e:
            self.refused["unauthorized" if isinstance(e, Unauthorized) else "invalid"] += 1
            self._reply(identity, {"ok": False, "error": str(e)})
        except Exception as e:  # a bug must not end a shared service: the sender learns, the log says
            self.refused["internal"] += 1
            log.exception("request %r failed", body.bytes[:200])
            self._reply(identity, {"ok": False, "error": f"internal error: {type(e).__name__}: {e}"})

    def _dispatch(self, identity: bytes, cmd: str, req: dict, role: str) -> None:
        if cmd in ("stats", "metrics"):  # they read aggregators: off this thread
            job_id = schema.integer(req, "job_id", 1, MAX_JOB_ID, default=None) if cmd == "stats" else None
            self._in_pool(self._answer_later, identity, self.stats if cmd == "stats" else self.metrics,
                          *((job_id,) if cmd == "stats" else ()))
            return
        with self.lock:
            if cmd == "join":
                self._join(identity, req)
                return  # answered when the group is complete
            if cmd == "leave":
                reply = self._leave(identity, req, role)
            elif cmd == "alive":
                reply = self._alive(req)
            elif cmd == "stuck":
                reply = self._stuck(identity, req)
            elif cmd == "report":
                reply = self._report(req)
            else:
                reply = self.status()
        if reply is not None:
            self._reply(identity, {"ok": True, **reply})

    def _answer_later(self, identity: bytes, fn: Any, *args: Any) -> None:
        try:
            reply = {"ok": True, **fn(*args)}
        except (RequestError, SwitchError, OSError) as e:
            reply = {"ok": False, "error": str(e)}
        self._reply(identity, reply)

    # ---- join ------------------------------------------------------------------------------

    def _join(self, identity: bytes, req: dict) -> None:
        name = schema.text(req, "job", schema.NAME, what="a job name (letters, digits, ._:/@+-, at most 200)")
        group = schema.integer(req, "group", 0, MAX_GROUP, default=0)
        workers = schema.integer(req, "workers", 1, MAX_WORKERS)
        worker = schema.integer(req, "worker", 0, workers - 1)
        host = schema.text(req, "host", schema.HOST, what="a host name or address")
        schema.integer(req, "udp_port", 1, 65535)
        pool = schema.integer(req, "pool", 1, self._largest_pool(), default=None)
        aggregator = schema.choice(req, "aggregator", AGGREGATOR_CHOICES, "any")
        secret = schema.text(req, "secret", schema.SECRET, what="the job's secret (32 to 128 hex digits)")
        self.topo.host(host)  # a clear error for an unknown host, now
        key = (name, group)
        if key in self.records or key in self.admitting:
            raise RequestError(f"job {name!r} group {group} is running; leave it first")
        pending = self.pending.get(key)
        if pending is None:
            if len(self.pending) >= MAX_PENDING:
                raise RequestError(f"{MAX_PENDING} groups are waiting for workers already; try again later")
            pending = PendingGroup(workers, pool, time.monotonic() + self.join_timeout, aggregator, digest(secret))
        elif not matches(secret, pending.secret):
            raise RequestError(f"job {name!r} group {group}: wrong job secret")
        if pending.workers != workers:
            raise RequestError(f"job {name!r} group {group} has {pending.workers} workers, not {workers}")
        if pending.aggregator != aggregator:
            raise RequestError(f"job {name!r} group {group} asked for aggregator {pending.aggregator!r}, "
                               f"not {aggregator!r}")
        if pending.pool != pool:
            raise RequestError(f"job {name!r} group {group} has pool {pending.pool or 'default'}, "
                               f"not {pool or 'default'}")
        if worker in pending.members:
            raise RequestError(f"worker {worker} of job {name!r} group {group} joined already")
        self.pending[key] = pending
        pending.members[worker] = (identity, req)
        self.last_seen[(name, group, worker)] = (time.monotonic(), 1.0)  # a join is a sign of life too
        if len(pending.members) < workers:
            return
        del self.pending[key]
        self.admitting.add(key)
        self._in_pool(self._admit, name, group, pending)

    def _largest_pool(self) -> int:
        """The largest pool any aggregator of the topology could give one group."""
        return max([self.topo.slots if self.topo.p4runtime else 0] + ([PS_SLOTS] if self.topo.ps else []))

    def _admit(self, name: str, group: int, pending: PendingGroup) -> None:
        """A complete group (pool thread): place it, then answer every worker, each with its token."""
        tokens = {w: new_secret() for w in pending.members}
        try:
            record, reason = self._allocate(name, group, pending, tokens)
        except Exception as e:  # whatever failed, every member of the group is answered
            if not isinstance(e, (RequestError, SwitchError, StoreError, OSError)):
                log.exception("job %s group %d: allocation failed", name, group)
            with self.lock:
                self.joins_failed += 1
                self.admitting.discard((name, group))
            for ident, _ in pending.members.values():
                self._reply(ident, {"ok": False, "error": f"job {name!r} group {group}: {e}"})
            return
        with self.lock:
            self.admitted[record.mode] += 1
            self.admitting.discard((name, group))
        for w, (ident, _) in pending.members.items():
            self._reply(ident, {"ok": True, **self._answer(record, reason), "worker": w, "token": tokens[w]})

    def _allocate(self, name: str, group: int, pending: PendingGroup, tokens: dict[int, str] | None = None,
                  exclude: frozenset[str] = frozenset(), workers: list[dict] | None = None) -> tuple[Record, str]:
        """Admit the group on the first aggregator that takes it, the whole group on one
        (``exclude``: aggregators not to try, such as the one a move leaves for being down).
        Runs on a pool thread: the lock is taken for the state only."""
        with self.lock:
            job_id, generation = self.store.claim_job_id(MAX_JOB_ID, busy=self.claimed | self.ending)
            self.claimed.add(job_id)
            order = self.candidates(job_id, pending.aggregator)
        try:
            if workers is None:
                assert tokens is not None
                workers = [{"index": w, "host": self.topo.host(str(req["host"])).name,
                            "udp_port": int(req["udp_port"]), "token": digest(tokens[w])}
                           for w, (_, req) in sorted(pending.members.items())]
            tried: list[str] = []
            for aggregator in order:
                if aggregator in exclude:
                    tried.append(f"{aggregator} is down")
                    continue
                try:
                    if aggregator == "switch":
                        record = self._allocate_switch(job_id, name, group, generation,
                                                       pending.pool or self.default_pool, workers)
                    else:
                        record = self._allocate_ps(self._ps(aggregator), job_id, name, group, generation,
                                                   pending.pool, workers)
                except AggregatorFailed as e:
                    tried.append(str(e))
                    continue
                if record.mode == "switch":
                    return record, "in-network aggregation on the switch"
                if pending.aggregator == "ps":
                    why = ["a software aggregator (PS), as the job asked"]
                elif self.topo.p4runtime is None:
                    why = ["no switch in the topology"]
                else:
                    why = []
                return record, "; ".join(why + tried)
            if not tried:
                raise RequestError("no aggregator can serve it: the topology has no switch and no PS fallback")
            raise RequestError("no aggregator can take the group: " + "; ".join(tried))
        finally:
            with self.lock:
                self.claimed.discard(job_id)

    def candidates(self, job_id: int, wanted: str) -> list[str]:
        """The aggregators to try for a group, in order: the one policy for choosing an aggregator.

        The switch first when the group may use it, then every PS of the topology, starting at
        job id mod their number (so groups spread over them); a PS that failed lately and is
        not yet due for a retry, or one whose liveness is being checked, goes last, still tried
        before the group is refused."""
        order = ["switch"] if wanted == "any" and self.topo.p4runtime is not None else []
        ps = [p.control for p in self.topo.ps]
        if ps:
            k = job_id % len(ps)
            order += ps[k:] + ps[:k]
        with self.lock:
            down, now = self.store.down(), time.time()
            suspect = set(self.suspect)
        # (the switch keeps its place: it fails at once while it is down, see _allocate_switch)
        resting = {a for a, (_, retry_at, _) in down.items() if retry_at > now and a != "switch"} | suspect
        return [a for a in order if a not in resting] + [a for a in order if a in resting]

    def _ps(self, control: str) -> PsEndpoint:
        return next(p for p in self.topo.ps if p.control == control)

    def _ps_keys(self, control: str) -> ClientKeys:
        """How the controller authenticates to a PS: its own key pair, the PS's public key."""
        ps = next((p for p in self.topo.ps if p.control == control), None)
        server = ps.public_key if ps is not None and ps.public_key is not None else self.aggregator_key
        if server is None:
            raise RequestError(f"no public key for PS {control}: the topology names none and the key "
                               "directory has no aggregator.key")
        return ClientKeys(server, self.keys.public, self.keys.secret)

    def ps_request(self, control: str, cmd: str, timeout: float = 5.0, **fields: Any) -> dict:
        """One request to a software aggregator's control channel (docs/protocol.md)."""
        reply = rpc.call(control, {"version": PS_CONTROL_VERSION, "cmd": cmd, **fields}, timeout,
                         self._ps_keys(control))
        if not reply.get("ok"):
            raise RequestError(f"software aggregator {control} refused {cmd}: {reply.get('error')}")
        return reply

    def _allocate_switch(self, job_id: int, name: str, group: int, generation: int, pool: int,
                         workers: list[dict]) -> Record:
        with self.switch_lock:
            if self.switch is None and time.monotonic() >= self._switch_retry_at:
                self.connect_switch()  # it may be back
            if self.switch is None:
                raise AggregatorFailed(f"switch unreachable: {self.switch_error}")
            with self.lock:
                try:
                    base = self.allocator.allocate(pool)
                except SlotsExhausted as e:
                    raise AggregatorFailed(f"switch slots exhausted: {e}") from None
            r = Record(job_id, name, group, "switch", generation, base, pool, workers,
                       {"data": f"{self.topo.aggregation_ip}:{UDP_PORT}"})
            a = self._allocation(r)
            try:
                admission.install(self.switch, a)
                result_rewrite.install(self.switch, a)
            except SwitchError as e:
                for remove in (admission.remove, result_rewrite.remove):  # what went in of it
                    try:
                        remove(self.switch, a)
                    except SwitchError:
                        pass
                with self.lock:
                    self.allocator.release(base)
                    self.store.mark_down("switch", str(e), time.time(), SWITCH_RETRY_SECONDS)
                raise AggregatorFailed(f"switch refused the group's entries: {e}") from None
        with self.lock:
            self._add(r)
            self.store.mark_up("switch")
        log.info("job %s group %d -> switch slots %d..%d (job id %d generation %d)", name, group, base,
                 base + pool - 1, job_id, generation)
        return r

    def _allocate_ps(self, ps: PsEndpoint, job_id: int, name: str, group: int, generation: int,
                     pool: int | None, workers: list[dict]) -> Record:
        addresses = [f"{self.topo.host(w['host']).ip}:{w['udp_port']}" for w in workers]
        base: int | None = None  # the slots, once allocated: released if the PS then fails
        try:
            lanes = ps.lanes(self.ps_request(ps.control, "ping"))  # the largest the PS and the path MTU take
            pool = pool or ps_pool(lanes, len(workers), self.default_pool)
            with self.lock:
                allocator = self.ps_allocators.setdefault(ps.control, SlotAllocator(PS_SLOTS))
                try:
                    base = allocator.allocate(pool)
                except SlotsExhausted as e:
                    raise AggregatorFailed(f"PS {ps.control}: {e}") from None
            self.ps_request(ps.control, "add_job",
                            job={"job": job_id, "base": base, "pool": pool, "workers": addresses,
                                 "generation": generation, "lanes": lanes})
        except (OSError, RequestError) as e:  # down (TimeoutError is an OSError), hanging, or refusing
            with self.lock:
                if base is not None:
                    allocator.release(base)
                self.store.mark_down(ps.control, str(e), time.time(), AGGREGATOR_RETRY_SECONDS)
            log.warning("PS %s failed to admit job %s group %d: %s", ps.control, name, group, e)
            raise AggregatorFailed(f"PS {ps.control}: {e}") from None
        r = Record(job_id, name, group, "ps", generation, base, pool, workers,
                   {"data": ps.data, "control": ps.control, "lanes": lanes})
        with self.lock:
            self.store.mark_up(ps.control)
            self._add(r)
        log.info("job %s group %d -> PS %s", name, group, ps.data)
        return r

    def _add(self, r: Record) -> None:
        self.store.add(r)
        self.records[(r.job_name, r.group)] = r

    # ---- a worker's own group: leave, heartbeats, reports -----------------------------------

    def _member(self, req: dict) -> tuple[Record, int]:
        """The running group and worker index a worker's request names, once its token matches."""
        name = schema.text(req, "job", schema.NAME, what="a job name")
        group = schema.integer(req, "group", 0, MAX_GROUP, default=0)
        worker = schema.integer(req, "worker", 0, MAX_WORKERS - 1)
        token = schema.text(req, "token", schema.SECRET, what="the worker's token from its join answer")
        r = self._running(name, group)
        if worker >= len(r.workers) or not matches(token, r.workers[worker].get("token", "")):
            raise RequestError(f"job {name!r} group {group}: no worker {worker} with this token")
        return r, worker

    def _leave(self, identity: bytes, req: dict, role: str) -> dict | None:
        """A worker's leave (with `worker` and its token) counts it out; the group is torn down
        when every worker has left, so nobody loses the slots while a slower peer still needs
        RESULTs. An operator's leave without `worker` tears the group down at once."""
        if req.get("worker") is None:
            if role != "operator":
                raise Unauthorized("a leave without a worker (ending the whole group) is for operators")
            r = self._running(schema.text(req, "job", schema.NAME, what="a job name"),
                              schema.integer(req, "group", 0, MAX_GROUP, default=0))
        else:
            r, worker = self._member(req)
            if req.get("stats") is not None:
                self.reports.setdefault(r.job_id, {})[worker] = schema.counters(req, "stats", REPORT_FIELDS)
            left = self.leaving.setdefault(r.job_id, set())
            left.add(worker)
            if len(left) < len(r.workers):
                return {"left": {"job": r.job_name, "group": r.group, "job_id": r.job_id, "worker": worker},
                        "remaining": sorted(set(range(len(r.workers))) - left)}
        self._begin_teardown(r)
        reply = {"ok": True, "left": {"job": r.job_name, "group": r.group, "job_id": r.job_id}, "remaining": []}
        self._in_pool(self._teardown_then_reply, r, identity, reply)
        return None

    def _teardown_then_reply(self, r: Record, identity: bytes, reply: dict) -> None:
        self._teardown(r)
        self._reply(identity, reply)

    def _running(self, name: str, group: int) -> Record:
        r = self.records.get((name, group))
        if r is None or r.job_id in self.ending:
            raise RequestError(f"job {name!r} group {group} is not running")
        return r

    def _begin_teardown(self, r: Record) -> None:
        """(lock held) From now on the group is not running for anybody; its state here goes (the
        heartbeats of a group being moved stay: its workers go on)."""
        self.ending.add(r.job_id)
        self.leaving.pop(r.job_id, None)
        if not any(key[:2] == (r.job_name, r.group) for key in self.moving):
            for w in range(len(r.workers)):
                self.last_seen.pop((r.job_name, r.group, w), None)
        self.stuck.pop((r.job_name, r.group, r.generation), None)

    def _teardown(self, r: Record, reachable: bool = True) -> None:
        """Free a group's allocation (pool thread): its entries or its PS job where the aggregator
        still answers (``reachable=False``: it is known dead, so nobody waits for it), its slots in
        any case. Its slots and job id are free only once the aggregator has let go of them."""
        with self.lock:
            self._begin_teardown(r)
        final = self._final_counters(r) if reachable else {}
        if r.mode == "switch":
            with self.switch_lock:
                if self.switch is not None and reachable:
                    a = self._allocation(r)
                    try:
                        admission.remove(self.switch, a)
                        result_rewrite.remove(self.switch, a)
                    except SwitchError as e:  # reconciliation removes them once the switch is back
                        log.warning("switch did not remove job id %d: %s", r.job_id, e)
        elif reachable:
            try:
                self.ps_request(r.aggregator["control"], "remove_job", job=r.job_id)
            except (OSError, RequestError) as e:  # a dead PS holds nothing: the group ends anyway
                with self.lock:
                    self.store.mark_down(r.aggregator["control"], str(e), time.time(), AGGREGATOR_RETRY_SECONDS)
                log.warning("PS %s did not remove job id %d: %s", r.aggregator["control"], r.job_id, e)
        with self.lock:
            metrics = self._group_metrics(r, final, running=False)
            self.reports.pop(r.job_id, None)
            (self.allocator if r.mode == "switch" else self.ps_allocators[r.aggregator["control"]]).release(r.base)
            self.store.remove(r.job_id)
            if self.records.get((r.job_name, r.group)) is r:
                del self.records[(r.job_name, r.group)]
            self.ending.discard(r.job_id)
            self.finished.append({**metrics, "ended": time.time()})  # for `metrics`, a while

    def _alive(self, req: dict) -> dict:
        every = schema.number(req, "every", 0.001, 60.0, default=1.0)
        try:
            r, worker = self._member(req)
            key = (r.job_name, r.group, worker)
        except RequestError:
            key = self._moving_member(req)  # a group being moved: its workers are alive all the same
            if key is None:
                raise
        self.last_seen[key] = (time.monotonic(), every)
        return {}

    def _moving_member(self, req: dict) -> tuple[str, int, int] | None:
        """(job, group, worker) of a worker of a group being moved, when its token says so."""
        name, group, worker = req.get("job"), req.get("group", 0), req.get("worker")
        token = req.get("token")
        for (job, grp, _), digests in self.moving_tokens.items():
            if (job, grp) == (name, group) and isinstance(worker, int) and 0 <= worker < len(digests) \
                    and isinstance(token, str) and matches(token, digests[worker]):
                return job, grp, worker
        return None

    def _report(self, req: dict) -> dict:
        """A worker's counters so far (cumulative); the latest one counts."""
        r, worker = self._member(req)
        self.reports.setdefault(r.job_id, {})[worker] = schema.counters(req, "stats", REPORT_FIELDS)
        return {}

    # ---- failover: heartbeats, silent groups, moves (docs/control.md) ------------------------

    def _presumed_dead(self, name: str, group: int, worker: int) -> bool:
        now = time.monotonic()
        # (a controller that was busy has not read the beats sent meanwhile: they count from the
        # end of that stall)
        when, every = self.last_seen.get((name, group, worker), (self.started, 1.0))
        return now - max(when, self.stalled_until) > DEAD_AFTER_BEATS * every

    def _stuck(self, identity: bytes, req: dict) -> dict | None:
        """A worker's aggregator has been silent: "wait" until every worker of the group says so (a
        slow peer is not a failure), then move the whole group at once; a peer whose heartbeats
        stopped ends the group instead. Every reporter of an allocation gets the same decision;
        those who report while it is being carried out get it when it is done."""
        generation = schema.integer(req, "generation", 0, 0xFFFF)
        call = schema.integer(req, "call", 0, 1 << 62)
        wanted = schema.choice(req, "aggregator", AGGREGATOR_CHOICES, "any")
        name = schema.text(req, "job", schema.NAME, what="a job name")
        group = schema.integer(req, "group", 0, MAX_GROUP, default=0)
        key = (name, group, generation)
        now = time.monotonic()
        for k, (when, _) in list(self.decided.items()):
            if now - when > DECISIONS_KEPT_SECONDS:
                del self.decided[k]
        if key in self.decided or key in self.moving:
            # the allocation is gone (moved or ended): its members' tokens still prove who asks
            worker = schema.integer(req, "worker", 0, MAX_WORKERS - 1)
            members = self.decided[key][1]["members"] if key in self.decided else self.moving_tokens[key]
            if worker >= len(members) or not matches(schema.text(req, "token", schema.SECRET, what="a token"),
                                                     members[worker]):
                raise RequestError(f"job {name!r} group {group}: no worker {worker} with this token")
            if key in self.moving:
                self.moving[key].append((identity, worker))
                return None
            return self._decision_for(self.decided[key][1], worker)
        r, worker = self._member(req)
        if r.generation != generation:
            raise RequestError(f"job {name!r} group {group} has no allocation of generation {generation}")
        reports = self.stuck.setdefault(key, {})
        reports[worker] = call
        missing = [w for w in range(len(r.workers)) if w not in reports]
        redo = min(reports.values())
        if missing:
            left = self.leaving.get(r.job_id, set())
            dead = [w for w in missing if w in left or self._presumed_dead(name, group, w)]
            if not dead:
                return {"state": "wait", "waiting_for": missing}
            why = ", ".join(f"worker {w} ({'left the group' if w in left else 'no heartbeat'})" for w in dead)
            decision = {"state": "failed", "redo": redo, "dead": dead,
                        "error": f"job {name!r} group {group}: {why}: the group is ended and its slots freed"}
            log.warning("job %s group %d: %s: ending the group", name, group, why)
            decide = lambda: (self._teardown(r), decision)[1]  # noqa: E731
        else:
            decide = lambda: self._move(r, wanted, redo)  # noqa: E731
        # From here the allocation is going: reporters wait for the decision, with the tokens they had.
        self.moving[key] = [(identity, worker)]
        self.moving_tokens[key] = [w.get("token", "") for w in r.workers]
        self._begin_teardown(r)
        self._in_pool(self._carry_out, key, r, decide)
        return None

    def _carry_out(self, key: tuple[str, int, int], r: Record, decide: Any) -> None:
        """(pool thread) Carry out a group's decision, then answer everyone who asked meanwhile."""
        try:
            decision = decide()
        except Exception as e:
            log.exception("job %s group %d: the decision could not be carried out", r.job_name, r.group)
            decision = {"state": "failed", "redo": 0, "dead": [],
                        "error": f"job {r.job_name!r} group {r.group}: the controller failed: {e}"}
        with self.lock:
            if decision["state"] == "failed":  # the group is gone: so are its heartbeats
                for w in range(len(r.workers)):
                    self.last_seen.pop((r.job_name, r.group, w), None)
            decision["members"] = self.moving_tokens.pop(key)
            self.decided[key] = (time.monotonic(), decision)
            self.stuck.pop(key, None)
            waiting = self.moving.pop(key)
        for identity, worker in waiting:
            self._reply(identity, {"ok": True, **self._decision_for(decision, worker)})

    @staticmethod
    def _decision_for(decision: dict, worker: int) -> dict:
        return {**{k: v for k, v in decision.items() if k != "members"}, "worker": worker}

    def _check(self, r: Record) -> str | None:
        """Why the group's aggregator is down, or None when it answers (pool thread)."""
        if r.mode == "switch":
            with self.switch_lock:
                if self.switch is None:
                    return f"switch unreachable: {self.switch_error}"
                try:
                    counters.totals(self.switch)
                except SwitchError as e:
                    self.switch.close()
                    self.switch, self.switch_error = None, str(e)
                    self._switch_retry_at = time.monotonic() + SWITCH_RETRY_SECONDS
                    return f"switch unreachable: {e}"
            return None
        try:
            self.ps_request(r.aggregator["control"], "ping", timeout=CHECK_TIMEOUT)
        except (OSError, RequestError) as e:
            return f"PS {r.aggregator['control']}: {e}"
        return None

    def _move(self, r: Record, wanted: str, redo: int) -> dict:
        """Every worker is stuck: a new allocation for the whole group, on the next aggregator
        that can serve (the same one when it still answers and comes first). Pool thread."""
        name = "switch" if r.mode == "switch" else r.aggregator["control"]
        with self.lock:
            self.suspect.add(name)
        try:
            down = self._check(r)
        finally:
            with self.lock:
                self.suspect.discard(name)
        if down is not None:
            with self.lock:
                self.store.mark_down(name, down, time.time(),
                                     SWITCH_RETRY_SECONDS if r.mode == "switch" else AGGREGATOR_RETRY_SECONDS)
        self._teardown(r, reachable=down is None)
        pending = PendingGroup(len(r.workers), r.pool, 0.0, wanted)
        why = down or f"{name} answers, but no RESULT reached any worker"
        try:
            new, reason = self._allocate(r.job_name, r.group, pending, workers=r.workers,
                                         exclude=frozenset([name]) if down is not None else frozenset())
        except (RequestError, SwitchError, StoreError, OSError) as e:
            with self.lock:
                self.joins_failed += 1
            log.warning("job %s group %d: silent aggregator (%s) and none to move to: %s", r.job_name, r.group,
                        why, e)
            return {"state": "failed", "redo": redo, "dead": [],
                    "error": f"job {r.job_name!r} group {r.group}: {why}; no aggregator left: {e}"}
        with self.lock:
            self.admitted[new.mode] += 1
        log.info("job %s group %d moved from %s (%s) to %s, redoing call %d", r.job_name, r.group, name, why,
                 new.aggregator["data"], redo)
        return {"state": "move", "redo": redo, **self._answer(new, reason=f"moved: {why}; now {reason}")}

    def _answer(self, record: Record, reason: str) -> dict:
        """The part of a join (or move) answer that is the same for every worker of the group."""
        host, port = record.aggregator["data"].rsplit(":", 1)
        return {"mode": record.mode, "reason": reason, "job": record.job_name, "group": record.group,
                "job_id": record.job_id, "generation": record.generation, "workers": len(record.workers),
                "pool": record.pool, "lanes": record.aggregator.get("lanes", self.topo.lanes),
                "aggregators": [{"host": host, "port": int(port), "pool": record.pool}]}

    def _expire(self) -> None:
        now = time.monotonic()
        for key, pending in list(self.pending.items()):
            if now > pending.deadline:
                del self.pending[key]
                missing = sorted(set(range(pending.workers)) - set(pending.members))
                for w in pending.members:
                    self.last_seen.pop((key[0], key[1], w), None)
                for ident, _ in pending.members.values():
                    self._reply(ident, {"ok": False, "error": f"job {key[0]!r} group {key[1]}: workers {missing} "
                                                              f"did not join within {self.join_timeout:g} s"})

    # ---- status and counters (operators) -----------------------------------------------------

    def idle(self) -> bool:
        """No group is running, being placed or ended, or waiting for workers."""
        with self.lock:
            return not (self.records or self.pending or self.admitting or self.ending)

    def status(self) -> dict[str, Any]:
        with self.lock:
            return {
                "switch": "connected" if self.switch is not None else f"unavailable: {self.switch_error}",
                "slots": self.allocator.slots, "free_slots": self.allocator.free(),
                "free_ranges": self.allocator.free_ranges(),
                "jobs": [{"job": r.job_name, "group": r.group, "job_id": r.job_id, "mode": r.mode, "base": r.base,
                          "pool": r.pool, "generation": r.generation, "workers": len(r.workers),
                          "aggregator": r.aggregator["data"]} for r in self._running_records()],
                "pending": [{"job": k[0], "group": k[1], "joined": sorted(p.members), "workers": p.workers}
                            for k, p in self.pending.items()],
                "aggregators": self.aggregators(),
                "refused": dict(self.refused),
            }

    def _running_records(self) -> list[Record]:
        return sorted((r for r in self.records.values() if r.job_id not in self.ending), key=lambda r: r.job_id)

    def aggregators(self) -> list[dict[str, Any]]:
        """Every aggregator of the topology: up, or down since when and why (from the store)."""
        with self.lock:
            down = self.store.down()
        out = []
        names = (["switch"] if self.topo.p4runtime is not None else []) + [p.control for p in self.topo.ps]
        for name in names:
            entry: dict[str, Any] = {"aggregator": name, "state": "up"}
            if name == "switch" and self.switch is None:
                entry.update(state="down", reason=self.switch_error)
            if name in down:
                since, retry_at, reason = down[name]
                entry.update(state="down", since=since, retry_at=retry_at, reason=reason)
            out.append(entry)
        return out

    def stats(self, job_id: int | None = None) -> dict[str, Any]:
        """The aggregators' counters of every running group (or one), read now. A PS that does not
        answer is named with its error, and the rest are still read."""
        out: dict[str, Any] = {}
        with self.lock:
            records = [r for r in self._running_records() if job_id is None or r.job_id == job_id]
        switch_read = self._read_switch() if any(r.mode == "switch" for r in records) or job_id is None else None
        if switch_read is not None:
            out["switch_totals"] = counters.totals_of(switch_read)
        ps_jobs, ps_errors = self._read_ps(records)
        for r in records:
            if r.mode == "switch":
                if switch_read is not None:
                    out[str(r.job_id)] = counters.job_counters(switch_read, r.job_id)
            elif r.aggregator["control"] in ps_errors:
                out[str(r.job_id)] = {"error": ps_errors[r.aggregator["control"]]}
            else:
                out[str(r.job_id)] = ps_jobs[r.aggregator["control"]].get(str(r.job_id), {})
        return out

    def _read_switch(self) -> dict[str, dict[int, int]] | None:
        with self.switch_lock:
            if self.switch is None:
                return None
            try:
                return counters.read_all(self.switch)
            except SwitchError as e:
                log.warning("reading the switch's counters: %s", e)
                return None

    def _read_ps(self, records: list[Record]) -> tuple[dict[str, dict], dict[str, str]]:
        """The counters of every PS that holds one of ``records``: (answers, errors) by control endpoint."""
        answers: dict[str, dict] = {}
        errors: dict[str, str] = {}
        for control in sorted({r.aggregator["control"] for r in records if r.mode == "ps"}):
            try:
                answers[control] = self.ps_request(control, "stats", timeout=CHECK_TIMEOUT)["jobs"]
            except (OSError, RequestError) as e:  # a PS that does not answer shows no counters, the rest do
                errors[control] = str(e)
                log.warning("PS %s: %s", control, e)
        return answers, errors

    def metrics(self) -> dict[str, Any]:
        """Everything the Prometheus endpoint and `passing-ctl top` show (docs/control.md, metrics):
        the aggregators with their slots, every running group (and those finished in the last
        FINISHED_RETENTION s) with its aggregator's counters and its workers' reports."""
        now = time.time()
        with self.lock:
            self.finished = [g for g in self.finished if now - g["ended"] < FINISHED_RETENTION]
            records = self._running_records()
        switch_read = self._read_switch() if any(r.mode == "switch" for r in records) else None
        ps_jobs, _ = self._read_ps(records)
        with self.lock:
            groups = []
            for r in records:
                if r.mode == "switch":
                    job_counters = counters.job_counters(switch_read, r.job_id) if switch_read is not None else {}
                else:
                    job_counters = ps_jobs.get(r.aggregator["control"], {}).get(str(r.job_id), {})
                groups.append(self._group_metrics(r, job_counters, running=True))
            slots = []
            for entry in self.aggregators():
                name = entry["aggregator"]
                allocator = self.allocator if name == "switch" else self.ps_allocators[name]
                slots.append({**entry, "kind": "switch" if name == "switch" else "ps", "slots": allocator.slots,
                              "free_slots": allocator.free()})
            out: dict[str, Any] = {
                "time": now, "aggregators": slots, "groups": groups + self.finished,
                "pending": len(self.pending), "admitted": dict(self.admitted), "joins_failed": self.joins_failed,
                "refused": dict(self.refused),
            }
        if switch_read is not None:
            out["switch_totals"] = counters.totals_of(switch_read)
        return out

    def _group_metrics(self, r: Record, job_counters: dict[str, int], running: bool) -> dict[str, Any]:
        return {"job": r.job_name, "group": r.group, "job_id": r.job_id, "generation": r.generation,
                "mode": r.mode, "aggregator": r.aggregator.get("control", "switch"), "pool": r.pool,
                "workers": len(r.workers), "running": running, "counters": job_counters,
                "hosts": {str(w): stats for w, stats in sorted(self.reports.get(r.job_id, {}).items())}}

    def _final_counters(self, r: Record) -> dict[str, int]:
        """The group's aggregator counters as it ends (for `metrics`); {} when they cannot be read."""
        try:
            if r.mode == "switch":
                with self.switch_lock:
                    return counters.for_job(self.switch, r.job_id) if self.switch is not None else {}
            # a live PS answers in milliseconds; a dead one must not hold the teardown for long
            return self.ps_request(r.aggregator["control"], "stats", timeout=1.0, job=r.job_id)["jobs"][str(r.job_id)]
        except (OSError, RequestError, SwitchError, KeyError) as e:
            log.info("final counters of job id %d: %s", r.job_id, e)
            return {}
