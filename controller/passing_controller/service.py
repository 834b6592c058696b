"""The controller service: hosts join and leave job groups over ZeroMQ (docs/control.md).

``Controller`` composes the parts, each a module of its own, and owns the one state they share
(state.py: the lock, the SQLite store, the in-memory view of the groups):

* serve.py: the transport: the CURVE-authenticated ROUTER socket, framing, the serving thread
  and the pool of threads for whatever waits on an aggregator;
* membership.py: joins, job secrets and worker tokens, leaves, reports;
* placement.py: which aggregator a group goes to, admitting it there, freeing it;
* failover.py: heartbeats, silent aggregators, moves;
* readout.py: status, stats, metrics;
* switch.py: the session with the switch, reconnecting and reconciling it; ps_control.py: the
  software aggregators' control channel.

``_handle`` below is where a command meets its part: a new command is added to the command
sets and to ``_handle``, and its logic to the part it belongs to.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from passing_protocol import rpc

from . import schema
from .allocation import MAX_JOB_ID
from .failover import Failover
from .keys import ServerKeys
from .membership import Membership
from .p4runtime import Pipeline
from .placement import MAX_POOL, Placement
from .ps_control import CHECK_TIMEOUT, REQUEST_TIMEOUT, PsControl
from .readout import Readout
from .schema import RequestError, Unauthorized
from .serve import Server
from .state import PendingGroup, State
from .switch import SwitchLink
from .topology import SWITCH, SWITCH_PREFIX, Topology, TopologyError

__all__ = ["CHECK_TIMEOUT", "Controller"]

# who may send what: a worker acts on its own group only (with its token)
WORKER_COMMANDS = frozenset({"join", "leave", "alive", "stuck", "report"})
OPERATOR_COMMANDS = WORKER_COMMANDS | {"status", "stats", "metrics"}


def check_switch_lanes(state: State, topo: Topology) -> None:
    """Refuse a store whose running switch groups use other lanes than their switch's program in the
    topology (its chip changed under them: their workers' packets would not parse there), or sit on a named
    switch the topology no longer has."""
    records = [r for r in state.records.values() if r.mode == "switch"]
    gone = sorted(f"{r.job_name} group {r.group} ({r.control})" for r in records
                  if r.control != SWITCH and r.control.removeprefix(SWITCH_PREFIX) not in topo.switches)
    if gone:
        raise TopologyError(
            f"the store holds switch groups on switches the topology does not name: {', '.join(gone)}; start "
            "with the topology they were placed under and end them (passing-ctl leave), or start with a new --store")
    for control in sorted({r.control for r in records}):
        view = topo.view(control)
        stale = sorted(f"{r.job_name} group {r.group} ({r.lanes(view.lanes)} lanes)"
                       for r in records if r.control == control and r.lanes(view.lanes) != view.lanes)
        if stale:
            what = "switch" if control == SWITCH else control
            raise TopologyError(
                f"the store holds switch groups placed with another lane count than the topology's {what} "
                f"(chip {view.chip!r}, {view.lanes} lanes): {', '.join(stale)}; start with the topology they were "
                "placed under and end them (passing-ctl leave), or start with a new --store")


class Controller:
    def __init__(self, topology: Topology, pipeline: Pipeline | None, store: str | Path, listen: str,
                 keys: ServerKeys, aggregator_key: bytes | None = None, join_timeout: float = 60.0,
                 default_pool: int = 256, switch_timeout: float = 5.0, ps_timeout: float = REQUEST_TIMEOUT,
                 check_timeout: float = CHECK_TIMEOUT) -> None:
        """``keys``: the controller's key pair and the clients it admits, with their roles;
        ``aggregator_key``: the public key of the software aggregators that the topology does
        not give one for; ``ps_timeout``: seconds a PS may take to answer a request (placement's
        ping, add_job, remove_job); ``check_timeout``: to answer the liveness check of a silent
        group or a counter read (docs/control.md)."""
        if not 1 <= default_pool <= MAX_POOL:
            raise ValueError(f"default pool {default_pool} outside 1..{MAX_POOL}")
        self.state = State(store, topology.slots, [ps.control for ps in topology.ps],
                           {view.name: view.slots for view in topology.switches.values()})
        try:
            check_switch_lanes(self.state, topology)
        except TopologyError:
            self.state.close()
            raise
        self.switch = SwitchLink(topology, pipeline, switch_timeout, self.state)
        # every switch's own P4Runtime session, by control name: the one, and each of the named "switches"
        self.switches = {SWITCH: self.switch, **{view.name: SwitchLink(view, pipeline, switch_timeout, self.state,
                                                                        view.name)
                                                 for view in topology.switches.values()}}
        self.ps = PsControl(topology, keys, aggregator_key, ps_timeout, check_timeout)
        self.readout = Readout(topology, self.state, self.switch, self.ps, self.switches)
        self.placement = Placement(topology, self.state, self.switch, self.ps, self.readout, default_pool,
                                   self.switches)
        for link in self.switches.values():
            link.connect()
        self.server = Server(listen, keys, self._handle, self._tick, self._stalled, self.state.refused)
        self.endpoint = self.server.endpoint
        self.membership = Membership(topology, self.state, self.placement, self.server.reply, self.server.in_pool,
                                     join_timeout)
        self.failover = Failover(self.state, self.membership, self.placement, self.switch, self.ps,
                                 self.server.reply, self.server.in_pool, self.switches)

    def _handle(self, identity: bytes, req: dict, role: str) -> None:
        """(serving thread) A request from a client of ``role``: to the part that answers it."""
        cmd = req.get("cmd")
        if not isinstance(cmd, str) or cmd not in OPERATOR_COMMANDS:
            raise RequestError(f"unknown command {rpc.show(cmd)}")
        if cmd not in (OPERATOR_COMMANDS if role == "operator" else WORKER_COMMANDS):
            raise Unauthorized(f"{cmd} is for operators; this key is a {role}'s")
        if cmd == "status" and self.readout.trees_running():  # it reads each tree node's counters: off this thread
            self.server.in_pool(self.server.answer_later, identity, self.readout.status_with_nodes)
            return
        if cmd in ("stats", "metrics"):  # they read aggregators: off this thread
            job_id = schema.integer(req, "job_id", 1, MAX_JOB_ID, default=None) if cmd == "stats" else None
            self.server.in_pool(self.server.answer_later, identity, self.stats if cmd == "stats" else self.metrics,
                                *((job_id,) if cmd == "stats" else ()))
            return
        with self.state.lock:
            if cmd == "join":
                self.membership.join(identity, req)
                return  # answered when the group is complete
            if cmd == "leave":
                reply = self.membership.leave(identity, req, role)
            elif cmd == "alive":
                reply = self.failover.alive(req)
            elif cmd == "stuck":
                reply = self.failover.stuck(identity, req)
            elif cmd == "report":
                reply = self.membership.report(req)
            else:
                reply = self.status()
        if reply is not None:
            self.server.reply(identity, {"ok": True, **reply})

    def _tick(self) -> None:
        """(serving thread) After every batch of requests."""
        with self.state.lock:
            self.membership.expire()

    def _stalled(self) -> None:
        self.failover.stalled()

    # ---- running and stopping ------------------------------------------------------------

    def serve(self) -> None:
        try:
            self.server.serve()
        finally:
            self.close()

    def stop(self, *_: object) -> None:
        self.server.stop()

    def install_signal_handlers(self) -> None:
        self.server.install_signal_handlers()

    def close(self) -> None:
        self.server.close()
        for link in self.switches.values():
            link.close()
        self.state.close()

    # ---- what operators and the embedded mode read -------------------------------------------

    def status(self) -> dict[str, Any]:
        return self.readout.status()

    def stats(self, job_id: int | None = None) -> dict[str, Any]:
        return self.readout.stats(job_id)

    def metrics(self) -> dict[str, Any]:
        return self.readout.metrics()

    def idle(self) -> bool:
        return self.readout.idle()

    @property
    def pending(self) -> dict[tuple[str, int], PendingGroup]:
        """Groups waiting for their workers."""
        return self.state.pending

    @property
    def moving(self) -> dict[tuple[str, int, int], list[tuple[bytes, int]]]:
        """Groups being moved (or ended) by failover, with who waits for the decision."""
        return self.state.moving
