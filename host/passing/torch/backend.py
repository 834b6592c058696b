"""ProcessGroupPassing: torch.distributed's process group for backend "passing".

all_reduce of one float32 tensor with SUM or AVG goes through PASSING, and so do
reduce_scatter and all_gather (passing.torch.sharded); everything else
(other collectives, ops, dtypes, several tensors) goes to the gloo backend registered
for the device, and each kind of fallback is logged once. Which network stage runs is decided
once, at set-up (passing.torch.modes; docs/torch.md, "Which mode runs when"); the class
docstring says where each collective goes.

Collectives run in issue order on one thread per group, so async_op=True overlaps them with
the caller.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroup, ReduceOp

from ..errors import PassingError
from . import device_calls
from .device_calls import Finishing
from .embedded import Embedded, store_gone
from .hierarchy import Layout
from .modes import IN_HOST, RING, leave, set_up
from .network import FailoverStage, GatherLane, Membership, device_group
from .options import SCHEMES, OptionError, Options
from .sharded import ShardedCollectives
from .work import DeviceTurn, InOrder, PassingWork, on_device, wait_ran

log = logging.getLogger("passing.torch")
Tensor = torch.Tensor
STORE_GONE_WAIT = 5.0  # s a rank waits at its end for rank 0's store to close (after rank 0's services)


class ProcessGroupPassing(ProcessGroup):
    """The process group of backend "passing". Every collective it answers is a method below:

    ===============================  ==================================  ======================================
    method                           through PASSING where it can        else the device backend's binding
    ===============================  ==================================  ======================================
    allreduce                        submit (the two-stage allreduce)    allreduce
    reduce_scatter                   sharded.reduce_scatter_list         reduce_scatter
    reduce_scatter_single            sharded.reduce_scatter_single       _reduce_scatter_base
    _reduce_scatter_base             sharded.reduce_scatter_single       _reduce_scatter_base
    reduce_scatter_single_coalesced  sharded.reduce_scatter_coalesced    _reduce_scatter_base, one call a pair
    allgather                        sharded.all_gather_list             allgather
    all_gather_single                sharded.all_gather_single           _allgather_base
    _allgather_base                  sharded.all_gather_single           _allgather_base
    all_gather_single_coalesced      sharded.all_gather_coalesced        _allgather_base, one call a pair
    all_to_all_single                -                                   alltoall_base
    broadcast, allgather_coalesced,  -                                   the same name
    allreduce_coalesced, reduce,
    gather, scatter, alltoall,
    alltoall_base, barrier, send,
    recv, recv_anysource
    ===============================  ==================================  ======================================

    The device backend is the one registered for the device of the call's first tensor: gloo for CPU
    tensors, NCCL (or gloo: options.device_backend) for CUDA ones. Why it is called from Python, through
    its own binding, rather than left to torch: at "the device backend's collectives" below."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta, name: str,
                 options: Options) -> None:
        super().__init__(rank, size)
        self.options = options
        self.scheme = SCHEMES[options.scheme]
        self._fallbacks_logged: set[str] = set()
        self.timeout = timeout
        self._store = store
        self._finishing = Finishing()  # gloo's calls that a callback of ours finishes: the barrier waits for them
        gloo = dist.ProcessGroupGloo(PrefixStore("gloo/", store), rank, size, timeout)
        self._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, gloo)
        cuda = device_group(options, PrefixStore("nccl/", store), rank, size, gloo)
        if cuda is not None:
            kind = ProcessGroup.BackendType.GLOO if cuda is gloo else ProcessGroup.BackendType.NCCL
            self._register_backend(torch.device("cuda"), kind, cuda)
        self._set_default_backend(ProcessGroup.BackendType.GLOO)
        self._streams: dict[int, torch.cuda.Stream] = {}  # CUDA device index -> the group's stream there

        self.layout = Layout.exchange(store, rank, size, str(options.server))
        stages = set_up(store, rank, size, timeout, name, options, self.layout)
        self.options = stages.options  # embedded mode: with rank 0's controller filled in
        self.mode, self.reason = stages.mode, stages.reason
        self.in_host = stages.in_host  # device type -> the in-host stage among this server's ranks
        self.peers = stages.peers  # device type -> this local rank's group across servers (ring)
        self.network = stages.network  # how a chunk is summed over the servers
        self.stream = stages.stream
        self.gather_lane = stages.gather_lane  # the all_gathers' own way through the network, beside stream's
        self._runner = stages.runner  # this group's collectives (but gather_lane's), in issue order
        self._membership = stages.membership
        self.embedded_mode = stages.embedded_mode  # PASSING_EMBEDDED=ps, no controller: rank 0's serves the group
        self.embedded = stages.embedded  # rank 0's services in embedded mode
        self.keys = stages.keys  # this rank's key toward the controller
        self._sharded = ShardedCollectives.of(stages, size, self.layout, self._fallbacks_logged)
        # at shutdown (destroy_process_group), or at interpreter exit for a group never destroyed: what was
        # issued runs, then the groups are left. Once only: the finalizer then lets go of what it holds (the
        # store among them, whose server in rank 0 must close with the group for a new init to find its own)
        # (_ending["store"]: where a rank but 0 waits for rank 0's end; shutdown() drops it for a subgroup)
        self._ending: dict[str, dist.Store | None] = {"store": stages.store}
        self._close = weakref.finalize(self, _close, stages.runner, stages.gather_lane, stages.membership,
                                       stages.embedded, self._ending)

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
            return self._device("allreduce", tensors, opts)
        return self.submit(tensors[0], "avg" if opts.reduceOp.op == ReduceOp.AVG else "sum",
                           caller_waits=not opts.asyncOp)

    def _whole_group_allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        """One server, or nothing configured and one rank per server: gloo's (NCCL's) own all_reduce
        among all ranks, so its very bits. gloo has no AVG: a float AVG on the CPU is gloo's SUM
        divided by the world size, as PASSING's AVG is."""
        t = tensors[0]
        avg = opts.reduceOp.op == ReduceOp.AVG and len(tensors) == 1 and t.is_floating_point() and \
            t.device.type == "cpu"
        if not avg:
            return self._device("allreduce", tensors, opts)
        summed = dist.AllreduceOptions()  # SUM
        summed.timeout = opts.timeout
        return self._device("allreduce", tensors, summed, then=lambda: t.div_(self.size()))

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

    def transport_stats(self) -> dict[str, int | str]:
        """This rank's packets and bytes to and from the aggregator(s) so far (both lanes), and its I/O path:
        ``io`` ('xdp' or 'udp') and ``io_reason`` (one line: the AF_XDP mode, or why not), the gather lane's
        after a '; ' where it has one; ``streams``: the reduce lane's (passing.stripes)."""
        if self.stream is None:
            return {}
        streams = [self.stream] + ([self.gather_lane.network.stream] if self.gather_lane is not None else [])
        total: dict[str, int | str] = {}
        for stream in streams:
            for key, value in stream.stats.as_dict().items():
                total[key] = int(total.get(key, 0)) + value
        total["io"] = "; ".join(s.io_path for s in streams)
        total["io_reason"] = "; ".join(s.io_reason for s in streams)
        total["streams"] = self.stream.streams
        return total

    def shutdown(self) -> None:
        if dist.distributed_c10d.GroupMember.WORLD is not self:
            # a subgroup's end is this rank's alone, as gloo's is: waiting for its rank 0 (which may be busy for
            # as long as the group's timeout) protects nothing, since the default group's store stays up
            self._ending["store"] = None
        self._close()
        if self.rank() != 0 and dist.distributed_c10d.GroupMember.WORLD is self and \
                os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # torchrun's store is its agent's
            # a new init_process_group must meet rank 0's new store, not its old one (passing.torch.embedded)
            store_gone(self._store, STORE_GONE_WAIT)
        super().shutdown()
        # let go of the stages now, not whenever this object goes: they hold the store (rank 0's server with it),
        # sockets and the in-host segment, and the user may keep a subgroup's handle after destroy
        self._store = self.network = self.stream = self.gather_lane = self.embedded = None
        self.in_host, self.peers = {}, {}
        self._sharded = ShardedCollectives.closed(self.mode, self.size(), self._fallbacks_logged)

    def _get_backend_name(self) -> str:
        return "passing"

    # ---- the sharded collectives: PASSING's where it takes them, else the device backend's ----------
    # Positional only, as torch passes them.

    def reduce_scatter(self, outputs: list[Tensor], input_lists: list[list[Tensor]], opts: Any, /) -> Any:
        work = self._sharded.reduce_scatter_list(outputs, input_lists, opts)
        return work if work is not None else \
            self._device("reduce_scatter", outputs, input_lists, opts)

    def reduce_scatter_single(self, output: Tensor, input: Tensor, opts: Any, /) -> Any:  # reduce_scatter_tensor
        work = self._sharded.reduce_scatter_single(output, input, opts)
        return work if work is not None else self._device("_reduce_scatter_base", output, input, opts)

    _reduce_scatter_base = reduce_scatter_single  # torch's older name of the same call

    def reduce_scatter_single_coalesced(self, outputs: list[Tensor], inputs: list[Tensor], opts: Any, /) -> Any:
        work = self._sharded.reduce_scatter_coalesced(outputs, inputs, opts)
        return work if work is not None else _EveryWork.of(self._single("_reduce_scatter_base"), outputs, inputs,
                                                           opts)

    def allgather(self, output_lists: list[list[Tensor]], inputs: list[Tensor], opts: Any, /) -> Any:
        work = self._sharded.all_gather_list(output_lists, inputs, opts)
        return work if work is not None else \
            self._device("allgather", output_lists, inputs, opts)

    def all_gather_single(self, output: Tensor, input: Tensor, opts: Any, /) -> Any:  # all_gather_into_tensor
        work = self._sharded.all_gather_single(output, input, opts)
        return work if work is not None else self._device("_allgather_base", output, input, opts)

    _allgather_base = all_gather_single  # torch's older name of the same call

    def all_gather_single_coalesced(self, outputs: list[Tensor], inputs: list[Tensor], opts: Any, /) -> Any:
        work = self._sharded.all_gather_coalesced(outputs, inputs, opts)
        return work if work is not None else _EveryWork.of(self._single("_allgather_base"), outputs, inputs,
                                                           opts)

    # ---- the device backend's collectives ------------------------------------------------------------
    # Every other collective goes to the backend of its tensors' device (gloo, NCCL), called from
    # Python. Left to torch's C++ trampoline instead, a collective a Python ProcessGroup does not
    # override runs with the GIL held (torch 2.13's WORK_OVERRIDE calls the parent inside its
    # gil_scoped_acquire), while gloo's worker thread, holding its queue's lock, may need the GIL to
    # drop the last reference to an earlier call's tensors: the next collective then waits for that
    # lock forever (about one run in ten of four collectives in a row). The backends' own bindings
    # release the GIL. The method names are torch's for a ProcessGroup; each calls the Backend's, with
    # non-contiguous tensors as contiguous copies written back (passing.torch.device_calls: gloo's bugs).

    def broadcast(self, *args: Any, **kwargs: Any) -> Any:
        return self._device("broadcast", *args, **kwargs)

    def allgather_coalesced(self, *args: Any, **kwargs: Any) -> Any:
        return self._device("allgather_coalesced", *args, **kwargs)

    def allreduce_coalesced(self, *args: Any, **kwargs: Any) -> Any:
        return self._device("allreduce_coalesced", *args, **kwargs)

    def reduce(self, *args: Any, **kwargs: Any) -> Any:
        return self._device("reduce", *args, **kwargs)

    def gather(self, *args: Any, **kwargs: Any) -> Any:
        return self._device("gather", *args, **kwargs)

    def scatter(self, *args: Any, **kwargs: Any) -> Any:
        return self._device("scatter", *args, **kwargs)

    def alltoall(self, *args: Any, **kwargs: Any) -> Any:
        return self._device("alltoall", *args, **kwargs)

    def all_to_all_single(self, *args: Any, **kwargs: Any) -> Any:
        return self._device("alltoall_base", *args, **kwargs)

    def alltoall_base(self, *args: Any, **kwargs: Any) -> Any:
        return self._device("alltoall_base", *args, **kwargs)

    def barrier(self, opts: Any = None) -> Any:
        """gloo's barrier, which waits for the collectives gloo runs, and, as gloo's does, for every collective
        of this group issued before it that is ours (both lanes, and our callbacks that finish gloo's outputs):
        once it returns their outputs are written; it fails with the first of them that failed. gloo's is
        issued here and now, in issue order with the group's other gloo calls."""
        opts = dist.BarrierOptions() if opts is None else opts
        prior = self._finishing.pending()
        for runner in (self._runner, self.gather_lane.runner if self.gather_lane is not None else None):
            prior += runner.pending() if runner is not None else []
        barrier = self._get_backend(torch.device("cpu")).barrier(opts)
        if not prior:
            return barrier
        timeout = self.timeout.total_seconds()

        def finish() -> list[torch.Tensor]:
            wait_ran(prior, timeout)
            barrier.wait()
            return []

        if self._runner is not None:  # after the lane's prior collectives, in issue order
            work = PassingWork(self._runner)
            self._runner.submit(work, finish, caller_waits=not opts.asyncOp)
            return work
        work = PassingWork()

        def settle() -> None:
            try:
                work.complete(finish())
            except BaseException as e:  # handed to whoever waits on the work
                work.fail(e)

        if not opts.asyncOp:
            settle()
            return work
        # not on gloo's callback thread: the prior works it waits for may need that very thread (a deadlock,
        # differential fuzzer seed 9104); a thread of its own, which ends with the wait (bounded by the timeout)
        threading.Thread(target=settle, name="passing-barrier", daemon=True).start()
        return work

    def send(self, *args: Any, **kwargs: Any) -> Any:
        return self._device("send", *args, **kwargs)

    def recv(self, *args: Any, **kwargs: Any) -> Any:
        return self._device("recv", *args, **kwargs)

    def recv_anysource(self, *args: Any, **kwargs: Any) -> Any:
        return self._device("recv_anysource", *args, **kwargs)

    def _device(self, name: str, *args: Any, then: Callable[[], None] | None = None, **kwargs: Any) -> Any:
        """The call ``name`` of the backend of the device of the call's first tensor (the CPU's without one),
        on dense memory (passing.torch.device_calls), then ``then()``."""
        t = _first_tensor([*args, *kwargs.values()])
        backend = self._get_backend(t.device if t is not None else torch.device("cpu"))
        return device_calls.call(backend, name, args, self._finishing, then, kwargs)

    def _single(self, name: str) -> Callable[[Tensor, Tensor, Any], Any]:
        """A coalesced call's single-tensor call, for _EveryWork."""
        return lambda output, input, opts: self._device(name, output, input, opts)


def _close(runner: InOrder | None, gather_lane: GatherLane | None, membership: Membership | None,
           embedded: Embedded | None, ending: dict[str, dist.Store | None]) -> None:
    """A process group's end: its collectives run, then it leaves its groups (and rank 0 stops its embedded
    controller once the others have left; ``ending["store"]``: where the others wait for that)."""
    if runner is not None:
        runner.shutdown()
    if gather_lane is not None:
        gather_lane.runner.shutdown()
    if membership is not None:
        leave(membership, embedded, gather_lane, ending["store"])


def _first_tensor(args: Any) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)):
            t = _first_tensor(a)
            if t is not None:
                return t
    return None


class _EveryWork(dist.Work):
    """The single-tensor calls of one coalesced call: done when each of them is."""

    def __init__(self, works: list[Any], outputs: list[Tensor]) -> None:
        super().__init__()
        self.works, self.outputs = works, outputs

    @classmethod
    def of(cls, single: Any, outputs: list[Tensor], inputs: list[Tensor], opts: Any) -> _EveryWork:
        """A coalesced collective a Backend has no binding for: ``single`` (its binding) once a pair."""
        return cls([single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)], outputs)

    def wait(self, timeout: timedelta | None = None) -> bool:
        for w in self.works:
            if timeout is None:
                w.wait()
            else:
                w.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def get_future(self) -> torch.futures.Future:
        """Done when every call is, with the outputs (as gloo's coalesced works), or the first call's error.
        A call whose work has no future makes this raise, as gloo's own coalesced work then does (its
        reduce_scatter's: "not implemented")."""
        def outputs(done: torch.futures.Future) -> list[Tensor]:
            for f in done.value():
                f.value()  # raises its error
            return self.outputs

        return torch.futures.collect_all([w.get_future() for w in self.works]).then(outputs)


_inherited_options: Options | None = None  # the default group's, for subgroups made without pg_options


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
    resolved = options.resolve(limit=backend_options.timeout.total_seconds())
    return ProcessGroupPassing(backend_options.store, backend_options.group_rank, backend_options.group_size,
                               backend_options.timeout, str(backend_options.group_id), resolved)
