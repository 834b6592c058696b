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

import passing.torch  # registers backend "passing"
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
                sent = transport_stats()["packets_sent"]
                work = dist.all_reduce(mine, op=op, async_op=async_op)
                if async_op:
                    work.wait()
                streamed = transport_stats()["packets_sent"] > sent  # it went through PASSING
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
                               "identical": bool(lo == hi), "streamed": streamed})
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


def ddp(epochs: int) -> dict:
    """The same DDP training on "passing" and on gloo; parameters compared every 10 steps."""
    from demo.train import digits, train

    data, gloo = digits(), dist.new_group(backend="gloo")
    return {"passing": train(data, None, epochs, check_group=gloo, check_every=10),
            "gloo": train(data, gloo, epochs, check_group=gloo, check_every=10)}


def post_local_sgd(epochs: int) -> dict:
    """torch's PostLocalSGD (hook + optimizer) over "passing", averaging within each server."""
    from demo.train import digits, train

    pg = dist.distributed_c10d._get_default_group()
    n = pg.layout.ranks_per_server
    world = dist.get_world_size()
    subgroup, _ = dist.new_subgroups_by_enumeration([list(range(s, s + n)) for s in range(0, world, n)])
    sent = transport_stats()["packets_sent"]
    out = train(digits(), None, epochs, local_sgd=4, subgroup=subgroup)
    out["streamed"] = transport_stats()["packets_sent"] > sent
    return out


def hook(epochs: int) -> dict:
    """gloo stays the default group; DDP's gradients go through passing.torch.allreduce_hook."""
    from demo.train import digits, train

    data, group = digits(), dist.new_group(backend="passing")
    hooked = train(data, None, epochs, check_group=None, check_every=10, hook=(group, passing.torch.allreduce_hook))
    hooked["bytes_sent"] = transport_stats(group)["bytes_sent"]
    return {"hook": hooked, "gloo": train(data, None, epochs, check_group=None, check_every=10)}


SCENARIOS = {"allreduce": lambda a: allreduce([int(s) for s in a]), "bytes": lambda a: bytes_per_allreduce(int(a[0])),
             "fallback": lambda a: fallback(), "dead_peer": lambda a: dead_peer(int(a[0])),
             "ddp": lambda a: ddp(int(a[0])), "post_local_sgd": lambda a: post_local_sgd(int(a[0])),
             "hook": lambda a: hook(int(a[0]))}


def init_explicitly() -> None:
    """init_process_group with arguments instead of torchrun's variables (which are removed first)."""
    import os

    env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                                          "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PASSING_CONTROLLER")}
    options = passing.torch.Options(controller=env["PASSING_CONTROLLER"], server=f"server-{env['GROUP_RANK']}")
    dist.init_process_group("passing", init_method=f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
                            rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]), pg_options=options)


def main() -> None:
    scenario, args = sys.argv[1], sys.argv[2:]
    if "--explicit" in args:
        args.remove("--explicit")
        init_explicitly()
    else:
        dist.init_process_group("gloo" if scenario == "hook" else "passing")
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
