"""Programs a job's tree role on a switch (docs/protocol.md, "Trees across racks", On a switch): the P4
`tree_role` table (job -> leaf, with its uplink, or root) and, at a leaf, the `uplink` table that admits
what comes down from the root and names the leaf job it answers.

A leaf job is a flat allocation of its rack's servers (admission and result_rewrite as ever) plus these
entries; a root job is a flat allocation whose workers are the leaves (each leaf a "host" at the port its
uplink arrives on, with its aggregation MAC and IP, and the PASSING port as its UDP port) plus its role.
Tree jobs carry SUM and MAX rounds only on a switch: the program takes no owner map yet.
"""

from __future__ import annotations

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
COUNTERS = ("sent_up", "answered", "late_answer")  # the roles' per-job counters (PassingIngress.*)


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


def leaf_entries(switch: Switch, a: Allocation, up: Uplink) -> list[p4runtime_pb2.Entity]:
    role = switch.table_entry(ROLE_TABLE, {"job": a.job}, LEAF, {
        "up_job": up.job, "up_generation": up.generation, "up_worker": up.worker, "port": up.port,
        "mac": mac_to_int(up.mac), "ip": ip_to_int(up.ip)})
    down = switch.table_entry(UPLINK_TABLE, {"job": up.job}, FROM_UPLINK, {
        "port": up.port, "generation": up.generation, "worker": up.worker, "leaf_job": a.job,
        "leaf_generation": a.generation, "base": a.base, "pool": a.pool, "full": a.full, "epoch": a.epoch,
        "group": a.group})
    return [role, down]


def root_entries(switch: Switch, a: Allocation) -> list[p4runtime_pb2.Entity]:
    return [switch.table_entry(ROLE_TABLE, {"job": a.job}, ROOT)]


def install(switch: Switch, entries: list[p4runtime_pb2.Entity]) -> None:
    switch.write([switch.update("insert", e) for e in entries])


def remove(switch: Switch, entries: list[p4runtime_pb2.Entity]) -> None:
    switch.write([switch.update("delete", e) for e in entries])
