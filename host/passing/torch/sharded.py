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

The all_gathers have a lane of their own (passing.torch.network.GatherLane): a second PASSING
group of the job (group GATHER_GROUP + j: its own slots, sequence space, socket, loss recovery and
failover), their own thread and in-host stage. So an all_gather issued while a reduce_scatter or an all_reduce is on the
wire (FSDP's backward) proceeds at the same time, as gloo's two threads let it: the reduce_scatter
loads the uplinks (every server sends the whole tensor, gets its block), the all_gather the
downlinks. Each lane runs its calls in issue order, which is the same on every rank.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed import ReduceOp

from .hierarchy import Layout
from .in_host import CpuInHostStage
from .modes import Stages
from .network import FailoverStage, GatherLane, Membership
from .options import ALL_GATHER, REDUCE_SCATTER
from .work import InOrder, PassingWork

log = logging.getLogger("passing.torch")

REDUCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class ShardedCollectives:
    """A process group's reduce_scatter and all_gather through PASSING. Each route answers a PassingWork,
    or None for a call it does not take, which the process group then hands to the device's backend."""

    mode: str  # the group's (pg.mode), to say why nothing goes through PASSING
    size: int  # ranks in the process group
    network: FailoverStage | None  # the reduce lane's network stage; None: no aggregator, nothing routed
    in_host: CpuInHostStage | None  # the reduce lane's stage among the server's ranks; None: one per server
    gather_lane: GatherLane | None
    runner: InOrder | None  # the group's thread, shared with its all_reduces
    membership: Membership | None  # the reduce lane's, which counts its calls
    grid: np.ndarray  # grid[server, local rank] = the rank there (hierarchy.Layout)
    keep_on_gloo: tuple[str, ...] | str | None  # options.keep_on_gloo: a tuple once resolved
    fallbacks_logged: set[str]  # the process group's: each kind of fallback is logged once

    @classmethod
    def of(cls, stages: Stages, size: int, layout: Layout, fallbacks_logged: set[str]) -> ShardedCollectives:
        """The grid is what every rank read from the store at set-up, so no collective, which on the
        group's thread would race the caller's own on the same gloo group."""
        network = stages.network if isinstance(stages.network, FailoverStage) else None  # an aggregator's only
        return cls(stages.mode, size, network, stages.in_host.get("cpu"), stages.gather_lane, stages.runner,
                   stages.membership, np.array(layout.grid, dtype=np.int64), stages.options.keep_on_gloo,
                   fallbacks_logged)

    @classmethod
    def closed(cls, mode: str, size: int, fallbacks_logged: set[str]) -> ShardedCollectives:
        """A shut-down group's: routes nothing (the device's backend then refuses the call)."""
        return cls(mode, size, None, None, None, None, None, np.zeros((0, 0), dtype=np.int64), (), fallbacks_logged)

    # ---- which calls go through PASSING ---------------------------------------------------------

    def _why_not(self, kind: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any) -> str:
        """Why this call goes to the device's backend ("" when PASSING takes it)."""
        if self.network is None:
            return f"any tensor ({self.mode or 'no network stage'})"
        if kind in self.keep_on_gloo:
            return "any tensor (keep_on_gloo)"
        tensors = [*outputs, *inputs]
        if any(t.device.type != "cpu" for t in tensors):
            return "device tensors (PASSING streams CPU memory)"
        if any(t.layout != torch.strided or not t.is_contiguous() or (t.dim() > 0 and t.stride(-1) != 1)
               for t in tensors):  # one element, or none, with a step is "contiguous" but not bytes in a row
            return "non-contiguous tensors"
        if len({t.dtype for t in tensors}) != 1:
            return "mixed dtypes"
        if kind == REDUCE_SCATTER:
            if tensors[0].dtype not in REDUCE_DTYPES:
                return f"dtype {tensors[0].dtype}"
            if opts.reduceOp.op not in (ReduceOp.SUM, ReduceOp.AVG):
                return f"op {opts.reduceOp.op.name}"
        return ""

    def _fits(self, whole: torch.Tensor, block: torch.Tensor) -> bool:
        """``whole`` is ``size`` blocks of ``block``'s shape stacked on dimension 0, as gloo requires of an
        all_gather's output and a reduce_scatter's input (a 0-dim block, or another shape, it refuses)."""
        return block.dim() > 0 and tuple(whole.shape) == (block.shape[0] * self.size, *block.shape[1:])

    def _routed(self, kind: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any) -> bool:
        why = self._why_not(kind, outputs, inputs, opts)
        if why and f"{kind}: {why}" not in self.fallbacks_logged:
            self.fallbacks_logged.add(f"{kind}: {why}")
            log.warning("passing: %s of %s goes to gloo/NCCL (logged once)", kind, why)
        return not why

    # ---- the routes (ProcessGroupPassing's methods hand each call here first) --------------------

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> PassingWork | None:
        if not self._fits(input, output) or not self._routed(REDUCE_SCATTER, [output], [input], opts):
            return None  # shapes that do not fit: gloo's own error, as on gloo
        return self._submit(lambda: self._reduce_scatter(output, input, _avg(opts)), [output], opts)

    def reduce_scatter_list(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                            opts: Any) -> PassingWork | None:
        if len(outputs) != 1 or len(input_lists) != 1 or len(input_lists[0]) != self.size or \
                any(t.shape != outputs[0].shape for t in input_lists[0]):
            return None  # gloo's answer, its errors included
        output, inputs = outputs[0], input_lists[0]
        if not self._routed(REDUCE_SCATTER, [output], inputs, opts):
            return None

        def run() -> None:
            self._reduce_scatter(output, torch.cat([t.reshape(-1) for t in inputs]), _avg(opts))

        return self._submit(run, [output], opts)

    def reduce_scatter_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                 opts: Any) -> PassingWork | None:
        if not all(self._fits(i, o) for o, i in zip(outputs, inputs, strict=True)) or \
                not self._routed(REDUCE_SCATTER, outputs, inputs, opts):
            return None

        def run() -> None:
            for o, i in zip(outputs, inputs):
                self._reduce_scatter(o, i, _avg(opts))

        return self._submit(run, outputs, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> PassingWork | None:
        if not self._fits(output, input) or not self._routed(ALL_GATHER, [output], [input], opts):
            return None  # shapes that do not fit: gloo's own error, as on gloo
        return self._submit(lambda: self._all_gather(output, input), [output], opts, gather=True)

    def all_gather_list(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                        opts: Any) -> PassingWork | None:
        if len(output_lists) != 1 or len(inputs) != 1 or len(output_lists[0]) != self.size or \
                any(t.shape != inputs[0].shape for t in output_lists[0]):
            return None  # uneven pieces: the device's backend (its errors included)
        outputs, input = output_lists[0], inputs[0]
        if not self._routed(ALL_GATHER, outputs, [input], opts):
            return None

        def run() -> None:
            flat = torch.empty(input.numel() * self.size, dtype=input.dtype)
            self._all_gather(flat, input)
            for t, piece in zip(outputs, flat.split(input.numel())):
                t.copy_(piece.view(t.shape))

        return self._submit(run, outputs, opts, gather=True)

    def all_gather_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                             opts: Any) -> PassingWork | None:
        if not all(self._fits(o, i) for o, i in zip(outputs, inputs, strict=True)) or \
                not self._routed(ALL_GATHER, outputs, inputs, opts):
            return None

        def run() -> None:
            for o, i in zip(outputs, inputs):
                self._all_gather(o, i)

        return self._submit(run, outputs, opts, gather=True)

    def _submit(self, run: Callable[[], None], outputs: list[torch.Tensor], opts: Any,
                gather: bool = False) -> PassingWork:
        """Run in issue order (passing.torch.work) on the group's thread, or on the gather lane's
        (``gather``, where the group has one); the work's value is ``outputs``."""
        lane = self.gather_lane if gather else None
        runner, membership = (lane.runner, lane.membership) if lane is not None else (self.runner, self.membership)
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

    # ---- the two stages -----------------------------------------------------------------------
    # The network stage is ``network`` (passing.torch.network.FailoverStage): the group's stream, moved with
    # its aggregator, or gloo among the same workers once no aggregator is left, as every worker decides
    # alike at the same call.

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, avg: bool) -> None:
        """Rank r's chunk of the sum of ``input`` (size chunks, in rank order) over every rank, into ``output``."""
        assert self.network is not None
        chunk = output.numel()
        wide = input.detach().reshape(-1)
        wide = wide if wide.dtype == torch.float32 else wide.float()
        if self.in_host is None:  # one rank per server: the network group is the process group, worker = rank
            summed = self.network.reduce_scatter(wide.numpy())
        else:
            chunks = wide.view(self.size, chunk)
            servers, n = self.grid.shape
            # local rank j's part: the chunks of the ranks with local index j, in server order
            order = torch.from_numpy(self.grid.T.reshape(-1).copy())
            mine = torch.empty(servers * chunk, dtype=torch.float32)
            with self.in_host.all_or_none():  # a local rank's network error fails every local rank's call
                self.in_host.reduce_scatter(chunks.index_select(0, order).view(n, servers * chunk), mine)
                summed = self.network.reduce_scatter(mine.numpy())  # network worker = server: its block is ours
                self.in_host.agree()
        result = torch.from_numpy(summed)
        if avg:
            result /= self.size
        output.copy_(result.view(output.shape))

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Every rank's ``input``, in rank order, into ``output``: bit for bit, whatever the dtype."""
        piece = input.detach().reshape(-1).view(torch.uint8)
        size = piece.numel()
        out = output.view(-1).view(torch.uint8)
        lane = self.gather_lane
        stage = lane.network if lane is not None else self.network
        in_host = lane.in_host if lane is not None else self.in_host
        assert stage is not None
        if in_host is None:
            stage.allgather(piece.numpy(), out.numpy())
            return
        servers, n = self.grid.shape
        network = torch.empty(servers * size, dtype=torch.uint8)  # the pieces of the ranks of this local index
        gathered = torch.empty(n * servers * size, dtype=torch.uint8)  # local rank j's network block at j
        with in_host.all_or_none():  # a local rank's network error fails every local rank's call
            stage.allgather(piece.numpy(), network.numpy())
            in_host.all_gather(network, gathered.view(n, servers * size))
        # block (j, s) is the piece of rank grid[s, j]
        order = torch.from_numpy(np.argsort(self.grid.T.reshape(-1), kind="stable"))
        out.view(self.size, size).copy_(gathered.view(n * servers, size).index_select(0, order))


def _avg(opts: Any) -> bool:
    return opts.reduceOp.op == ReduceOp.AVG
