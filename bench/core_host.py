"""bench/core.py's measurements of the host side (its sections 1-6) and gloo's allreduce, each in separate
processes on loopback; the worker processes are bench/core.py's (``--blast-receiver``, ``--memory-worker``,
``--gloo-worker``). Run through bench/core.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from passing import wire
from passing.aggregator.control_channel import ControlClient
from passing.launch import free_udp_ports, start_aggregator
from passing.transport import BatchSocket, pack_address

CORE = Path(__file__).resolve().with_name("core.py")  # the benchmark, which starts the worker processes


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
    recv = subprocess.Popen([sys.executable, str(CORE), "--blast-receiver", str(port), str(lanes), str(int(offload))],
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
        procs = [subprocess.Popen([sys.executable, str(CORE), "--memory-worker", str(w), str(workers), ready["data"],
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
    procs = [subprocess.Popen([sys.executable, str(CORE), "--gloo-worker", str(r), str(workers), str(port),
                               str(elements), str(iterations)], stdout=subprocess.PIPE, text=True)
             for r in range(workers)]
    seconds = max(json.loads(p.communicate(timeout=1800)[0].splitlines()[-1])["seconds"] for p in procs)
    return {"workers": workers, "seconds": seconds, "gbit_per_s_per_worker": elements * 4 * 8 / seconds / 1e9}


def done(row: dict[str, Any] | None) -> bool:
    """A PASSING run that produced figures (a failed one has "error" instead)."""
    return row is not None and "seconds" in row
