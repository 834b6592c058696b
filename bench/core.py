"""Core benchmark: raw batched UDP, the software aggregator and allreduce, native vs numpy vs gloo.

    make bench-core                    # or: python bench/core.py [--quick] [--workers 2 4 8]

One run measures, everything on this machine, on loopback, as separate processes:

1. the raw batched UDP blast (GSO/GRO and plain datagrams), no processing;
2. the aggregator alone, open loop, for each engine (native: C data path; numpy: Python);
3. the allreduce of 8 MiB float32 (2 097 152 elements) with 2, 4, 8 workers on the native
   path (native host engine + native aggregator), the numpy path (both numpy) and gloo,
   plus one row at 1024 lanes per packet (2 workers);
4. the aggregator's CPU at a steady 5 000 packets/s of a 2-worker job, for each engine;
5. the peak memory a 25M-float allreduce adds in a worker (native path, out= and out=None);
6. allreduce under host-side loss (4 workers, 200 000 floats, loss 0/1/5/20 % each way);
7. torch's all_reduce on backend "passing" with no controller configured, against gloo in
   the same processes: one server of 2 ranks (1 M float32); then, for each mode (PASSING_EMBEDDED
   off: the ring, gloo among each local rank's peers; ps: rank 0's embedded controller and
   aggregator), 2, 4, 8 single-rank servers and 2 x 2, 4 x 2 ranks (8 MiB) on loopback, and as
   root, servers in network namespaces over veths: 2 x 1, 2 x 2, 4 x 2 at MTU 1500, 2 x 1 at 9000.
   Each row has the load average beside it.

Prints tables and the targets next to the figures; writes bench/results/core.json. The
figures include the CPU contention of the workers and the aggregator sharing the cores.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from passing import wire
from passing.aggregator.control_channel import ControlClient
from passing.launch import free_udp_ports, start_aggregator
from passing.transport import BatchSocket, pack_address

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: cluster/
RESULTS = Path(__file__).resolve().parent / "results"
ENGINES = ("native", "numpy")  # native: native host engine + native aggregator; numpy: both numpy
MIB = 1 << 20

# The targets, printed next to the figures.
TARGET_CAPACITY_VS_RAW = 0.50  # native aggregator alone: packets per busy core / raw GSO blast rate
TARGET_SPEEDUP = 5.0  # native over numpy, 8 MiB, 2 workers
TARGET_VS_GLOO = 5.0  # native ms / gloo ms
TARGET_STEADY_CPU = 0.05  # native aggregator's CPU share at 5 kpps
TARGET_MEMORY = 64 * MIB  # peak added by a 25M-float allreduce with out=
TARGET_LOSS = {0.01: 1.5, 0.05: 2.5, 0.20: 10.0}  # time / loss-free time
TARGET_ONE_SERVER_VS_GLOO = 1.2  # backend "passing" on one server / gloo, same processes
TARGET_RING_VS_GLOO = 1.05  # nothing configured, one rank per server (gloo's own all_reduce) / gloo
TARGET_HIERARCHY_VS_GLOO = 1.0  # nothing configured, several ranks per server (in-host + peers) / gloo
TARGET_RETRANSMISSIONS = 1e-4  # loss-free runs: retransmissions per packet sent


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, all its threads (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _aggregator(engine: str, lanes: int, pool: int, extra: list[str] | None = None) -> tuple[subprocess.Popen, dict]:
    """An aggregator whose jobs, and widest packet, have ``lanes`` lanes (the switch's 64 in most rows)."""
    return start_aggregator(["--engine", engine, "--lanes", str(lanes), "--max-lanes", str(lanes), "--slots",
                             str(max(4096, pool)), *(extra or [])])


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(10)


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


# ---- 1. raw batched UDP ------------------------------------------------------------------


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


def raw_blast(lanes: int, seconds: float, offload: bool) -> dict[str, Any]:
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


# ---- 2. the aggregator alone, open loop -----------------------------------------------------


def aggregator_capacity(engine: str, workers: int, lanes: int, pool: int, seconds: float) -> dict[str, Any]:
    """This process plays `workers` workers sending every round back to back, without waiting
    for RESULTs; the aggregator process has the other core to itself. Its rate of taking
    DATA packets (and emitting as many RESULTs) is the aggregator path's packet rate."""
    agg, ready = _aggregator(engine, lanes, pool)
    socks = [BatchSocket(("127.0.0.1", 0), lanes=lanes, buffer_bytes=1 << 20) for _ in range(workers)]
    try:
        control = ControlClient(ready["control"])
        addresses = ["{}:{}".format(*s.address) for s in socks]
        job = control.request("add_job", job={"job": 1, "pool": pool, "workers": addresses})["job"]
        host, port = ready["data"].rsplit(":", 1)
        dest = pack_address(host, int(port))
        rounds = 4 * pool  # one block: every slot and both sets, twice
        psn = np.arange(rounds)
        blocks = [wire.encode(type=wire.DATA, job=1, worker=w, psn=psn, pool=pool, payload=np.ones(lanes, np.int64),
                              generation=job["generation"], lanes=lanes) for w in range(workers)]
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
        _stop(agg)
    taken = after["received"] - before["received"]
    return {"engine": ready["engine"], "workers": workers, "offered": base * workers, "received": taken,
            "aggregated": after["aggregated"] - before["aggregated"],
            "results_sent": after["results_sent"] - before["results_sent"],
            "packets_per_s": taken / wall, "cpu_share": cpu / wall,
            # the sender's core saturates first (loopback delivery runs on it), so the aggregator
            # idles part of the time: its CPU per packet gives what one busy core would take
            "cpu_us_per_packet": cpu / taken * 1e6, "capacity_packets_per_s": taken / cpu}


# ---- 3. and 6. allreduce through the software aggregator ------------------------------------


def passing_allreduce(engine: str, workers: int, elements: int, lanes: int, pool: int, iterations: int,
                      warmup: int = 1, drop: float = 0.0) -> dict[str, Any]:
    """`workers` passing-allreduce processes (self-checked) and one aggregator, all on `engine`."""
    agg, ready = _aggregator(engine, lanes, pool)
    try:
        addresses = [f"127.0.0.1:{p}" for p in free_udp_ports(workers)]
        control = ControlClient(ready["control"])
        job = control.request("add_job", job={"job": 1, "pool": pool, "workers": addresses})["job"]
        procs = [
            subprocess.Popen([sys.executable, "-m", "passing.cli", "allreduce", "--engine", engine, "--worker", str(w),
                              "--workers", str(workers), "--aggregator", ready["data"], "--bind", addresses[w],
                              "--generation", str(job["generation"]), "--pool", str(pool), "--lanes", str(lanes),
                              "--size", str(elements), "--iterations", str(iterations), "--warmup", str(warmup),
                              "--drop", str(drop), "--seed", "0"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for w in range(workers)
        ]
        cpu_before = _cpu_seconds(agg.pid)
        reports, errors = [], []
        for p in procs:
            out, err = p.communicate(timeout=1800)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if lines:
                reports.append(json.loads(lines[-1]))
            else:
                errors.append(err.strip().splitlines()[-1] if err.strip() else f"exit {p.returncode}")
        cpu = _cpu_seconds(agg.pid) - cpu_before
        totals = control.request("stats")["totals"]
    finally:
        _stop(agg)
    if errors:
        return {"engine": engine, "workers": workers, "lanes": lanes, "drop": drop, "ok": False, "error": errors[0]}
    seconds = max(r["seconds"] for r in reports)
    return {
        "engine": engine, "host_engines": sorted({r["engine"] for r in reports}), "aggregator_engine": ready["engine"],
        "workers": workers, "lanes": lanes, "elements": elements, "drop": drop,
        "seconds": seconds,
        "gbit_per_s_per_worker": elements * 4 * 8 / seconds / 1e9,
        "aggregator_cpu_ms_per_call": cpu / (warmup + iterations) * 1e3,  # the MAX round and the SUM stream
        "retransmissions": sum(r["retransmissions"] for r in reports),
        "packets_sent": sum(r.get("packets_sent", 0) for r in reports),
        "ok": all(r["ok"] for r in reports),
        "max_error": max(r["max_error"] for r in reports),
        "bound": min(r["bound"] for r in reports),
        "aggregator_totals": totals,
    }


# ---- 4. the aggregator's CPU at a steady packet rate --------------------------------------


def aggregator_steady(engine: str, rate: float, seconds: float, lanes: int, pool: int,
                      admit: bool = True) -> dict[str, Any]:
    """A paced sender (this process) plays both workers of an admitted 2-worker job: one round
    (a DATA packet from each worker) every 2/rate seconds, so every round completes; the
    RESULTs are read back. The aggregator's CPU over the run comes from /proc/PID/stat.

    admit=False: the same packets for a job never admitted, so the aggregator wakes, reads,
    parses and rejects each one and sends nothing: the floor that waking up per packet costs
    on this machine, whatever the engine does."""
    agg, ready = _aggregator(engine, lanes, pool)
    socks = [BatchSocket(("127.0.0.1", 0), lanes=lanes) for _ in range(2)]
    try:
        control = ControlClient(ready["control"])
        addresses = ["{}:{}".format(*s.address) for s in socks]
        job = (control.request("add_job", job={"job": 1, "pool": pool, "workers": addresses})["job"] if admit
               else {"generation": 0})
        host, port = ready["data"].rsplit(":", 1)
        dest = pack_address(host, int(port))
        rounds = int(rate / 2 * seconds)
        blocks = [wire.encode(type=wire.DATA, job=1, worker=w, psn=np.arange(rounds), pool=pool,
                              payload=np.ones(lanes, np.int64), generation=job["generation"], lanes=lanes)
                  for w in range(2)]
        rows = np.arange(rounds)
        results = 0
        time.sleep(1.0)  # idle: the aggregator's own background cost
        cpu0, t0 = _cpu_seconds(agg.pid), time.perf_counter()
        time.sleep(1.0)
        idle_share = (_cpu_seconds(agg.pid) - cpu0) / (time.perf_counter() - t0)
        before, cpu_before, start = control.request("stats")["totals"], _cpu_seconds(agg.pid), time.perf_counter()
        interval = 2.0 / rate
        for r in range(rounds):
            delay = start + r * interval - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            for w, sock in enumerate(socks):
                sock.send_batch(blocks[w], dest, rows[r : r + 1])
            if r % 64 == 63:
                results += sum(len(s.recv_packets()[1]) for s in socks)
        sent_span = time.perf_counter() - start
        time.sleep(0.1)
        cpu, wall = _cpu_seconds(agg.pid) - cpu_before, time.perf_counter() - start
        after = control.request("stats")["totals"]
        results += sum(len(s.recv_packets()[1]) for s in socks)
    finally:
        for sock in socks:
            sock.close()
        _stop(agg)
    return {"engine": ready["engine"], "rounds": rounds, "packets": 2 * rounds,
            "offered_packets_per_s": 2 * rounds / sent_span, "seconds": wall,
            "completed": after["completed"] - before["completed"], "results_received": results,
            "rejected": after["rejected"] - before["rejected"],
            "cpu_share": cpu / wall, "idle_cpu_share": idle_share,
            "cpu_us_per_packet": cpu / (2 * rounds) * 1e6}


# ---- 5. peak memory of one allreduce in a worker ------------------------------------------


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def memory_worker(worker: int, workers: int, aggregator: str, bind: str, generation: int, pool: int, lanes: int,
                  elements: int, engine: str, use_out: bool) -> None:
    """One Group in this process: the peak RSS (VmHWM) during one allreduce minus the RSS once
    the input and the output exist. Prints JSON."""
    from passing import Group

    with Group(1, worker, workers, [aggregator], pool=pool, lanes=lanes, generation=generation, bind=bind,
               engine=engine, timeout=60.0) as group:
        x = np.random.default_rng(worker).standard_normal(elements, dtype=np.float32)  # no float64 temporary
        out = np.empty(elements, np.float32) if use_out else None
        if out is not None:
            out.fill(0.0)  # resident, as a reused buffer would be
        baseline = _status_bytes("VmRSS")
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            reset = True
        except OSError:
            reset = False  # then VmHWM may predate the call: peak - baseline is an upper bound
        hwm_before = _status_bytes("VmHWM")
        start = time.perf_counter()
        result = group.allreduce(x, out=out)
        seconds = time.perf_counter() - start
        peak = _status_bytes("VmHWM")
        engine_used = group.engine
    print(json.dumps({"worker": worker, "engine": engine_used, "out": use_out, "hwm_reset": reset,
                      "rss_after_alloc": baseline, "hwm_before_call": hwm_before, "peak": peak,
                      "added": peak - baseline, "seconds": seconds, "finite": bool(np.isfinite(result).all())}),
          flush=True)


def allreduce_memory(engine: str, elements: int, lanes: int, pool: int, use_out: bool, workers: int = 2) \
        -> dict[str, Any]:
    agg, ready = _aggregator(engine, lanes, pool)
    try:
        addresses = [f"127.0.0.1:{p}" for p in free_udp_ports(workers)]
        job = ControlClient(ready["control"]).request("add_job", job={"job": 1, "pool": pool,
                                                                      "workers": addresses})["job"]
        procs = [subprocess.Popen([sys.executable, __file__, "--memory-worker", str(w), str(workers), ready["data"],
                                   addresses[w], str(job["generation"]), str(pool), str(lanes), str(elements), engine,
                                   str(int(use_out))], stdout=subprocess.PIPE, text=True)
                 for w in range(workers)]
        reports = []
        for p in procs:
            out, _ = p.communicate(timeout=600)
            if p.returncode != 0:
                raise RuntimeError(f"memory worker failed: {out}")
            reports.append(json.loads(out.splitlines()[-1]))
    finally:
        _stop(agg)
    return {"engine": engine, "elements": elements, "out": use_out, "added": max(r["added"] for r in reports),
            "input_bytes": elements * 4, "seconds": max(r["seconds"] for r in reports), "workers": reports}


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


def gloo_allreduce(workers: int, elements: int, iterations: int) -> dict[str, Any] | None:
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


# ---- 7. torch's all_reduce on backend "passing", no controller configured, vs gloo -------------


def torch_worker(elements: int, iterations: int) -> None:
    """One rank (torchrun's variables): backend "passing" with no controller configured (the mode
    PASSING_EMBEDDED picks: the ring, or rank 0's embedded controller and aggregator), and gloo among
    the same processes. Each call is timed after a barrier; the two alternate call by call (which
    goes first alternates too), so both see the same machine, and each reports its median (a
    descheduled call on a shared 2-core machine moves a mean). Prints JSON."""
    import torch
    import torch.distributed as dist

    import passing.torch  # noqa: F401  registers backend "passing"
    from passing import quantize

    dist.init_process_group("passing")
    gloo = dist.new_group(backend="gloo")
    pg = dist.distributed_c10d._get_default_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(elements, generator=torch.Generator().manual_seed(rank))
    exact = x.double()
    dist.all_reduce(exact, group=gloo)  # float64: the reference sum
    x_max = torch.tensor([float(x.abs().max())])
    dist.all_reduce(x_max, op=dist.ReduceOp.MAX, group=gloo)
    stats = getattr(pg, "transport_stats", lambda: {})
    times: dict[str, list[float]] = {"passing": [], "gloo": []}
    results: dict[str, torch.Tensor] = {}
    before: dict[str, int] = {}
    for i in range(1 + iterations):  # the first of each is a warm-up
        if i == 1:
            before = stats()
        order = (("passing", None), ("gloo", gloo))
        for name, group in order if i % 2 else reversed(order):  # neither always first after the barrier
            work = x.clone()
            dist.barrier(group=gloo)
            start = time.perf_counter()
            dist.all_reduce(work, group=group)
            if i:
                times[name].append(time.perf_counter() - start)
            results[name] = work
    after = stats()
    workers = pg.stream.workers if getattr(pg, "stream", None) is not None else world
    bound = quantize.error_bound(quantize.auto_scale(world * float(x_max), workers), workers) if workers > 1 else 0.0
    bound += 4 * world * float(np.finfo(np.float32).eps) * world * float(x_max)  # float32 rounding of the sums
    print(json.dumps({
        "rank": rank, "world": world, "servers": pg.layout.servers, "mode": pg.mode, "reason": pg.reason,
        "lanes": pg.stream.lanes if getattr(pg, "stream", None) is not None else None,
        "seconds": {name: float(np.median(t)) for name, t in times.items()},
        "max_error": float((results["passing"].double() - exact).abs().max()), "bound": bound,
        "identical_to_gloo": bool(torch.equal(results["passing"], results["gloo"])),
        "transport": {k: after[k] - before.get(k, 0) for k in after},
    }), flush=True)
    dist.destroy_process_group()


def torch_allreduce(servers: int, ranks: int, elements: int, iterations: int, mtu: int | None = None,
                    embedded: str = "off") -> dict[str, Any]:
    """s servers x n ranks of torch_worker, no controller, PASSING_EMBEDDED=``embedded``; with ``mtu``,
    each server a network namespace on a veth of that MTU (root), else all on loopback."""
    from cluster import netns
    from cluster.local import collect, launch_ranks

    argv = [sys.executable, __file__, "--torch-worker", str(elements), str(iterations)]
    clean = {"PASSING_CONTROLLER": "", "PASSING_EMBEDDED": embedded, "PASSING_REPORT_INTERVAL": "0"}
    if mtu is None:
        outcomes = collect(launch_ranks(argv, servers, ranks, clean), 1800)
    else:
        names = [f"server{s}" for s in range(servers)]
        with netns.EmulatedNetwork(names) as net:
            net.set_mtu(mtu)
            procs = launch_ranks(argv, servers, ranks, clean,
                                 popen_for_server=lambda s: lambda a, **kw: net.popen(names[s], a, **kw),
                                 env_for_server=lambda s: {"GLOO_SOCKET_IFNAME": "eth0"},
                                 master_host=net.hosts[names[0]].ip)
            outcomes = collect(procs, 1800)
    reports = [r for _, r, _ in outcomes]
    row: dict[str, Any] = {"servers": servers, "ranks": ranks, "elements": elements, "mtu": mtu, "embedded": embedded}
    if any(r is None for r in reports):
        rc, _, err = next(o for o in outcomes if o[1] is None)
        return {**row, "ok": False, "error": (err.strip().splitlines() or [f"exit {rc}"])[-1]}
    passing_s = max(r["seconds"]["passing"] for r in reports)
    gloo_s = max(r["seconds"]["gloo"] for r in reports)
    sent = sum(r["transport"].get("packets_sent", 0) for r in reports)
    resent = sum(r["transport"].get("retransmissions", 0) for r in reports)
    return {**row, "ok": all(r["max_error"] <= r["bound"] for r in reports), "mode": reports[0]["mode"],
            "reason": reports[0]["reason"], "lanes": reports[0]["lanes"], "passing_seconds": passing_s,
            "gloo_seconds": gloo_s, "vs_gloo": passing_s / gloo_s,
            "identical_to_gloo": all(r["identical_to_gloo"] for r in reports),
            "max_error": max(r["max_error"] for r in reports), "bound": min(r["bound"] for r in reports),
            "packets_sent": sent, "retransmissions": resent}


def _layout(text: str) -> tuple[int, int]:
    """'4x2' -> (4 servers, 2 ranks each)."""
    servers, _, ranks = text.partition("x")
    try:
        return int(servers), int(ranks)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a layout is SERVERSxRANKS, e.g. 4x2") from None


def _veth(text: str) -> tuple[int, int, int]:
    """'2x2@1500' -> (2 servers, 2 ranks each, MTU 1500)."""
    layout, _, mtu = text.partition("@")
    try:
        return (*_layout(layout), int(mtu))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a veth row is SERVERSxRANKS@MTU, e.g. 2x2@1500") from None


# ---- the sections ------------------------------------------------------------------------------


def _done(row: dict[str, Any] | None) -> bool:
    """A PASSING run that produced figures (a failed one has "error" instead)."""
    return row is not None and "seconds" in row


def _ms(row: dict[str, Any] | None) -> str:
    if row is None:
        return "n/a"
    return f"{row['seconds'] * 1e3:.1f}" if "seconds" in row else "FAILED"


def section_raw(args: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    print("\n== 1. raw batched UDP blast (one sender process, one receiver process) ==")
    raw: dict[str, Any] = {}
    for mode, offload in (("offload", True), ("plain", False)):
        raw[mode] = r = raw_blast(args.lanes, args.blast_seconds, offload)
        print(f"{mode:>7}: {r['packets_per_s'] / 1e3:7.0f} kpps received ({r['gbit_per_s']:.2f} Gbit/s; "
              f"{r['received']}/{r['sent']} delivered)", flush=True)
    return raw


def section_capacity(args: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    print("\n== 2. the aggregator alone, open loop, GSO/GRO ==")
    print(f"{'engine':>7} | {'workers':>7} | {'taken kpps':>10} | {'CPU':>5} | {'us/packet':>9} | "
          f"{'kpps per busy core':>18} | {'vs raw GSO':>10}")
    raw = results["raw"]
    capacity: dict[str, dict[str, Any]] = {e: {} for e in args.engines}
    for engine in args.engines:
        for n in args.workers:
            c = aggregator_capacity(engine, n, args.lanes, args.pool, args.blast_seconds)
            c["vs_raw_gso"] = c["capacity_packets_per_s"] / raw["offload"]["packets_per_s"] if raw else None
            capacity[engine][str(n)] = c
            print(f"{engine:>7} | {n:>7} | {c['packets_per_s'] / 1e3:10.0f} | {c['cpu_share']:5.0%} | "
                  f"{c['cpu_us_per_packet']:9.3f} | {c['capacity_packets_per_s'] / 1e3:18.0f} | "
                  f"{c['vs_raw_gso'] or 0:10.0%}", flush=True)
    return capacity


def section_allreduce(args: argparse.Namespace, results: dict[str, Any]) -> list[dict[str, Any]]:
    engines = args.engines
    print(f"\n== 3. allreduce of {args.elements} float32, ms per call (1 warm-up + {args.iterations} timed), "
          f"aggregator CPU ms per call ==")
    print(f"{'workers':>7} | {'lanes':>5} | {'native ms':>9} | {'numpy ms':>9} | {'gloo ms':>8} | "
          f"{'native/numpy speed-up':>21} | {'native/gloo':>11} | {'agg CPU ms nat/np':>17} | "
          f"{'retx nat/np':>11} | {'exact':>5}")
    configs = [(n, args.lanes, args.pool) for n in args.workers]
    if args.wide_lanes:
        configs.append((2, args.wide_lanes, args.wide_pool))
    gloo: dict[int, dict[str, Any] | None] = {}
    allreduce: list[dict[str, Any]] = []
    for n, lanes, pool in configs:
        if n not in gloo:
            gloo[n] = gloo_allreduce(n, args.elements, args.iterations)
        row: dict[str, Any] = {"workers": n, "lanes": lanes, "pool": pool, "gloo": gloo[n]}
        for engine in engines:
            row[engine] = passing_allreduce(engine, n, args.elements, lanes, pool, args.iterations)
        nat, nump, gl = row.get("native"), row.get("numpy"), gloo[n]
        row["speedup"] = nump["seconds"] / nat["seconds"] if _done(nat) and _done(nump) else None
        row["native_vs_gloo"] = nat["seconds"] / gl["seconds"] if _done(nat) and gl else None
        allreduce.append(row)
        cpu = "/".join(f"{row[e]['aggregator_cpu_ms_per_call']:.0f}" if _done(row[e]) else "-" for e in engines)
        retx = "/".join(str(row[e]["retransmissions"]) if _done(row[e]) else "-" for e in engines)
        exact = all(row[e]["ok"] for e in engines)
        speedup = f"{row['speedup']:.1f}x" if row["speedup"] else "n/a"
        vs_gloo = f"{row['native_vs_gloo']:.1f}x" if row["native_vs_gloo"] else "n/a"
        print(f"{n:>7} | {lanes:>5} | {_ms(nat):>9} | {_ms(nump):>9} | {_ms(gl):>8} | {speedup:>21} | "
              f"{vs_gloo:>11} | {cpu:>17} | {retx:>11} | {'yes' if exact else 'NO':>5}", flush=True)
    return allreduce


def section_steady(args: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    print(f"\n== 4. aggregator CPU at a steady {args.steady_rate:.0f} packets/s (2-worker job, "
          f"{args.steady_seconds:g} s, every round completes) ==")
    steady: dict[str, Any] = {}
    for engine in args.engines:
        s = steady[engine] = aggregator_steady(engine, args.steady_rate, args.steady_seconds, args.lanes, args.pool)
        print(f"{engine:>7}: {s['cpu_share']:6.2%} of a core ({s['cpu_us_per_packet']:.1f} us/packet; idle "
              f"{s['idle_cpu_share']:.2%}) at {s['offered_packets_per_s']:.0f} packets/s offered; "
              f"{s['completed']}/{s['rounds']} rounds completed, "
              f"{s['results_received']}/{s['packets']} RESULTs back", flush=True)
    if "native" in args.engines:
        f = steady["floor"] = aggregator_steady("native", args.steady_rate, args.steady_seconds, args.lanes,
                                                args.pool, admit=False)
        print(f"  floor: {f['cpu_share']:6.2%} of a core ({f['cpu_us_per_packet']:.1f} us/packet) for the same "
              f"packets of a job not admitted ({f['rejected']}/{f['packets']} rejected, nothing sent): waking up, "
              f"reading and parsing one packet at a time", flush=True)
    return steady


def section_memory(args: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    print(f"\n== 5. peak memory added by one allreduce of {args.memory_elements} float32 "
          f"({args.memory_elements * 4 / MIB:.0f} MiB), 2 workers, native path ==")
    memory: dict[str, Any] = {}
    if "native" in args.engines:
        for use_out in (True, False):
            m = memory["out" if use_out else "out=None"] = allreduce_memory(
                "native", args.memory_elements, args.lanes, args.pool, use_out)
            resets = all(w["hwm_reset"] for w in m["workers"])
            print(f"{'out=' if use_out else 'out=None':>8}: {m['added'] / MIB:7.1f} MiB peak over the RSS "
                  "with input and output allocated (worst worker; VmHWM "
                  f"{'reset' if resets else 'NOT reset: upper bound'}), "
                  f"call {m['seconds'] * 1e3:.0f} ms", flush=True)
    return memory


def section_loss(args: argparse.Namespace, results: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    print(f"\n== 6. loss: {args.loss_workers} workers, {args.loss_elements} float32, pool {args.loss_pool}, "
          f"1 warm-up + {args.loss_iterations} timed, host-side loss each way at every worker ==")
    print(f"{'engine':>7} | {'loss':>5} | {'ms/call':>8} | {'vs no loss':>10} | {'target':>6} | {'retx':>6} | "
          f"{'exact':>5}")
    loss: dict[str, list[dict[str, Any]]] = {}
    for engine in args.engines:
        loss[engine] = []
        for p in sorted(args.loss):
            r = passing_allreduce(engine, args.loss_workers, args.loss_elements, args.lanes, args.loss_pool,
                                  args.loss_iterations, drop=p)
            base = loss[engine][0] if loss[engine] else r
            r["vs_no_loss"] = r["seconds"] / base["seconds"] if _done(r) and _done(base) else None
            loss[engine].append(r)
            ratio = f"{r['vs_no_loss']:.2f}x" if r["vs_no_loss"] else "n/a"
            goal = f"{TARGET_LOSS[p]:g}x" if p in TARGET_LOSS else "-"
            print(f"{engine:>7} | {p:5.0%} | {_ms(r):>8} | {ratio:>10} | {goal:>6} | "
                  f"{r.get('retransmissions', '-'):>6} | {'yes' if r['ok'] else 'NO':>5}"
                  + (f"  ({r['error']})" if "error" in r else ""), flush=True)
    return loss


def section_torch(args: argparse.Namespace, results: dict[str, Any]) -> list[dict[str, Any]]:
    print(f"\n== 7. torch all_reduce on backend \"passing\", no controller configured, vs gloo in the same processes "
          f"(1 warm-up + {args.torch_iterations} timed, alternating; medians). embedded off: the ring (gloo among "
          f"each local rank's peers); ps: rank 0's embedded controller and aggregator ==")
    print(f"{'servers x ranks':>15} | {'where':>10} | {'elements':>9} | {'embedded':>8} | {'mode':>7} | {'lanes':>5} | "
          f"{'passing ms':>10} | {'gloo ms':>8} | {'vs gloo':>7} | {'bit-identical':>13} | {'exact':>5} | "
          f"{'retx/packets':>12} | load")
    runs: list[tuple[int, int, int, int | None, str]] = []
    if args.one_server_elements:
        runs.append((1, 2, args.one_server_elements, None, "off"))
    for embedded in args.torch_embedded:
        runs += [(s, n, args.torch_elements, None, embedded) for s, n in args.torch_layouts]
        if os.geteuid() == 0:
            runs += [(s, n, args.torch_elements, mtu, embedded) for s, n, mtu in args.veths]
    if os.geteuid() != 0 and args.veths:
        print("  (the network-namespace rows need root: skipped)")
    rows: list[dict[str, Any]] = []
    for servers, ranks, elements, mtu, embedded in runs:
        t = torch_allreduce(servers, ranks, elements, args.torch_iterations, mtu, embedded)
        t["loadavg"] = os.getloadavg()[0]  # the machine's load over the last minute, next to the figure
        rows.append(t)
        where = f"veth {mtu}" if mtu else "loopback"
        head = f"{f'{servers} x {ranks}':>15} | {where:>10} | {elements:>9} | {embedded:>8}"
        if not t["ok"] and "error" in t:
            print(f"{head} | FAILED: {t['error']}", flush=True)
            continue
        print(f"{head} | {t['mode']:>7} | {t['lanes'] or '-':>5} | {t['passing_seconds'] * 1e3:10.1f} | "
              f"{t['gloo_seconds'] * 1e3:8.1f} | {t['vs_gloo']:6.2f}x | "
              f"{'yes' if t['identical_to_gloo'] else 'no':>13} | {'yes' if t['ok'] else 'NO':>5} | "
              f"{t['retransmissions']:>5}/{t['packets_sent']} | {t['loadavg']:.2f}", flush=True)
    return rows


# number -> (key in the results, the function that runs and prints it)
SECTIONS: dict[int, tuple[str, Callable[[argparse.Namespace, dict[str, Any]], Any]]] = {
    1: ("raw", section_raw), 2: ("aggregator_alone", section_capacity), 3: ("allreduce", section_allreduce),
    4: ("steady", section_steady), 5: ("memory", section_memory), 6: ("loss", section_loss),
    7: ("torch", section_torch),
}
EMPTY: dict[str, Any] = {"raw": {}, "aggregator_alone": {}, "allreduce": [], "steady": {}, "memory": {}, "loss": {},
                         "torch": []}


class Targets:
    """The targets judged so far, each printed as it is judged."""

    def __init__(self) -> None:
        self.judged: list[dict[str, Any]] = []

    def judge(self, what: str, value: float | None, goal: float, higher_is_better: bool, text: str) -> None:
        met = value is not None and (value >= goal if higher_is_better else value <= goal)
        self.judged.append({"what": what, "value": value, "target": goal, "met": met})
        print(f"  {what}: {text} -> {_verdict(met)}")


def judge_host_targets(args: argparse.Namespace, results: dict[str, Any], targets: Targets) -> None:
    """Sections 1-6: the aggregator, the host engine, memory and loss."""
    engines, raw, steady = args.engines, results["raw"], results["steady"]
    if "native" in engines:
        for n, c in results["aggregator_alone"].get("native", {}).items() if raw else []:
            targets.judge(f"native aggregator alone, {n} workers, capacity vs raw GSO", c["vs_raw_gso"],
                          TARGET_CAPACITY_VS_RAW, True,
                          f"{c['vs_raw_gso']:.0%} (target >= {TARGET_CAPACITY_VS_RAW:.0%})")
        for row in results["allreduce"]:
            if row["speedup"] and row["workers"] == 2 and row["lanes"] == args.lanes:
                targets.judge("native speed-up over numpy, 8 MiB, 2 workers", row["speedup"], TARGET_SPEEDUP, True,
                              f"{row['speedup']:.1f}x (target >= {TARGET_SPEEDUP:g}x)")
        for row in results["allreduce"]:
            if row["native_vs_gloo"]:
                targets.judge(f"native/gloo, {row['workers']} workers, {row['lanes']} lanes", row["native_vs_gloo"],
                              TARGET_VS_GLOO, False, f"{row['native_vs_gloo']:.1f}x (target <= {TARGET_VS_GLOO:g}x)")
        s = steady.get("native")
        if s:
            targets.judge(f"native aggregator CPU at {args.steady_rate:.0f} pps", s["cpu_share"], TARGET_STEADY_CPU,
                          False, f"{s['cpu_share']:.2%} of a core (target <= {TARGET_STEADY_CPU:.0%}; the receive-only "
                          f"floor on this machine: {steady['floor']['cpu_share']:.2%})")
        m = results["memory"].get("out")
        if m:
            targets.judge(f"peak memory added, {args.memory_elements} floats, out=", m["added"] / MIB,
                          TARGET_MEMORY / MIB, False,
                          f"{m['added'] / MIB:.1f} MiB (target <= {TARGET_MEMORY / MIB:.0f} MiB)")
    for engine in engines:
        for r in results["loss"].get(engine, []):
            goal = TARGET_LOSS.get(r["drop"])
            if goal is not None:
                value = r["vs_no_loss"] if r["ok"] else None
                targets.judge(f"{engine} under {r['drop']:.0%} loss vs no loss (exact)", value, goal, False,
                              f"{value:.2f}x (target <= {goal:g}x)" if value else "failed or inexact")
    for row in results["allreduce"]:  # loss-free runs: spurious retransmissions
        for engine in engines:
            r = row.get(engine)
            if _done(r) and r.get("packets_sent"):
                rate = r["retransmissions"] / r["packets_sent"]
                targets.judge(f"{engine} retransmissions per packet, {row['workers']} workers, {row['lanes']} lanes, "
                              "no loss", rate, TARGET_RETRANSMISSIONS, False, f"{r['retransmissions']} of "
                              f"{r['packets_sent']} (target <= 1 per {1 / TARGET_RETRANSMISSIONS:.0f})")


def judge_torch_targets(results: dict[str, Any], targets: Targets) -> None:
    """Section 7: the one-server row and the ring's rows against gloo; every row exact; the embedded
    PS's rows are figures for the record, with no time target."""
    for t in results["torch"]:
        mode = f"embedded {t['embedded']}" if t["servers"] > 1 else "one server"
        name = f"torch {t['servers']} x {t['ranks']} ({mode})"
        if "error" in t:
            targets.judge(name, None, 0, False, f"failed: {t['error']}")
            continue
        where = f"veths of MTU {t['mtu']}" if t["mtu"] else "loopback"
        if t["servers"] == 1:
            targets.judge(f"{name}: bit-identical to gloo", float(t["identical_to_gloo"]), 1.0, True,
                          "yes" if t["identical_to_gloo"] else "no")
            goal: float | None = TARGET_ONE_SERVER_VS_GLOO
        elif t["embedded"] == "off":
            goal = TARGET_RING_VS_GLOO if t["ranks"] == 1 else TARGET_HIERARCHY_VS_GLOO
            if t["ranks"] == 1:
                targets.judge(f"{name} on {where}: bit-identical to gloo", float(t["identical_to_gloo"]), 1.0, True,
                              "yes" if t["identical_to_gloo"] else "no")
        else:
            goal = None
        if goal is not None:
            targets.judge(f"{name} on {where} vs gloo (exact)", t["vs_gloo"] if t["ok"] else None, goal, False,
                          f"{t['vs_gloo']:.2f}x at load {t['loadavg']:.2f} (target <= {goal:g}x)"
                          + ("" if t["ok"] else ", NOT exact"))
        else:
            targets.judge(f"{name} on {where}: exact", float(t["ok"]), 1.0, True,
                          f"{'yes' if t['ok'] else 'NO'} ({t['vs_gloo']:.2f}x gloo at load {t['loadavg']:.2f}, "
                          "for the record)")
        if t["packets_sent"]:
            targets.judge(f"{name} on {where}: retransmissions per packet", t["retransmissions"] / t["packets_sent"],
                          TARGET_RETRANSMISSIONS, False, f"{t['retransmissions']} of {t['packets_sent']}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a short run (under a minute): 2 workers, 1 s blasts, 2 s at the steady rate, loss 0 and 5 %%")
    p.add_argument("--elements", type=int, default=2 * 1024 * 1024, help="float32 elements per allreduce")
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--lanes", type=int, default=wire.DEFAULT_LANES)
    p.add_argument("--pool", type=int, default=512)
    p.add_argument("--iterations", type=int, default=3, help="timed allreduces per run (after one warm-up)")
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    p.add_argument("--blast-seconds", type=float, default=3.0)
    p.add_argument("--wide-lanes", type=int, default=1024, help="lanes of the extra 2-worker row (0: none)")
    p.add_argument("--wide-pool", type=int, default=256)
    p.add_argument("--steady-rate", type=float, default=5000.0, help="packets/s of the steady-rate run")
    p.add_argument("--steady-seconds", type=float, default=5.0)
    p.add_argument("--memory-elements", type=int, default=25_000_000)
    p.add_argument("--loss-workers", type=int, default=4)
    p.add_argument("--loss-elements", type=int, default=200_000)
    p.add_argument("--loss-pool", type=int, default=256)
    p.add_argument("--loss-iterations", type=int, default=10)
    p.add_argument("--loss", type=float, nargs="+", default=[0.0, 0.01, 0.05, 0.20],
                   help="host-side loss each way at every worker (0 is the reference)")
    p.add_argument("--torch-layouts", type=_layout, nargs="*", default=[(2, 1), (4, 1), (8, 1), (2, 2), (4, 2)],
                   metavar="SxN", help="section 7: servers x ranks per server on loopback (none: skip those rows)")
    p.add_argument("--veths", type=_veth, nargs="*", default=[(2, 1, 1500), (2, 2, 1500), (4, 2, 1500), (2, 1, 9000)],
                   metavar="SxN@MTU", help="section 7: servers in network namespaces on veths of that MTU (root only)")
    p.add_argument("--torch-embedded", nargs="+", choices=("off", "ps"), default=["off", "ps"],
                   help="section 7: the PASSING_EMBEDDED values to run the rows with (off: the ring; ps: rank 0's PS)")
    p.add_argument("--torch-elements", type=int, default=2 * 1024 * 1024)
    p.add_argument("--one-server-elements", type=int, default=1_000_000,
                   help="section 7: float32 elements of the one-server row (0: skip it)")
    p.add_argument("--torch-iterations", type=int, default=20,
                   help="section 7: timed calls of each (after one warm-up); the median is reported")
    p.add_argument("--sections", type=int, nargs="+", choices=sorted(SECTIONS), default=sorted(SECTIONS),
                   help="run only these sections (the targets of the others are not judged)")
    p.add_argument("--out", type=Path, default=RESULTS / "core.json")
    args = p.parse_args()
    if args.quick:
        args.workers, args.blast_seconds, args.steady_seconds, args.loss = [2], 1.0, 2.0, [0.0, 0.05]
        args.torch_layouts, args.veths = [(2, 1), (2, 2)], []
    if 0.0 not in args.loss:
        args.loss = [0.0, *args.loss]
    return args


def main() -> int:
    args = parse_args()
    machine = {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
               "numpy": np.__version__, "loadavg_at_start": os.getloadavg()}
    print(f"machine: {machine['cores']} cores, {machine['platform']}, python {machine['python']}, "
          f"load average at start {machine['loadavg_at_start'][0]:.2f}")
    print(f"buffer: {args.elements} float32 ({args.elements * 4 / MIB:.1f} MiB), "
          f"{args.lanes} lanes/packet ({wire.packet_size(args.lanes)} B), pool {args.pool}", flush=True)
    started = time.perf_counter()
    results = dict(EMPTY)
    for number in sorted(args.sections):
        key, run = SECTIONS[number]
        results[key] = run(args, results)

    print("\n== targets ==")
    targets = Targets()
    judge_host_targets(args, results, targets)
    judge_torch_targets(results, targets)

    elapsed = time.perf_counter() - started
    machine["loadavg_at_end"] = os.getloadavg()
    print(f"\nran {elapsed:.0f} s; load average at end {machine['loadavg_at_end'][0]:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = vars(args) | {"out": str(args.out)}
    args.out.write_text(json.dumps({"config": config, "machine": machine, "seconds": elapsed, **results,
                                    "targets": targets.judged}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from cluster.local import ensure_keys

    ensure_keys()
    if len(sys.argv) > 1 and sys.argv[1] == "--blast-receiver":
        blast_receiver(int(sys.argv[2]), int(sys.argv[3]), bool(int(sys.argv[4])), idle=1.0)
    elif len(sys.argv) > 1 and sys.argv[1] == "--gloo-worker":
        gloo_worker(*map(int, sys.argv[2:7]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--torch-worker":
        torch_worker(int(sys.argv[2]), int(sys.argv[3]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--memory-worker":
        w, n, agg, bind, gen, pool, lanes, elements, engine, use_out = sys.argv[2:12]
        memory_worker(int(w), int(n), agg, bind, int(gen), int(pool), int(lanes), int(elements), engine,
                      bool(int(use_out)))
    else:
        sys.exit(main())
