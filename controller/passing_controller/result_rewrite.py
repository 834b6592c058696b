"""Programs the job's multicast group and the egress `result_rewrite` table.

A completed round is replicated once per worker (replication id = worker index); the
egress rewrites each copy's MAC/IP/UDP destination to that worker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .allocation import Allocation
from .topology import ip_to_int, mac_to_int

if TYPE_CHECKING:  # the session needs the switch extra; importing this module does not
    from p4.v1 import p4runtime_pb2

    from .session import Switch

TABLE = "PassingEgress.result_rewrite"
ACTION = "PassingEgress.to_worker"


def entries(switch: Switch, a: Allocation) -> list[p4runtime_pb2.Entity]:
    group = switch.multicast_group(a.group, [(w.host.port, w.index) for w in a.workers])
    rewrites = [
        switch.table_entry(TABLE, {"job": a.job, "worker": w.index}, ACTION,
                           {"mac": mac_to_int(w.host.mac), "ip": ip_to_int(w.host.ip), "port": w.udp_port})
        for w in a.workers
    ]
    return [group, *rewrites]


def install(switch: Switch, a: Allocation) -> None:
    switch.write([switch.update("insert", e) for e in entries(switch, a)])


def remove(switch: Switch, a: Allocation) -> None:
    switch.write([switch.update("delete", e) for e in reversed(entries(switch, a))])
