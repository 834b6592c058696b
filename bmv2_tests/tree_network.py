"""Three BMv2 switches in Mininet: two racks' leaves and the spine that joins them (docs/bmv2.md, A tree).

    h1 h2 ... (rack 1)        h3 h4 ... (rack 2)
       |  |                      |  |
      s1 (leaf) port k+1 --- 1 s3 (spine) 2 --- port k+1 s2 (leaf)
                                  | 3    | 4 (``controller_ip`` given)
                                 hs      ctl (in the root namespace: the controller, as in bmv2_tests/network.py)
hs is a server on the spine: the stranger the root admits nothing from.

Every switch runs the same program; its entries make it a leaf or the root (passing_controller.tree_roles).
Plain traffic crosses the tree by L2 forwarding; no switch forwards to another switch's aggregation MAC,
so a server's datagram never reaches the root but through its leaf's program.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass

from .network import (
    HostInfo,
    MininetWithAgents,
    free_tcp_port,
    host_mac,
    import_mininet,
    make_switch_class,
    prepare_hosts,
    wait_for_grpc,
)

SPINE = "s3"
STRANGER = "hs"


@dataclass(frozen=True)
class SwitchInfo:
    name: str
    mac: str  # its aggregation address: where its servers (a leaf) or its leaves (the root) send DATA
    ip: str
    grpc_port: int
    uplink: int | None  # a leaf's port toward the spine


class TreeNetwork(MininetWithAgents):
    """``per_rack`` hosts under each of the leaves s1 and s2 (ports 1..per_rack, uplink port per_rack + 1),
    the spine s3 (port r + 1 to leaf r + 1, port 3 to the stranger hs, port 4 to the controller's host ctl
    when ``controller_ip`` is given: a host in the root namespace, where passing-controller reaches every
    switch's gRPC port on localhost and the servers through the switches)."""

    def __init__(self, per_rack: int = 2, controller_ip: str | None = None) -> None:
        import_mininet()
        from mininet.net import Mininet

        self.per_rack = per_rack
        self.ctl = None if controller_ip is None else HostInfo("ctl", host_mac(0x65), controller_ip, 4)
        self.log_dir = tempfile.mkdtemp(prefix="passing-bmv2-tree-")
        self.net = Mininet(controller=None, build=False, autoSetMacs=False, autoStaticArp=False)
        self.agents: dict = {}
        try:
            self._start(make_switch_class())
        except BaseException:
            self.stop()
            raise

    def _start(self, BMv2Switch: type) -> None:
        k = self.per_rack
        self.switches = {
            "s1": SwitchInfo("s1", "02:00:00:00:01:fe", "10.0.0.251", free_tcp_port(), k + 1),
            "s2": SwitchInfo("s2", "02:00:00:00:02:fe", "10.0.0.252", free_tcp_port(), k + 1),
            SPINE: SwitchInfo(SPINE, "02:00:00:00:03:fe", "10.0.0.250", free_tcp_port(), None),
        }
        for s in self.switches.values():
            self.net.addSwitch(s.name, cls=BMv2Switch, grpc_port=s.grpc_port, log_dir=self.log_dir)
        self.racks: list[list[HostInfo]] = []
        n = 0
        for leaf in ("s1", "s2"):
            rack = []
            for port in range(1, k + 1):
                n += 1
                info = HostInfo(f"h{n}", host_mac(n), f"10.0.0.{n}", port)
                self.net.addHost(info.name, ip=f"{info.ip}/24", mac=info.mac)
                self.net.addLink(info.name, leaf, port2=port)
                rack.append(info)
            self.racks.append(rack)
        for r, leaf in enumerate(("s1", "s2")):
            self.net.addLink(leaf, SPINE, port1=k + 1, port2=r + 1)
        self.stranger = HostInfo(STRANGER, host_mac(0x64), "10.0.0.100", 3)
        self.net.addHost(STRANGER, ip=f"{self.stranger.ip}/24", mac=self.stranger.mac)
        self.net.addLink(STRANGER, SPINE, port2=3)
        if self.ctl is not None:
            self.net.addHost(self.ctl.name, ip=f"{self.ctl.ip}/24", mac=self.ctl.mac, inNamespace=False)
            self.net.addLink(self.ctl.name, SPINE, port2=self.ctl.port)
        self.net.build()
        self.net.start()
        arp = {h.name: {self.switches[leaf].ip: self.switches[leaf].mac}
               for leaf, rack in zip(("s1", "s2"), self.racks, strict=True) for h in rack}
        arp[STRANGER] = {self.switches[SPINE].ip: self.switches[SPINE].mac}
        if self.ctl is not None:  # a PS there (a spare taking a leaf's place) sends its partials to the spine
            arp[self.ctl.name] = {self.switches[SPINE].ip: self.switches[SPINE].mac}
        prepare_hosts(self.net, self.hosts + ([self.ctl] if self.ctl is not None else []), arp)
        for s in self.switches.values():
            wait_for_grpc(self.net.get(s.name), s.grpc_port, self.log_dir)

    @property
    def hosts(self) -> list[HostInfo]:
        return [h for rack in self.racks for h in rack] + [self.stranger]

    def topology(self) -> dict:
        """The controller's topology file for this network (docs/bmv2.md, "A tree of three switches"): the
        three switches by name with their links, every host on its switch, and the fabric's racks: rack1 on
        s1, rack2 on s2, the spine on s3."""
        k = self.per_rack
        switches = {
            name: {"p4runtime": f"127.0.0.1:{s.grpc_port}", "aggregation_mac": s.mac, "aggregation_ip": s.ip,
                   "chip": "bmv2", "links": {SPINE: k + 1} if s.uplink else {"s1": 1, "s2": 2}}
            for name, s in self.switches.items()}
        on = [(h, leaf) for leaf, rack in zip(("s1", "s2"), self.racks, strict=True) for h in rack]
        on += [(self.stranger, SPINE)] + ([(self.ctl, SPINE)] if self.ctl is not None else [])
        return {
            "switches": switches,
            "hosts": [{"name": h.name, "mac": h.mac, "ip": h.ip, "port": h.port, "switch": s} for h, s in on],
            "fabric": [{"name": f"rack{r + 1}", "switch": leaf, "hosts": [h.name for h in rack], "uplink": "spine"}
                       for r, (leaf, rack) in enumerate(zip(("s1", "s2"), self.racks, strict=True))]
            + [{"name": "spine", "switch": SPINE}],
        }

    def program_plain(self, switch: str, session) -> None:
        """What the controller writes on a switch from the topology alone: L2 forwarding (every host's MAC
        toward it, broadcasts to the switch's own hosts) and the switch's aggregation address, from the
        switch's view of ``topology()`` (passing_controller.topology, docs/control.md, Several switches)."""
        from passing_controller import aggregator_address, l2_forward
        from passing_controller.topology import Topology

        view = Topology.from_dict(self.topology()).view(f"switch:{switch}")
        l2_forward.install(session, view)
        aggregator_address.install(session, view)
