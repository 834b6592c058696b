"""The controller's link to its switch: the one P4Runtime session, connecting and reconnecting,
reconciling the switch's tables with the store (docs/control.md, "Restart"), and the P4
controls a group's admission installs.

The session (``session.Switch``) needs the ``switch`` extra of passing-controller; this module
imports it only in ``connect``, when the topology has a switch, so a PS-only controller runs
without it.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import admission, aggregator_address, l2_forward, result_rewrite, tree_switch
from .allocation import Allocation, Worker
from .p4runtime import EXTRA, Pipeline, SwitchError, SwitchSupportMissing, Tls
from .state import State
from .store import Record
from .topology import Topology

if TYPE_CHECKING:
    from .session import Switch

log = logging.getLogger("passing_controller")

SWITCH_RETRY_SECONDS = 30.0  # a switch that was unavailable is tried again at a join after this long
# The P4 controls with entries of their own per group: installed when a group is admitted on the
# switch, removed when it ends, reinstalled from the store by a reconciliation. A new per-group
# control (a module with TABLE, install and remove, like these) is added here.
GROUP_CONTROLS = (admission, result_rewrite)
# The P4 controls whose entries follow from the topology alone: installed by a reconciliation.
TOPOLOGY_CONTROLS = (l2_forward, aggregator_address)


def _session() -> Any:
    """The session module, or SwitchSupportMissing naming the extra."""
    try:
        from . import session
    except ImportError as e:
        raise SwitchSupportMissing(
            f"the topology has a switch, and controlling it over P4Runtime needs p4runtime-shell: install the "
            f"'{EXTRA}' extra of passing-controller (pip install 'passing-controller[{EXTRA}]', or "
            f"pip install -e 'controller[{EXTRA}]' in a checkout; missing: {e})") from None
    return session


def connect(address: str, device_id: int = 0, timeout: float = 5.0, tls: Tls | None = None) -> Switch:
    """A primary P4Runtime session with the switch at ``address`` (SwitchUnreachable if none answers),
    over TLS when ``tls`` is given."""
    return _session().Switch(address, device_id, timeout=timeout, tls=tls)


def allocation(topo: Topology, r: Record) -> Allocation:
    """A group's record as the per-group P4 controls take it (its first stream)."""
    return allocations(topo, r)[0]


def allocations(topo: Topology, r: Record) -> list[Allocation]:
    """Every stream of a group as the per-group P4 controls take it: its first, then each of ``r.stripes``,
    stream s with its own job id, generation and slots, from each worker's UDP port + s."""
    out = []
    for s, (job_id, generation, base) in enumerate([(r.job_id, r.generation, r.base)] + [
            (stripe["job_id"], stripe["generation"], stripe["base"]) for stripe in r.stripes]):
        workers = tuple(Worker(w["index"], topo.host(w["host"]), w["udp_port"] + s) for w in r.workers)
        out.append(Allocation(job_id, generation, base, r.pool, workers))
    return out


class SwitchLink:
    """The session with one switch (None while it is unavailable, with the reason): the topology's switch, or
    a named one of its "switches" (``topo`` then that switch's view, ``name`` its control name "switch:NAME")."""

    def __init__(self, topo: Topology, pipeline: Pipeline | None, timeout: float, state: State,
                 name: str = "switch") -> None:
        self.topo, self.pipeline, self.timeout, self.state, self.name = topo, pipeline, timeout, state, name
        self.lock = threading.Lock()  # the P4Runtime session: one request at a time
        self.session: Switch | None = None
        self.error: str | None = None
        self.retry_at = 0.0

    def connect(self) -> None:
        """Connect, then either load the pipeline (a fresh switch) or reconcile with it."""
        if self.topo.p4runtime is None:
            self.session, self.error = None, "no switch in the topology (PS only)"
            self.retry_at = float("inf")
            return
        try:
            tls = None if self.topo.tls is None else Tls(**{k: Path(v) for k, v in self.topo.tls.items()})
            sw = connect(self.topo.p4runtime, self.topo.device_id, timeout=self.timeout, tls=tls)
        except SwitchError as e:
            self._down(str(e))
            log.warning("%s unavailable, PS fallback only: %s", self.name, e)
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
                log.info("pipeline loaded on %s (%s)", self.topo.p4runtime, self.name)
            self._reconcile(sw)
        except SwitchError as e:
            sw.close()
            self._down(str(e))
            log.warning("%s unusable, PS fallback only: %s", self.name, e)
            return
        self.session, self.error = sw, None
        with self.state.lock:
            self.state.store.mark_up(self.name)

    def connect_if_due(self) -> None:
        """(self.lock held) Try a switch that was unavailable again once its retry time has come."""
        if self.session is None and time.monotonic() >= self.retry_at:
            self.connect()  # it may be back

    def lost(self, error: str) -> None:
        """(self.lock held) The session failed: it is closed, and tried again after a while."""
        assert self.session is not None
        self.session.close()
        self.session, self.error = None, error
        self.retry_at = time.monotonic() + SWITCH_RETRY_SECONDS

    def _down(self, error: str) -> None:
        self.session, self.error = None, error
        self.retry_at = time.monotonic() + SWITCH_RETRY_SECONDS
        with self.state.lock:
            self.state.store.mark_down(self.name, error, time.time(), SWITCH_RETRY_SECONDS)

    def _reconcile(self, sw: Switch) -> None:
        """Make the switch's tables exactly what the store says (registers stay as they are)."""
        deletes = []
        tables = [control.TABLE for control in GROUP_CONTROLS + TOPOLOGY_CONTROLS]
        if tree_switch.supported(sw):  # the tree roles' tables (the v1model program's)
            tables += tree_switch.TABLES
        for table in tables:
            deletes += [sw.update("delete", e) for e in sw.read_table(table)]
        deletes += [sw.update("delete", e) for e in sw.read_multicast_groups()]
        sw.write(deletes)
        for control in TOPOLOGY_CONTROLS:
            control.install(sw, self.topo)
        with self.state.lock:
            records = [r for r in self.state.records.values() if r.mode == "switch" and r.control == self.name]
            nodes = [node["object"] for r in self.state.records.values() if r.mode == "tree"
                     for node in r.aggregator.get("tree", []) if node["control"] == self.name]
        for r in records:
            for a in allocations(self.topo, r):
                for control in GROUP_CONTROLS:
                    control.install(sw, a)
        for obj in nodes:  # the tree nodes on the switch, from the job objects their records keep
            tree_switch.install(sw, self.topo, obj)
        log.info("%s reconciled: %d switch allocations, %d tree nodes", self.name, len(records), len(nodes))

    def close(self) -> None:
        with self.lock:
            if self.session is not None:
                self.session.close()
                self.session = None
