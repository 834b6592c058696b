"""ProcessGroupPassing: torch.distributed's process group for backend "passing".

all_reduce of one float32 tensor with SUM or AVG goes through PASSING, and so do
reduce_scatter and all_gather (passing.torch.sharded); everything else
(other collectives, ops, dtypes, several tensors) goes to the gloo backend registered
for the device, and each kind of fallback is logged once. Which network stage runs
(docs/torch.md, "Which mode runs when"):

- a configured controller: the switch, or a PS when the switch cannot serve (mode "switch", "ps");
- nothing configured: no aggregator at all; the in-host stages around an all_reduce of each
  rank's chunk among its peers on the other servers, over gloo (NCCL for CUDA); with one rank
  per server, the whole group's own all_reduce (mode "ring");
- PASSING_EMBEDDED=ps and no controller: rank 0's embedded controller and software aggregator
  (mode "ps");
- every rank on one server: no network stage, the in-host group's own all_reduce (mode "in-host").

Collectives run in issue order on one thread per group, so async_op=True overlaps them with
the caller.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import uuid
import weakref
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions
from torch._C._distributed_c10d import Backend as C10dBackend
from torch.distributed import PrefixStore, ProcessGroup, ReduceOp

from .. import control, wire
from ..errors import GroupFailed, PassingError
from ..keys import ClientKeys
from ..replay import Replay
from ..stream import Group
from ..transport import BatchSocket
from . import embedded, sharded
from .hierarchy import Layout, NetworkStage, PeerStage, sum_through
from .in_host import CollectiveInHost, CpuInHostStage, InHostStage, ThroughHostMemory, cpu_in_host
from .options import SCHEMES, OptionError, Options, route_source
from .sharded import GATHER_GROUP, GatherLane, gather_pool
from .work import DeviceTurn, InOrder, PassingWork, on_device

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
                self.stream.allgather_bytes(piece, [piece.size] * self.stream.workers, out)
                return
            except GroupFailed as e:
                piece = self._to_gloo(e, piece)
        out[...] = self._on_gloo(Replay("gather", piece, sizes=[piece.size] * self.stream.workers))

    def _to_gloo(self, failed: GroupFailed, current: np.ndarray) -> np.ndarray:
        """No aggregator left: make the gloo group, redo over it the calls a peer did not complete (this
        worker's share), and return the interrupted call's input as it was at its start."""
        if failed.dead:  # a peer is gone: no transport can finish the call
            raise failed
        log.warning("passing: %s; this process group carries on over gloo", failed)
        self.gloo = gloo_group(PrefixStore(self.prefix, self.store), self.stream.worker,
                               self.stream.workers, self.timeout, self.stream.socket.address[0])
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
            out = torch.empty(tensor.numel() // self.stream.workers, dtype=tensor.dtype)
            self.gloo._reduce_scatter_base(out, tensor, dist.ReduceScatterOptions()).wait()
        else:
            self.gloo.allreduce([tensor], dist.AllreduceOptions()).wait()
            out = tensor
        if call.op == "avg":
            out /= self.stream.workers
        return out.numpy()

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:  # the two-stage allreduce's network stage
        return sum_through(self, tensor)


class ProcessGroupPassing(ProcessGroup):
    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta, name: str,
                 options: Options) -> None:
        super().__init__(rank, size)
        self.options = options
        self.scheme = SCHEMES[options.scheme]
        self._fallbacks_logged: set[str] = set()
        gloo = dist.ProcessGroupGloo(PrefixStore("gloo/", store), rank, size, timeout)
        self._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, gloo)
        cuda = device_group(options, PrefixStore("nccl/", store), rank, size, gloo)
        if cuda is not None:
            kind = ProcessGroup.BackendType.GLOO if cuda is gloo else ProcessGroup.BackendType.NCCL
            self._register_backend(torch.device("cuda"), kind, cuda)
        self._set_default_backend(ProcessGroup.BackendType.GLOO)

        self.layout = Layout.exchange(store, rank, size, str(options.server))
        self.mode = "gloo" if self.scheme.aggregator is None else ""
        self.reason = f"scheme {options.scheme}: every all_reduce is gloo's"
        self.in_host: dict[str, InHostStage] = {}  # device type -> the in-host stage among this server's ranks
        self.peers: dict[str, C10dBackend] = {}  # device type -> this local rank's group across servers (ring)
        self.network: NetworkStage | None = None  # how a chunk is summed over the servers
        self.stream: Group | None = None
        self.gather_lane: GatherLane | None = None  # the all_gathers' own way through the network, beside stream's
        self._runner: InOrder | None = None  # this group's collectives (but gather_lane's), in issue order
        self._streams: dict[int, torch.cuda.Stream] = {}  # CUDA device index -> the group's stream there
        self._membership: Membership | None = None
        self.embedded_mode = False  # PASSING_EMBEDDED=ps, no controller: rank 0's embedded one serves the group
        self.embedded: embedded.Embedded | None = None  # rank 0's services in embedded mode
        self.keys: ClientKeys | None = None  # this rank's key toward the controller
        if self.scheme.aggregator is None:
            return
        if self.scheme.in_host and self.layout.servers == 1:
            self._in_host_only(rank)
            return
        if self.options.controller is None and self.options.embedded == "off":
            self._ring(store, rank, timeout, name)
            return
        try:
            self._connect(store, rank, timeout, name)
        except BaseException:
            if self.embedded is not None:
                self.embedded.close(linger=0)
            raise

    # ---- set-up ------------------------------------------------------------------------

    def _connect(self, store: dist.Store, rank: int, timeout: timedelta, name: str) -> None:
        """Join this rank's aggregation group through the controller (rank 0's embedded one if asked for)."""
        if self.options.controller is None:
            self._start_embedded(store, rank)
        else:
            self.keys = control.worker_keys(None)
        in_host = self.scheme.in_host and self.layout.ranks_per_server > 1
        if in_host:
            self._set_up_in_host(store, timeout)
            group, worker, workers = self.layout.local_rank, self.layout.server, self.layout.servers
        else:
            group, worker, workers = 0, rank, self.size()
        if workers > wire.MAX_WORKERS:
            raise OptionError(f"{workers} workers in one aggregation group; PASSING takes at most {wire.MAX_WORKERS}"
                              + ("" if in_host else " (the in-host schemes need one per server)"))
        job, secret = self._job_name(store, name)
        self.stream, answer = self._join(job, secret, group, worker, workers)
        self.network = FailoverStage(self.stream, store, f"passing/fallback/{name}/{group}/", timeout)
        self.mode, self.reason = answer["mode"], answer["reason"]
        if self.embedded_mode:
            self.reason = f"embedded controller in rank 0 (PASSING_EMBEDDED=ps): {self.reason}"
        assert self.keys is not None
        self._membership = Membership(str(self.options.controller), job, group, worker, str(answer["token"]),
                                      self.keys, self.stream, float(self.options.report_interval),
                                      embedded=self.embedded_mode)
        self.gather_lane = self._open_gather_lane(store, timeout, name, job, secret, group, worker, workers,
                                                  gather_pool(int(answer["pool"]), workers))
        weakref.finalize(self, _close, self._membership, self.embedded, self.gather_lane)  # also at interpreter exit
        self._start_runner(name)
        log.info("passing: rank %d: job %s group %d worker %d of %d on %s (%s)", rank, job, group, worker, workers,
                 self.mode, self.reason)

    def _open_gather_lane(self, store: dist.Store, timeout: timedelta, name: str, job: str, secret: str, group: int,
                          worker: int, workers: int, pool: int) -> GatherLane:
        """The all_gathers' own group of the job (group GATHER_GROUP + group, ``pool`` slots), thread and
        in-host stage (passing.torch.sharded.GatherLane)."""
        gather_group = GATHER_GROUP + group
        stream, answer = self._join(job, secret, gather_group, worker, workers, pool)
        assert self.keys is not None
        membership = Membership(str(self.options.controller), job, gather_group, worker, str(answer["token"]),
                                self.keys, stream, float(self.options.report_interval), embedded=self.embedded_mode)
        in_host = (self._cpu_in_host(store, timeout, f"passing/local/{self.layout.server}/gather/")
                   if self.in_host else None)
        runner = InOrder(f"passing-pg{name}-gather")
        weakref.finalize(self, runner.shutdown)
        return GatherLane(FailoverStage(stream, store, f"passing/fallback/{name}/{gather_group}/", timeout),
                          runner, in_host, membership)

    def _start_runner(self, name: str) -> None:
        self._runner = InOrder(f"passing-pg{name}")
        weakref.finalize(self, self._runner.shutdown)  # also at interpreter exit: what was issued runs

    def _in_host_only(self, rank: int) -> None:
        """Every rank is on one server: the in-host stage alone produces the sum, so all_reduce is
        gloo's (NCCL's) among them, with no controller and no aggregator; rank 0 says so once."""
        global _in_host_logged
        self.mode = IN_HOST
        self.reason = (f"one server: its {self.layout.ranks_per_server} rank(s) are the whole process group, so "
                       f"the in-host all_reduce (gloo; NCCL for CUDA) is the sum and there is no network stage "
                       f"(scheme {self.options.scheme}; no controller contacted, no aggregator started)")
        if rank == 0 and not _in_host_logged:
            _in_host_logged = True
            log.warning("passing: %s", self.reason)

    def _ring(self, store: dist.Store, rank: int, timeout: timedelta, name: str) -> None:
        """Nothing configured: no switch to find and no aggregator asked for, and one would only add a
        hop (every worker's bytes in and out of one process), so the network stage is an all_reduce
        among the peers, gloo's (NCCL's): with the in-host stage, rank j of every server sums chunk j
        (a ring of s, not s*n, across the servers, in n flows); without, the whole group's own all_reduce."""
        global _ring_logged
        self.mode = RING
        s, n = self.layout.servers, self.layout.ranks_per_server
        if self.scheme.in_host and n > 1:
            self._set_up_in_host(store, timeout)
            self.peers = self._peer_groups(store, timeout)
            self.network = PeerStage(self.peers)
            self._start_runner(name)
            how = (f"in-host reduce-scatter among each server's {n} ranks, all_reduce of each rank's chunk among its "
                   f"{s} peers on the other servers (gloo; NCCL for CUDA), in-host all-gather")
        else:
            how = f"the all_reduce of gloo (NCCL for CUDA) among all {self.size()} ranks"
        self.reason = (f"nothing configured (no PASSING_CONTROLLER or pg_options.controller, PASSING_EMBEDDED off): "
                       f"no switch or aggregator to use, so {how} (scheme {self.options.scheme}); set "
                       f"PASSING_CONTROLLER for a switch, or PASSING_EMBEDDED=ps for a software aggregator in rank 0")
        if rank == 0 and not _ring_logged:
            _ring_logged = True
            log.warning("passing: %s", self.reason)

    def _peer_groups(self, store: dist.Store, timeout: timedelta) -> dict[str, C10dBackend]:
        """Rank j's group of the rank j of every server, where gloo's own groups are (or at PASSING_HOST).
        Each rank builds its own group from the process group's store: no new_group ordering to keep."""
        s, j = self.layout.servers, self.layout.local_rank
        prefix = f"passing/peers/{j}/"
        groups: dict[str, C10dBackend] = {
            "cpu": gloo_group(PrefixStore(prefix + "gloo/", store), self.layout.server, s, timeout, self.options.host)}
        cuda = device_group(self.options, PrefixStore(prefix + "nccl/", store), self.layout.server, s, groups["cpu"])
        if cuda is not None:
            groups["cuda"] = cuda
        return groups

    def _start_embedded(self, store: dist.Store, rank: int) -> None:
        """Rank 0 starts the embedded controller and aggregator and publishes the endpoint in the
        group's store; every rank then uses it as its controller."""
        global _embedded_logged
        if rank == 0:
            try:
                address = str(self.options.host) if self.options.host else embedded.rank0_address(store)
                self.embedded = embedded.Embedded(address, float(self.options.join_timeout), self.options.mtu)
            except BaseException as e:  # the other ranks wait for the key: give them the error
                embedded.publish(store, {"error": f"{type(e).__name__}: {e}"})
                raise
            embedded.publish(store, self.embedded.announcement())
        endpoint, self.keys = embedded.endpoint(store)
        host = self.options.host or route_source(endpoint)
        self.options = dataclasses.replace(self.options, controller=endpoint, host=host)
        self.embedded_mode = True
        if rank == 0 and not _embedded_logged:
            _embedded_logged = True
            log.warning("passing: no controller configured (PASSING_CONTROLLER unset, no pg_options.controller) "
                        "and PASSING_EMBEDDED=ps: rank 0 runs an embedded controller and software aggregator at %s, "
                        "and the groups aggregate there (PS mode); set PASSING_CONTROLLER to use a switch", endpoint)
        else:
            log.info("passing: embedded controller of rank 0 at %s", endpoint)

    def _set_up_in_host(self, store: dist.Store, timeout: timedelta) -> None:
        """The in-host stages among this server's ranks: shared memory (a gloo group over loopback only where
        there is none) for CPU tensors, NCCL for CUDA ones."""
        n, j = self.layout.ranks_per_server, self.layout.local_rank
        prefix = f"passing/local/{self.layout.server}/"
        cpu = self._cpu_in_host(store, timeout, prefix)
        self.in_host = {"cpu": cpu}
        cuda = device_group(self.options, PrefixStore(prefix + "nccl/", store), j, n, None)
        if cuda is not None:
            self.in_host["cuda"] = CollectiveInHost(cuda)
        elif torch.cuda.is_available():
            self.in_host["cuda"] = ThroughHostMemory(cpu)

    def _cpu_in_host(self, store: dist.Store, timeout: timedelta, prefix: str) -> CpuInHostStage:
        n, j = self.layout.ranks_per_server, self.layout.local_rank
        return cpu_in_host(
            j, n, lambda: gloo_group(PrefixStore(prefix + "gloo/", store), j, n, timeout, "127.0.0.1"), store,
            prefix + "shm/", timeout.total_seconds(), directory=str(self.options.shared_memory),
            engine=str(self.options.engine))

    def _job_name(self, store: dist.Store, name: str) -> tuple[str, str]:
        """The same job name and secret on every rank of this process group, and new ones per run.
        The secret goes through the c10d store, which the ranks already trust with each other."""
        if self.rank() == 0:
            job = f"{self.options.job}/pg{name}" if self.options.job else f"torch-{uuid.uuid4().hex[:12]}/pg{name}"
            store.set(f"passing/job/{name}", json.dumps({"name": job, "secret": control.new_job_secret()}))
        job = json.loads(store.get(f"passing/job/{name}"))
        return str(job["name"]), str(job["secret"])

    def _join(self, job: str, secret: str, group: int, worker: int, workers: int,
              pool: int | None = None) -> tuple[Group, dict[str, Any]]:
        o = self.options
        sock = BatchSocket((str(o.host), 0))
        line: control.Failover | None = None
        try:
            answer = control.join(str(o.controller), job, worker, workers, host=str(o.host),
                                  udp_port=sock.address[1], secret=secret, group=group,
                                  pool=o.pool if pool is None else pool,
                                  aggregator=str(self.scheme.aggregator), timeout=float(o.join_timeout),
                                  keys=self.keys)
            if int(answer["lanes"]) != wire.DEFAULT_LANES:  # same port, sized for the aggregator's packets
                port = sock.address[1]
                sock.close()
                sock = BatchSocket((str(o.host), port), lanes=int(answer["lanes"]))
            line = (control.Failover(str(o.controller), job, group, worker, str(answer["token"]),
                                     aggregator=str(self.scheme.aggregator), after=float(o.failover_after),
                                     keys=self.keys) if o.failover_after else None)
            stream = Group.from_answer(answer, bind=sock, scale=o.scale, on_overflow=str(o.on_overflow),
                                       rto=float(o.rto), timeout=float(o.timeout), engine=str(o.engine),
                                       failover=line)
        except BaseException:
            sock.close()
            if line is not None:
                line.close()  # its heartbeats would keep a group that never formed looking alive
            raise
        return stream, answer

    # ---- collectives -------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = dist.AllreduceOptions() if opts is None else opts
        if self.mode == IN_HOST or (self.mode == RING and self.network is None):
            return self._whole_group_allreduce(tensors, opts)
        why = self._unsupported(tensors, opts)
        if why:
            if why not in self._fallbacks_logged:
                self._fallbacks_logged.add(why)
                log.warning("passing: all_reduce of %s goes to gloo/NCCL (logged once)", why)
            return self._get_backend(tensors[0].device).allreduce(tensors, opts)
        return self.submit(tensors[0], "avg" if opts.reduceOp.op == ReduceOp.AVG else "sum",
                           caller_waits=not opts.asyncOp)

    def _whole_group_allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        """One server, or nothing configured and one rank per server: gloo's (NCCL's) own all_reduce
        among all ranks, so its very bits. gloo has no AVG: a float AVG on the CPU is gloo's SUM
        divided by the world size, as PASSING's AVG is."""
        backend = self._get_backend(tensors[0].device)
        t = tensors[0]
        if opts.reduceOp.op != ReduceOp.AVG or len(tensors) != 1 or not t.is_floating_point() or \
                t.device.type != "cpu":
            return backend.allreduce(tensors, opts)
        summed = dist.AllreduceOptions()  # SUM
        summed.timeout = opts.timeout
        work, result = backend.allreduce(tensors, summed), PassingWork()

        def divide(done: torch.futures.Future) -> None:
            try:
                done.wait()
                t.div_(self.size())
            except BaseException as e:  # handed to whoever waits on the work
                result.fail(e)
                return
            result.complete([t])

        work.get_future().then(divide)
        return result

    def submit(self, tensor: torch.Tensor, op: str, caller_waits: bool = False) -> PassingWork:
        """Allreduce ``tensor`` in place, in issue order; the work's future's value is [tensor].
        ``caller_waits``: the caller waits on it at once (async_op=False): see passing.torch.work.
        A CUDA tensor is read once the caller's current stream has reached this call (passing.torch.work.
        on_device), as NCCL's collectives do."""
        assert self._runner is not None
        turn = DeviceTurn.of([tensor], self._streams)
        work = PassingWork(self._runner, devices=turn.devices if turn else None)
        self._runner.submit(work, lambda: self._run(tensor, op, work, turn), caller_waits)
        return work

    def _run(self, tensor: torch.Tensor, op: str, work: PassingWork, turn: DeviceTurn | None) -> list[torch.Tensor]:
        start = time.monotonic()
        with on_device(turn, work):
            if tensor.numel():
                in_host = self.in_host.get(tensor.device.type) if self.in_host else None
                if self.in_host and in_host is None:
                    raise PassingError(f"no in-host group for {tensor.device.type} tensors")
                assert self.network is not None
                # float16/bfloat16 (mixed precision) travel as their float32 values and come back cast;
                # a strided tensor (a 1-D view with a step) as a contiguous copy
                flat = tensor.detach().reshape(-1)
                wide = flat.float() if flat.dtype != torch.float32 else flat.contiguous()
                out = self.network.sum(wide) if in_host is None else in_host.allreduce(wide, self.network)
                if op == "avg":
                    out /= self.size()
                if out.data_ptr() != tensor.data_ptr():  # summed in place already when it could be
                    tensor.copy_(out.view(tensor.shape))
        if self._membership is not None:
            self._membership.record_call(time.monotonic() - start)
        return [tensor]

    def _unsupported(self, tensors: list[torch.Tensor], opts: Any) -> str:
        if self.network is None:
            return f"any tensor (scheme {self.options.scheme})"
        if len(tensors) != 1:
            return f"{len(tensors)} tensors at once"
        t = tensors[0]
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return f"dtype {t.dtype}"
        if t.layout != torch.strided:
            return f"layout {t.layout}"
        if opts.reduceOp.op not in (ReduceOp.SUM, ReduceOp.AVG):
            return f"op {opts.reduceOp.op.name}"
        return ""

    # ---- reporting and shutdown ---------------------------------------------------------

    def lanes(self) -> list[FailoverStage]:
        """The network stages through an aggregator: the group's, and its gather lane's ([] without)."""
        stages = [self.network] if isinstance(self.network, FailoverStage) else []
        return stages + ([self.gather_lane.network] if self.gather_lane is not None else [])

    def transport_stats(self) -> dict[str, int]:
        """This rank's packets and bytes to and from the aggregator(s) so far (both lanes)."""
        if self.stream is None:
            return {}
        total = self.stream.stats.as_dict()
        if self.gather_lane is not None:
            for key, value in self.gather_lane.network.stream.stats.as_dict().items():
                total[key] = total.get(key, 0) + value
        return total

    def shutdown(self) -> None:
        if self._runner is not None:
            self._runner.shutdown()
        if self.gather_lane is not None:
            self.gather_lane.runner.shutdown()
        if self._membership is not None:
            _close(self._membership, self.embedded, self.gather_lane)
        super().shutdown()

    def _get_backend_name(self) -> str:
        return "passing"


# Every other collective goes to the backend of its tensors' device (gloo, NCCL), called from
# Python. Left to torch's C++ trampoline instead, a collective a Python ProcessGroup does not
# override runs with the GIL held (torch 2.13's WORK_OVERRIDE calls the parent inside its
# gil_scoped_acquire), while gloo's worker thread, holding its queue's lock, may need the GIL to
# drop the last reference to an earlier call's tensors: the next collective then waits for that
# lock forever (about one run in ten of four collectives in a row). The backends' own bindings
# release the GIL. The names are torch's for a ProcessGroup and for a Backend.
_TO_BACKEND = {
    "broadcast": "broadcast", "allgather": "allgather", "allgather_coalesced": "allgather_coalesced",
    "all_gather_single": "_allgather_base", "_allgather_base": "_allgather_base",
    "allreduce_coalesced": "allreduce_coalesced", "reduce": "reduce", "reduce_scatter": "reduce_scatter",
    "reduce_scatter_single": "_reduce_scatter_base", "_reduce_scatter_base": "_reduce_scatter_base",
    "gather": "gather", "scatter": "scatter", "alltoall": "alltoall", "all_to_all_single": "alltoall_base",
    "alltoall_base": "alltoall_base", "barrier": "barrier", "send": "send", "recv": "recv",
    "recv_anysource": "recv_anysource",
}


def _first_tensor(args: Any) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)):
            t = _first_tensor(a)
            if t is not None:
                return t
    return None


def _to_backend(name: str, backend_name: str) -> Any:
    def collective(self: ProcessGroupPassing, *args: Any, **kwargs: Any) -> Any:
        t = _first_tensor([*args, *kwargs.values()])
        backend = self._get_backend(t.device if t is not None else torch.device("cpu"))
        return getattr(backend, backend_name)(*args, **kwargs)

    collective.__name__ = collective.__qualname__ = name
    return collective


for _name, _backend_name in _TO_BACKEND.items():
    setattr(ProcessGroupPassing, _name, _to_backend(_name, _backend_name))


class _EveryWork(dist.Work):
    """The single-tensor calls of one coalesced call: done when each of them is."""

    def __init__(self, works: list[Any]) -> None:
        super().__init__()
        self.works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        for w in self.works:
            if timeout is None:
                w.wait()
            else:
                w.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def _coalesced(name: str, single: str) -> Any:
    """A coalesced collective a Backend has no binding for: one single-tensor call per pair."""

    def collective(self: ProcessGroupPassing, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                   opts: Any) -> Any:
        backend = self._get_backend(inputs[0].device if inputs else torch.device("cpu"))
        return _EveryWork([getattr(backend, single)(o, i, opts) for o, i in zip(outputs, inputs, strict=True)])

    collective.__name__ = collective.__qualname__ = name
    return collective


for _name, _single in (("all_gather_single_coalesced", "_allgather_base"),
                       ("reduce_scatter_single_coalesced", "_reduce_scatter_base")):
    setattr(ProcessGroupPassing, _name, _coalesced(_name, _single))


sharded.install(ProcessGroupPassing)  # reduce_scatter and all_gather through PASSING where it can take them


def _close(membership: Membership, embedded_services: embedded.Embedded | None,
           gather_lane: GatherLane | None = None) -> None:
    """Leave the groups; rank 0 then stops its embedded controller once the others have left too."""
    if gather_lane is not None:
        gather_lane.membership.close()
    membership.close()
    if embedded_services is not None:
        embedded_services.close()


IN_HOST = "in-host"  # pg.mode of a group on one server: no network stage
RING = "ring"  # pg.mode with nothing configured: gloo (NCCL) among the peers, no aggregator
_inherited_options: Options | None = None  # the default group's, for subgroups made without pg_options
_embedded_logged = False  # the embedded mode is announced once per process
_in_host_logged = False  # and so is a group that needs no network stage
_ring_logged = False  # and a group with nothing configured


def create(backend_options: Any, pg_options: Any) -> ProcessGroupPassing:
    """torch.distributed's creator for backend "passing" (extended API)."""
    global _inherited_options
    if pg_options is None:
        options = _inherited_options or Options()
    elif isinstance(pg_options, Options):
        options = pg_options
    elif isinstance(pg_options, dict):
        options = Options(**pg_options)
    else:
        raise OptionError(f"pg_options for backend 'passing' must be passing.torch.Options or a dict, "
                          f"not {type(pg_options).__name__}")
    if pg_options is not None and not backend_options.global_ranks_in_group:  # the default group
        _inherited_options = options
    resolved = options.resolve()
    return ProcessGroupPassing(backend_options.store, backend_options.group_rank, backend_options.group_size,
                               backend_options.timeout, str(backend_options.group_id), resolved)
