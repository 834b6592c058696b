"""The network stage of a PASSING process group and what it hangs on: its membership at the
controller (Membership), gloo among the same workers once no aggregator is left (FailoverStage),
the all_gathers' own lane beside it (GatherLane), and the one place each of the gloo and the
device (NCCL) groups is built (gloo_group, device_group).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions
from torch._C._distributed_c10d import Backend as C10dBackend
from torch.distributed import PrefixStore

from .. import control
from ..errors import GroupFailed, PassingError
from ..keys import ClientKeys
from ..replay import Replay
from ..stream import Group
from .hierarchy import sum_through
from .options import OptionError, Options
from .work import InOrder

if TYPE_CHECKING:
    from .in_host import CpuInHostStage

log = logging.getLogger("passing.torch")

class Membership:
    """This rank's place in a controller group: reports its counters to the controller every
    ``report_interval`` s (0: only with its leave) and leaves it once, at shutdown or exit."""

    def __init__(self, controller: str, job: str, group: int, worker: int, token: str, keys: ClientKeys,
                 stream: Group, report_interval: float = 0.0, embedded: bool = False) -> None:
        self.controller, self.job, self.group, self.worker, self.stream = controller, job, group, worker, stream
        self.token, self.keys = token, keys
        self.embedded = embedded  # the controller lives in rank 0: its end is no surprise
        self.calls, self.call_seconds = 0, 0.0  # this rank's allreduces through PASSING
        self._closed = threading.Lock()
        self.closed = False
        self._stop = threading.Event()
        self._reporter: threading.Thread | None = None
        if report_interval > 0:
            self._reporter = threading.Thread(target=self._report_every, args=(report_interval,), daemon=True,
                                              name=f"passing-report-{job}-{group}")
            self._reporter.start()

    def record_call(self, seconds: float) -> None:
        self.calls += 1
        self.call_seconds += seconds

    def stats(self) -> dict[str, float]:
        """What the controller exports for this worker (docs/control.md, report)."""
        return {**self.stream.stats.as_dict(), "calls": self.calls, "call_seconds": self.call_seconds}

    def _report_every(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                control.report(self.controller, self.job, self.group, self.worker, self.token, self.stats(),
                               keys=self.keys)
            except PassingError as e:  # metrics are best effort: training goes on
                log.debug("passing: report to %s: %s", self.controller, e)

    def close(self) -> None:
        with self._closed:
            if self.closed:
                return
            self.closed = True
        self._stop.set()
        if self._reporter is not None:
            self._reporter.join(10)
        stats = self.stats()
        self.stream.close()
        try:
            control.leave(self.controller, self.job, self.group, self.worker, self.token, timeout=5.0, stats=stats,
                          keys=self.keys)
        except PassingError as e:
            (log.info if self.embedded else log.warning)("passing: leaving job %s group %d: %s", self.job,
                                                         self.group, e)


def gloo_group(store: dist.Store, rank: int, size: int, timeout: timedelta, address: str | None) -> C10dBackend:
    """A gloo process group of ``size`` ranks that meet in ``store``, this one at ``address``
    (None: where gloo's own groups are: GLOO_SOCKET_IFNAME's interfaces, else the host name's address)."""
    if address is None:
        return dist.ProcessGroupGloo(store, rank, size, timeout)  # the constructor that reads GLOO_SOCKET_IFNAME
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(store, rank, size, options)


def device_group(options: Options, store: dist.Store, rank: int, size: int,
                 gloo: C10dBackend | None) -> C10dBackend | None:
    """The group that carries CUDA tensors among these ranks (options.device_backend): NCCL's, or
    ``gloo`` (gloo takes CUDA tensors for all_reduce, broadcast and all_gather). None without CUDA,
    or for gloo where no gloo group is given (the caller goes through host memory)."""
    if not torch.cuda.is_available():
        return None
    nccl = options.device_backend == "nccl" or (options.device_backend == "auto" and dist.is_nccl_available())
    if nccl:
        if not dist.is_nccl_available():
            raise OptionError("device_backend='nccl' (PASSING_DEVICE_BACKEND): this torch has no NCCL")
        return dist.ProcessGroupNCCL(store, rank, size)
    return gloo


class FailoverStage:
    """The network stage of one process group: its PASSING Group, and gloo among the same
    workers once the controller has no aggregator left for it (docs/control.md "Failover"),
    for every collective that goes through the aggregator.

    All the group's workers get the same decision for the same call, so they switch together;
    each first redoes, over gloo, the calls the group agreed to redo (its share of them, from
    their replay records), then the interrupted one from its start."""

    def __init__(self, stream: Group, store: dist.Store, prefix: str, timeout: timedelta) -> None:
        self.stream, self.store, self.prefix, self.timeout = stream, store, prefix, timeout
        self.gloo: C10dBackend | None = None

    def allreduce(self, array: np.ndarray, op: str = "sum", out: np.ndarray | None = None) -> np.ndarray:
        if self.gloo is None:
            try:
                return self.stream.allreduce(array, op, out=out)
            except GroupFailed as e:
                array = self._to_gloo(e, array)
        result = out if out is not None else np.empty_like(array)
        if result is not array:
            result[...] = array
        return self._on_gloo(Replay("reduce", result, op))

    def reduce_scatter(self, array: np.ndarray) -> np.ndarray:
        """This worker's block of the sum of ``array`` (the workers' blocks one after the other)."""
        if self.gloo is None:
            try:
                return self.stream.reduce_scatter(array, "sum")
            except GroupFailed as e:
                array = self._to_gloo(e, array)
        return self._on_gloo(Replay("scatter", array))

    def allgather(self, piece: np.ndarray, out: np.ndarray) -> None:
        """Every worker's ``piece`` (bytes, the same size at every worker) into ``out``, in worker order."""
        if self.gloo is None:
            try:
                self.stream.allgather_bytes(piece, [piece.size] * self.stream.servers, out)
                return
            except GroupFailed as e:
                piece = self._to_gloo(e, piece)
        out[...] = self._on_gloo(Replay("gather", piece, sizes=[piece.size] * self.stream.servers))

    def _to_gloo(self, failed: GroupFailed, current: np.ndarray) -> np.ndarray:
        """No aggregator left: make the gloo group, redo over it the calls a peer did not complete (this
        worker's share), and return the interrupted call's input as it was at its start."""
        if failed.dead:  # a peer is gone: no transport can finish the call
            raise failed
        log.warning("passing: %s; this process group carries on over gloo", failed)
        self.gloo = gloo_group(PrefixStore(self.prefix, self.store), self.stream.rank,
                               self.stream.servers, self.timeout, self.stream.socket.address[0])
        for call in failed.redo:
            self._on_gloo(call.copy())
        return failed.current.input if failed.current is not None else current

    def _on_gloo(self, call: Replay) -> np.ndarray:
        """``call`` over gloo, its input overwritten where the collective works in place; its result."""
        assert self.gloo is not None
        tensor = torch.from_numpy(call.input)
        if call.kind == "gather":
            out = torch.empty(sum(call.sizes or []), dtype=torch.uint8)
            self.gloo._allgather_base(out, tensor, AllgatherOptions()).wait()
            return out.numpy()
        if call.kind == "scatter":
            out = torch.empty(tensor.numel() // self.stream.servers, dtype=tensor.dtype)
            self.gloo._reduce_scatter_base(out, tensor, dist.ReduceScatterOptions()).wait()
        else:
            self.gloo.allreduce([tensor], dist.AllreduceOptions()).wait()
            out = tensor
        if call.op == "avg":
            out /= self.stream.servers
        return out.numpy()

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:  # the two-stage allreduce's network stage
        return sum_through(self, tensor)


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
