"""Core benchmark: raw batched UDP rate, PASSING allreduce through the software aggregator, gloo.

    make bench-core                    # or: python bench/core.py --elements 2097152 --workers 2 4 8

Prints one table and writes bench/results/core.json. Everything runs on this machine,
on loopback, as separate processes: the figures include the CPU contention of N
workers and the aggregator sharing the machine's cores (reported alongside).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from passing import wire
from passing.aggregator import ControlClient
from passing.cli import free_udp_ports, start_aggregator
from passing.transport import BatchSocket, pack_address

RESULTS = Path(__file__).resolve().parent / "results"


# ---- raw batched UDP --------------------------------------------------------------------


def blast_receiver(port: int, lanes: int, offload: bool, idle: float) -> None:
    """Count datagrams until `idle` seconds pass without one; print count and span."""
    sock = BatchSocket(("127.0.0.1", port), lanes=lanes, offload=offload)
    print("ready", flush=True)
    count, first, last = 0, None, None
    while True:
        if not sock.wait_readable(idle):
            break
        _, lengths, _ = sock.recv_packets()
        if len(lengths):
            now = time.perf_counter()
            first = first or now
            last = now
            count += len(lengths)
    print(json.dumps({"packets": count, "seconds": (last - first) if count else 0.0}), flush=True)


def raw_blast(lanes: int, seconds: float, offload: bool) -> dict:
    """One sender process blasting batches at one receiver process, through the same transport."""
    (port,) = free_udp_ports(1)
    recv = subprocess.Popen([sys.executable, __file__, "--blast-receiver", str(port), str(lanes), str(int(offload))],
                            stdout=subprocess.PIPE, text=True)
    assert recv.stdout.readline().strip() == "ready"
    sender = BatchSocket(("127.0.0.1", 0), lanes=lanes, offload=offload)
    packets = wire.empty(1024, lanes)
    dest = pack_address("127.0.0.1", port)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sender.send_batch(packets, dest)
    sent = sender.stats.packets_sent
    sender.close()
    report = json.loads(recv.communicate(timeout=60)[0].splitlines()[-1])
    rate = report["packets"] / report["seconds"]
    return {"sent": sent, "received": report["packets"], "packets_per_s": rate,
            "gbit_per_s": rate * wire.packet_size(lanes) * 8 / 1e9}


# ---- the aggregator alone, open loop -----------------------------------------------------


def aggregator_capacity(workers: int, lanes: int, pool: int, seconds: float, offload: bool) -> dict:
    """This process plays `workers` workers sending every round back to back, without waiting
    for RESULTs; the aggregator process has the other core to itself. Its rate of taking
    DATA packets (and emitting as many RESULTs) is the aggregator path's packet rate."""
    flag = [] if offload else ["--no-offload"]
    agg, ready = start_aggregator(["--lanes", str(lanes), "--slots", str(max(4096, pool)), *flag])
    socks = [BatchSocket(("127.0.0.1", 0), lanes=lanes, offload=offload, buffer_bytes=1 << 20)
             for _ in range(workers)]
    try:
        control = ControlClient(ready["control"])
        addresses = ["{}:{}".format(*s.address) for s in socks]
        control.request("add_job", job={"job": 1, "pool": pool, "workers": addresses})
        host, port = ready["data"].rsplit(":", 1)
        dest = pack_address(host, int(port))
        rounds = 4 * pool  # one block: every slot and both sets, twice
        psn = np.arange(rounds)
        blocks = [wire.encode(type=wire.DATA, job=1, worker=w, psn=psn, pool=pool, payload=np.ones(lanes, np.int64),
                              lanes=lanes) for w in range(workers)]
        chunk = 512
        before, cpu_before, start = control.request("stats")["totals"], _cpu_seconds(agg.pid), time.perf_counter()
        end, base = start + seconds, 0
        while time.perf_counter() < end:
            for at in range(0, rounds, chunk):
                for w, sock in enumerate(socks):
                    sock.send_batch(blocks[w], dest, np.arange(at, at + chunk))
            base += rounds
            for b in blocks:
                b["hdr"]["psn"] += rounds  # the next block of rounds
        time.sleep(0.2)  # let it finish what is queued
        after, cpu, wall = control.request("stats")["totals"], _cpu_seconds(agg.pid) - cpu_before, \
            time.perf_counter() - start
    finally:
        for sock in socks:
            sock.close()
        agg.terminate()
        agg.wait(10)
    offered = base * workers
    taken = after["received"] - before["received"]
    return {"workers": workers, "offered": offered, "received": taken,
            "aggregated": after["aggregated"] - before["aggregated"],
            "results_sent": after["results_sent"] - before["results_sent"],
            "packets_per_s": taken / wall, "cpu_share": cpu / wall,
            # the sender's core saturates first (loopback delivery runs on it), so the aggregator
            # idles part of the time: its CPU per packet gives what one busy core would take
            "cpu_us_per_packet": cpu / taken * 1e6, "capacity_packets_per_s": taken / cpu}


# ---- PASSING through the software aggregator -------------------------------------------


def passing_allreduce(workers: int, elements: int, lanes: int, pool: int, iterations: int, offload: bool) -> dict:
    flag = [] if offload else ["--no-offload"]
    agg, ready = start_aggregator(["--lanes", str(lanes), "--slots", str(max(4096, pool)), *flag])
    try:
        addresses = [f"127.0.0.1:{p}" for p in free_udp_ports(workers)]
        control = ControlClient(ready["control"])
        control.request("add_job", job={"job": 1, "pool": pool, "workers": addresses})
        procs = [
            subprocess.Popen([sys.executable, "-m", "passing.cli", "allreduce", "--worker", str(w), "--workers",
                              str(workers), "--aggregator", ready["data"], "--bind", addresses[w], "--pool", str(pool),
                              "--lanes", str(lanes), "--size", str(elements), "--iterations", str(iterations),
                              "--warmup", "1", "--no-check", *flag], stdout=subprocess.PIPE, text=True)
            for w in range(workers)
        ]
        cpu_before, wall_start = _cpu_seconds(agg.pid), time.perf_counter()
        reports = []
        for p in procs:
            out, _ = p.communicate(timeout=1800)
            if p.returncode != 0:
                raise RuntimeError(f"worker failed: {out}")
            reports.append(json.loads(out.splitlines()[-1]))
        cpu, wall = _cpu_seconds(agg.pid) - cpu_before, time.perf_counter() - wall_start
        totals = control.request("stats")["totals"]
    finally:
        agg.terminate()
        agg.wait(10)
    seconds = max(r["seconds"] for r in reports)
    packets = -(-elements // lanes) + 1  # + the MAX round of auto scaling
    return {
        "workers": workers,
        "seconds": seconds,
        "gbit_per_s_per_worker": elements * 4 * 8 / seconds / 1e9,
        "aggregator_rx_packets_per_s": workers * packets / seconds,  # and as many RESULTs out
        "aggregator_cpu_share": cpu / wall,  # of one core, over the workers' whole run
        "retransmissions": sum(r["retransmissions"] for r in reports),
        "aggregator_totals": totals,
    }


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- gloo ----------------------------------------------------------------------------------


def gloo_worker(rank: int, world: int, port: int, elements: int, iterations: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.ones(elements, dtype=torch.float32)
    dist.all_reduce(x)  # warm-up
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(x)
    elapsed = (time.perf_counter() - start) / iterations
    dist.destroy_process_group()
    print(json.dumps({"seconds": elapsed}), flush=True)


def gloo_allreduce(workers: int, elements: int, iterations: int) -> dict | None:
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, "--gloo-worker", str(r), str(workers), str(port),
                               str(elements), str(iterations)], stdout=subprocess.PIPE, text=True)
             for r in range(workers)]
    seconds = max(json.loads(p.communicate(timeout=1800)[0].splitlines()[-1])["seconds"] for p in procs)
    return {"workers": workers, "seconds": seconds, "gbit_per_s_per_worker": elements * 4 * 8 / seconds / 1e9}


# ---- main ------------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elements", type=int, default=2 * 1024 * 1024, help="float32 elements per allreduce")
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--lanes", type=int, default=wire.DEFAULT_LANES)
    p.add_argument("--pool", type=int, default=512)
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--blast-seconds", type=float, default=3.0)
    p.add_argument("--out", type=Path, default=RESULTS / "core.json")
    args = p.parse_args()

    print(f"machine: {os.cpu_count()} cores, {platform.platform()}, python {platform.python_version()}")
    print(f"buffer: {args.elements} float32 ({args.elements * 4 / 2**20:.1f} MiB), "
          f"{args.lanes} lanes/packet ({wire.packet_size(args.lanes)} B), pool {args.pool}")
    modes = {"offload": True, "plain": False}  # UDP GSO/GRO on, or one kernel datagram per packet
    raw = {}
    for mode, offload in modes.items():
        raw[mode] = raw_blast(args.lanes, args.blast_seconds, offload)
        print(f"raw batched UDP blast ({mode}): {raw[mode]['packets_per_s'] / 1e3:.0f} kpps received "
              f"({raw[mode]['gbit_per_s']:.2f} Gbit/s; {raw[mode]['received']}/{raw[mode]['sent']} delivered)",
              flush=True)
    capacity = {}
    for mode, offload in modes.items():
        for n in args.workers:
            c = aggregator_capacity(n, args.lanes, args.pool, args.blast_seconds, offload)
            capacity[f"{mode}-{n}"] = c
            print(f"aggregator alone ({mode}, {n} workers, open loop): took {c['packets_per_s'] / 1e3:.0f} kpps "
                  f"at {c['cpu_share']:.0%} of a core = {c['cpu_us_per_packet']:.2f} us/packet -> "
                  f"{c['capacity_packets_per_s'] / 1e3:.0f} kpps per busy core = "
                  f"{c['capacity_packets_per_s'] / raw[mode]['packets_per_s']:.0%} of the raw {mode} rate", flush=True)
    rows = []
    print(f"{'workers':>7} | {'mode':>7} | {'PASSING ms':>10} | {'Gbit/s/worker':>13} | {'agg rx kpps':>11} | "
          f"{'vs raw':>6} | {'agg CPU':>7} | {'retx':>5} | {'gloo ms':>8} | {'gloo Gbit/s':>11}")
    for n in args.workers:
        gl = gloo_allreduce(n, args.elements, args.iterations)
        gloo_ms = f"{gl['seconds'] * 1e3:8.1f}" if gl else "     n/a"
        gloo_bw = f"{gl['gbit_per_s_per_worker']:11.3f}" if gl else "        n/a"
        for mode, offload in modes.items():
            pa = passing_allreduce(n, args.elements, args.lanes, args.pool, args.iterations, offload)
            ratio = pa["aggregator_rx_packets_per_s"] / raw[mode]["packets_per_s"]
            rows.append({"mode": mode, "passing": pa, "gloo": gl, "ratio_to_raw": ratio})
            print(f"{n:>7} | {mode:>7} | {pa['seconds'] * 1e3:10.1f} | {pa['gbit_per_s_per_worker']:13.3f} | "
                  f"{pa['aggregator_rx_packets_per_s'] / 1e3:11.0f} | {ratio:6.0%} | "
                  f"{pa['aggregator_cpu_share']:7.0%} | {pa['retransmissions']:>5} | {gloo_ms} | {gloo_bw}",
                  flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": vars(args) | {"out": str(args.out)}, "raw": raw,
                                    "aggregator_alone": capacity, "allreduce": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--blast-receiver":
        blast_receiver(int(sys.argv[2]), int(sys.argv[3]), bool(int(sys.argv[4])), idle=1.0)
    elif len(sys.argv) > 1 and sys.argv[1] == "--gloo-worker":
        gloo_worker(*map(int, sys.argv[2:7]))
    else:
        sys.exit(main())
