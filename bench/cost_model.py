"""Cost model of one allreduce per scheme (docs/torch.md, "Schemes"), for the emulated-cluster benchmark.

The seed paper's equations count the bytes the bottleneck link carries; here they are
extended with what the wire really carries and with the self-clocked window:

* every 256-byte payload (64 int32 lanes) travels in a 314-byte frame
  (14 Ethernet + 20 IPv4 + 8 UDP + 16 PASSING header), so a link of B bit/s moves
  B / (8·314) PASSING packets per second; with another lane count L (``Setup.lanes``: the
  Tofino 2 program had 72 before the tree roles) the frame is 58 + 4·L bytes (346 for 288 of
  payload, 1.20x);
* a worker keeps at most ``pool`` packets in flight, so G windows sharing a link move
  at most G·pool packets per round-trip time: rate = min(B/(8·314), G·pool/RTT);
* gloo's ring runs over TCP: 1448 bytes of payload per 1514-byte frame (timestamps on),
  plus half a 66-byte ACK per segment for the flow the other way over the same link:
  1.07x the payload (measured on a server link in 4x2: 1.13x per all_reduce; the rest,
  gloo's own messages, is not modelled). A PASSING all_reduce measured 1.02x the bytes
  modelled here (the rest: its MAX round and the barrier).

Per all_reduce of K bytes (P = ceil(elements/L) packets, L = 64 lanes) with s servers × n ranks:

| scheme   | bottleneck link | packets on it (each way)  | windows on it |
| -------- | --------------- | ------------------------- | ------------- |
| ps       | the PS link     | s·n·P                     | s·n           |
| psring   | the PS link     | s·n·P/n = s·P             | s·n           |
| switchml | a server link   | n·P                       | n             |
| passing  | a server link   | n·P/n = P                 | n             |
| ring     | a server link   | 2(W−1)/W·K bytes over TCP | —             |

(P/n is the per-rank chunk after the in-host reduce-scatter, rounded up to whole packets.)
Both directions carry the same amount and are limited independently, so one direction
gives the time. The in-host schemes add the in-host reduce-scatter + all-gather time,
and every scheme a fixed per-call cost (the auto-scale MAX round, thread hand-offs,
Python): the harness measures both (an in-host probe and a one-packet all_reduce) and
passes them in, and takes half the one-packet all_reduce (a MAX and a SUM round trip) as
the RTT of the window limit; everything else is the equations above.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

LANES = 64  # a Tofino 1's single pass (and BMv2's program): the default of every Setup
FRAME_OVERHEAD = 14 + 20 + 8 + 16  # Ethernet, IPv4, UDP and PASSING headers of every PASSING packet


def payload(lanes: int = LANES) -> int:
    """Bytes of gradient per PASSING packet."""
    return 4 * lanes


def frame(lanes: int = LANES) -> int:
    """Bytes on the wire per PASSING packet: 314 at 64 lanes, 346 at 72."""
    return FRAME_OVERHEAD + payload(lanes)


PAYLOAD = payload()  # 256 bytes at the default lanes
FRAME = frame()  # 314 bytes at the default lanes
TCP_PAYLOAD, TCP_FRAME = 1448, 1514  # MSS with timestamps, Ethernet frame at MTU 1500
TCP_ACK_SHARE = 66 / 2  # a 66-byte ACK per two segments, sharing the link with the reverse flow's data

SCHEMES = ("ps", "psring", "switchml", "passing", "ring")
IN_HOST = {"psring", "passing"}  # schemes with the in-host reduce-scatter / all-gather


@dataclass(frozen=True)
class Setup:
    """What a prediction depends on besides the scheme and the gradient size."""

    servers: int
    ranks: int  # per server
    rate_mbit: float  # every server link and the PS link, each direction
    pool: int = 128  # packets in flight per worker
    rtt_s: float = 0.002  # unloaded round trip rank -> aggregator -> rank
    fixed_s: float = 0.0  # per-call cost independent of size (measured: a one-packet all_reduce)
    in_host_s: float = 0.0  # in-host reduce-scatter + all-gather of this size (measured), in-host schemes only
    lanes: int = LANES  # int32 values per PASSING packet: the aggregator's program (64 on each switch chip)


@dataclass(frozen=True)
class Prediction:
    scheme: str
    seconds: float  # fixed + in-host + network
    network_s: float
    in_host_s: float
    fixed_s: float
    link: str  # which link is the bottleneck
    link_bytes: float  # bytes on the wire over that link, one direction
    window_limited: bool  # the windows, not the link rate, set the pace

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def packets(elements: int, lanes: int = LANES) -> int:
    return math.ceil(elements / lanes)


def windows(scheme: str, servers: int, ranks: int) -> int:
    """Self-clocked windows that share the scheme's bottleneck link (0 for ring: TCP)."""
    if scheme == "ring":
        return 0
    return servers * ranks if scheme in ("ps", "psring") else ranks


def predict(scheme: str, elements: int, setup: Setup) -> Prediction:
    """Predicted seconds of one all_reduce of ``elements`` float32 values."""
    s, n = setup.servers, setup.ranks
    world = s * n
    bits_per_s = setup.rate_mbit * 1e6
    if scheme == "ring":
        # Ranks are numbered server by server, so gloo's ring leaves each server once:
        # that hop carries every one of the 2(W-1) steps' 1/W-sized segments.
        payload = 2 * (world - 1) / world * 4 * elements if world > 1 else 0.0
        wire_bytes = payload * (TCP_FRAME + TCP_ACK_SHARE) / TCP_PAYLOAD
        return Prediction(scheme, setup.fixed_s + wire_bytes * 8 / bits_per_s, wire_bytes * 8 / bits_per_s, 0.0,
                          setup.fixed_s, "server link", wire_bytes, False)
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; one of {', '.join(SCHEMES)}")
    in_host = scheme in IN_HOST and n > 1
    per_worker = packets(math.ceil(elements / n), setup.lanes) if in_host else packets(elements, setup.lanes)
    if scheme in ("ps", "psring"):
        link, count = "PS link", world * per_worker
    else:
        link, count = "server link", n * per_worker
    size = frame(setup.lanes)
    link_pps = bits_per_s / (8 * size)
    g = windows(scheme, s, n)
    window_pps = g * setup.pool / setup.rtt_s if setup.rtt_s > 0 else math.inf
    pps = min(link_pps, window_pps)
    network = count / pps
    host = setup.in_host_s if in_host else 0.0
    return Prediction(scheme, setup.fixed_s + host + network, network, host, setup.fixed_s, link, count * size,
                      window_pps < link_pps)


def bottleneck_packets_per_s(scheme: str, setup: Setup) -> float:
    """Packets per second the aggregator takes in when the bottleneck link is full (0: none used)."""
    if scheme == "ring":
        return 0.0
    link_pps = setup.rate_mbit * 1e6 / (8 * frame(setup.lanes))
    if scheme in ("ps", "psring"):
        return link_pps  # the PS link feeds it
    return setup.servers * link_pps  # every server link feeds the switch


# ---- racks under leaves, joined by a spine (bench/emulated_racks.py) -------------------------------------

RACK_SCHEMES = ("ring", "hring", "ps", "tree")  # one rank a server: PASSING's in-host stage has nothing to do


@dataclass(frozen=True)
class Racks:
    """A cluster of ``racks`` x ``per_rack`` servers, one rank each: server links of ``rate_mbit`` to their
    rack's leaf, each leaf's uplink of ``uplink_mbit`` to the spine (each direction). Oversubscription is
    per_rack x rate / uplink (1: none; 2 and 4: the uplink carries half and a quarter of what the rack's
    servers can send). The flat PS sits on the spine behind a server link of its own; a tree's root is the
    spine (no link of its own to cross), its leaves the racks' leaf switches."""

    racks: int
    per_rack: int
    rate_mbit: float
    uplink_mbit: float
    pool: int = 128
    rtt_s: float = 0.002
    fixed_s: float = 0.0
    lanes: int = LANES

    @property
    def servers(self) -> int:
        return self.racks * self.per_rack

    @property
    def oversubscription(self) -> float:
        return self.per_rack * self.rate_mbit / self.uplink_mbit


def tcp_seconds(payload_bytes: float, rate_mbit: float) -> float:
    """Seconds ``payload_bytes`` of gloo's TCP payload take on a link of ``rate_mbit``, frames and ACKs counted."""
    return payload_bytes * (TCP_FRAME + TCP_ACK_SHARE) / TCP_PAYLOAD * 8 / (rate_mbit * 1e6)


def predict_racks(scheme: str, elements: int, r: Racks) -> Prediction:
    """Predicted seconds of one all_reduce of ``elements`` float32 across racks (each link each way):

    * ring (ranks in rack order): every server link and every uplink carries 2(N-1)/N K (one edge of the
      ring leaves each rack, one enters it): K-sized over min(B, U);
    * hring: reduce_scatter in the rack, (m-1)/m K on a server link; then the shards' rings across racks,
      2(R-1)/R K/m on a server link and m of them, 2(R-1)/R K, on an uplink; then the all_gather in the rack,
      (m-1)/m K: three stages one after the other;
    * ps: the PS link carries N P packets, an uplink m P (a rack's servers each send their whole gradient);
    * tree: a server link and an uplink each carry P packets (a leaf sends one partial per round up and
      takes one RESULT down), the root is the spine: P packets over min(B, U); the windows: m at a leaf, one
      on an uplink."""
    if scheme not in RACK_SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r} across racks; one of {', '.join(RACK_SCHEMES)}")
    n, m, k = r.servers, r.per_rack, 4 * elements
    if scheme == "ring":
        payload_bytes = 2 * (n - 1) / n * k
        network = tcp_seconds(payload_bytes, min(r.rate_mbit, r.uplink_mbit))
        link = "uplink" if r.uplink_mbit < r.rate_mbit else "server link"
        wire = payload_bytes * (TCP_FRAME + TCP_ACK_SHARE) / TCP_PAYLOAD
        return Prediction(scheme, r.fixed_s + network, network, 0.0, r.fixed_s, link, wire, False)
    if scheme == "hring":
        inside = (m - 1) / m * k  # each of reduce_scatter and all_gather, on a server link
        across_server = 2 * (r.racks - 1) / r.racks * k / m
        across_uplink = m * across_server
        cross = max(tcp_seconds(across_server, r.rate_mbit), tcp_seconds(across_uplink, r.uplink_mbit))
        network = 2 * tcp_seconds(inside, r.rate_mbit) + cross
        on_uplink = tcp_seconds(across_uplink, r.uplink_mbit) > tcp_seconds(across_server, r.rate_mbit)
        link = "uplink" if on_uplink else "server link"  # the one that sets the racks' rings' pace
        wire = (across_uplink if on_uplink else 2 * inside + across_server) * (TCP_FRAME + TCP_ACK_SHARE) / TCP_PAYLOAD
        return Prediction(scheme, r.fixed_s + network, network, 0.0, r.fixed_s, link, wire, False)
    p, size = packets(elements, r.lanes), frame(r.lanes)
    if scheme == "ps":  # (link, packets, windows) of each link it crosses
        links = [("PS link", n * p, n, r.rate_mbit), ("uplink", m * p, m, r.uplink_mbit)]
    else:
        links = [("server link", p, 1, r.rate_mbit), ("uplink", p, 1, r.uplink_mbit)]
    times = []
    for name, count, g, rate in links:
        link_pps = rate * 1e6 / (8 * size)
        window_pps = g * r.pool / r.rtt_s if r.rtt_s > 0 else math.inf
        times.append((count / min(link_pps, window_pps), name, count, window_pps < link_pps))
    network, link, count, limited = max(times)
    return Prediction(scheme, r.fixed_s + network, network, 0.0, r.fixed_s, link, count * size, limited)


def ring_steps(servers: int) -> int:
    """Steps of a ring all_reduce, one after the other: reduce-scatter and all-gather, N - 1 each."""
    return 2 * (servers - 1)


def predict_latency(scheme: str, servers: int, step_s: float, round_trip_s: float) -> float:
    """A small all_reduce where latency, not bandwidth, sets the time: the ring's 2(N - 1) steps of
    ``step_s`` each, against the tree's one round trip through two levels (a leaf's round trip, measured as
    ``round_trip_s`` with one aggregator, and the root's on top: twice it)."""
    if scheme == "ring":
        return ring_steps(servers) * step_s
    if scheme == "tree":
        return 2 * round_trip_s
    raise ValueError(f"no latency model for {scheme!r}")


def main() -> None:
    """Print the model's table for the paper's configurations at 10 Gbit/s, full size, at each lane count
    (``--lanes``, default each switch program's: CHIP_LANES), with Ring / PASSING."""
    import argparse

    from passing_controller.topology import CHIP_LANES

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--lanes", type=int, nargs="+", default=sorted(set(CHIP_LANES.values())))
    args = parser.parse_args()
    sizes = {"resnet50": 25_557_032, "vgg19-cifar": 20_035_018}
    for lanes in args.lanes:
        print(f"{lanes} lanes: {frame(lanes)}-byte frames for {payload(lanes)} bytes of payload "
              f"({frame(lanes) / payload(lanes):.3f}x)")
        print(f"{'config':7s} {'model':12s} " + " ".join(f"{s:>9s}" for s in SCHEMES)
              + "  ring/passing   (seconds at 10 Gbit/s, network only)")
        for servers, ranks in ((2, 2), (2, 4), (4, 2), (4, 4)):
            setup = Setup(servers, ranks, 10_000.0, pool=128, rtt_s=1e-5, lanes=lanes)
            for name, elements in sizes.items():
                times = {s: predict(s, elements, setup).seconds for s in SCHEMES}
                print(f"{servers}x{ranks:<5d} {name:12s} " + " ".join(f"{t:9.4f}" for t in times.values())
                      + f"  {times['ring'] / times['passing']:12.2f}")


if __name__ == "__main__":
    main()
