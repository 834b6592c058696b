"""One rank of a torch test run: `python -m tests.torch_worker SCENARIO [ARGS]`.

Started by tests/test_torch_*.py with torchrun's environment (cluster.local.rank_env);
prints one JSON line with what the test checks.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import passing.torch  # noqa: F401  (registers backend "passing")
from passing.torch import transport_stats


def bound(x_max: float, servers: int, world: int, scale_workers: int) -> float:
    """|PASSING − gloo| allowed: quantization of a sum of ``world`` inputs at most x_max,
    plus float32 rounding of the two different summation orders."""
    from passing import quantize

    total = world * x_max
    if total == 0:
        return 0.0
    q = quantize.error_bound(quantize.auto_scale(total, scale_workers), scale_workers)
    return q + 4 * world * float(np.finfo(np.float32).eps) * total


def allreduce(sizes: list[int]) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = dist.new_group(backend="gloo")
    pg = dist.distributed_c10d._get_default_group()
    servers = pg.layout.servers
    checks = []
    for size in sizes:
        for async_op in (False, True):
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                g = torch.Generator().manual_seed(size * 131 + rank)
                x = (torch.rand(size, generator=g) - 0.5) * (rank + 1)
                mine = x.clone()
                work = dist.all_reduce(mine, op=op, async_op=async_op)
                if async_op:
                    assert not work.is_completed() or True  # may already be done for tiny tensors
                    work.wait()
                expected = x.clone()
                dist.all_reduce(expected, group=reference)  # gloo has no AVG: sum, then divide
                if op == dist.ReduceOp.AVG:
                    expected /= world
                x_max = torch.tensor([x.abs().max().item()])
                dist.all_reduce(x_max, op=dist.ReduceOp.MAX, group=reference)
                b = bound(float(x_max), servers, world, pg.stream.workers if pg.stream else world)
                if op == dist.ReduceOp.AVG:
                    b /= world
                err = float((mine - expected).abs().max())
                # every rank must hold the very same bits
                digest = torch.tensor([float(mine.double().sum())], dtype=torch.float64)
                lo, hi = digest.clone(), digest.clone()
                dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=reference)
                dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=reference)
                checks.append({"size": size, "async": async_op, "op": str(op), "error": err, "bound": b,
                               "identical": bool(lo == hi)})
    return {"checks": checks, "mode": pg.mode, "servers": servers, "ranks_per_server": pg.layout.ranks_per_server}


def bytes_per_allreduce(size: int) -> dict:
    x = torch.ones(size)
    dist.all_reduce(x)  # warm-up: the first call's MAX round is in every call, so count a later one
    before = transport_stats()["bytes_sent"]
    dist.all_reduce(x)
    return {"bytes_sent": transport_stats()["bytes_sent"] - before, "server": int(dist.get_rank()) // int(
        dist.distributed_c10d._get_default_group().layout.ranks_per_server)}


def fallback() -> dict:
    """Other dtypes, ops and collectives go to gloo, and give gloo's answers."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    i = torch.full((5,), rank + 1, dtype=torch.int64)
    dist.all_reduce(i)
    out["int64_sum"] = i.tolist()
    d = torch.full((3,), float(rank), dtype=torch.float64)
    dist.all_reduce(d, op=dist.ReduceOp.MAX)
    out["float64_max"] = d.tolist()
    f = torch.full((4,), float(rank))
    dist.all_reduce(f, op=dist.ReduceOp.MAX)
    out["float32_max"] = f.tolist()
    b = torch.full((2,), float(rank))
    dist.broadcast(b, src=world - 1)
    out["broadcast"] = b.tolist()
    gathered = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([float(rank)]))
    out["all_gather"] = [float(t) for t in gathered]
    dist.barrier()
    return out


def dead_peer(victim: int) -> dict:
    """Rank ``victim`` exits before the second all_reduce; the others must get an error from wait()."""
    x = torch.ones(10_000)
    dist.all_reduce(x)
    if dist.get_rank() == victim:
        sys.stdout.write(json.dumps({"victim": True}) + "\n")
        sys.stdout.flush()
        import os

        os._exit(0)
    start = time.monotonic()
    work = dist.all_reduce(torch.ones(10_000), async_op=True)
    try:
        work.wait()
    except Exception as e:  # what the test wants to see
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


SCENARIOS = {"allreduce": lambda a: allreduce([int(s) for s in a]), "bytes": lambda a: bytes_per_allreduce(int(a[0])),
             "fallback": lambda a: fallback(), "dead_peer": lambda a: dead_peer(int(a[0]))}


def main() -> None:
    scenario, args = sys.argv[1], sys.argv[2:]
    dist.init_process_group("passing")
    try:
        result = SCENARIOS[scenario](args)
    finally:
        if scenario != "dead_peer":
            dist.destroy_process_group()
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    if scenario == "dead_peer":
        import os

        os._exit(0)  # the default group's gloo cannot shut down cleanly with a peer gone


if __name__ == "__main__":
    main()
