"""Who is in a group (docs/control.md: join, leave, report): joins that gather a group's workers
and prove they know the job's secret, the tokens its workers get, leaves, and the checks that
a worker's later request is about its own group.

The serving thread calls ``join``, ``leave`` and ``report`` with the lock held; what waits on an
aggregator (admitting a complete group, tearing one down) goes to the pool (``in_pool``), and
its answers go out through ``reply``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from . import schema
from .fabric import MAX_LEAVES, MAX_RACK
from .keys import digest, matches, new_secret
from .p4runtime import SwitchError
from .placement import MAX_FLAT, Placement
from .schema import RequestError, Unauthorized
from .serve import InPool, Reply
from .state import PendingGroup, State
from .store import Record, StoreError
from .topology import Topology

log = logging.getLogger("passing_controller")

MAX_WORKERS = MAX_LEAVES * MAX_RACK  # a group: 32 on one aggregator (placement.MAX_FLAT), up to 1 024 across racks
MAX_GROUP = 1023  # group indices (a server's local rank)
MAX_STREAMS = 16  # a join's "streams": a job id and slots each (passing.stripes.default_streams' most)
MAX_PENDING = 4096  # groups waiting for their workers at once
AGGREGATOR_CHOICES = ("any", "ps")  # a join's "aggregator": the PS and PSRing baselines ask for "ps"
REPORT_FIELDS = ("packets_sent", "bytes_sent", "packets_received", "bytes_received", "retransmissions",
                 "early_retransmissions", "calls", "call_seconds")  # what a worker reports (docs/control.md)


class Membership:
    def __init__(self, topo: Topology, state: State, placement: Placement, reply: Reply, in_pool: InPool,
                 join_timeout: float) -> None:
        self.topo, self.state, self.placement = topo, state, placement
        self.reply, self.in_pool, self.join_timeout = reply, in_pool, join_timeout

    # ---- join ------------------------------------------------------------------------------

    def join(self, identity: bytes, req: dict) -> None:
        """(lock held) Answered when the group is complete, or refused at once."""
        s = self.state
        name = schema.text(req, "job", schema.NAME, what="a job name (letters, digits, ._:/@+-, at most 200)")
        group = schema.integer(req, "group", 0, MAX_GROUP, default=0)
        # more than one aggregator's 32 only where racks can take them (a tree, placement.py)
        workers = schema.integer(req, "workers", 1, MAX_WORKERS if self.topo.fabric is not None else MAX_FLAT)
        worker = schema.integer(req, "worker", 0, workers - 1)
        host = schema.text(req, "host", schema.HOST, what="a host name or address")
        udp_port = schema.integer(req, "udp_port", 1, 65535)
        pool = schema.integer(req, "pool", 1, self.placement.largest_pool(), default=None)
        aggregator = schema.choice(req, "aggregator", AGGREGATOR_CHOICES, "any")
        streams = schema.integer(req, "streams", 1, MAX_STREAMS, default=1)
        if udp_port + streams - 1 > 65535:
            raise RequestError(f"{streams} streams from UDP port {udp_port}: stream s is sent from udp_port + s, "
                               "past 65535")
        if pool is not None and pool * streams > self.placement.largest_pool():
            raise RequestError(f"{streams} streams of {pool} slots need {pool * streams} slots at one aggregator; "
                               f"the largest of the topology has {self.placement.largest_pool()}")
        secret = schema.text(req, "secret", schema.SECRET, what="the job's secret (32 to 128 hex digits)")
        self.topo.host(host)  # a clear error for an unknown host, now
        key = (name, group)
        if key in s.records or key in s.admitting:
            raise RequestError(f"job {name!r} group {group} is running; leave it first")
        pending = s.pending.get(key)
        if pending is None:
            if len(s.pending) >= MAX_PENDING:
                raise RequestError(f"{MAX_PENDING} groups are waiting for workers already; try again later")
            pending = PendingGroup(workers, pool, time.monotonic() + self.join_timeout, aggregator, digest(secret),
                                   streams)
        elif not matches(secret, pending.secret):
            raise RequestError(f"job {name!r} group {group}: wrong job secret")
        if pending.workers != workers:
            raise RequestError(f"job {name!r} group {group} has {pending.workers} workers, not {workers}")
        if pending.aggregator != aggregator:
            raise RequestError(f"job {name!r} group {group} asked for aggregator {pending.aggregator!r}, "
                               f"not {aggregator!r}")
        if pending.streams != streams:
            raise RequestError(f"job {name!r} group {group} has {pending.streams} streams, not {streams}")
        if pending.pool != pool:
            raise RequestError(f"job {name!r} group {group} has pool {pending.pool or 'default'}, "
                               f"not {pool or 'default'}")
        if worker in pending.members:
            raise RequestError(f"worker {worker} of job {name!r} group {group} joined already")
        s.pending[key] = pending
        pending.members[worker] = (identity, req)
        s.last_seen[(name, group, worker)] = (time.monotonic(), 1.0)  # a join is a sign of life too
        if len(pending.members) < workers:
            return
        del s.pending[key]
        s.admitting.add(key)
        self.in_pool(self._admit, name, group, pending)

    def _admit(self, name: str, group: int, pending: PendingGroup) -> None:
        """A complete group (pool thread): place it, then answer every worker, each with its token."""
        s = self.state
        tokens = {w: new_secret() for w in pending.members}
        try:
            record, reason = self.placement.allocate(name, group, pending, tokens)
        except Exception as e:  # whatever failed, every member of the group is answered
            if not isinstance(e, (RequestError, SwitchError, StoreError, OSError)):
                log.exception("job %s group %d: allocation failed", name, group)
            with s.lock:
                s.joins_failed += 1
                s.admitting.discard((name, group))
            for ident, _ in pending.members.values():
                self.reply(ident, {"ok": False, "error": f"job {name!r} group {group}: {e}"})
            return
        with s.lock:
            s.admitted[record.mode] += 1
            s.admitting.discard((name, group))
        for w, (ident, _) in pending.members.items():
            self.reply(ident, {"ok": True, **self.placement.worker_answer(record, reason, w), "token": tokens[w]})

    def expire(self) -> None:
        """(lock held) Refuse the groups whose workers did not all join in time."""
        s = self.state
        now = time.monotonic()
        for key, pending in list(s.pending.items()):
            if now > pending.deadline:
                del s.pending[key]
                missing = sorted(set(range(pending.workers)) - set(pending.members))
                for w in pending.members:
                    s.last_seen.pop((key[0], key[1], w), None)
                for ident, _ in pending.members.values():
                    self.reply(ident, {"ok": False, "error": f"job {key[0]!r} group {key[1]}: workers {missing} "
                                                             f"did not join within {self.join_timeout:g} s"})

    # ---- a worker's own group: who asks, leave, reports --------------------------------------

    def member(self, req: dict) -> tuple[Record, int]:
        """(lock held) The running group and worker index a worker's request names, once its token matches."""
        name = schema.text(req, "job", schema.NAME, what="a job name")
        group = schema.integer(req, "group", 0, MAX_GROUP, default=0)
        worker = schema.integer(req, "worker", 0, MAX_WORKERS - 1)
        token = schema.text(req, "token", schema.SECRET, what="the worker's token from its join answer")
        r = self.running(name, group)
        if worker >= len(r.workers) or not matches(token, r.workers[worker].get("token", "")):
            raise RequestError(f"job {name!r} group {group}: no worker {worker} with this token")
        return r, worker

    def running(self, name: str, group: int) -> Record:
        r = self.state.records.get((name, group))
        if r is None or r.job_id in self.state.ending:
            raise RequestError(f"job {name!r} group {group} is not running")
        return r

    def leave(self, identity: bytes, req: dict, role: str) -> dict | None:
        """A worker's leave (with `worker` and its token) counts it out; the group is torn down
        when every worker has left, so nobody loses the slots while a slower peer still needs
        RESULTs. An operator's leave without `worker` tears the group down at once."""
        s = self.state
        if req.get("worker") is None:
            if role != "operator":
                raise Unauthorized("a leave without a worker (ending the whole group) is for operators")
            r = self.running(schema.text(req, "job", schema.NAME, what="a job name"),
                             schema.integer(req, "group", 0, MAX_GROUP, default=0))
        else:
            r, worker = self.member(req)
            if req.get("stats") is not None:
                s.reports.setdefault(r.job_id, {})[worker] = schema.counters(req, "stats", REPORT_FIELDS)
            left = s.leaving.setdefault(r.job_id, set())
            left.add(worker)
            if len(left) < len(r.workers):
                return {"left": {"job": r.job_name, "group": r.group, "job_id": r.job_id, "worker": worker},
                        "remaining": sorted(set(range(len(r.workers))) - left)}
        self.placement.begin_teardown(r)
        reply = {"ok": True, "left": {"job": r.job_name, "group": r.group, "job_id": r.job_id}, "remaining": []}
        self.in_pool(self._teardown_then_reply, r, identity, reply)
        return None

    def _teardown_then_reply(self, r: Record, identity: bytes, reply: dict[str, Any]) -> None:
        self.placement.teardown(r)
        self.reply(identity, reply)

    def report(self, req: dict) -> dict:
        """A worker's counters so far (cumulative); the latest one counts."""
        r, worker = self.member(req)
        self.state.reports.setdefault(r.job_id, {})[worker] = schema.counters(req, "stats", REPORT_FIELDS)
        return {}
