"""The sharded collectives of backend "passing": what FSDP, HSDP and ZeRO move.

reduce_scatter (gradients) goes through OWNER_ONLY rounds and all_gather (parameters) through
GATHER packets the aggregator relays (docs/protocol.md, Kinds; passing.stream.Group's
``reduce_scatter`` and ``allgather_bytes``), with the in-host stage around the network one:

* reduce_scatter: the ranks of a server first reduce-scatter among themselves, so that local
  rank j holds the server's sum of the chunks of every rank with local index j (one per
  server); network group j then reduce-scatters those, server s's block back to server s.
* all_gather: network group j first gathers the pieces of the ranks with local index j (one per
  server); the ranks of a server then all-gather those among themselves.

SUM and AVG of float32 (float16 and bfloat16 as their float32 values) take the reduce path, every
dtype the gather path, bit for bit; anything else, CUDA tensors, a collective the options keep on
gloo (``keep_on_gloo``), and every group without a network stage (one server, scheme ring) go to
the device's backend as before.

The all_gathers have a lane of their own (GatherLane): a second PASSING group of the job (group
GATHER_GROUP + j: its own slots, sequence space, socket, loss recovery and failover), their own
thread and in-host stage. So an all_gather issued while a reduce_scatter or an all_reduce is on the
wire (FSDP's backward) proceeds at the same time, as gloo's two threads let it: the reduce_scatter
loads the uplinks (every server sends the whole tensor, gets its block), the all_gather the
downlinks. Each lane runs its calls in issue order, which is the same on every rank.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.distributed import ReduceOp

from .options import SHARDED_COLLECTIVES
from .work import InOrder, PassingWork

if TYPE_CHECKING:
    from .backend import FailoverStage, Membership, ProcessGroupPassing
    from .in_host import CpuInHostStage

log = logging.getLogger("passing.torch")

REDUCE_SCATTER, ALL_GATHER = SHARDED_COLLECTIVES  # the names keep_on_gloo takes
REDUCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GATHER_GROUP = 512  # the gather lane of group j is the job's group GATHER_GROUP + j (the controller takes 0-1023)


def gather_pool(pool: int, workers: int) -> int:
    """The gather lane's window for a reduce lane's ``pool``: pool / workers, at least 8 (at most pool).
    The aggregator relays each GATHER to the workers - 1 others, so a server's downlink queue holds the
    others' gather windows: (workers - 1) / workers of a pool toward each server, a little less than the
    reduce lane's pool of RESULTs and ACKs, which therefore wait behind about as much again rather than
    (workers - 1) times as much. With the full pool on both lanes the reduce_scatter under an all_gather
    went at the pace of its window rather than of its uplink (docs/benchmarks.md has the figures)."""
    return min(pool, max(8, -(-pool // max(1, workers))))


@dataclass
class GatherLane:
    """The all_gathers' own way: their network stage (a second group of the job), the thread that runs
    them in issue order, the in-host stage among the server's ranks (None: one rank per server) and the
    second group's membership at the controller."""

    network: FailoverStage
    runner: InOrder
    in_host: CpuInHostStage | None
    membership: Membership


def install(cls: type[ProcessGroupPassing]) -> None:
    """Put the sharded collectives on the process group class, each falling back to the method it
    replaces (the device backend's) for what it does not route."""
    routes = {
        "reduce_scatter_single": _reduce_scatter_single,  # reduce_scatter_tensor
        "_reduce_scatter_base": _reduce_scatter_single,
        "reduce_scatter": _reduce_scatter_list,
        "reduce_scatter_single_coalesced": _reduce_scatter_coalesced,
        "all_gather_single": _all_gather_single,  # all_gather_into_tensor
        "_allgather_base": _all_gather_single,
        "allgather": _all_gather_list,
        "all_gather_single_coalesced": _all_gather_coalesced,
    }
    for name, route in routes.items():
        setattr(cls, name, _with_fallback(name, route, getattr(cls, name)))


def _with_fallback(name: str, route: Any, fallback: Any) -> Any:
    def collective(self: ProcessGroupPassing, *args: Any) -> Any:
        work = route(self, *args)
        return work if work is not None else fallback(self, *args)

    collective.__name__ = collective.__qualname__ = name
    return collective


# ---- which calls go through PASSING -----------------------------------------------------------


def _why_not(pg: ProcessGroupPassing, kind: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
             opts: Any) -> str:
    """Why this call goes to the device's backend ("" when PASSING takes it)."""
    if pg.stream is None:
        return f"any tensor ({pg.mode or 'no network stage'})"
    if kind in pg.options.keep_on_gloo:
        return "any tensor (keep_on_gloo)"
    tensors = [*outputs, *inputs]
    if any(t.device.type != "cpu" for t in tensors):
        return "device tensors (PASSING streams CPU memory)"
    if any(t.layout != torch.strided or not t.is_contiguous() for t in tensors):
        return "non-contiguous tensors"
    if len({t.dtype for t in tensors}) != 1:
        return "mixed dtypes"
    if kind == REDUCE_SCATTER:
        if tensors[0].dtype not in REDUCE_DTYPES:
            return f"dtype {tensors[0].dtype}"
        if opts.reduceOp.op not in (ReduceOp.SUM, ReduceOp.AVG):
            return f"op {opts.reduceOp.op.name}"
    return ""


def _routed(pg: ProcessGroupPassing, kind: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
            opts: Any) -> bool:
    why = _why_not(pg, kind, outputs, inputs, opts)
    if why and f"{kind}: {why}" not in pg._fallbacks_logged:
        pg._fallbacks_logged.add(f"{kind}: {why}")
        log.warning("passing: %s of %s goes to gloo/NCCL (logged once)", kind, why)
    return not why


# ---- the ProcessGroup methods ------------------------------------------------------------------


def _reduce_scatter_single(pg: ProcessGroupPassing, output: torch.Tensor, input: torch.Tensor,
                           opts: Any) -> PassingWork | None:
    if not _routed(pg, REDUCE_SCATTER, [output], [input], opts):
        return None
    if input.numel() != output.numel() * pg.size():
        raise ValueError(f"reduce_scatter: input of {input.numel()} elements for an output of {output.numel()} "
                         f"in a group of {pg.size()}")
    return _submit(pg, lambda: reduce_scatter(pg, output, input, _avg(opts)), [output], opts)


def _reduce_scatter_list(pg: ProcessGroupPassing, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                         opts: Any) -> PassingWork | None:
    if len(outputs) != 1 or len(input_lists) != 1 or len(input_lists[0]) != pg.size() or \
            any(t.numel() != outputs[0].numel() for t in input_lists[0]):
        return None
    output, inputs = outputs[0], input_lists[0]
    if not _routed(pg, REDUCE_SCATTER, [output], inputs, opts):
        return None

    def run() -> None:
        reduce_scatter(pg, output, torch.cat([t.reshape(-1) for t in inputs]), _avg(opts))

    return _submit(pg, run, [output], opts)


def _reduce_scatter_coalesced(pg: ProcessGroupPassing, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                              opts: Any) -> PassingWork | None:
    if not _routed(pg, REDUCE_SCATTER, outputs, inputs, opts) or \
            any(i.numel() != o.numel() * pg.size() for o, i in zip(outputs, inputs, strict=True)):
        return None

    def run() -> None:
        for o, i in zip(outputs, inputs):
            reduce_scatter(pg, o, i, _avg(opts))

    return _submit(pg, run, outputs, opts)


def _all_gather_single(pg: ProcessGroupPassing, output: torch.Tensor, input: torch.Tensor,
                       opts: Any) -> PassingWork | None:
    if not _routed(pg, ALL_GATHER, [output], [input], opts):
        return None
    if output.numel() != input.numel() * pg.size():
        raise ValueError(f"all_gather: output of {output.numel()} elements for an input of {input.numel()} "
                         f"in a group of {pg.size()}")
    return _submit(pg, lambda: all_gather(pg, output, input), [output], opts, gather=True)


def _all_gather_list(pg: ProcessGroupPassing, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                     opts: Any) -> PassingWork | None:
    if len(output_lists) != 1 or len(inputs) != 1 or len(output_lists[0]) != pg.size() or \
            any(t.numel() != inputs[0].numel() for t in output_lists[0]):
        return None  # uneven pieces: the device's backend
    outputs, input = output_lists[0], inputs[0]
    if not _routed(pg, ALL_GATHER, outputs, [input], opts):
        return None

    def run() -> None:
        flat = torch.empty(input.numel() * pg.size(), dtype=input.dtype)
        all_gather(pg, flat, input)
        for t, piece in zip(outputs, flat.split(input.numel())):
            t.copy_(piece.view(t.shape))

    return _submit(pg, run, outputs, opts, gather=True)


def _all_gather_coalesced(pg: ProcessGroupPassing, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                          opts: Any) -> PassingWork | None:
    if not _routed(pg, ALL_GATHER, outputs, inputs, opts) or \
            any(o.numel() != i.numel() * pg.size() for o, i in zip(outputs, inputs, strict=True)):
        return None

    def run() -> None:
        for o, i in zip(outputs, inputs):
            all_gather(pg, o, i)

    return _submit(pg, run, outputs, opts, gather=True)


def _avg(opts: Any) -> bool:
    return opts.reduceOp.op == ReduceOp.AVG


def _submit(pg: ProcessGroupPassing, run: Any, outputs: list[torch.Tensor], opts: Any,
            gather: bool = False) -> PassingWork:
    """Run in issue order (passing.torch.work) on the group's thread, or on the gather lane's
    (``gather``, where the group has one); the work's value is ``outputs``."""
    lane = pg.gather_lane if gather else None
    runner, membership = (lane.runner, lane.membership) if lane is not None else (pg._runner, pg._membership)
    assert runner is not None
    work = PassingWork(runner)

    def job() -> list[torch.Tensor]:
        start = time.monotonic()
        run()
        if membership is not None:
            membership.record_call(time.monotonic() - start)
        return outputs

    runner.submit(work, job, caller_waits=not opts.asyncOp)
    return work


# ---- the two stages ---------------------------------------------------------------------------
# The network stage is ``pg.network`` (backend.FailoverStage): the group's stream, moved with its
# aggregator, or gloo among the same workers once no aggregator is left, as every worker decides alike
# at the same call.


def rank_grid(pg: ProcessGroupPassing) -> np.ndarray:
    """grid[server, local rank] = the rank there: what every rank read from the store at set-up
    (hierarchy.Layout), so no collective, which on the group's thread would race the caller's own
    on the same gloo group."""
    return np.array(pg.layout.grid, dtype=np.int64)


def reduce_scatter(pg: ProcessGroupPassing, output: torch.Tensor, input: torch.Tensor, avg: bool) -> None:
    """Rank r's chunk of the sum of ``input`` (size chunks, in rank order) over every rank, into ``output``."""
    chunk = output.numel()
    wide = input.detach().reshape(-1)
    wide = wide if wide.dtype == torch.float32 else wide.float()
    in_host = pg.in_host.get("cpu") if pg.in_host else None
    if in_host is None:  # one rank per server: the network group is the process group, worker = rank
        summed = pg.network.reduce_scatter(wide.numpy())
    else:
        grid = rank_grid(pg)
        chunks = wide.view(pg.size(), chunk)
        servers, n = grid.shape
        # local rank j's part: the chunks of the ranks with local index j, in server order
        order = torch.from_numpy(grid.T.reshape(-1).copy())
        mine = torch.empty(servers * chunk, dtype=torch.float32)
        in_host.reduce_scatter(chunks.index_select(0, order).view(n, servers * chunk), mine)
        summed = pg.network.reduce_scatter(mine.numpy())  # network worker = server: its block is this rank's
    result = torch.from_numpy(summed)
    if avg:
        result /= pg.size()
    output.copy_(result.view(output.shape))


def all_gather(pg: ProcessGroupPassing, output: torch.Tensor, input: torch.Tensor) -> None:
    """Every rank's ``input``, in rank order, into ``output``: bit for bit, whatever the dtype."""
    piece = input.detach().reshape(-1).view(torch.uint8)
    size = piece.numel()
    out = output.view(-1).view(torch.uint8)
    lane = pg.gather_lane
    stage = lane.network if lane is not None else pg.network
    in_host = lane.in_host if lane is not None else (pg.in_host.get("cpu") if pg.in_host else None)
    if in_host is None:
        stage.allgather(piece.numpy(), out.numpy())
        return
    grid = rank_grid(pg)
    servers, n = grid.shape
    network = torch.empty(servers * size, dtype=torch.uint8)  # the pieces of the ranks of this local index
    stage.allgather(piece.numpy(), network.numpy())
    gathered = torch.empty(n * servers * size, dtype=torch.uint8)  # local rank j's network block at j
    in_host.all_gather(network, gathered.view(n, servers * size))
    # block (j, s) is the piece of rank grid[s, j]
    order = torch.from_numpy(np.argsort(grid.T.reshape(-1), kind="stable"))
    out.view(pg.size(), size).copy_(gathered.view(n * servers, size).index_select(0, order))
