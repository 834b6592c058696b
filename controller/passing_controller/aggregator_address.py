"""Programs the P4 `aggregator_address` table: the IPv4 address hosts send DATA to.

PASSING packets to any other address (a PS host behind the same switch) are forwarded
like any other traffic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .topology import Topology, ip_to_int

if TYPE_CHECKING:  # the session needs the switch extra; importing this module does not
    from p4.v1 import p4runtime_pb2

    from .session import Switch

TABLE = "PassingIngress.aggregator_address"


def entries(switch: Switch, topo: Topology) -> list[p4runtime_pb2.Entity]:
    return [switch.table_entry(TABLE, {"ip": ip_to_int(topo.aggregation_ip)}, "NoAction")]


def install(switch: Switch, topo: Topology) -> None:
    switch.write([switch.update("insert", e) for e in entries(switch, topo)])
