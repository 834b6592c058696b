"""The topology file: which host sits on which switch port, with which addresses.

JSON::

    {
      "switch": {"p4runtime": "127.0.0.1:9559", "device_id": 0,
                 "aggregation_mac": "02:00:00:00:00:fe", "aggregation_ip": "10.0.0.254",
                 "slots": 1024, "chip": "tofino2",
                 "tls": {"ca": "ca.pem", "cert": "controller.pem", "key": "controller.key"}},
      "hosts": [{"name": "h1", "mac": "02:00:00:00:00:01", "ip": "10.0.0.1", "port": 1}, ...],
      "ps": [{"data": "10.0.0.100:9877", "control": "tcp://10.0.0.100:9878", "mtu": 9000,
              "public_key": "Z85..."}],
      "fabric": [{"name": "rack1", "ps": "10.0.0.100:9877", "hosts": ["h1"], "uplink": "spine"}, ...]
    }

Without "switch" the controller serves software aggregators (PS) only; "hosts" may then
be left out, and a join may name its host by any IPv4 address. Nothing about ports or
addresses is hard-coded anywhere else. "tls" (optional): P4Runtime over TLS, with the CA of the
switch's certificate, and a client certificate and key where the switch asks for one. A PS's
``public_key`` (its CURVE key, Z85) is needed only when it is not the key directory's
``aggregator.key`` (docs/security.md). "fabric" (optional): racks of hosts under leaf aggregators and
the roots that join them, for trees across racks (passing_controller.fabric, docs/control.md, Fabric).

A group on the switch uses the lane count of the P4 program its chip runs (``CHIP_LANES``:
"chip" is "bmv2", "tofino" or "tofino2", "bmv2" by default). A "lanes" of the switch's own must
agree with it, unless "lanes_override" is true: for a program compiled with another
PASSING_LANES (docs/control.md, Lanes). A group on a PS gets
the largest lane count that both the PS takes (its `ping` says) and the path MTU between the
hosts and it allows without IP fragmentation: `mtu` of the PS entry, 1500 by default (65536
for a PS on a loopback address, the embedded one's case).
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .fabric import Fabric, FabricError


class TopologyError(ValueError):
    """A topology file that cannot be used, with the reason."""


SWITCH = "switch"  # the one switch's control name (a flat group's, a fabric node's "switch": true)
SWITCH_PREFIX = "switch:"  # a named switch's control name: "switch:" + its name in "switches"


def is_switch(control: str) -> bool:
    """Whether an aggregator's control name is a switch's (the one, or a named one) rather than a PS's."""
    return control == SWITCH or control.startswith(SWITCH_PREFIX)


# The lane count (int32 values per packet) of each switch chip's PASSING program, the one place the
# controller knows them; a switch entry's "chip" picks one. Each is a compile-time constant of its
# program, changed only by rebuilding it (then say so with "lanes" and "lanes_override"):
#   bmv2:    p4/v1model/passing.p4, PASSING_LANES of p4/include/constants.p4 (`make p4`)
#   tofino:  p4/tna/passing.p4 built with TOFINO_LANES (the Makefile's default, `make p4-tofino`)
#   tofino2: p4/t2na/passing.p4, its PASSING_T2NA_LANES (`make p4-tofino2`; 72 before the tree roles)
CHIP_LANES = {"bmv2": 64, "tofino": 64, "tofino2": 64}
DEFAULT_CHIP = "bmv2"  # a topology that names no chip: the lane count every switch had before chips
MAX_SWITCH_LANES = 1024  # what an override may state: the most the host engines and the aggregator take


IP_UDP_HEADERS = 20 + 8  # an IPv4 header without options, a UDP header
PASSING_HEADER = 16  # docs/protocol.md
MAX_UDP_PAYLOAD = 65535 - IP_UDP_HEADERS  # 65507: the largest datagram whatever the MTU
DEFAULT_MTU = 1500  # Ethernet: what a path between machines carries unless the topology says more
LOOPBACK_MTU = 65536  # Linux's lo


def lanes_for(mtu: int, aggregator_max: int) -> int:
    """The most int32 lanes a packet may carry over a path of ``mtu`` bytes (IPv4 and UDP headers
    included: no IP fragmentation) to an aggregator that takes at most ``aggregator_max``."""
    fits = (min(mtu - IP_UDP_HEADERS, MAX_UDP_PAYLOAD) - PASSING_HEADER) // 4
    return max(1, min(fits, aggregator_max))


PS_WINDOW_BYTES = 2 << 20  # what a group keeps in flight at a PS by default: workers x pool x packet
PS_MIN_POOL = 16


def ps_pool(lanes: int, workers: int, most: int) -> int:
    """A PS group's pool when the job does not ask for one: its workers' packets in flight
    (workers x pool x packet bytes) within PS_WINDOW_BYTES, so that the slots the PS's one
    data thread touches stay in its cache, and at most ``most`` (the controller's default).
    Switch-sized packets keep ``most``; measured in docs/benchmarks.md (issue 22)."""
    packet = PASSING_HEADER + 4 * lanes
    return max(PS_MIN_POOL, min(most, PS_WINDOW_BYTES // (workers * packet)))


def switch_lanes(sw: dict[str, Any]) -> tuple[str, int]:
    """The switch entry's chip and the lane count its groups get: its chip's program's
    (CHIP_LANES), or an explicit "lanes" with "lanes_override": true (a program rebuilt with
    another PASSING_LANES). A "lanes" that disagrees with the chip without the override is an
    error: hosts sending packets of another size than the program parses would have every one
    dropped, or worse, summed in the wrong lanes."""
    if not isinstance(sw, dict):
        raise TopologyError(f'topology: "switch" must be an object, got {sw!r}')
    chip = sw.get("chip", DEFAULT_CHIP)
    if not isinstance(chip, str) or chip not in CHIP_LANES:
        raise TopologyError(f'switch "chip" {chip!r} is not a known chip: one of '
                            + ", ".join(f"{c!r} ({n} lanes)" for c, n in CHIP_LANES.items()))
    override = sw.get("lanes_override", False)
    if not isinstance(override, bool):
        raise TopologyError(f'switch "lanes_override" must be true or false, got {override!r}')
    program = CHIP_LANES[chip]
    if "lanes" not in sw:
        if override:
            raise TopologyError('switch "lanes_override" is true but no "lanes" says what the program was built with')
        return chip, program
    lanes = sw["lanes"]
    if isinstance(lanes, bool) or not isinstance(lanes, int) or not 1 <= lanes <= MAX_SWITCH_LANES:
        raise TopologyError(f'switch "lanes" must be an integer 1..{MAX_SWITCH_LANES}, got {lanes!r}')
    if lanes != program and not override:
        raise TopologyError(
            f'switch "lanes" {lanes} disagrees with chip {chip!r}, whose PASSING program has {program} lanes: '
            f'leave "lanes" out to use {program}, name the right "chip", or, for a program compiled with '
            f'PASSING_LANES={lanes}, add "lanes_override": true')
    return chip, lanes


def mac_to_int(mac: str) -> int:
    parts = mac.split(":")
    if len(parts) != 6 or not all(len(p) == 2 for p in parts):
        raise TopologyError(f"bad MAC address {mac!r}")
    try:
        return int("".join(parts), 16)
    except ValueError:
        raise TopologyError(f"bad MAC address {mac!r}") from None


def ip_to_int(ip: str) -> int:
    try:
        return int(ipaddress.IPv4Address(ip))
    except ValueError:
        raise TopologyError(f"bad IPv4 address {ip!r}") from None


def _tls(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("ca"), str) or set(value) - {"ca", "cert", "key"} \
            or ("cert" in value) != ("key" in value):
        raise TopologyError('switch "tls" must be {"ca": path} or {"ca", "cert", "key"} (paths to PEM files)')
    return {k: str(v) for k, v in value.items()}


def _public_key(value: Any) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) != 40:
        raise TopologyError(f"a PS public_key must be a 40-character Z85 CURVE key, got {value!r}")
    return value.encode()


@dataclass(frozen=True)
class Host:
    name: str
    mac: str
    ip: str
    port: int
    switch: str | None = None  # the named switch it is on ("switches"); None: the one "switch" (or none)


@dataclass(frozen=True)
class PsEndpoint:
    data: str  # host:port of the software aggregator's UDP socket
    control: str  # its ZeroMQ control endpoint
    mtu: int = DEFAULT_MTU  # the path MTU between the hosts and it
    public_key: bytes | None = None  # its CURVE public key (Z85); None: the key directory's aggregator.key

    def lanes(self, ping: dict[str, Any]) -> int:
        """A group's lane count on this PS, from its `ping` answer (the largest packet it takes)."""
        return lanes_for(self.mtu, int(ping.get("max_lanes", ping["lanes"])))  # an older PS states only lanes

    @staticmethod
    def default_mtu(data: str) -> int:
        host = data.rsplit(":", 1)[0]
        try:
            return LOOPBACK_MTU if ipaddress.ip_address(host).is_loopback else DEFAULT_MTU
        except ValueError:  # a host name: a machine of the network
            return LOOPBACK_MTU if host == "localhost" else DEFAULT_MTU


@dataclass
class Topology:
    p4runtime: str | None  # None: no switch, PS only
    device_id: int
    aggregation_mac: str
    aggregation_ip: str
    slots: int
    lanes: int
    hosts: list[Host]
    ps: list[PsEndpoint] = field(default_factory=list)
    tls: dict[str, str] | None = None  # P4Runtime over TLS: {"ca", "cert"?, "key"?} (file paths)
    chip: str | None = None  # the switch's chip (a CHIP_LANES key); None: no switch
    fabric: Fabric | None = None  # racks of leaves under roots, for trees (passing_controller.fabric); None: one level
    # several switches ("switches", docs/control.md, "Several switches"): each one's view, by name. A view is
    # a Topology of that switch: its own hosts in ``hosts``, the hosts on other switches in ``remote`` and the
    # other switches' aggregation addresses in ``neighbours``, each at this switch's port toward it
    switches: dict[str, Topology] = field(default_factory=dict)
    remote: list[Host] = field(default_factory=list)
    neighbours: list[Host] = field(default_factory=list)
    name: str = SWITCH  # a view's: its control name, "switch:NAME"

    def host(self, name_or_ip: str) -> Host:
        for h in [*self.hosts, *self.remote, *self.neighbours]:
            if name_or_ip in (h.name, h.ip):
                return h
        if self.p4runtime is None and not self.switches:  # PS only: an address is all a software aggregator needs
            ip_to_int(name_or_ip)
            return Host(name_or_ip, "00:00:00:00:00:00", name_or_ip, 0)
        raise TopologyError(f"no host {name_or_ip!r} in the topology")

    @classmethod
    def load(cls, path: str | Path) -> Topology:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise TopologyError(f"cannot read topology {path}: {e}") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Topology:
        misplaced = sorted({"chip", "lanes_override"} & set(raw))
        if misplaced:  # read nowhere there: a switch would silently run the default chip's lanes
            raise TopologyError(f'topology: {", ".join(misplaced)} belong in the "switch" object')
        try:
            ps = [PsEndpoint(str(p["data"]), str(p["control"]),
                             mtu=int(p.get("mtu", PsEndpoint.default_mtu(str(p["data"])))),
                             public_key=_public_key(p.get("public_key"))) for p in raw.get("ps", [])]
            if "switches" in raw:
                if "switch" in raw:
                    raise TopologyError('topology: "switch" and "switches" together: name the one switch in '
                                        '"switches" too (a topology has one switch, or several named ones)')
                topo = multi_switch(cls, raw, ps)
            elif "switch" not in raw:
                if not ps:
                    raise TopologyError("topology: neither a switch nor a PS to aggregate on")
                hosts = [Host(str(h["name"]), str(h.get("mac", "00:00:00:00:00:00")), str(h["ip"]),
                              int(h.get("port", 0))) for h in raw.get("hosts", [])]
                topo = cls(p4runtime=None, device_id=0, aggregation_mac="00:00:00:00:00:00",
                           aggregation_ip="0.0.0.0", slots=0, lanes=int(raw.get("lanes", 64)), hosts=hosts, ps=ps)
            else:
                sw = raw["switch"]
                if any("switch" in h for h in raw["hosts"]):
                    raise TopologyError('topology: a host names its "switch", but only "switches" names switches')
                hosts = [Host(str(h["name"]), str(h["mac"]), str(h["ip"]), int(h["port"])) for h in raw["hosts"]]
                chip, lanes = switch_lanes(sw)
                topo = cls(
                    p4runtime=str(sw["p4runtime"]), device_id=int(sw.get("device_id", 0)),
                    aggregation_mac=str(sw["aggregation_mac"]), aggregation_ip=str(sw["aggregation_ip"]),
                    slots=int(sw.get("slots", 1024)), lanes=lanes, hosts=hosts, ps=ps,
                    tls=_tls(sw.get("tls")), chip=chip,
                )
        except TopologyError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise TopologyError(f"topology: missing or bad field {e}") from None
        for p in topo.ps:
            if not 68 <= p.mtu <= LOOPBACK_MTU:  # IPv4's minimum .. Linux's loopback
                raise TopologyError(f"PS {p.data}: mtu {p.mtu} outside 68..{LOOPBACK_MTU}")
        for h in topo.hosts:
            mac_to_int(h.mac)
            ip_to_int(h.ip)
            if not 0 <= h.port < 512:
                raise TopologyError(f"host {h.name}: switch port {h.port} outside 0..511")
        mac_to_int(topo.aggregation_mac)
        ip_to_int(topo.aggregation_ip)
        for attr in ("name", "mac", "ip", "port"):
            values = [getattr(h, attr) if attr != "port" else (h.switch, h.port) for h in topo.hosts]
            if len(set(values)) != len(values):
                raise TopologyError(f"two hosts share a {attr}" + (" on one switch" if attr == "port" else ""))
        if "fabric" in raw:
            on = {name: [n for h in view.hosts for n in (h.name, h.ip)] for name, view in topo.switches.items()}
            try:
                topo.fabric = Fabric.from_list(raw["fabric"], [n for h in topo.hosts for n in (h.name, h.ip)],
                                               [p.data for p in topo.ps], topo.p4runtime is not None, on)
            except FabricError as e:
                raise TopologyError(str(e)) from None
            tree_lanes(topo)
        return topo

    def view(self, control: str) -> Topology:
        """The topology of the switch whose control name is ``control``: this one's for SWITCH, a named
        switch's view for "switch:NAME"."""
        if control == SWITCH:
            return self
        return self.switches[control.removeprefix(SWITCH_PREFIX)]


SWITCH_KEYS = {"p4runtime", "device_id", "aggregation_mac", "aggregation_ip", "slots", "chip", "lanes",
               "lanes_override", "tls", "links"}


def multi_switch(cls: type[Topology], raw: dict[str, Any], ps: list[PsEndpoint]) -> Topology:
    """A topology of several named switches ("switches": {name: switch entry with its "links"}; every host
    names the switch it is on): the whole, with no switch of its own (flat groups go to a PS), and each
    switch's view in ``switches`` (docs/control.md, "Several switches")."""
    named = raw["switches"]
    if not isinstance(named, dict) or not named:
        raise TopologyError('topology: "switches" must be an object of named switch entries')
    hosts = []
    for h in raw["hosts"]:
        if h.get("switch") not in named:
            raise TopologyError(f"host {h.get('name')!r}: \"switch\" {h.get('switch')!r} is none of the topology's "
                                f"switches ({', '.join(map(repr, named))})")
        hosts.append(Host(str(h["name"]), str(h["mac"]), str(h["ip"]), int(h["port"]), str(h["switch"])))
    links: dict[str, dict[str, int]] = {}
    views: dict[str, Topology] = {}
    for name, sw in named.items():
        if not name or not isinstance(sw, dict):
            raise TopologyError(f"switch {name!r}: a named switch must be an object (and its name not empty)")
        if set(sw) - SWITCH_KEYS:
            raise TopologyError(f"switch {name!r}: unknown keys {sorted(set(sw) - SWITCH_KEYS)}")
        try:
            chip, lanes = switch_lanes(sw)
        except TopologyError as e:
            raise TopologyError(f"switch {name!r}: {e}") from None
        links[name] = _links(name, sw.get("links", {}), named, [h.port for h in hosts if h.switch == name])
        views[name] = cls(p4runtime=str(sw["p4runtime"]), device_id=int(sw.get("device_id", 0)),
                          aggregation_mac=str(sw["aggregation_mac"]), aggregation_ip=str(sw["aggregation_ip"]),
                          slots=int(sw.get("slots", 1024)), lanes=lanes, chip=chip, tls=_tls(sw.get("tls")),
                          hosts=[h for h in hosts if h.switch == name], name=SWITCH_PREFIX + name)
    for name, to in links.items():
        for other in to:
            if name not in links[other]:
                raise TopologyError(f"switch {name!r} links to {other!r}, which names no link back to it")
    for attr in ("aggregation_mac", "aggregation_ip"):
        values = [getattr(v, attr) for v in views.values()] + [getattr(h, attr.split("_")[1]) for h in hosts]
        if len(set(values)) != len(values):
            raise TopologyError(f"two switches, or a switch and a host, share an address ({attr})")
    sessions = [(v.p4runtime, v.device_id) for v in views.values()]
    if len(set(sessions)) != len(sessions):
        raise TopologyError("two switches share a P4Runtime address and device_id: each needs its own session")
    for name, view in views.items():
        ports = _next_hops(name, links)
        view.remote = [Host(h.name, h.mac, h.ip, ports[h.switch], h.switch) for h in hosts
                       if h.switch != name and h.switch in ports]
        view.neighbours = [Host(other, v.aggregation_mac, v.aggregation_ip, ports[other], other)
                           for other, v in views.items() if other in ports]
    return cls(p4runtime=None, device_id=0, aggregation_mac="00:00:00:00:00:00", aggregation_ip="0.0.0.0", slots=0,
               lanes=int(raw.get("lanes", 64)), hosts=hosts, ps=ps, switches=views)


def _links(name: str, raw: Any, named: dict[str, Any], host_ports: list[int]) -> dict[str, int]:
    """A switch's "links": {other switch: this switch's port toward it}."""
    if not isinstance(raw, dict) or any(o not in named or o == name for o in raw) \
            or any(isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < 512 for p in raw.values()):
        raise TopologyError(f"switch {name!r}: \"links\" must map other switches of the topology to ports 0..511, "
                            f"got {raw!r}")
    ports = list(raw.values()) + host_ports
    if len(set(ports)) != len(ports):
        raise TopologyError(f"switch {name!r}: a port is named twice among its links and hosts")
    return dict(raw)


def _next_hops(start: str, links: dict[str, dict[str, int]]) -> dict[str, int]:
    """Every switch reachable from ``start`` over the links -> ``start``'s port toward it (breadth first)."""
    out: dict[str, int] = {}
    frontier = [(other, port) for other, port in links[start].items()]
    while frontier:
        other, port = frontier.pop(0)
        if other in out or other == start:
            continue
        out[other] = port
        frontier += [(nxt, port) for nxt in links[other]]
    return out


def tree_lanes(topo: Topology) -> None:
    """The switches of one tree (a root and its leaves) take one lane count: a packet keeps its lanes on every
    hop, and a switch parses its program's alone."""
    assert topo.fabric is not None
    for root in (n for n in topo.fabric.nodes.values() if not n.leaf):
        members = [root, *(n for n in topo.fabric.nodes.values() if n.uplink == root.name)]
        lanes = {n.name: topo.view(n.aggregator).lanes for n in members if is_switch(n.aggregator)}
        if len(set(lanes.values())) > 1:
            raise TopologyError(f"fabric root {root.name!r}: its switches take different lane counts "
                                + ", ".join(f"{n} {v}" for n, v in lanes.items())
                                + ": one tree's switches must run programs of one lane count")
