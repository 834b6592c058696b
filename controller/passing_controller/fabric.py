"""A fabric of racks: which aggregator serves each rack's hosts (a leaf), and which one joins the racks (a
root), for two-level aggregation trees (docs/protocol.md, "Trees across racks"; docs/control.md, Fabric).

The topology file's optional "fabric" list::

    "fabric": [
      {"name": "rack1", "ps": "10.0.1.100:9877", "hosts": ["h1", "h2"], "uplink": "spine"},
      {"name": "rack2", "ps": "10.0.2.100:9877", "hosts": ["h3", "h4"], "uplink": "spine"},
      {"name": "spine", "ps": "10.0.9.100:9877"}
    ]

A node with hosts is a leaf; a node without is a root. A node's aggregator is a PS of the topology's "ps"
list, named by its "data" address ("switch": true names the topology's switch instead, and "switch": "s1"
one of its named "switches": a leaf's hosts then on that switch, and no two nodes on one switch). ``plan`` places a
group whose hosts sit under several leaves: a leaf job per rack, a root job over the leaves, and the owner
maps that name each server by its number in the whole group; a group under one leaf stays flat there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_LEAVES = 32  # a root's bitmap
MAX_RACK = 32  # a leaf's bitmap
MAX_OWNERS = 128  # the 7-bit owner of the wire: OWNER_ONLY rounds and GATHERs cross trees up to this
UP = -2  # a leaf's owner map: a server of another rack (docs/protocol.md)
NODE_KEYS = {"name", "ps", "switch", "hosts", "uplink"}


class FabricError(ValueError):
    """A fabric that cannot be used, or a group it cannot place, with the reason (a FabricError when the
    topology file's fabric is read)."""


@dataclass(frozen=True)
class Node:
    name: str
    aggregator: str  # a PS's data address, "switch" (the topology's one), or "switch:NAME" (a named one)
    hosts: tuple[str, ...]  # empty: a root
    uplink: str | None

    @property
    def leaf(self) -> bool:
        return bool(self.hosts)


@dataclass(frozen=True)
class Fabric:
    nodes: dict[str, Node]

    def leaf_of(self, host: str) -> Node:
        for node in self.nodes.values():
            if host in node.hosts:
                return node
        raise FabricError(f"fabric: host {host!r} is under no leaf")

    @classmethod
    def from_list(cls, raw: Any, hosts: Sequence[str], ps_data: Sequence[str], has_switch: bool,
                  switches: Mapping[str, Sequence[str]] | None = None) -> Fabric:
        """Checked: names unique, each aggregator known, every host of the topology under at most one leaf, a
        leaf's uplink a root (two levels: no cycle, no chain), every leaf with an uplink when there is a root,
        a root with 1..32 leaves, a leaf with 1..32 hosts. ``switches``: the topology's named switches, each
        with the hosts on it (names and addresses): a leaf on one has its hosts there, one node a switch."""
        if not isinstance(raw, list) or not raw:
            raise FabricError('topology: "fabric" must be a non-empty list of nodes')
        nodes: dict[str, Node] = {}
        for entry in raw:
            node = _node(entry, ps_data, has_switch, switches or {})
            if node.name in nodes:
                raise FabricError(f"fabric: two nodes named {node.name!r}")
            same = [n.name for n in nodes.values() if n.aggregator == node.aggregator != "switch"]
            if same and node.aggregator.startswith("switch:"):
                raise FabricError(f"fabric nodes {same[0]!r} and {node.name!r} are both on switch "
                                  f"{node.aggregator.split(':', 1)[1]!r}: a switch is one node of the fabric")
            nodes[node.name] = node
        owner: dict[str, str] = {}
        for node in nodes.values():
            for h in node.hosts:
                if h in owner:
                    raise FabricError(f"fabric: host {h!r} is under two leaves, {owner[h]!r} and {node.name!r}")
                if hosts and h not in hosts:
                    raise FabricError(f"fabric: leaf {node.name!r} names host {h!r}, which the topology lacks")
                owner[h] = node.name
        _check_uplinks(nodes)
        return cls(nodes)


def _node(entry: Any, ps_data: Sequence[str], has_switch: bool, switches: Mapping[str, Sequence[str]]) -> Node:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
        raise FabricError(f"fabric: a node must be an object with a \"name\", got {entry!r}"[:200])
    name = entry["name"]
    unknown = set(entry) - NODE_KEYS
    if unknown:
        raise FabricError(f"fabric node {name!r}: unknown keys {sorted(unknown)}")
    if ("ps" in entry) == bool(entry.get("switch")):
        raise FabricError(f'fabric node {name!r}: name its aggregator, "ps" (a PS data address) or "switch" (true: '
                          f'the topology\'s switch; a name: one of its "switches")')
    switch = entry.get("switch")
    if isinstance(switch, str):
        if switch not in switches:
            raise FabricError(f"fabric node {name!r}: no switch named {switch!r} in the topology's \"switches\""
                              + (f" ({', '.join(map(repr, switches))})" if switches else ""))
        away = [h for h in entry.get("hosts", []) if isinstance(h, str) and h not in switches[switch]]
        if away:
            raise FabricError(f"fabric leaf {name!r} on switch {switch!r}: hosts {away} are not on that switch")
        aggregator = f"switch:{switch}"
    elif switch not in (None, True, False):
        raise FabricError(f'fabric node {name!r}: "switch" must be true or a switch\'s name, got {switch!r}')
    elif switch:
        if not has_switch:
            raise FabricError(f"fabric node {name!r}: the topology has no switch"
                              + (' named by true (name one of its "switches")' if switches else ""))
        aggregator = "switch"
    else:
        aggregator = entry["ps"]
        if aggregator not in ps_data:
            raise FabricError(f"fabric node {name!r}: no PS with data address {aggregator!r} in the topology")
    hosts = entry.get("hosts", [])
    if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts) or len(set(hosts)) != len(hosts):
        raise FabricError(f"fabric node {name!r}: \"hosts\" must be a list of distinct host names")
    if len(hosts) > MAX_RACK:
        raise FabricError(f"fabric node {name!r}: {len(hosts)} hosts, a leaf takes at most {MAX_RACK}")
    uplink = entry.get("uplink")
    if uplink is not None and not isinstance(uplink, str):
        raise FabricError(f"fabric node {name!r}: \"uplink\" must be a node's name")
    return Node(name, aggregator, tuple(hosts), uplink)


def _check_uplinks(nodes: dict[str, Node]) -> None:
    for node in nodes.values():
        seen = [node.name]
        at = node
        while at.uplink is not None:  # a cycle first: its message says more than "not a root"
            if at.uplink not in nodes:
                raise FabricError(f"fabric node {at.name!r}: uplink {at.uplink!r} is no node of the fabric")
            if at.uplink in seen:
                raise FabricError("fabric: uplinks form a cycle: " + " -> ".join([*seen, at.uplink]))
            seen.append(at.uplink)
            at = nodes[at.uplink]
    roots = [n for n in nodes.values() if not n.leaf]
    for node in nodes.values():
        if not node.leaf:
            if node.uplink is not None:
                raise FabricError(f"fabric node {node.name!r}: a root (no hosts) has no uplink")
            continue
        if node.uplink is None:
            if roots or len(nodes) > 1:
                raise FabricError(f"fabric leaf {node.name!r} has no uplink: every rack's leaf names its root")
            continue
        if nodes[node.uplink].leaf:
            raise FabricError(f"fabric leaf {node.name!r}: uplink {node.uplink!r} is a leaf (trees have two "
                                f"levels: a leaf's uplink is a root)")
    for root in roots:
        leaves = [n for n in nodes.values() if n.uplink == root.name]
        if not 1 <= len(leaves) <= MAX_LEAVES:
            raise FabricError(f"fabric root {root.name!r}: {len(leaves)} leaves, must be 1..{MAX_LEAVES}")


@dataclass(frozen=True)
class Rack:
    node: Node
    hosts: tuple[int, ...]  # indices into the group's hosts (its workers), in worker order at this leaf
    first: int  # the global number of its first server


@dataclass(frozen=True)
class TreePlan:
    """Where a group goes: under one leaf (``root`` None: a flat job there), or a tree of ``racks`` under
    ``root``. Servers are numbered rack after rack in ``racks`` order (their global ``number``)."""

    racks: tuple[Rack, ...]
    root: Node | None
    servers: int

    @property
    def owner_only(self) -> bool:
        """Whether OWNER_ONLY rounds and GATHERs can cross the plan (owners are 7 bits)."""
        return self.root is None or self.servers <= MAX_OWNERS

    def number(self, worker: int) -> tuple[int, int, int]:
        """A group worker's (rack index, its worker index at the leaf, its global number)."""
        for r, rack in enumerate(self.racks):
            if worker in rack.hosts:
                w = rack.hosts.index(worker)
                return r, w, rack.first + w
        raise KeyError(worker)

    def job_objects(self, job: int, generation: int, pool: int, lanes: int, addresses: Sequence[str],
                    data: dict[str, str], root_job: int | None = None,
                    bases: dict[str, int] | None = None) -> dict[str, dict[str, Any]]:
        """The software aggregator job object of every node of the plan (docs/protocol.md, control channel):
        ``addresses`` the group's workers' "ip:port", ``data`` each node's aggregator address, ``root_job``
        the root's job id (default ``job``): a leaf job id per rack is ``job`` with this generation."""
        bases = bases or {}
        if self.root is None:
            rack = self.racks[0]
            return {rack.node.name: {"job": job, "generation": generation, "pool": pool, "lanes": lanes,
                                     "base": bases.get(rack.node.name, 0),
                                     "workers": [addresses[i] for i in rack.hosts]}}
        root_job = job if root_job is None else root_job
        if root_job == job and any(r.node.aggregator == self.root.aggregator for r in self.racks):
            raise FabricError(f"fabric: root {self.root.name!r} shares an aggregator with a leaf: it needs a "
                                f"job id of its own")
        owners = self.owner_only
        out = {self.root.name: {
            "job": root_job, "generation": generation, "pool": pool, "lanes": lanes, "role": "root",
            "base": bases.get(self.root.name, 0), "workers": [data[r.node.name] for r in self.racks],
            "owners": [r for r, rack in enumerate(self.racks) for _ in rack.hosts] if owners else None}}
        for r, rack in enumerate(self.racks):
            local = range(rack.first, rack.first + len(rack.hosts))
            out[rack.node.name] = {
                "job": job, "generation": generation, "pool": pool, "lanes": lanes, "role": "leaf",
                "base": bases.get(rack.node.name, 0), "workers": [addresses[i] for i in rack.hosts],
                "owners": [g - rack.first if g in local else UP for g in range(self.servers)] if owners else None,
                "up": {"job": root_job, "generation": generation, "worker": r, "root": data[self.root.name]}}
        return out


def plan(fabric: Fabric, hosts: Sequence[str]) -> TreePlan:
    """Place a group whose worker i runs on ``hosts[i]``: the leaves of its hosts in the fabric's order, its
    workers in their order under each. One leaf: flat there. Several: they must share one root."""
    racks: list[Rack] = []
    by_leaf: dict[str, list[int]] = {}
    for i, h in enumerate(hosts):
        by_leaf.setdefault(fabric.leaf_of(h).name, []).append(i)
    first = 0
    for node in fabric.nodes.values():
        if node.name in by_leaf:
            members = tuple(by_leaf[node.name])
            if len(members) > MAX_RACK:
                raise FabricError(f"fabric leaf {node.name!r}: {len(members)} workers of one group, "
                                    f"at most {MAX_RACK}")
            racks.append(Rack(node, members, first))
            first += len(members)
    if len(racks) == 1:
        return TreePlan(tuple(racks), None, first)
    aggregators = [r.node.aggregator for r in racks]
    if len(set(aggregators)) != len(aggregators):  # one aggregator holds one job of a job id
        raise FabricError("fabric: the group's leaves " + ", ".join(repr(r.node.name) for r in racks)
                            + " do not each have an aggregator of their own")
    uplinks = {r.node.uplink for r in racks}
    if len(uplinks) != 1 or None in uplinks:
        raise FabricError("fabric: the group's leaves " + ", ".join(repr(r.node.name) for r in racks)
                            + " share no root")
    return TreePlan(tuple(racks), fabric.nodes[uplinks.pop()], first)
