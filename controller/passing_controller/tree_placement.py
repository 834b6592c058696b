"""A group across racks (docs/control.md, "Trees across racks"): slots at each of its leaves and at the
root, every node programmed over its control channel with the fabric plan's job objects (fabric.py, the
one place that says what each node's job is), the per-worker part of the join answer, and freeing it all.

A node is a software aggregator, or a switch whose program takes the roles (the v1model program;
tree_switch.py writes its entries from the node's job object over that switch's own session), as a leaf or
as the root: the topology's one switch, or one of its named "switches" (docs/control.md, "Several
switches"). Every node gets the same
job id and generation (the plan needs the root on an aggregator of its own), and the same ``pool`` and
``lanes``, so a packet keeps its slot and set on every hop. Runs on a pool thread: the lock is taken for
the state only, never while an aggregator is asked (the switch's lock while the switch is).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import tree_switch
from .allocator import SlotAllocator, SlotsExhausted
from .fabric import Fabric, FabricError, TreePlan, plan
from .p4runtime import SwitchError
from .ps_control import PsControl
from .schema import RequestError
from .state import State
from .store import Record
from .topology import SWITCH, PsEndpoint, Topology, TopologyError, is_switch, ps_pool

if TYPE_CHECKING:
    from .switch import SwitchLink

log = logging.getLogger("passing_controller")

AGGREGATOR_RETRY_SECONDS = 30.0  # as placement.py's: a PS that failed goes last for this long


class TreeRefused(RuntimeError):
    """The group cannot be placed as a tree (the text says why): a group of at most 32 workers falls back
    to one aggregator, a larger one is refused with it."""


@dataclass
class _Node:
    name: str
    role: str  # "leaf" or "root"
    ps: PsEndpoint | None  # None: its switch
    data: str  # where its workers send
    lanes: int = 0
    base: int | None = None
    switch: str = SWITCH  # the fabric's switch of the node (its control name), taken while ``ps`` is None

    @property
    def control(self) -> str:
        return self.switch if self.ps is None else self.ps.control


def _what(n: _Node) -> str:
    if n.ps is not None:
        return f"PS {n.ps.control}"
    return "the switch" if n.switch == SWITCH else f"switch {n.switch.split(':', 1)[1]!r}"


def tree_plan(topo: Topology, workers: list[dict]) -> TreePlan | None:
    """The fabric's plan of a group whose workers are ``workers`` (index order): None when the topology
    has no fabric or the group sits under one leaf (it stays flat, placed as today)."""
    fabric = topo.fabric
    if fabric is None:
        return None
    p = plan(fabric, [fabric_host(fabric, topo, w["host"]) for w in workers])
    return p if p.root is not None else None


def fabric_host(fabric: Fabric, topo: Topology, host: str) -> str:
    """How the fabric names a worker's host: a leaf lists a host by its name or its address."""
    h = topo.host(host)
    listed = {x for node in fabric.nodes.values() for x in node.hosts}
    return h.name if h.name in listed else h.ip


def nodes_of(record: Record) -> list[dict[str, Any]]:
    """A tree record's nodes, the leaves in the plan's order and the root last: {"name", "role", "control",
    "data", "base"} each, and a leaf's "workers" (the group indices of its servers, its worker order) and
    "first" (its first server's number in the whole group)."""
    return list(record.aggregator.get("tree", []))


def worker_answer(record: Record, worker: int) -> dict[str, Any]:
    """What a join answer says to group worker ``worker`` of a tree (docs/control.md, "Trees across
    racks"): its leaf's address, its index at the leaf (``worker``, its bit there) among the leaf's
    ``workers``, the job's ``servers`` and its ``number`` in the whole group, every group worker's number
    (``numbers``, in group worker order: how a reduce_scatter's blocks and an all_gather's pieces, in that
    order, map to owners), and whether OWNER_ONLY rounds, GATHER and NACK cross the tree (``owner_only``:
    owners are 7 bits, so a tree of at most 128 servers)."""
    numbers = [0] * len(record.workers)
    for node in nodes_of(record):
        if node["role"] == "leaf":
            for local, w in enumerate(node["workers"]):
                numbers[w] = node["first"] + local
    for node in nodes_of(record):
        if node["role"] == "leaf" and worker in node["workers"]:
            host, port = node["data"].rsplit(":", 1)
            local = node["workers"].index(worker)
            return {"worker": local, "workers": len(node["workers"]), "servers": len(record.workers),
                    "number": node["first"] + local, "numbers": numbers, "leaf": node["name"],
                    "owner_only": bool(record.aggregator.get("owner_only")),
                    "aggregators": [{"host": host, "port": int(port), "pool": record.pool}]}
    raise KeyError(f"worker {worker} is under no leaf of job id {record.job_id}")


class TreePlacement:
    def __init__(self, topo: Topology, state: State, ps: PsControl, default_pool: int,
                 switch: SwitchLink | None = None, switches: dict[str, SwitchLink] | None = None) -> None:
        """``switches``: the session of every switch by its control name (default: ``switch``, the one)."""
        self.topo, self.state, self.ps, self.default_pool = topo, state, ps, default_pool
        self.switches = switches if switches is not None else {SWITCH: switch} if switch is not None else {}

    def allocate(self, p: TreePlan, job_id: int, name: str, group: int, generation: int, pool: int | None,
                 workers: list[dict], exclude: frozenset[str], switch_allowed: bool = True) -> Record:
        """Admit the group as ``p``'s tree: every node takes its job, or none keeps one (TreeRefused).
        ``switch_allowed`` False: the job asked for software aggregators, so no node may be the switch."""
        assert p.root is not None
        nodes = [self._node(r.node.name, "leaf", r.node.aggregator, switch_allowed) for r in p.racks]
        nodes.append(self._node(p.root.name, "root", p.root.aggregator, switch_allowed))
        added: list[_Node] = []
        objects: dict[str, dict] = {}
        try:
            for n in nodes:  # a node down (``exclude``) or failing its check is taken by a spare PS, if any
                n.lanes = self._check_or_substitute(n, nodes, exclude)
            asked_pool = pool
            while True:  # a switch out of slots is taken by a spare PS too, and the slots asked again
                lanes = min(n.lanes for n in nodes)
                for n in nodes:  # a switch takes its program's
                    if n.ps is None and lanes != self.topo.view(n.switch).lanes:
                        raise TreeRefused(f"the tree's nodes take {lanes} lanes, {_what(n)}'s program "
                                          f"{self.topo.view(n.switch).lanes}")
                # the most workers any node of the tree has: a leaf's rack, or the root's leaves
                pool = asked_pool or ps_pool(lanes, max([len(r.hosts) for r in p.racks] + [len(p.racks)]),
                                             self.default_pool)
                full = self._take_slots(nodes, pool)
                if full is None:
                    break
                full.lanes = self._check_or_substitute(full, nodes, exclude | {full.switch}, "is out of slots")
            addresses = [f"{self.topo.host(w['host']).ip}:{w['udp_port']}" for w in workers]
            data = {n.name: n.data for n in nodes}
            objects = p.job_objects(job_id, generation, pool, lanes, addresses, data,
                                    bases={n.name: int(n.base) for n in nodes if n.base is not None})
            for n in nodes:
                if n.ps is None:
                    try:
                        tree_switch.check(self.topo.view(n.switch), objects[n.name])
                    except (tree_switch.TreeSwitchError, TopologyError) as e:
                        raise TreeRefused(f"{n.role} {n.name!r} ({_what(n)}): {e}") from None
            for n in [nodes[-1], *nodes[:-1]]:  # the root first: the leaves' partials find their job there
                if n.ps is None:
                    self._switch_install(n, objects[n.name])
                else:
                    self._request(n, "add_job", job=objects[n.name])
                added.append(n)
        except (TreeRefused, FabricError) as e:
            self._undo(nodes, added, job_id, objects)
            raise TreeRefused(str(e)) from None
        except BaseException:  # whatever else failed (a bug, the store): nothing of the tree stays taken
            self._undo(nodes, added, job_id, objects)
            raise
        # a switch node keeps its job object: its entries are written again from it (teardown, reconciliation)
        tree = [{"name": n.name, "role": n.role, "control": n.control, "data": n.data, "base": n.base,
                 **({"object": objects[n.name]} if n.ps is None else {})} for n in nodes]
        for entry, rack in zip(tree, p.racks, strict=False):  # a leaf's servers: group indices, first number
            entry.update(workers=list(rack.hosts), first=rack.first)
        root = nodes[-1]
        r = Record(job_id, name, group, "tree", generation, int(root.base or 0), pool, workers,
                   {"data": root.data, "control": root.control, "lanes": lanes, "tree": tree,
                    "owner_only": p.owner_only})
        with self.state.lock:
            for n in nodes:
                self.state.store.mark_up(n.control)
        log.info("job %s group %d -> tree of %d racks under %s (job id %d generation %d)", name, group,
                 len(p.racks), root.name, job_id, generation)
        return r

    def _node(self, name: str, role: str, aggregator: str, switch_allowed: bool) -> _Node:
        if is_switch(aggregator) and not switch_allowed:
            raise TreeRefused(f"fabric {role} {name!r} is a switch, and the job asked for a software aggregator")
        if is_switch(aggregator):
            view = self.topo.view(aggregator)
            return _Node(name, role, None, f"{view.aggregation_ip}:{tree_switch.UDP_PORT}", switch=aggregator)
        ps = next(ps for ps in self.topo.ps if ps.data == aggregator)  # the fabric names PSs of the topology
        return _Node(name, role, ps, ps.data)

    def _allocator(self, control: str) -> SlotAllocator:
        """(lock held) The slots of a node's aggregator."""
        return self.state.allocator_for(control)

    def _take_slots(self, nodes: list[_Node], pool: int) -> _Node | None:
        """Slots of ``pool`` at every node; a switch node that has not enough: returned, with none taken
        anywhere (a spare PS may take its place). A PS out of slots: TreeRefused."""
        with self.state.lock:
            for n in nodes:
                try:
                    n.base = self._allocator(n.control).allocate(pool)
                except SlotsExhausted as e:
                    if n.ps is None:
                        for m in nodes:
                            if m.base is not None:
                                self._allocator(m.control).release(m.base)
                                m.base = None
                        return n
                    raise TreeRefused(f"{n.role} {n.name!r} ({_what(n)}): {e}") from None
        return None

    def _check_or_substitute(self, n: _Node, nodes: list[_Node], exclude: frozenset[str],
                             why: str = "is down") -> int:
        """The node's lanes (``_check``), on its own aggregator (a PS, or the switch) or a spare PS
        (``spares``): one that is down (in ``exclude``: a move leaves it) is not tried, a PS that failed lately
        is tried after the spares, any other first. None answers: TreeRefused, saying why for each."""
        own, own_data, resting = n.ps, n.data, self._resting()
        spares = self.spares({m.control for m in nodes} | exclude)
        tried = [f"{n.role} {n.name!r} ({_what(n)}) {why}"] if n.control in exclude else []
        order: list[PsEndpoint | None] = \
            list(spares) if tried else [*spares, own] if n.control in resting else [own, *spares]
        for ps in order:
            n.ps, n.data = ps, (own_data if ps is own or ps is None else ps.data)
            try:
                lanes = self._check(n)
            except TreeRefused as e:
                tried.append(str(e) if ps is own else f"spare {e}")
                continue
            if ps is not own:
                log.info("tree node %s (%s): PS %s instead of %s", n.name, n.role, n.control,
                         n.switch if own is None else own.control)
            return lanes
        n.ps, n.data = own, own_data
        raise TreeRefused("; ".join(tried) + ("" if spares else ", and no spare PS is left"))

    def spares(self, used: set[str]) -> list[PsEndpoint]:
        """The PSs that may take a node of a tree in place of its own, in the order tried: the topology's PSs
        that no node of the fabric names first (spares), then those of other nodes; never one in ``used``
        (the tree's other nodes, those down), and those that failed lately last."""
        named = {node.aggregator for node in self.topo.fabric.nodes.values()} if self.topo.fabric else set()
        resting = self._resting()
        free = [ps for ps in self.topo.ps if ps.control not in used]
        return sorted(free, key=lambda ps: (ps.control in resting, ps.data in named))

    def _resting(self) -> set[str]:
        """The PSs that failed lately (marked down, not yet due for a retry)."""
        with self.state.lock:
            down, now = self.state.store.down(), time.time()
        return {a for a, (_, retry_at, _) in down.items() if retry_at > now}

    def _check(self, n: _Node) -> int:
        """The node's lanes, once its `ping` states the role it is to take (a switch: its program's tables)."""
        if n.ps is None:
            link = self.switches.get(n.switch)
            if link is None:
                raise TreeRefused(f"{n.role} {n.name!r} is {_what(n)}, and the controller has no link to it")
            with link.lock:
                link.connect_if_due()
                if link.session is None:
                    raise TreeRefused(f"{n.role} {n.name!r}: {_what(n)} unreachable: {link.error}")
                if not tree_switch.supported(link.session):
                    raise TreeRefused(f"{n.role} {n.name!r}: {_what(n)}'s program takes no tree roles (no table "
                                      f"{tree_switch.TABLES[0]})")
            return self.topo.view(n.switch).lanes
        ping = self._request(n, "ping")
        roles = ping.get("roles")
        if not isinstance(roles, list) or n.role not in roles:
            raise TreeRefused(f"{n.role} {n.name!r} (PS {n.ps.control}) takes no {n.role} role (its ping states "
                              f"roles {roles!r}: an older software aggregator)")
        return n.ps.lanes(ping)

    def _switch_install(self, n: _Node, obj: dict[str, Any]) -> None:
        link, view = self.switches[n.switch], self.topo.view(n.switch)
        with link.lock:
            try:
                if link.session is None:
                    raise SwitchError(f"switch unreachable: {link.error}")
                tree_switch.install(link.session, view, obj)
            except SwitchError as e:
                try:  # what went in of it
                    if link.session is not None:
                        tree_switch.remove(link.session, view, obj)
                except SwitchError:
                    pass
                raise TreeRefused(f"{n.role} {n.name!r} ({_what(n)}) refused the tree's entries: {e}") from None

    def _switch_remove(self, control: str, obj: dict[str, Any], job_id: int) -> None:
        link = self.switches.get(control)
        if link is None:
            return
        with link.lock:
            if link.session is None:  # a reconciliation removes them once the switch is back
                return
            try:
                tree_switch.remove(link.session, self.topo.view(control), obj)
            except SwitchError as e:
                log.warning("%s did not remove tree job id %d: %s", control, job_id, e)

    def _request(self, n: _Node, cmd: str, **fields: Any) -> dict:
        assert n.ps is not None
        try:
            return self.ps.request(n.ps.control, cmd, **fields)
        except (OSError, RequestError) as e:  # down, hanging or refusing: tried last for a while
            with self.state.lock:
                self.state.store.mark_down(n.ps.control, str(e), time.time(), AGGREGATOR_RETRY_SECONDS)
            log.warning("PS %s (%s %s) failed: %s", n.ps.control, n.role, n.name, e)
            raise TreeRefused(f"{n.role} {n.name!r} (PS {n.ps.control}): {e}") from None

    def _undo(self, nodes: list[_Node], added: list[_Node], job_id: int, objects: dict[str, dict]) -> None:
        """What a failed placement had taken: the jobs some nodes admitted, every node's slots."""
        for n in added:
            if n.ps is None:
                self._switch_remove(n.switch, objects[n.name], job_id)
                continue
            try:
                self.ps.request(n.ps.control, "remove_job", job=job_id)
            except (OSError, RequestError) as e:
                log.warning("PS %s did not remove a half-placed tree's job: %s", n.ps.control, e)
        with self.state.lock:
            for n in nodes:
                if n.base is not None:
                    self._allocator(n.control).release(n.base)
                    n.base = None

    def teardown(self, r: Record, down: frozenset[str] = frozenset()) -> None:
        """(pool thread) Every node lets go of the group's job where it still answers (``down``: the nodes
        known dead, not asked); its slots go free. The nodes are asked at once: a dead one that no check has
        found yet (a group idle while it died) costs one request's timeout, however many there are."""
        nodes = [node for node in nodes_of(r) if node["control"] not in down]
        if nodes:
            with ThreadPoolExecutor(len(nodes)) as pool:
                list(pool.map(lambda node: self._remove(node, r.job_id), nodes))

    def _remove(self, node: dict[str, Any], job_id: int) -> None:
        if is_switch(node["control"]):
            self._switch_remove(node["control"], node["object"], job_id)
            return
        try:
            self.ps.request(node["control"], "remove_job", job=job_id)
        except (OSError, RequestError) as e:  # a dead PS holds nothing: the group ends anyway
            with self.state.lock:
                self.state.store.mark_down(node["control"], str(e), time.time(), AGGREGATOR_RETRY_SECONDS)
            log.warning("PS %s (%s %s) did not remove job id %d: %s", node["control"], node["role"], node["name"],
                        job_id, e)

    def release(self, r: Record) -> None:
        """(lock held) The slots of every node of a tree record."""
        for node in nodes_of(r):
            self._allocator(node["control"]).release(node["base"])

