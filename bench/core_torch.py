"""bench/core.py's section 7: torch's all_reduce on backend "passing" with no controller configured, against
gloo in the same processes (the ranks are bench/core.py's ``--torch-worker``). Run through bench/core.py (the
repository on the path: cluster/)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np
from core_host import CORE


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

    argv = [sys.executable, str(CORE), "--torch-worker", str(elements), str(iterations)]
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
