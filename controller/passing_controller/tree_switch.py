"""A tree node on the topology's switch (docs/control.md, Fabric): the fabric plan's job object of that node
(fabric.TreePlan.job_objects, the one place that says what each node's job is) as the switch's entries:
admission and result_rewrite as for a flat group, and the role (tree_roles). Built from the object and the
topology alone, so that a teardown and a reconciliation after a restart write exactly what the placement did.

A leaf's servers and a root's leaves are hosts of the topology (the switch admits by ingress port and
addresses each replica to a host); a leaf's root is a host too, listening on the PASSING port (a leaf sends
its partials to UDP 9877).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import admission, result_rewrite, tree_roles
from .allocation import Allocation, Worker
from .topology import Topology

if TYPE_CHECKING:
    from .session import Switch

UDP_PORT = 9877  # docs/protocol.md: where a leaf's partials go
TABLES = (tree_roles.ROLE_TABLE, tree_roles.UPLINK_TABLE, tree_roles.OWNER_TABLE)


class TreeSwitchError(ValueError):
    """The node cannot run on the switch (the text says why)."""


def supported(sw: Switch) -> bool:
    """Whether the switch's program takes the tree roles (its P4Info has their tables)."""
    return sw.p4info is not None and tree_roles.ROLE_TABLE in sw.p4info.tables


def _address(topo: Topology, address: str) -> tuple[Any, int]:
    ip, port = address.rsplit(":", 1)
    return topo.host(ip), int(port)  # TopologyError: no host of the switch


def allocation(topo: Topology, obj: dict[str, Any]) -> Allocation:
    """The node's flat part: its workers (a leaf's servers, a root's leaves) as hosts of the topology."""
    workers = tuple(Worker(i, *_address(topo, a)) for i, a in enumerate(obj["workers"]))
    return Allocation(obj["job"], obj["generation"], obj["base"], obj["pool"], workers)


def uplink(topo: Topology, obj: dict[str, Any]) -> tree_roles.Uplink:
    up = obj["up"]
    host, port = _address(topo, up["root"])
    if port != UDP_PORT:
        raise TreeSwitchError(f"a switch leaf sends its partials to UDP port {UDP_PORT}; its root {up['root']} "
                              f"listens on {port}")
    return tree_roles.Uplink(up["job"], up["generation"], up["worker"], host.port, host.mac, host.ip)


def _roles(sw: Switch, topo: Topology, obj: dict[str, Any], a: Allocation) -> list:
    if obj.get("role") == "leaf":
        return tree_roles.leaf_entries(sw, a, uplink(topo, obj), obj.get("owners"))
    if obj.get("role") == "root":
        return tree_roles.root_entries(sw, a, obj.get("owners"))
    raise TreeSwitchError(f"job {obj['job']}: role {obj.get('role')!r} is no tree role")


def check(topo: Topology, obj: dict[str, Any]) -> None:
    """TreeSwitchError (or TopologyError) if the node's object cannot be written, before anything is."""
    a = allocation(topo, obj)
    if obj.get("role") == "leaf":
        uplink(topo, obj)
    if len(a.workers) > 32:
        raise TreeSwitchError(f"job {obj['job']}: {len(a.workers)} workers, a switch's bitmap has 32")


def install(sw: Switch, topo: Topology, obj: dict[str, Any]) -> None:
    a = allocation(topo, obj)
    admission.install(sw, a)
    result_rewrite.install(sw, a)
    if obj.get("role") == "leaf":
        tree_roles.install_leaf(sw, a, uplink(topo, obj), obj.get("owners"))
    else:
        tree_roles.install(sw, _roles(sw, topo, obj, a))


def remove(sw: Switch, topo: Topology, obj: dict[str, Any]) -> None:
    a = allocation(topo, obj)
    tree_roles.remove(sw, _roles(sw, topo, obj, a))
    result_rewrite.remove(sw, a)
    admission.remove(sw, a)
