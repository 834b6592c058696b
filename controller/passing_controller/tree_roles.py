"""Programs a job's tree role on a switch (docs/protocol.md, "Trees across racks", On a switch): the P4
`tree_role` table (job -> leaf, with its uplink, or root), the job's `owner_map` ((job, owner) -> its
worker here, or up), and at a leaf the `uplink` table that admits what comes down from the root and names
the leaf job it answers, and its multicast group's uplink replica (a server's GATHER goes up by it).

A leaf job is a flat allocation of its rack's servers (admission and result_rewrite as ever) plus these
entries; a root job is a flat allocation whose workers are the leaves (each leaf a "host" at the port its
uplink arrives on, with its aggregation MAC and IP, and the PASSING port as its UDP port) plus its role.
Owner maps are fabric.py's (``TreePlan.job_objects``' "owners"): a worker index, UP for another rack's
server, NONE for no server; without one (None) the tree carries SUM and MAX rounds only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .allocation import Allocation
from .topology import ip_to_int, mac_to_int

if TYPE_CHECKING:  # the session needs the switch extra; importing this module does not
    from p4.v1 import p4runtime_pb2

    from .session import Switch

ROLE_TABLE = "PassingIngress.tree_role"
LEAF, ROOT = "PassingIngress.leaf", "PassingIngress.root"
UPLINK_TABLE = "PassingIngress.uplink"
FROM_UPLINK = "PassingIngress.from_uplink"
OWNER_TABLE = "PassingIngress.owner_map"
OWNER_WORKER, OWNER_UP = "PassingIngress.owner_worker", "PassingIngress.owner_up"
COUNTERS = ("sent_up", "answered", "late_answer")  # the roles' per-job counters (PassingIngress.*)
UP_RID = 255  # PASSING_UP_RID of p4/v1model/passing.p4: the replication id of a leaf group's uplink replica
UP, NONE = -2, -1  # an owner map's values but worker indices (fabric.py's UP; the software aggregator's)
MAX_OWNERS = 128  # the wire's 7-bit owner


@dataclass(frozen=True)
class Uplink:
    """Where a leaf job's partials go: the root's job id and generation, this leaf's worker index there,
    the switch port toward the root, and the root's aggregation MAC and IP."""

    job: int
    generation: int
    worker: int
    port: int
    mac: str
    ip: str


def owner_entries(switch: Switch, job: int, owners: Sequence[int] | None) -> list[p4runtime_pb2.Entity]:
    """The job's owner map: an entry per owner that names a worker here, or up (UP)."""
    if owners is None:
        return []
    if len(owners) > MAX_OWNERS or any(o < UP for o in owners):
        raise ValueError(f"job {job}: an owner map has at most {MAX_OWNERS} entries, each a worker, UP or NONE")
    return [switch.table_entry(OWNER_TABLE, {"job": job, "owner": g}, OWNER_UP) if o == UP else
            switch.table_entry(OWNER_TABLE, {"job": job, "owner": g}, OWNER_WORKER, {"worker": o})
            for g, o in enumerate(owners) if o != NONE]


def leaf_group(switch: Switch, a: Allocation, up: Uplink) -> p4runtime_pb2.Entity:
    """The leaf job's multicast group: its servers (result_rewrite's) and the uplink replica; written over
    result_rewrite's group ("modify") once that is installed."""
    return switch.multicast_group(a.group, [(w.host.port, w.index) for w in a.workers] + [(up.port, UP_RID)])


def leaf_entries(switch: Switch, a: Allocation, up: Uplink,
                 owners: Sequence[int] | None = None) -> list[p4runtime_pb2.Entity]:
    role = switch.table_entry(ROLE_TABLE, {"job": a.job}, LEAF, {
        "up_job": up.job, "up_generation": up.generation, "up_worker": up.worker, "port": up.port,
        "mac": mac_to_int(up.mac), "ip": ip_to_int(up.ip)})
    down = switch.table_entry(UPLINK_TABLE, {"job": up.job}, FROM_UPLINK, {
        "port": up.port, "generation": up.generation, "worker": up.worker, "leaf_job": a.job,
        "leaf_generation": a.generation, "base": a.base, "pool": a.pool, "full": a.full, "epoch": a.epoch,
        "group": a.group})
    return [role, down, *owner_entries(switch, a.job, owners)]


def root_entries(switch: Switch, a: Allocation, owners: Sequence[int] | None = None) -> list[p4runtime_pb2.Entity]:
    return [switch.table_entry(ROLE_TABLE, {"job": a.job}, ROOT), *owner_entries(switch, a.job, owners)]


def install_leaf(switch: Switch, a: Allocation, up: Uplink,
                 owners: Sequence[int] | None = None) -> list[p4runtime_pb2.Entity]:
    """A leaf job's role over its flat entries (admission and result_rewrite installed): returns what
    ``remove`` takes away (before result_rewrite's removal, which deletes the group)."""
    entries = leaf_entries(switch, a, up, owners)
    switch.write([switch.update("modify", leaf_group(switch, a, up))])
    install(switch, entries)
    return entries


def install_root(switch: Switch, a: Allocation, owners: Sequence[int] | None = None) -> list[p4runtime_pb2.Entity]:
    entries = root_entries(switch, a, owners)
    install(switch, entries)
    return entries


def install(switch: Switch, entries: list[p4runtime_pb2.Entity]) -> None:
    switch.write([switch.update("insert", e) for e in entries])


def remove(switch: Switch, entries: list[p4runtime_pb2.Entity]) -> None:
    switch.write([switch.update("delete", e) for e in entries])
