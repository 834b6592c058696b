"""BMv2 benchmark: plain L2 forwarding rate vs PASSING aggregation rate, in one Mininet run.

    sudo make bench-bmv2          # needs BMv2, p4c and Mininet (docs/bmv2.md)

Prints the rates and writes bench/results/bmv2.json. BMv2 is a software switch for
correctness: these figures say how long BMv2 runs take, nothing about a hardware switch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bmv2_tests.network import AGGREGATION_IP, Bmv2Network, compile_p4, missing_requirements  # noqa: E402
from cluster.local import ensure_keys  # noqa: E402
from passing import wire  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

BLAST = r"""
import sys, time, socket
count, dst, port, size, rate = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
payload = bytes(size)
start = time.perf_counter()
for i in range(count):  # paced: BMv2 drops what it cannot take, so offer a steady rate
    while time.perf_counter() < start + i / rate:
        pass
    s.sendto(payload, (dst, port))
"""

SINK = r"""
import json, socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 24)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.settimeout(3.0)
print("ready", flush=True)
n, first, last = 0, None, None
try:
    while True:
        s.recv(65536)
        last = time.perf_counter()
        first = first or last
        n += 1
except socket.timeout:
    pass
print(json.dumps({"packets": n, "seconds": (last - first) if n > 1 else 0.0}), flush=True)
"""


def l2_rate(net: Bmv2Network, rates: tuple[float, ...] = (2e3, 5e3, 10e3, 20e3, 40e3), seconds: float = 2.0) -> dict:
    """Offer paced UDP streams of PASSING-sized datagrams h1 -> h2; the highest rate that gets
    through with under 1 % loss is BMv2's L2 forwarding rate."""
    steps = []
    for rate in rates:
        sink = net.net.get("h2").popen([sys.executable, "-c", SINK, "5000"], stdout=subprocess.PIPE, text=True)
        assert sink.stdout.readline().strip() == "ready"
        count = int(rate * seconds)
        blast = net.net.get("h1").popen([sys.executable, "-c", BLAST, str(count), "10.0.0.2", "5000",
                                         str(wire.packet_size()), str(rate)])
        blast.wait(600)
        report = json.loads(sink.communicate(timeout=60)[0].splitlines()[-1])
        steps.append({"offered_pps": rate, "sent": count, "received": report["packets"]})
        print(f"  L2 offered {rate / 1e3:.0f} kpps: {report['packets']}/{count} delivered", flush=True)
    ok = [s["offered_pps"] for s in steps if s["received"] >= 0.99 * s["sent"]]
    return {"steps": steps, "packets_per_s": max(ok) if ok else 0.0}


def aggregation_rate(net: Bmv2Network, switch, workers: int, elements: int) -> dict:
    from passing_controller import admission, result_rewrite
    from passing_controller.allocation import Allocation, Worker
    from passing_controller.topology import Host

    hosts = net.hosts[:workers]
    job = 100 + workers
    alloc = Allocation(job, generation=0, base=0, pool=64, workers=tuple(
        Worker(i, Host(h.name, h.mac, h.ip, h.port), 20000) for i, h in enumerate(hosts)))
    admission.install(switch, alloc)
    result_rewrite.install(switch, alloc)
    try:
        procs = [net.net.get(h.name).popen(
            [sys.executable, "-m", "passing.cli", "allreduce", "--job", str(job), "--worker", str(i), "--workers",
             str(workers), "--aggregator", f"{AGGREGATION_IP}:{wire.UDP_PORT}", "--bind", f"{h.ip}:20000",
             "--pool", "64", "--size", str(elements), "--warmup", "1", "--iterations", "2", "--no-check",
             "--timeout", "120"], stdout=subprocess.PIPE, text=True, cwd=str(REPO)) for i, h in enumerate(hosts)]
        reports = [json.loads(p.communicate(timeout=1200)[0].splitlines()[-1]) for p in procs]
    finally:
        admission.remove(switch, alloc)
        result_rewrite.remove(switch, alloc)
    seconds = max(r["seconds"] for r in reports)
    packets = -(-elements // wire.DEFAULT_LANES) + 1
    return {"workers": workers, "elements": elements, "seconds": seconds,
            "aggregated_packets_per_s": workers * packets / seconds,
            "retransmissions": sum(r["retransmissions"] for r in reports)}


def main() -> int:
    missing = missing_requirements()
    if missing:
        print(f"bench-bmv2: {missing}", file=sys.stderr)
        return 2
    from passing_controller import aggregator_address, l2_forward
    from passing_controller.p4runtime import Pipeline
    from passing_controller.session import Switch
    from passing_controller.topology import Topology

    p4info, device_config = compile_p4()
    net = Bmv2Network(4)
    try:
        switch = Switch(net.p4runtime_address)
        switch.set_pipeline(Pipeline(p4info, device_config))
        topo = Topology.from_dict(net.topology())
        l2_forward.install(switch, topo)
        aggregator_address.install(switch, topo)
        time.sleep(0.5)
        l2 = l2_rate(net)
        print(f"BMv2 L2 forwarding, {wire.packet_size()}-byte UDP payloads: {l2['packets_per_s'] / 1e3:.1f} kpps "
              "(highest offered rate delivered with < 1 % loss)", flush=True)
        runs = []
        for workers in (2, 4):
            a = aggregation_rate(net, switch, workers, 64 * 2000)
            runs.append(a)
            print(f"BMv2 PASSING aggregation, {workers} workers: {a['aggregated_packets_per_s'] / 1e3:.1f} kpps "
                  f"of DATA in (+ as many RESULTs out), {a['seconds'] * 1e3:.0f} ms per allreduce of "
                  f"{a['elements']} float32, {a['retransmissions']} retransmissions; "
                  f"{a['aggregated_packets_per_s'] / l2['packets_per_s']:.0%} of the L2 rate", flush=True)
        switch.close()
    finally:
        net.stop()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bmv2.json").write_text(json.dumps({"l2": l2, "aggregation": runs}, indent=2))
    print(f"wrote {RESULTS / 'bmv2.json'}")
    return 0


if __name__ == "__main__":
    ensure_keys()
    sys.exit(main())
