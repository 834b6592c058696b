"""Programs plain L2 forwarding: every host's MAC to its port, broadcast flooded to the switch's own hosts.

A switch of several (topology "switches") forwards a host on another switch to its port toward that switch
(the view's ``remote``); broadcasts stay on the switch (the hosts have static ARP), so no flood loops
between switches. No switch forwards to another's aggregation MAC: a server's datagram reaches a root only
through its leaf's program."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .topology import Topology, mac_to_int

if TYPE_CHECKING:  # the session needs the switch extra; importing this module does not
    from p4.v1 import p4runtime_pb2

    from .session import Switch

TABLE = "PassingIngress.l2_forward"
FORWARD, FLOOD = "PassingIngress.forward", "PassingIngress.flood"
FLOOD_GROUP = 1  # PASSING_FLOOD_GROUP in p4/include/constants.p4
BROADCAST = "ff:ff:ff:ff:ff:ff"


def entries(switch: Switch, topo: Topology) -> list[p4runtime_pb2.Entity]:
    forward = [
        switch.table_entry(TABLE, {"dst_addr": mac_to_int(h.mac)}, FORWARD, {"port": h.port})
        for h in [*topo.hosts, *topo.remote]
    ]
    flood = switch.table_entry(TABLE, {"dst_addr": mac_to_int(BROADCAST)}, FLOOD)
    group = switch.multicast_group(FLOOD_GROUP, [(h.port, 0) for h in topo.hosts])
    return [group, *forward, flood]


def install(switch: Switch, topo: Topology) -> None:
    switch.write([switch.update("insert", e) for e in entries(switch, topo)])
