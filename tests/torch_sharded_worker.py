"""One rank of a sharded-collectives run: `python -m tests.torch_sharded_worker SCENARIO [ARGS]`.

Started by tests/test_torch_sharded.py with torchrun's environment; prints one JSON line. Every
answer is compared with gloo's among the same ranks (a gloo group made beside the default one).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

import passing.torch  # noqa: F401  (registers backend "passing")
from passing.torch import transport_stats


def packets_sent() -> int:
    return transport_stats().get("packets_sent", 0)


def collectives(sizes: list[int]) -> dict:
    """reduce_scatter and all_gather, every form FSDP and ZeRO use, against gloo's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    checks = []

    def check(name: str, mine: torch.Tensor, reference: torch.Tensor, sent: int, exact: bool) -> None:
        error = float((mine.double() - reference.double()).abs().max()) if mine.numel() else 0.0
        checks.append({"name": name, "streamed": packets_sent() > sent, "exact": bool(torch.equal(mine, reference)),
                       "error": error, "scale": float(reference.double().abs().max()) if mine.numel() else 0.0,
                       "want_exact": exact, "empty": mine.numel() == 0})

    for size in sizes:
        g = torch.Generator().manual_seed(size * 7 + rank)
        x = torch.randn(world * size, generator=g)
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            for async_op in (False, True):
                out, sent = torch.empty(size), packets_sent()
                work = dist.reduce_scatter_tensor(out, x, op=op, async_op=async_op)
                if async_op:
                    work.wait()
                ref = torch.empty(size)
                dist.reduce_scatter_tensor(ref, x, group=gloo)  # gloo: SUM; AVG divides after
                if op == dist.ReduceOp.AVG:
                    ref /= world
                check(f"reduce_scatter_tensor {size} {op} async={async_op}", out, ref, sent, False)
        out, ref, sent = torch.empty(size), torch.empty(size), packets_sent()
        dist.reduce_scatter(out, list(x.chunk(world)))
        dist.reduce_scatter(ref, list(x.chunk(world)), group=gloo)
        check(f"reduce_scatter list {size}", out, ref, sent, False)
        half, sent = torch.empty(size, dtype=torch.bfloat16), packets_sent()
        dist.reduce_scatter_tensor(half, x.bfloat16())
        ref_half = torch.empty(size)
        dist.reduce_scatter_tensor(ref_half, x.bfloat16().float(), group=gloo)
        check(f"reduce_scatter_tensor bfloat16 {size}", half.float(), ref_half.bfloat16().float(), sent, False)
        for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool, torch.uint8):
            piece = (torch.randn(size, generator=g) * 1000).to(dtype) if dtype != torch.bool else \
                torch.rand(size, generator=g) > 0.5
            if dtype == torch.float32 and size > 2:
                piece[0], piece[1], piece[2] = float("nan"), float("-inf"), -0.0  # bit for bit, these too
            out, sent = torch.empty(world * size, dtype=dtype), packets_sent()
            dist.all_gather_into_tensor(out, piece)
            ref = torch.empty(world * size, dtype=dtype)
            dist.all_gather_into_tensor(ref, piece, group=gloo)
            same_bits = out.view(torch.uint8).equal(ref.view(torch.uint8)) if size else True
            checks.append({"name": f"all_gather_into_tensor {dtype} {size}", "streamed": packets_sent() > sent,
                           "exact": same_bits, "error": 0.0, "scale": 0.0, "want_exact": True,
                           "empty": size == 0})
        outs, sent = [torch.empty(size) for _ in range(world)], packets_sent()
        dist.all_gather(outs, x[:size])
        refs = [torch.empty(size) for _ in range(world)]
        dist.all_gather(refs, x[:size], group=gloo)
        check(f"all_gather list {size}", torch.cat(outs), torch.cat(refs), sent, True)
    # the coalesced forms (FSDP's with several parameters)
    pieces = [torch.randn(n, generator=torch.Generator().manual_seed(rank + n)) for n in (3, 100)]
    outs, sent = [torch.empty(world * p.numel()) for p in pieces], packets_sent()
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, p in zip(outs, pieces):
            dist.all_gather_into_tensor(o, p)
    cm.wait()
    refs = [torch.empty(world * p.numel()) for p in pieces]
    for r, p in zip(refs, pieces):
        dist.all_gather_into_tensor(r, p, group=gloo)
    check("all_gather coalesced", torch.cat(outs), torch.cat(refs), sent, True)
    grads = [torch.randn(world * n, generator=torch.Generator().manual_seed(rank * 3 + n)) for n in (5, 70)]
    outs, sent = [torch.empty(g.numel() // world) for g in grads], packets_sent()
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, gr in zip(outs, grads):
            dist.reduce_scatter_tensor(o, gr)
    cm.wait()
    refs = [torch.empty(g.numel() // world) for g in grads]
    for r, gr in zip(refs, grads):
        dist.reduce_scatter_tensor(r, gr, group=gloo)
    check("reduce_scatter coalesced", torch.cat(outs), torch.cat(refs), sent, False)
    pg = dist.distributed_c10d._get_default_group()
    return {"checks": checks, "mode": pg.mode, "servers": pg.layout.servers, "world": world}


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
          steps: int, pause=None) -> list[float]:  # noqa: ANN001
    """``steps`` steps of MSE training on one batch; the loss of each. ``pause(step, phase)`` is called
    before each forward ("forward": FSDP's all_gathers) and each backward ("backward": its reduce_scatters)."""
    losses = []
    for step in range(steps):
        if pause is not None:
            pause(step, "forward")
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        if pause is not None:
            pause(step, "backward")
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses


def fsdp(steps: int, lr: float = 0.1, pause=None) -> dict:  # noqa: ANN001
    """FSDP2 (fully_shard) of a small MLP on the passing default group and on a gloo group: the same
    model, data and optimizer (SGD at ``lr``, momentum 0.9); their losses step by step. ``pause(step,
    phase)``: called in the passing run before fully_shard (step -1, "startup") and as ``train`` says."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    out: dict = {}
    for name, group in (("passing", dist.distributed_c10d._get_default_group()), ("gloo", gloo)):
        if pause is not None and name == "passing":
            pause(-1, "startup")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                    torch.nn.ReLU(), torch.nn.Linear(64, 4))
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(100 + rank))  # this rank's batch
        y = (x[:, :4] * 2).sin()
        sent, start = packets_sent(), time.monotonic()
        losses = train(model, optimizer, x, y, steps, pause if name == "passing" else None)
        out[name] = {"losses": losses, "streamed": packets_sent() > sent, "seconds": time.monotonic() - start}
    pg = dist.distributed_c10d._get_default_group()
    out["mode"], out["moves"] = pg.mode, sum(lane.stream.moves for lane in pg.lanes())  # both lanes
    out["on_gloo"] = any(lane.gloo is not None for lane in pg.lanes())
    return out


def strike_point(phase: str, step: int):  # noqa: ANN201
    """A ``pause`` for ``fsdp``: at (step, phase) rank 0 touches PASSING_TEST_MARKER and waits (30 s at
    most) for the test to strike the aggregator and touch the marker's ".done"; every other rank goes on
    into the next collective, where it waits for rank 0."""
    import os
    import time
    from pathlib import Path

    marker = Path(os.environ["PASSING_TEST_MARKER"])

    def pause(at_step: int, at_phase: str) -> None:
        if dist.get_rank() == 0 and (at_step, at_phase) == (step, phase):
            marker.touch()
            done = marker.with_suffix(".done")
            deadline = time.monotonic() + 30
            while not done.exists() and time.monotonic() < deadline:
                time.sleep(0.01)

    return pause


def hsdp(steps: int, lr: float = 0.1) -> dict:
    """HSDP: fully_shard over a 2-D mesh of 4 ranks, [[0, 1], [2, 3]], sharded along the rows and
    replicated along the columns, on "passing" subgroups and on gloo subgroups alike (SGD at ``lr``,
    momentum 0.9); the losses."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    grid = [[0, 1], [2, 3]]
    out: dict = {}
    for backend in ("passing", "gloo"):
        # every rank makes every group, in the same order
        rows = [dist.new_group(r, backend=backend) for r in grid]
        columns = [dist.new_group([grid[0][c], grid[1][c]], backend=backend) for c in range(2)]
        row, column = rank // 2, rank % 2
        mesh = DeviceMesh.from_group([columns[column], rows[row]], "cpu", mesh=torch.tensor(grid),
                                     mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(100 + rank))
        y = (x[:, :4] * 2).sin()
        sent = packets_sent_in(rows[row]), packets_sent_in(columns[column])
        losses = train(model, optimizer, x, y, steps)
        out[backend] = {"losses": losses, "shard_streamed": packets_sent_in(rows[row]) > sent[0],
                        "replicate_streamed": packets_sent_in(columns[column]) > sent[1]}
    return out


def packets_sent_in(group: dist.ProcessGroup) -> int:
    """PASSING packets this rank sent in ``group`` (0 for a gloo group)."""
    pg = group if isinstance(group, passing.torch.ProcessGroupPassing) else None
    return pg.transport_stats().get("packets_sent", 0) if pg is not None else 0


def on_gloo(sizes: list[int]) -> dict:
    """The collectives once the network stage carries on over gloo, as after a failover with no
    aggregator left (network.FailoverStage): its gloo group among the same workers stands in."""
    from datetime import timedelta

    from torch.distributed import PrefixStore

    from passing.torch.network import gloo_group

    pg = dist.distributed_c10d._get_default_group()
    group = pg.layout.local_rank if pg.in_host else 0
    store = dist.distributed_c10d._get_default_store()
    for lane, stage in (("main", pg.network), ("gather", pg.gather_lane.network)):  # both lanes' stages
        stream = stage.stream
        stage.gloo = gloo_group(PrefixStore(f"test/on_gloo/{lane}/{group}/", store), stream.worker, stream.workers,
                                timedelta(seconds=60), stream.socket.address[0])
    return collectives(sizes)


def overlap(size: int) -> dict:
    """A reduce_scatter issued, then an all_gather, while the test holds the reduce lane's PS stopped
    (SIGSTOP): the all_gather must complete with the reduce_scatter still pending (the lanes overlap);
    then the test lets the PS go on and the reduce_scatter completes. Rank 0 tells the test where it is
    through PASSING_TEST_MARKER: ``.joined`` (wait for ``.stopped``), then ``.gathered``."""
    import os
    from pathlib import Path

    marker = Path(os.environ["PASSING_TEST_MARKER"])
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    dist.barrier(group=gloo)  # every rank has joined both lanes
    if rank == 0:
        marker.with_suffix(".joined").touch()
    deadline = time.monotonic() + 60
    while not marker.with_suffix(".stopped").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    grads = torch.arange(world * size, dtype=torch.float32) + rank
    reduced = torch.empty(size)
    piece = torch.full((size,), float(rank), dtype=torch.float64)
    gathered = torch.empty(world * size, dtype=torch.float64)
    scatter = dist.reduce_scatter_tensor(reduced, grads, async_op=True)
    gather = dist.all_gather_into_tensor(gathered, piece, async_op=True)
    gather.wait()
    scatter_pending = not scatter.is_completed()
    gathered_right = bool(torch.equal(gathered, torch.arange(world, dtype=torch.float64).repeat_interleave(size)))
    dist.barrier(group=gloo)  # gloo's: the reduce lane is stuck
    if rank == 0:
        marker.with_suffix(".gathered").touch()
    scatter.wait()
    want = (torch.arange(world * size, dtype=torch.float32).view(world, size)[rank] * world
            + sum(range(world)))
    return {"scatter_pending_when_gathered": scatter_pending, "gathered_right": gathered_right,
            "reduced_error": float((reduced - want).abs().max()),
            "mode": dist.distributed_c10d._get_default_group().mode}


SCENARIOS = {"collectives": lambda a: collectives([int(s) for s in a]),
             "fsdp": lambda a: fsdp(int(a[0]), *map(float, a[1:])),  # steps [learning rate]
             # steps, learning rate, phase (startup, forward, backward), step
             "fsdp_fault": lambda a: fsdp(int(a[0]), float(a[1]), strike_point(a[2], int(a[3]))),
             "hsdp": lambda a: hsdp(int(a[0]), *map(float, a[1:])), "on_gloo": lambda a: on_gloo([int(s) for s in a]),
             "overlap": lambda a: overlap(int(a[0]))}


def main() -> None:
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # cluster.local.collect asks before it kills
    scenario, args = sys.argv[1], sys.argv[2:]
    dist.init_process_group("passing")
    try:
        result = SCENARIOS[scenario](args)
    finally:
        dist.destroy_process_group()
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
