"""Sharded collectives on the wire: bytes per server of reduce_scatter and all_gather against the physics.

    python bench/sharded.py [--size-mib 4] [--workers 2 4 8] [--lanes 64 364]

N single-rank servers (worker threads of this process, each its own socket) and one software
aggregator (the C engine) on loopback. For an array of S bytes per server (reduce_scatter: the
input; all_gather: the output), the physics per server (docs/protocol.md, Kinds):

    reduce_scatter in the network: up S, down S/N        ring: S(N-1)/N each way
    all_gather by relay/multicast: up S/N, down S(N-1)/N ring: S(N-1)/N each way

The measured figures are UDP payload bytes (the PASSING header and the lanes, retransmissions
included), from the hosts' own counters; the ratio to the physics shows the header's share
(16 bytes a packet: 6 % at the switch's 64 lanes, 1 % at 364, a 1500-byte MTU) and, down in a
reduce_scatter, the ACKs (a header per packet of the other servers). Writes
bench/results/sharded.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import threading
import time
from pathlib import Path

import numpy as np

from passing import Group, wire
from passing.aggregator.control_channel import job_from_json
from passing.aggregator.server import SoftwareAggregator
from passing.launch import free_udp_ports

RESULTS = Path(__file__).resolve().parent / "results" / "sharded.json"


def run(workers: int, lanes: int, size_bytes: int, kind: str) -> dict:
    """One call of ``kind`` on N workers; bytes per worker and the call's wall time."""
    addresses = [f"127.0.0.1:{p}" for p in free_udp_ports(workers)]
    pool = max(8, min(256, (2 << 20) // (workers * wire.packet_size(lanes))))  # the controller's PS window rule
    agg = SoftwareAggregator(listen=("127.0.0.1", 0), control=None, engine="native", lanes=lanes, max_lanes=lanes,
                             jobs=[job_from_json({"job": 1, "pool": pool, "workers": addresses, "lanes": lanes})])
    server = threading.Thread(target=agg.serve)
    server.start()
    groups = [Group(1, w, workers, [agg.address], pool=pool, bind=addresses[w], lanes=lanes, timeout=60,
                    engine="numpy") for w in range(workers)]
    elements = size_bytes // 4
    rng = np.random.default_rng(0)
    inputs = [rng.integers(-1000, 1000, elements).astype(np.int32) for _ in range(workers)]
    times: list[float] = [0.0] * workers
    errors: list[BaseException] = []

    def work(w: int) -> None:
        try:
            g = groups[w]
            start = time.perf_counter()
            if kind == "reduce_scatter":
                g.reduce_scatter(inputs[w])
            else:
                g.allgather(inputs[w][: elements // workers])
            times[w] = time.perf_counter() - start
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = [g.stats for g in groups]
    for g in groups:
        g.close()
    agg.stop()
    server.join(10)
    if errors:
        raise errors[0]
    s = float(size_bytes)
    up, down = (s, s / workers) if kind == "reduce_scatter" else (s / workers, s * (workers - 1) / workers)
    ring = s * (workers - 1) / workers
    sent = float(np.mean([st.bytes_sent for st in stats]))
    received = float(np.mean([st.bytes_received for st in stats]))
    return {"kind": kind, "workers": workers, "lanes": lanes, "bytes": size_bytes, "physics_up": up,
            "physics_down": down, "ring_each_way": ring, "sent": sent, "received": received,
            "up_ratio": sent / up, "down_ratio": received / down,
            "retransmissions": int(sum(st.retransmissions for st in stats)), "seconds": max(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=float, default=4.0)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--lanes", type=int, nargs="+", default=[64, 364])
    args = parser.parse_args()
    size = int(args.size_mib * (1 << 20)) // 4 * 4
    rows = []
    print(f"{'collective':15} {'N':>2} {'lanes':>5} {'up/phys':>8} {'down/phys':>9} {'ring/phys up':>12} "
          f"{'resent':>6} {'s':>6}")
    for lanes in args.lanes:
        for workers in args.workers:
            for kind in ("reduce_scatter", "all_gather"):
                r = run(workers, lanes, size - size % (4 * workers), kind)
                rows.append(r)
                print(f"{kind:15} {workers:>2} {lanes:>5} {r['up_ratio']:8.3f} {r['down_ratio']:9.3f} "
                      f"{r['ring_each_way'] / r['physics_up']:12.2f} {r['retransmissions']:6d} {r['seconds']:6.2f}",
                      flush=True)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": platform.platform(), "python": platform.python_version(),
                                   "size_bytes": size, "rows": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
