"""A group across racks (docs/control.md, "Trees across racks"): slots at each of its leaves and at the
root, every node programmed over its control channel with the fabric plan's job objects (fabric.py, the
one place that says what each node's job is), the per-worker part of the join answer, and freeing it all.

Software aggregators only (PS leaves and a PS root): the BMv2 program takes the roles, and tree_roles.py
writes a switch's entries, but the topology names one switch and this placement does not use them yet.
Every node gets the same job id and generation (the plan needs the root on an aggregator of its own), and
the same ``pool`` and ``lanes``, so a packet keeps its slot and set on every hop. Runs on a pool thread:
the lock is taken for the state only, never while an aggregator is asked.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from .allocator import SlotAllocator, SlotsExhausted
from .fabric import Fabric, FabricError, TreePlan, plan
from .ps_control import PsControl
from .schema import RequestError
from .state import PS_SLOTS, State
from .store import Record
from .topology import PsEndpoint, Topology, ps_pool

log = logging.getLogger("passing_controller")

AGGREGATOR_RETRY_SECONDS = 30.0  # as placement.py's: a PS that failed goes last for this long


class TreeRefused(RuntimeError):
    """The group cannot be placed as a tree (the text says why): a group of at most 32 workers falls back
    to one aggregator, a larger one is refused with it."""


@dataclass
class _Node:
    name: str
    role: str  # "leaf" or "root"
    ps: PsEndpoint
    lanes: int = 0
    base: int | None = None


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
    ``workers``, the job's ``servers`` and its ``number`` in the whole group, and whether OWNER_ONLY rounds,
    GATHER and NACK cross the tree (``owner_only``: owners are 7 bits, so a tree of at most 128 servers)."""
    for node in nodes_of(record):
        if node["role"] == "leaf" and worker in node["workers"]:
            host, port = node["data"].rsplit(":", 1)
            local = node["workers"].index(worker)
            return {"worker": local, "workers": len(node["workers"]), "servers": len(record.workers),
                    "number": node["first"] + local, "leaf": node["name"],
                    "owner_only": bool(record.aggregator.get("owner_only")),
                    "aggregators": [{"host": host, "port": int(port), "pool": record.pool}]}
    raise KeyError(f"worker {worker} is under no leaf of job id {record.job_id}")


class TreePlacement:
    def __init__(self, topo: Topology, state: State, ps: PsControl, default_pool: int) -> None:
        self.topo, self.state, self.ps, self.default_pool = topo, state, ps, default_pool

    def allocate(self, p: TreePlan, job_id: int, name: str, group: int, generation: int, pool: int | None,
                 workers: list[dict], exclude: frozenset[str]) -> Record:
        """Admit the group as ``p``'s tree: every node takes its job, or none keeps one (TreeRefused)."""
        assert p.root is not None
        nodes = [_Node(r.node.name, "leaf", self._endpoint(r.node.name, r.node.aggregator)) for r in p.racks]
        nodes.append(_Node(p.root.name, "root", self._endpoint(p.root.name, p.root.aggregator)))
        for n in nodes:
            if n.ps.control in exclude:
                raise TreeRefused(f"{n.role} {n.name!r} (PS {n.ps.control}) is down")
        added: list[_Node] = []
        try:
            for n in nodes:
                n.lanes = self._check(n)
            lanes = min(n.lanes for n in nodes)
            # the most workers any node of the tree has: a leaf's rack, or the root's leaves
            pool = pool or ps_pool(lanes, max([len(r.hosts) for r in p.racks] + [len(p.racks)]), self.default_pool)
            with self.state.lock:
                for n in nodes:
                    allocator = self.state.ps_allocators.setdefault(n.ps.control, SlotAllocator(PS_SLOTS))
                    try:
                        n.base = allocator.allocate(pool)
                    except SlotsExhausted as e:
                        raise TreeRefused(f"{n.role} {n.name!r} (PS {n.ps.control}): {e}") from None
            addresses = [f"{self.topo.host(w['host']).ip}:{w['udp_port']}" for w in workers]
            data = {n.name: n.ps.data for n in nodes}
            objects = p.job_objects(job_id, generation, pool, lanes, addresses, data,
                                    bases={n.name: int(n.base) for n in nodes if n.base is not None})
            for n in [nodes[-1], *nodes[:-1]]:  # the root first: the leaves' partials find their job there
                self._request(n, "add_job", job=objects[n.name])
                added.append(n)
        except (TreeRefused, FabricError) as e:
            self._undo(nodes, added, job_id)
            raise TreeRefused(str(e)) from None
        except BaseException:  # whatever else failed (a bug, the store): nothing of the tree stays taken
            self._undo(nodes, added, job_id)
            raise
        tree = [{"name": n.name, "role": n.role, "control": n.ps.control, "data": n.ps.data, "base": n.base}
                for n in nodes]
        for entry, rack in zip(tree, p.racks, strict=False):  # a leaf's servers: group indices, first number
            entry.update(workers=list(rack.hosts), first=rack.first)
        root = nodes[-1]
        r = Record(job_id, name, group, "tree", generation, int(root.base or 0), pool, workers,
                   {"data": root.ps.data, "control": root.ps.control, "lanes": lanes, "tree": tree,
                    "owner_only": p.owner_only})
        with self.state.lock:
            for n in nodes:
                self.state.store.mark_up(n.ps.control)
        log.info("job %s group %d -> tree of %d racks under %s (job id %d generation %d)", name, group,
                 len(p.racks), root.name, job_id, generation)
        return r

    def _endpoint(self, node: str, data: str) -> PsEndpoint:
        if data == "switch":
            raise TreeRefused(f"fabric node {node!r} is the switch: tree placement does not program a switch's "
                              f"roles yet (passing_controller.tree_roles writes them; docs/control.md, Fabric)")
        return next(ps for ps in self.topo.ps if ps.data == data)  # the fabric names PSs of the topology

    def _check(self, n: _Node) -> int:
        """The node's lanes, once its `ping` states the role it is to take."""
        ping = self._request(n, "ping")
        roles = ping.get("roles")
        if not isinstance(roles, list) or n.role not in roles:
            raise TreeRefused(f"{n.role} {n.name!r} (PS {n.ps.control}) takes no {n.role} role (its ping states "
                              f"roles {roles!r}: an older software aggregator)")
        return n.ps.lanes(ping)

    def _request(self, n: _Node, cmd: str, **fields: Any) -> dict:
        try:
            return self.ps.request(n.ps.control, cmd, **fields)
        except (OSError, RequestError) as e:  # down, hanging or refusing: tried last for a while
            with self.state.lock:
                self.state.store.mark_down(n.ps.control, str(e), time.time(), AGGREGATOR_RETRY_SECONDS)
            log.warning("PS %s (%s %s) failed: %s", n.ps.control, n.role, n.name, e)
            raise TreeRefused(f"{n.role} {n.name!r} (PS {n.ps.control}): {e}") from None

    def _undo(self, nodes: list[_Node], added: list[_Node], job_id: int) -> None:
        """What a failed placement had taken: the jobs some nodes admitted, every node's slots."""
        for n in added:
            try:
                self.ps.request(n.ps.control, "remove_job", job=job_id)
            except (OSError, RequestError) as e:
                log.warning("PS %s did not remove a half-placed tree's job: %s", n.ps.control, e)
        with self.state.lock:
            for n in nodes:
                if n.base is not None:
                    self.state.ps_allocators[n.ps.control].release(n.base)
                    n.base = None

    def teardown(self, r: Record, reachable: bool) -> None:
        """(pool thread) Every node lets go of the group's job where it still answers; its slots go free."""
        for node in nodes_of(r):
            if not reachable:
                break
            try:
                self.ps.request(node["control"], "remove_job", job=r.job_id)
            except (OSError, RequestError) as e:  # a dead PS holds nothing: the group ends anyway
                with self.state.lock:
                    self.state.store.mark_down(node["control"], str(e), time.time(), AGGREGATOR_RETRY_SECONDS)
                log.warning("PS %s (%s %s) did not remove job id %d: %s", node["control"], node["role"],
                            node["name"], r.job_id, e)

    def release(self, r: Record) -> None:
        """(lock held) The slots of every node of a tree record."""
        for node in nodes_of(r):
            self.state.ps_allocators[node["control"]].release(node["base"])

