"""The controller service: hosts join and leave job groups over ZeroMQ (docs/control.md).

One thread, one ROUTER socket: a join is answered only when every worker of its group
has joined (or its wait times out), so replies are deferred per request. A group gets a
slot range on the switch when the switch is reachable and has room; otherwise it gets a
software aggregator (PS fallback), and the answer says so and why.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from . import admission, aggregator_address, counters, l2_forward, result_rewrite, rpc
from .allocation import MAX_JOB_ID, Allocation, Worker
from .allocator import SlotAllocator, SlotsExhausted
from .p4runtime import Pipeline, SwitchError, connect
from .store import Record, Store, StoreError
from .topology import PsEndpoint, Topology, TopologyError

if TYPE_CHECKING:
    from .session import Switch

log = logging.getLogger("passing_controller")

PROTOCOL_VERSION = 2  # 2: the join answer carries the allocation's generation
PS_CONTROL_VERSION = 2  # the software aggregator's control channel (docs/protocol.md)
UDP_PORT = 9877  # docs/protocol.md: the aggregator's PASSING port
MAX_WORKERS = 32
SWITCH_RETRY_SECONDS = 30.0  # a switch that was unavailable is tried again at a join after this long
AGGREGATOR_RETRY_SECONDS = 30.0  # a PS that failed goes last in the order for this long
AGGREGATOR_CHOICES = ("any", "ps")  # a join's "aggregator": the PS and PSRing baselines ask for "ps"
FINISHED_RETENTION = 300.0  # s a finished group stays in `metrics`, so a scrape sees its final counters
REPORT_FIELDS = ("packets_sent", "bytes_sent", "packets_received", "bytes_received", "retransmissions",
                 "early_retransmissions", "calls", "call_seconds")  # what a worker reports (docs/control.md)
DEAD_AFTER_BEATS = 3  # a worker whose heartbeats stopped this many intervals ago is presumed dead
CHECK_TIMEOUT = 2.0  # seconds the liveness check of a silent aggregator may take
DECISIONS_KEPT_SECONDS = 600.0  # a move's decision is answered to late reporters this long


class RequestError(ValueError):
    """A request the controller refuses; the text goes back to the host."""


class AggregatorFailed(RuntimeError):
    """One aggregator could not take a group (the text says which and why); the next one is tried."""


@dataclass
class PendingGroup:
    workers: int
    pool: int
    deadline: float
    aggregator: str  # "any": the switch when it can serve, else a PS; "ps": a PS in any case
    members: dict[int, tuple[bytes, dict]] = field(default_factory=dict)  # worker -> (identity, request)


class Controller:
    def __init__(self, topology: Topology, pipeline: Pipeline | None, store: str | Path, listen: str,
                 join_timeout: float = 60.0, default_pool: int = 256, switch_timeout: float = 5.0) -> None:
        self.topo = topology
        self.pipeline = pipeline
        self.store = Store(store)
        self.join_timeout, self.default_pool, self.switch_timeout = join_timeout, default_pool, switch_timeout
        self.allocator = SlotAllocator(topology.slots)
        self.ps_allocators = {ps.control: SlotAllocator(4096) for ps in topology.ps}
        self.switch: Switch | None = None
        self.switch_error: str | None = None
        self._switch_retry_at = 0.0
        self.pending: dict[tuple[str, int], PendingGroup] = {}
        self.leaving: dict[int, set[int]] = {}  # job id -> workers that left (the group goes when all have)
        # For `metrics` (memory only: counters restart with the controller, as Prometheus expects):
        self.reports: dict[int, dict[int, dict[str, float]]] = {}  # job id -> worker -> its latest report
        self.finished: list[dict[str, Any]] = []  # groups torn down lately, with their final counters
        self.admitted = {"switch": 0, "ps": 0}  # groups allocated since start (joins and moves), by mode
        self.joins_failed = 0  # groups no aggregator could take since start (joins and moves)
        # failover (docs/control.md): heartbeats, the reports of silent groups, and what was decided
        self.started = self.stalled_until = time.monotonic()  # heartbeats count from the later of these
        self.last_seen: dict[tuple[str, int, int], tuple[float, float]] = {}  # worker -> (when, interval)
        self.stuck: dict[tuple[str, int, int], dict[int, int]] = {}  # (job, group, generation) -> worker -> call
        self.decided: dict[tuple[str, int, int], tuple[float, dict]] = {}  # same key -> (when, decision)
        for r in self.store.all():
            (self.allocator if r.mode == "switch" else self.ps_allocators.setdefault(
                r.aggregator["control"], SlotAllocator(4096))).reserve(r.base, r.pool)
        self.connect_switch()
        self._ctx = zmq.Context.instance()
        self.socket = self._ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(listen)
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.inproc = f"inproc://passing-controller-{id(self)}"  # the metrics endpoint's way in, same thread
        self.socket.bind(self.inproc)
        self._stop = threading.Event()

    # ---- the switch ----------------------------------------------------------------------

    def connect_switch(self) -> None:
        """Connect, then either load the pipeline (a fresh switch) or reconcile with it."""
        if self.topo.p4runtime is None:
            self.switch, self.switch_error = None, "no switch in the topology (PS only)"
            self._switch_retry_at = float("inf")
            return
        try:
            sw = connect(self.topo.p4runtime, self.topo.device_id, timeout=self.switch_timeout)
        except SwitchError as e:
            self.switch, self.switch_error = None, str(e)
            self._switch_retry_at = time.monotonic() + SWITCH_RETRY_SECONDS
            self.store.mark_down("switch", str(e), time.time(), SWITCH_RETRY_SECONDS)
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
            self.switch, self.switch_error = None, str(e)
            self._switch_retry_at = time.monotonic() + SWITCH_RETRY_SECONDS
            self.store.mark_down("switch", str(e), time.time(), SWITCH_RETRY_SECONDS)
            log.warning("switch unusable, PS fallback only: %s", e)
            return
        self.switch, self.switch_error = sw, None
        self.store.mark_up("switch")

    def _reconcile(self, sw: Switch) -> None:
        """Make the switch's tables exactly what the store says (registers stay as they are)."""
        deletes = []
        for table in (admission.TABLE, result_rewrite.TABLE, l2_forward.TABLE, aggregator_address.TABLE):
            deletes += [sw.update("delete", e) for e in sw.read_table(table)]
        deletes += [sw.update("delete", e) for e in sw.read_multicast_groups()]
        sw.write(deletes)
        l2_forward.install(sw, self.topo)
        aggregator_address.install(sw, self.topo)
        for r in self.store.all():
            if r.mode == "switch":
                a = self._allocation(r)
                admission.install(sw, a)
                result_rewrite.install(sw, a)
        log.info("switch reconciled: %d switch allocations", sum(r.mode == "switch" for r in self.store.all()))

    def _allocation(self, r: Record) -> Allocation:
        workers = tuple(Worker(w["index"], self.topo.host(w["host"]), w["udp_port"]) for w in r.workers)
        return Allocation(r.job_id, r.generation, r.base, r.pool, workers)

    # ---- requests ------------------------------------------------------------------------

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if dict(poller.poll(100)).get(self.socket):
                    identity, _, raw = self.socket.recv_multipart()
                    began = time.monotonic()
                    self._handle(identity, raw)
                    if time.monotonic() - began > 0.5:  # heartbeats queued meanwhile: no one's fault
                        self.stalled_until = time.monotonic()
                self._expire()
        finally:
            self.close()

    def stop(self, *_: object) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGINT, self.stop)
        signal.signal(signal.SIGTERM, self.stop)

    def close(self) -> None:
        self.socket.close()
        if self.switch is not None:
            self.switch.close()
        self.store.close()

    def _reply(self, identity: bytes, reply: dict) -> None:
        self.socket.send_multipart([identity, b"", json.dumps(reply).encode()])

    def _handle(self, identity: bytes, raw: bytes) -> None:
        try:
            request = json.loads(raw)
            if not isinstance(request, dict):
                raise RequestError("a request must be a JSON object")
            if request.get("version") != PROTOCOL_VERSION:
                raise RequestError(f"unsupported protocol version {request.get('version')!r} "
                                   f"(this controller speaks {PROTOCOL_VERSION})")
            cmd = request.get("cmd")
            if cmd == "join":
                self._join(identity, request)
                return  # answered when the group is complete
            if cmd == "leave":
                reply = self._leave(request)
            elif cmd == "alive":
                reply = self._alive(request)
            elif cmd == "stuck":
                reply = self._stuck(request)
            elif cmd == "status":
                reply = self.status()
            elif cmd == "stats":
                reply = self.stats(request.get("job_id"))
            elif cmd == "report":
                reply = self._report(request)
            elif cmd == "metrics":
                reply = self.metrics()
            else:
                raise RequestError(f"unknown command {cmd!r}")
            self._reply(identity, {"ok": True, **reply})
        except (RequestError, TopologyError, SwitchError, json.JSONDecodeError, UnicodeDecodeError, KeyError,
                TypeError, ValueError) as e:
            self._reply(identity, {"ok": False, "error": str(e)})

    def _join(self, identity: bytes, req: dict) -> None:
        name, group, worker, workers = str(req["job"]), int(req.get("group", 0)), int(req["worker"]), \
            int(req["workers"])
        if not 1 <= workers <= MAX_WORKERS or not 0 <= worker < workers:
            raise RequestError(f"worker {worker} of {workers}: need 0 <= worker < workers <= {MAX_WORKERS}")
        self.topo.host(str(req["host"]))  # a clear error for an unknown host, now
        if not 0 < int(req["udp_port"]) < 65536:
            raise RequestError(f"bad udp_port {req['udp_port']}")
        if self._record(name, group) is not None:
            raise RequestError(f"job {name!r} group {group} is running; leave it first")
        aggregator = str(req.get("aggregator", "any"))
        if aggregator not in AGGREGATOR_CHOICES:
            raise RequestError(f"aggregator must be one of {AGGREGATOR_CHOICES}, got {aggregator!r}")
        key = (name, group)
        pending = self.pending.setdefault(key, PendingGroup(
            workers, int(req.get("pool", self.default_pool)), time.monotonic() + self.join_timeout, aggregator))
        if pending.workers != workers:
            raise RequestError(f"job {name!r} group {group} has {pending.workers} workers, not {workers}")
        if pending.aggregator != aggregator:
            raise RequestError(f"job {name!r} group {group} asked for aggregator {pending.aggregator!r}, "
                               f"not {aggregator!r}")
        if worker in pending.members:
            raise RequestError(f"worker {worker} of job {name!r} group {group} joined already")
        pending.members[worker] = (identity, req)
        self.last_seen[(name, group, worker)] = (time.monotonic(), 1.0)  # a join is a sign of life too
        if len(pending.members) < workers:
            return
        del self.pending[key]
        try:
            record, reason = self._allocate(name, group, pending)
        except (RequestError, SwitchError, StoreError, OSError) as e:
            self.joins_failed += 1
            for ident, _ in pending.members.values():
                self._reply(ident, {"ok": False, "error": f"job {name!r} group {group}: {e}"})
            return
        self.admitted[record.mode] += 1
        for w, (ident, _) in pending.members.items():
            self._reply(ident, {"ok": True, **self._answer(record, reason), "worker": w})

    def _allocate(self, name: str, group: int, pending: PendingGroup,
                  exclude: frozenset[str] = frozenset()) -> tuple[Record, str]:
        """Admit the group on the first aggregator that takes it, the whole group on one
        (``exclude``: aggregators not to try, such as the one a move leaves for being down)."""
        job_id, generation = self.store.claim_job_id(MAX_JOB_ID)
        workers = [{"index": w, "host": self.topo.host(str(req["host"])).name, "udp_port": int(req["udp_port"])}
                   for w, (_, req) in sorted(pending.members.items())]
        tried: list[str] = []
        for aggregator in self.candidates(job_id, pending.aggregator):
            if aggregator in exclude:
                tried.append(f"{aggregator} is down")
                continue
            try:
                if aggregator == "switch":
                    record = self._allocate_switch(job_id, name, group, generation, pending.pool, workers)
                else:
                    record = self._allocate_ps(self._ps(aggregator), job_id, name, group, generation, pending.pool,
                                               workers)
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

    def candidates(self, job_id: int, wanted: str) -> list[str]:
        """The aggregators to try for a group, in order: the one policy for choosing an aggregator.

        The switch first when the group may use it, then every PS of the topology, starting at
        job id mod their number (so groups spread over them); a PS that failed lately and is
        not yet due for a retry goes last, still tried before the group is refused."""
        order = ["switch"] if wanted == "any" and self.topo.p4runtime is not None else []
        ps = [p.control for p in self.topo.ps]
        if ps:
            k = job_id % len(ps)
            order += ps[k:] + ps[:k]
        down, now = self.store.down(), time.time()
        # (the switch keeps its place: it fails at once while it is down, see _allocate_switch)
        resting = {a for a, (_, retry_at, _) in down.items() if retry_at > now and a != "switch"}
        return [a for a in order if a not in resting] + [a for a in order if a in resting]

    def _ps(self, control: str) -> PsEndpoint:
        return next(p for p in self.topo.ps if p.control == control)

    def _allocate_switch(self, job_id: int, name: str, group: int, generation: int, pool: int,
                         workers: list[dict]) -> Record:
        if self.switch is None and time.monotonic() >= self._switch_retry_at:
            self.connect_switch()  # it may be back
        if self.switch is None:
            raise AggregatorFailed(f"switch unreachable: {self.switch_error}")
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
            self.allocator.release(base)
            for remove in (admission.remove, result_rewrite.remove):  # what went in of it
                try:
                    remove(self.switch, a)
                except SwitchError:
                    pass
            self.store.mark_down("switch", str(e), time.time(), SWITCH_RETRY_SECONDS)
            raise AggregatorFailed(f"switch refused the group's entries: {e}") from None
        self.store.add(r)
        self.store.mark_up("switch")
        log.info("job %s group %d -> switch slots %d..%d (job id %d generation %d)", name, group, base,
                 base + pool - 1, job_id, generation)
        return r

    def _allocate_ps(self, ps: PsEndpoint, job_id: int, name: str, group: int, generation: int, pool: int,
                     workers: list[dict]) -> Record:
        allocator = self.ps_allocators.setdefault(ps.control, SlotAllocator(4096))
        try:
            base = allocator.allocate(pool)
        except SlotsExhausted as e:
            raise AggregatorFailed(f"PS {ps.control}: {e}") from None
        addresses = [f"{self.topo.host(w['host']).ip}:{w['udp_port']}" for w in workers]
        try:
            lanes = ps.lanes(ps_request(ps.control, "ping"))  # the largest that the PS and the path MTU take
            ps_request(ps.control, "add_job",
                       job={"job": job_id, "base": base, "pool": pool, "workers": addresses,
                            "generation": generation, "lanes": lanes})
        except (OSError, RequestError) as e:  # down (TimeoutError is an OSError), hanging, or refusing
            allocator.release(base)
            self.store.mark_down(ps.control, str(e), time.time(), AGGREGATOR_RETRY_SECONDS)
            log.warning("PS %s failed to admit job %s group %d: %s", ps.control, name, group, e)
            raise AggregatorFailed(f"PS {ps.control}: {e}") from None
        self.store.mark_up(ps.control)
        r = Record(job_id, name, group, "ps", generation, base, pool, workers,
                   {"data": ps.data, "control": ps.control, "lanes": lanes})
        self.store.add(r)
        log.info("job %s group %d -> PS %s", name, group, ps.data)
        return r

    def _leave(self, req: dict) -> dict:
        """A worker's leave (with `worker`) counts it out; the group is torn down when every
        worker has left, so nobody loses the slots while a slower peer still needs RESULTs.
        A leave without `worker` (the operator's) tears the group down at once."""
        name, group = str(req["job"]), int(req.get("group", 0))
        r = self._running(name, group)
        if req.get("worker") is not None:
            worker = self._worker_of(r, int(req["worker"]))
            if req.get("stats") is not None:
                self.reports.setdefault(r.job_id, {})[worker] = _report_stats(req["stats"])
            left = self.leaving.setdefault(r.job_id, set())
            left.add(worker)
            if len(left) < len(r.workers):
                return {"left": {"job": name, "group": group, "job_id": r.job_id, "worker": worker},
                        "remaining": sorted(set(range(len(r.workers))) - left)}
        self._teardown(r)
        return {"left": {"job": name, "group": group, "job_id": r.job_id}, "remaining": []}

    def _record(self, name: str, group: int) -> Record | None:
        """The allocation of job ``name``'s group ``group``, if it runs."""
        return next((r for r in self.store.all() if r.job_name == name and r.group == group), None)

    def _running(self, name: str, group: int) -> Record:
        r = self._record(name, group)
        if r is None:
            raise RequestError(f"job {name!r} group {group} is not running")
        return r

    @staticmethod
    def _worker_of(r: Record, worker: int) -> int:
        if not 0 <= worker < len(r.workers):
            raise RequestError(f"job {r.job_name!r} group {r.group} has no worker {worker}")
        return worker

    def _teardown(self, r: Record, reachable: bool = True) -> None:
        """Free a group's allocation: its entries or its PS job where the aggregator still answers
        (``reachable=False``: it is known dead, so nobody waits for it), its slots in any case."""
        self.leaving.pop(r.job_id, None)
        final = self._group_metrics(r, self._final_counters(r) if reachable else {}, running=False)
        self.reports.pop(r.job_id, None)
        if r.mode == "switch":
            if self.switch is not None and reachable:
                a = self._allocation(r)
                try:
                    admission.remove(self.switch, a)
                    result_rewrite.remove(self.switch, a)
                except SwitchError as e:  # reconciliation removes them once the switch is back
                    log.warning("switch did not remove job id %d: %s", r.job_id, e)
            self.allocator.release(r.base)
        else:
            if reachable:
                try:
                    ps_request(r.aggregator["control"], "remove_job", job=r.job_id)
                except (OSError, RequestError) as e:  # a dead PS holds nothing: the group ends anyway
                    self.store.mark_down(r.aggregator["control"], str(e), time.time(), AGGREGATOR_RETRY_SECONDS)
                    log.warning("PS %s did not remove job id %d: %s", r.aggregator["control"], r.job_id, e)
            self.ps_allocators[r.aggregator["control"]].release(r.base)
        self.store.remove(r.job_id)
        self.finished.append({**final, "ended": time.time()})  # for `metrics`, a while

    # ---- failover: heartbeats, silent groups, moves (docs/control.md) ------------------------

    def _alive(self, req: dict) -> dict:
        every = float(req.get("every", 1.0))
        if not 0 < every <= 60:
            raise RequestError(f"heartbeat interval {every} outside (0, 60] s")
        self.last_seen[(str(req["job"]), int(req.get("group", 0)), int(req["worker"]))] = (time.monotonic(), every)
        return {}

    def _presumed_dead(self, name: str, group: int, worker: int) -> bool:
        now = time.monotonic()
        # (a controller that was busy, e.g. checking a dead aggregator, has not read the beats sent
        # meanwhile: they count from the end of that stall)
        when, every = self.last_seen.get((name, group, worker), (self.started, 1.0))
        return now - max(when, self.stalled_until) > DEAD_AFTER_BEATS * every

    def _stuck(self, req: dict) -> dict:
        """A worker's aggregator has been silent: "wait" until every worker of the group says so (a
        slow peer is not a failure), then move the whole group at once; a peer whose heartbeats
        stopped ends the group instead. Every reporter of an allocation gets the same decision."""
        name, group, worker = str(req["job"]), int(req.get("group", 0)), int(req["worker"])
        generation, call = int(req["generation"]), int(req["call"])
        wanted = str(req.get("aggregator", "any"))
        if wanted not in AGGREGATOR_CHOICES:
            raise RequestError(f"aggregator must be one of {AGGREGATOR_CHOICES}, got {wanted!r}")
        if call < 0:
            raise RequestError(f"bad call index {call}")
        key = (name, group, generation)
        now = time.monotonic()
        for k, (when, _) in list(self.decided.items()):
            if now - when > DECISIONS_KEPT_SECONDS:
                del self.decided[k]
        if key in self.decided:
            return {**self.decided[key][1], "worker": worker}
        r = self._record(name, group)
        if r is None or r.generation != generation:
            raise RequestError(f"job {name!r} group {group} has no allocation of generation {generation}")
        self._worker_of(r, worker)
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
            self._teardown(r)
        else:
            decision = self._move(r, wanted, redo)
        del self.stuck[key]
        self.decided[key] = (now, decision)
        return {**decision, "worker": worker}

    def _check(self, r: Record) -> str | None:
        """Why the group's aggregator is down, or None when it answers."""
        if r.mode == "switch":
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
            ps_request(r.aggregator["control"], "ping", timeout=CHECK_TIMEOUT)
        except (OSError, RequestError) as e:
            return f"PS {r.aggregator['control']}: {e}"
        return None

    def _move(self, r: Record, wanted: str, redo: int) -> dict:
        """Every worker is stuck: a new allocation for the whole group, on the next aggregator
        that can serve (the same one when it still answers and comes first)."""
        down = self._check(r)
        name = "switch" if r.mode == "switch" else r.aggregator["control"]
        if down is not None:
            self.store.mark_down(name, down, time.time(),
                                 SWITCH_RETRY_SECONDS if r.mode == "switch" else AGGREGATOR_RETRY_SECONDS)
        self._teardown(r, reachable=down is None)
        pending = PendingGroup(len(r.workers), r.pool, 0.0, wanted, {
            w["index"]: (b"", {"host": w["host"], "udp_port": w["udp_port"]}) for w in r.workers})
        why = down or f"{name} answers, but no RESULT reached any worker"
        try:
            new, reason = self._allocate(r.job_name, r.group, pending,
                                         exclude=frozenset([name]) if down is not None else frozenset())
        except (RequestError, SwitchError, StoreError, OSError) as e:
            self.joins_failed += 1
            log.warning("job %s group %d: silent aggregator (%s) and none to move to: %s", r.job_name, r.group,
                        why, e)
            return {"state": "failed", "redo": redo, "dead": [],
                    "error": f"job {r.job_name!r} group {r.group}: {why}; no aggregator left: {e}"}
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

    def _report(self, req: dict) -> dict:
        """A worker's counters so far (cumulative); the latest one counts."""
        name, group, worker = str(req["job"]), int(req.get("group", 0)), int(req["worker"])
        r = self._running(name, group)
        self.reports.setdefault(r.job_id, {})[self._worker_of(r, worker)] = _report_stats(req["stats"])
        return {}

    def _expire(self) -> None:
        now = time.monotonic()
        for key, pending in list(self.pending.items()):
            if now > pending.deadline:
                del self.pending[key]
                missing = sorted(set(range(pending.workers)) - set(pending.members))
                for ident, _ in pending.members.values():
                    self._reply(ident, {"ok": False, "error": f"job {key[0]!r} group {key[1]}: workers {missing} "
                                                              f"did not join within {self.join_timeout:g} s"})

    # ---- status and counters ---------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {
            "switch": "connected" if self.switch is not None else f"unavailable: {self.switch_error}",
            "slots": self.allocator.slots, "free_slots": self.allocator.free(),
            "free_ranges": self.allocator.free_ranges(),
            "jobs": [{"job": r.job_name, "group": r.group, "job_id": r.job_id, "mode": r.mode, "base": r.base,
                      "pool": r.pool, "generation": r.generation, "workers": len(r.workers),
                      "aggregator": r.aggregator["data"]} for r in self.store.all()],
            "pending": [{"job": k[0], "group": k[1], "joined": sorted(p.members), "workers": p.workers}
                        for k, p in self.pending.items()],
            "aggregators": self.aggregators(),
        }

    def aggregators(self) -> list[dict[str, Any]]:
        """Every aggregator of the topology: up, or down since when and why (from the store)."""
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

    def stats(self, job_id: int | None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.switch is not None:
            out["switch_totals"] = counters.totals(self.switch)
        for r in self.store.all():
            if job_id is not None and r.job_id != int(job_id):
                continue
            if r.mode == "switch" and self.switch is not None:
                out[str(r.job_id)] = counters.for_job(self.switch, r.job_id)
            elif r.mode == "ps":
                out[str(r.job_id)] = ps_request(r.aggregator["control"], "stats", job=r.job_id)["jobs"][str(r.job_id)]
        return out

    def metrics(self) -> dict[str, Any]:
        """Everything the Prometheus endpoint and `passing-ctl top` show (docs/control.md, metrics):
        the aggregators with their slots, every running group (and those finished in the last
        FINISHED_RETENTION s) with its aggregator's counters and its workers' reports."""
        now = time.time()
        self.finished = [g for g in self.finished if now - g["ended"] < FINISHED_RETENTION]
        records = self.store.all()
        switch_read: dict[str, dict[int, int]] | None = None
        if self.switch is not None and any(r.mode == "switch" for r in records):
            try:
                switch_read = counters.read_all(self.switch)
            except SwitchError as e:
                log.warning("metrics: reading the switch's counters: %s", e)
        ps_jobs: dict[str, dict[str, dict[str, int]]] = {}
        for control in {r.aggregator["control"] for r in records if r.mode == "ps"}:
            try:
                ps_jobs[control] = ps_request(control, "stats")["jobs"]
            except (OSError, RequestError) as e:  # a PS that does not answer shows no counters, the rest do
                log.warning("metrics: PS %s: %s", control, e)
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
                return counters.for_job(self.switch, r.job_id) if self.switch is not None else {}
            # a live PS answers in milliseconds; a dead one must not hold the teardown for long
            return ps_request(r.aggregator["control"], "stats", timeout=1.0, job=r.job_id)["jobs"][str(r.job_id)]
        except (OSError, RequestError, SwitchError, KeyError) as e:
            log.info("final counters of job id %d: %s", r.job_id, e)
            return {}


def _report_stats(stats: Any) -> dict[str, float]:
    if not isinstance(stats, dict):
        raise RequestError("stats must be an object of counters")
    return {k: float(stats[k]) for k in REPORT_FIELDS if k in stats}


def ps_request(endpoint: str, cmd: str, timeout: float = 5.0, **fields: Any) -> dict:
    """One request to a software aggregator's control channel (docs/protocol.md)."""
    reply = rpc.call(endpoint, {"version": PS_CONTROL_VERSION, "cmd": cmd, **fields}, timeout)
    if not reply.get("ok"):
        raise RequestError(f"software aggregator {endpoint} refused {cmd}: {reply.get('error')}")
    return reply
