"""The host streaming engine's public face: Group, one worker's allreduce, reduce_scatter and
all_gather of one group's arrays through aggregators, and its failover.

A group (job, worker) streams its array as packets of ``lanes`` int32 values. With p aggregators the
packets are split into p contiguous blocks, one per aggregator, each with its own slot pool and psn
stream (passing.stream_state holds them between calls). The parts, by object:

  - passing.reduce_path: a reduction's rounds (int32 exact; float32 through scaling rounds and a
    class round for NaN and infinities), each a pass of the reduce stream;
  - passing.reduce_stream: the numpy reduce stream, self-clocked per aggregator;
  - passing.gather_stream: the all_gather, GATHER packets the aggregator relays, NACKs from the
    receivers and a completion round;
  - passing.recovery: loss recovery (RTT estimate, RACK, probes) and failover's silence rule;
  - passing.native_stream: the same two loops in C (host/csrc/stream.c, gather.c, through passing.native);
  - passing.errors, passing.replay: what a call raises, and its replay record;
  - passing.numbering: a job's servers across racks, and reduce_scatter's and all_gather's wire work in them.

``reduce_scatter`` is the reduce stream with OWNER_ONLY rounds (a packet's sums come back to the
worker whose block it is, the others get a header-only ACK); ``allgather`` sends each worker's bytes
once as GATHER packets (docs/protocol.md, Kinds; docs/architecture.md). Both run in either engine: the
native one (host/csrc/stream.c, gather.c) and the numpy one, the executable specification it is tested against.
``engine="auto"`` takes the native one where it loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from . import native, numbering, stripes, wire
from .call_rules import check_out, check_reduce
from .errors import AggregatorUnreachable, GroupFailed, PassingError, Silenced
from .recovery import LossRecovery, SilenceWatch
from .reduce_path import ReducePath
from .replay import Replay
from .stream_state import Aggregator, StreamState, aggregators_of, native_rng
from .transport import BatchSocket, TransportStats, parse_endpoint

MAX_SERVERS = 32 * 32  # a two-level tree's: 32 leaves of 32 servers (docs/protocol.md, "Trees across racks")


class FailoverLine(Protocol):
    """A worker's line to the controller for moves (passing.control.Failover is the real one)."""

    after: float  # seconds without any RESULT before the group asks to move

    def report(self, job_id: int, generation: int, call: int) -> dict[str, Any]: ...

    def close(self) -> None: ...


class Group:
    """One worker's membership in an aggregation group.

    Example::

        g = Group(job=1, worker=0, workers=2, aggregators=["127.0.0.1:9877"], pool=256,
                  bind="127.0.0.1:20000")
        total = g.allreduce(np.ones(1000, np.float32))   # == 2.0 everywhere

    ``scale`` is ``"auto"`` (a MAX round picks a power-of-two scale per aggregator) or
    a number (fixed scale; ``on_overflow="auto"`` redoes an overflowing call in auto
    mode, ``"raise"`` raises PassingOverflow). The aggregator admits this worker by
    its source address, so ``bind`` must be the address given to the aggregator; it may
    be a BatchSocket bound earlier (to learn the port before a join), which the group then owns.
    ``servers``: the servers of the whole job where this group is a leaf's, its rack's part of a tree across
    racks (docs/protocol.md, "Trees across racks"): an auto scale and an average are for them (default:
    ``workers``); ``number``, ``numbers``, ``owner_only``: this server's global number there, every server's
    in the caller's order, whether the tree carries owners (passing.numbering). ``from_answer`` takes them all.
    ``rto``, ``max_rto`` and ``timeout``: loss recovery (passing.recovery); ``drop``: a test
    impairment, this fraction of packets lost each way, here at the host. ``io``: the I/O path, AF_XDP beside
    the socket where it can run ("auto"), or forced ("udp", "xdp"): passing.xdp. ``streams``: the reduce passes
    striped over that many streams on threads of their own (native engine), stream s a job of its own at the
    aggregators (``stream_jobs[s - 1]``, default job + s; a controller's answer gives them) from bind's port + s
    or ``stream_sockets[s - 1]``; a move takes every stream along: passing.stripes.
    """

    def __init__(
        self,
        job: int,
        worker: int,
        workers: int,
        aggregators: Sequence[str | tuple[str, int] | Aggregator],
        pool: int = 256,
        generation: int = 0,
        lanes: int = wire.DEFAULT_LANES,
        bind: str | tuple[str, int] | BatchSocket = ("0.0.0.0", 0),
        scale: str | float = "auto",
        on_overflow: str = "raise",
        rto: float = 1.0,
        max_rto: float = 1.0,
        timeout: float = 30.0,
        offload: bool = True,
        drop: float = 0.0,
        drop_seed: int | None = None,
        engine: str = "auto",
        failover: FailoverLine | None = None,
        servers: int | None = None,
        number: int | None = None,
        numbers: Sequence[int] | None = None,
        owner_only: bool = True,
        io: str = "auto",
        streams: int = 1,
        stream_jobs: Sequence[int | Sequence[int]] | None = None,
        stream_sockets: Sequence[BatchSocket] | None = None,
    ) -> None:
        if not 0 <= job < 1 << 16:
            raise ValueError(f"job {job} outside 0..65535")
        if not 0 <= generation < wire.GENERATIONS:
            raise ValueError(f"generation {generation} outside 0..{wire.GENERATIONS - 1}")
        if not 1 <= workers <= wire.MAX_WORKERS:
            raise ValueError(f"workers must be 1..{wire.MAX_WORKERS}, got {workers}")
        if not 0 <= worker < workers:
            raise ValueError(f"worker {worker} outside 0..{workers - 1}")
        if servers is not None and not workers <= servers <= MAX_SERVERS:
            raise ValueError(f"servers must be {workers}..{MAX_SERVERS} (the job's, at least this leaf's workers), "
                             f"got {servers}")
        order = numbering.check_numbering(worker, workers, servers, number, numbers, owner_only)
        if scale != "auto" and not (isinstance(scale, (int, float)) and scale > 0):
            raise ValueError(f"scale must be 'auto' or a positive number, got {scale!r}")
        if on_overflow not in ("raise", "auto"):
            raise ValueError(f"on_overflow must be 'raise' or 'auto', got {on_overflow!r}")
        if not aggregators:
            raise ValueError("at least one aggregator is needed")
        if not 0.0 <= drop < 1.0:
            raise ValueError(f"drop must be in [0, 1), got {drop}")
        drop_rng = np.random.default_rng(drop_seed)
        shards = [Aggregator.parse(a, pool) for a in aggregators]
        for a in shards:
            if not 1 <= a.pool <= 1 << 16:
                raise ValueError(f"pool must be 1..65536, got {a.pool}")
        self.scale, self.on_overflow = scale, on_overflow
        if not 0 < rto <= max_rto:
            raise ValueError(f"need 0 < rto <= max_rto, got {rto} and {max_rto}")
        self.recovery = LossRecovery(rto, max_rto, timeout)
        self.native = native.use_native(engine)
        self.engine = "native" if self.native else "numpy"
        rng = native_rng(drop_seed)
        self._failed: str | None = None  # after a failed call the psn streams are out of step
        # Failover (docs/control.md): silent for failover.after s, the group asks the controller to
        # move it; every worker then redoes the interrupted call, and the one before it where a
        # peer had not completed that, so the inputs of the last two calls are kept (copies).
        self.failover = failover
        self.calls = 0  # network calls completed: the index the group agrees on when it moves
        self._attempt = 0  # the call now on the wire (below self.calls while redoing one)
        self._kept: dict[int, Replay] = {}
        self._decision: dict[str, Any] | None = None
        self._no_move = ""  # why the last silence report moved nothing: the controller's "wait", or no answer
        self.moves = 0
        if isinstance(bind, BatchSocket):
            if bind.dtype != wire.packet_dtype(lanes):
                raise ValueError(f"the socket was made for other than {lanes} lanes")
            socket = bind
        else:
            socket = BatchSocket(parse_endpoint(bind, 0) if isinstance(bind, str) else bind, lanes=lanes,
                                 offload=offload)
        try:
            socket.open_io(io, self.native)  # AF_XDP beside the socket where it can run (passing.xdp)
        except BaseException:
            if socket is not bind:
                socket.close()
            raise
        self.state = StreamState(job, worker, workers, generation, lanes, shards, socket, drop, drop_rng, rng)
        self.state.servers = workers if servers is None else servers
        self.state.number = worker if number is None else number  # checked above: known where servers differ
        self.state.order, self.state.owner_only = order, bool(owner_only)
        self._numbered = servers in (None, workers) or number is not None
        if streams != 1:  # streams 1.. on threads of their own (passing.stripes)
            try:
                self.state.stripes = stripes.open_stripes(self.state, self.recovery, streams, stream_jobs,
                                                          socket.address, io, offload, stream_sockets, self.native)
            except BaseException:
                socket.close()
                raise

    @classmethod
    def from_answer(cls, answer: dict, bind: str | tuple[str, int] | BatchSocket, **options) -> Group:
        """A group from the controller's join answer (passing.control.join): switch or PS alike, its streams too."""
        options = stripes.answer_options(answer, options)
        return cls(
            job=int(answer["job_id"]), generation=int(answer["generation"]), worker=int(answer["worker"]),
            workers=int(answer["workers"]), aggregators=aggregators_of(answer), lanes=int(answer["lanes"]),
            servers=answer.get("servers"), number=answer.get("number"), numbers=answer.get("numbers"),
            owner_only=bool(answer.get("owner_only", True)), bind=bind, **options,
        )

    # the stream's identity and settings, held by its parts (a move changes the identity)
    @property
    def job(self) -> int:
        return self.state.job

    @property
    def generation(self) -> int:
        """The allocation this group belongs to (stamped on DATA, checked on RESULT)."""
        return self.state.generation

    @property
    def worker(self) -> int:
        return self.state.worker

    @property
    def workers(self) -> int:
        return self.state.workers

    @property
    def servers(self) -> int:
        """The servers of the whole job: ``workers`` but for a leaf's group of a tree across racks."""
        return self.state.servers

    @property
    def rank(self) -> int:
        """This server's index in the caller's order of the job's servers (reduce_scatter's block, all_gather's
        piece): ``worker`` in a flat group."""
        return numbering.rank_of(self.state)

    @property
    def lanes(self) -> int:
        return self.state.lanes

    @property
    def aggregators(self) -> list[Aggregator]:
        return self.state.aggregators

    @property
    def socket(self) -> BatchSocket:
        return self.state.socket

    @property
    def drop(self) -> float:
        return self.state.drop

    @property
    def rto_min(self) -> float:
        return self.recovery.rto_min

    @property
    def max_rto(self) -> float:
        return self.recovery.max_rto

    @property
    def timeout(self) -> float:
        return self.recovery.timeout

    @property
    def stats(self) -> TransportStats:
        """The socket's counters (with several streams, a sum of every stream's: a copy)."""
        if self.state.stripes:
            return stripes.total_stats(self.socket.stats, self.state.stripes)
        return self.socket.stats

    @property
    def streams(self) -> int:
        """The streams the group's reduce passes are striped over (passing.stripes)."""
        return 1 + len(self.state.stripes)

    @property
    def address(self) -> tuple[str, int]:
        return self.socket.address

    @property
    def io_path(self) -> str:
        """The I/O path of the group's packets: 'xdp' (AF_XDP beside the socket) or 'udp'."""
        return self.socket.io_path

    @property
    def io_reason(self) -> str:
        """One line: why that path (the AF_XDP mode, or why not AF_XDP)."""
        return self.socket.io_reason

    def close(self) -> None:
        if self.failover is not None:
            self.failover.close()
        stripes.close_stripes(self.state.stripes)
        self.socket.close()

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- public API ----------------------------------------------------------------

    def allreduce(self, array: np.ndarray, op: str = "sum", out: np.ndarray | None = None) -> np.ndarray:
        """Sum (or average) ``array`` over all workers of the group.

        float32 goes through scaling (exact to within ``quantize.error_bound``); int32
        is summed exactly and raises PassingOverflow when a sum leaves int32. The result
        goes to ``out`` when given (same dtype and size, C-contiguous; it may be ``array``
        itself: the native engine then needs no memory beyond its window; a fixed-scale call
        in place takes a temporary, since it may have to be redone in auto mode), else to a
        new array. NaN and infinities give IEEE sums element by element, as gloo does.
        """
        x = np.asarray(array)
        check_reduce(x, op, "allreduce")
        if out is not None:
            check_out(out, x.dtype, x.size)
        self._check_usable()
        flat = np.ascontiguousarray(x).reshape(-1)
        result = np.empty(x.shape, x.dtype) if out is None else out
        if flat.size == 0:
            return result
        self._call(Replay("reduce", flat, op), result.reshape(-1))
        return result

    # ---- sharded data parallelism (docs/protocol.md, Kinds) ------------------------------------

    def reduce_scatter(self, array: np.ndarray, op: str = "sum", out: np.ndarray | None = None) -> np.ndarray:
        """Server r's block of the sum (or average) of ``array`` over all servers of the job: ``array`` is
        the servers' blocks one after the other (its size a multiple of the servers; ``servers`` is
        ``workers`` in a flat group), the answer block ``rank`` (size / servers elements, into ``out`` when
        given). float32 or int32, as allreduce.

        The reduce path with OWNER_ONLY rounds: each server's block is padded to whole packets, and a
        packet's sums come back to the block's server alone (its ``owner``: its global number); the others
        get a header-only ACK. Per server: up ``size``, down ``size / servers`` of sums and one ACK per
        packet of the others. A tree without owners (more than 128 servers): SUM rounds (down ``size``)."""
        x = np.asarray(array)
        check_reduce(x, op, "reduce_scatter")
        self._check_numbered("reduce_scatter")
        if x.size % self.servers:
            raise ValueError(f"reduce_scatter of {x.size} elements: not a multiple of the {self.servers} servers")
        chunk = x.size // self.servers
        if out is not None:
            check_out(out, x.dtype, chunk)
        self._check_usable()
        result = np.empty(chunk, x.dtype) if out is None else out
        if chunk == 0:
            return result
        self._call(Replay("scatter", np.ascontiguousarray(x).reshape(-1), op), result.reshape(-1))
        return result

    def allgather(self, array: np.ndarray) -> np.ndarray:
        """Every server's ``array`` (the same shape and dtype at every server), stacked in ``rank`` order:
        shape ``(servers, *array.shape)``. Any dtype, bit for bit."""
        x = np.ascontiguousarray(array)
        out = np.empty((self.servers, *x.shape), x.dtype)
        self.allgather_bytes(x.reshape(-1).view(np.uint8), [x.nbytes] * self.servers, out.reshape(-1).view(np.uint8))
        return out

    def allgather_bytes(self, piece: np.ndarray, sizes: Sequence[int], out: np.ndarray) -> np.ndarray:
        """Every server's ``piece`` of bytes, ``rank`` r's ``sizes[r]`` bytes at ``sum(sizes[:r])`` of ``out``
        (uint8, C-contiguous, ``sum(sizes)`` bytes). Every server gives the same ``sizes``.

        Each server sends its piece once as GATHER packets (its ``owner``: its global number), which the
        aggregator (a tree: each level) relays to the others; a receiver asks for what it lacks with NACKs,
        and the call ends with a one-packet completion round through the reduce path once every server
        holds every piece. A tree without owners (more than 128 servers): a SUM round (passing.numbering)."""
        sizes = [int(v) for v in sizes]
        self._check_numbered("all_gather")
        me = self.rank
        if len(sizes) != self.servers or min(sizes) < 0:
            raise ValueError(f"sizes must give {self.servers} byte counts >= 0, got {sizes}")
        if piece.dtype != np.uint8 or piece.ndim != 1 or piece.size != sizes[me]:
            raise ValueError(f"piece must be {sizes[me]} bytes (a 1-d uint8 array)")
        check_out(out, np.dtype(np.uint8), sum(sizes), "bytes")
        self._check_usable()
        offsets = np.r_[0, np.cumsum(sizes)]
        out.reshape(-1)[offsets[me] : offsets[me + 1]] = piece
        if self.servers == 1 or max(sizes) == 0:
            return out  # nobody sends anything
        self._call(Replay("gather", piece, sizes=sizes), out.reshape(-1))
        return out

    # ---- one call on the wire -------------------------------------------------------------

    def _check_numbered(self, call: str) -> None:
        """reduce_scatter and all_gather name servers by their number in the whole job: a leaf's group of a
        tree needs its own (docs/protocol.md, "Trees across racks"; a join answer gives it)."""
        if not self._numbered:
            raise PassingError(f"{call} needs this server's number in the job: this group is a leaf's {self.workers} "
                               f"of the job's {self.state.servers} servers, and was given no number (allreduce only)")

    def _check_usable(self) -> None:
        """After a call failed, the psn streams are out of step: every later call raises."""
        if self._failed:
            raise PassingError(
                f"job {self.job} worker {self.worker}: group unusable after an earlier error: {self._failed}"
            )

    def _call(self, call: Replay, out: np.ndarray) -> None:
        """One network call, through moves where the group has a failover line; an error that leaves
        the streams out of step makes the group unusable."""
        try:
            if self.failover is None:
                self._run(call, out)
            else:
                self._run_with_failover(call, out)
        except (AggregatorUnreachable, OSError) as e:
            self._failed = str(e)
            raise

    def _run(self, call: Replay, out: np.ndarray, source: np.ndarray | None = None) -> None:
        """Put ``call`` on the wire once, reading ``source`` (default: its input), writing ``out``."""
        source = call.input if source is None else source
        if call.kind == "gather":
            assert call.sizes is not None
            numbering.gather(self.state, self.recovery, self._silence_watch(), self.native, self._reduce_path(), source,
                             call.sizes, out)
        elif call.kind == "scatter":
            numbering.scatter(self.state, self._reduce_path(), source, out, call.op)
        else:
            self._reduce_path().run(source, out, call.op)

    def _reduce_path(self) -> ReducePath:
        return ReducePath(self.state, self.recovery, self._silence_watch(), self.native, self.scale, self.on_overflow)

    # ---- failover (docs/control.md) ----------------------------------------------------------

    def _silence_watch(self) -> SilenceWatch | None:
        """What the streams ask when they hear nothing for a while: none without a failover line."""
        return None if self.failover is None else SilenceWatch(self.failover.after, self._on_silence)

    def _run_with_failover(self, call: Replay, out: np.ndarray) -> None:
        """One call that survives moves, whatever its kind: on a move every worker redoes, on the new
        allocation, the calls from the one the controller names (docs/control.md), then this one from
        its start. Each call's replay record (its kind, a copy of its input) is kept for that."""
        index = self.calls
        kept = self._kept[index] = call.copy()  # outlives an in-place output, and this call
        self._kept.pop(index - 2, None)
        source = kept.input if np.shares_memory(call.input, out) else call.input
        redo: list[int] = []
        meet = False
        self._no_move = ""
        while True:
            try:
                if meet:  # moved: every worker is on the new allocation before any call is redone
                    self._attempt = redo[0] if redo else index
                    self._meet()
                    meet = False
                for k in redo:  # calls this worker completed but a peer did not: its share again
                    self._attempt = k
                    self._run(self._kept[k], self._kept[k].scratch(self.servers))
                redo = []
                self._attempt = index
                self._run(kept, out, source)
                break
            except AggregatorUnreachable as e:
                if self._no_move:  # why no move came
                    e.add_note(f"failover: {self._no_move} (docs/control.md, Failover)")
                raise
            except Silenced:
                decision, self._decision = self._decision, None
                assert decision is not None
                first = int(decision["redo"])
                if decision["state"] != "move":
                    raise GroupFailed(
                        f"job {self.job} worker {self.worker}: {decision.get('error', 'the group could not move')}",
                        [int(w) for w in decision.get("dead", [])],
                        [self._kept[k] for k in range(first, index)], kept) from None
                if not index - 1 <= first <= index or any(k not in self._kept for k in range(first, index)):
                    raise PassingError(f"job {self.job} worker {self.worker}: the controller asks to redo call "
                                       f"{first}, but this worker is at call {index}") from None
                self._move_to(decision)
                redo = list(range(first, index))
                meet = True
        self.calls = index + 1

    def _meet(self) -> None:
        """A one-packet round on a new allocation before any call is redone on it: its RESULT says that
        every worker has moved. Without it, a worker that moved first could send GATHERs that the
        aggregator relays to a peer still waiting for its decision on the old allocation, which drops them
        (another job id); only a NACK would recover them, and with ``failover_after`` at or below the
        probe's wait the group would find itself silent and move again, for ever. A DATA round loses
        nothing (the aggregator keeps it until every worker has sent), and a GATHER sent after it reaches
        a peer that is in the new allocation's stream, which keeps it for its all_gather."""
        one = np.zeros(1, np.int32)
        self._reduce_path().run(one, one, "sum")

    def _on_silence(self) -> bool:
        """The stream heard nothing for failover.after s: ask the controller. True gives the call up
        (the decision is in self._decision); a controller that does not answer means keep waiting."""
        assert self.failover is not None
        try:
            decision = self.failover.report(self.job, self.generation, self._attempt)
        except PassingError as e:
            self._no_move = f"the controller did not answer the silence report: {e}"
            return False  # the controller is down: the data path goes on until `timeout`
        if decision.get("state") == "wait":
            waiting_for = [int(w) for w in decision.get("waiting_for", [])]
            self._no_move = f"the controller was waiting for worker(s) {waiting_for} of the group to report the " \
                            "silence too"
            return False
        self._decision = decision
        return True

    def _move_to(self, answer: dict[str, Any]) -> None:
        """The group's new allocation (a move answer, checked by passing.numbering.check_move)."""
        stripes.move_streams(self.state, answer, numbering.check_move(self.state, answer))  # every stream moves
        self.moves += 1
