"""The host streaming engine: allreduce of one group's array through aggregators.

A group (job, worker) streams its array as packets of ``lanes`` int32 values. With p
aggregators the packets are split into p contiguous blocks, one per aggregator, each
with its own slot pool and psn stream. Per aggregator the window is self-clocked:
psn p uses slot p mod pool, and p + pool is sent only once the RESULT of p is in, so at
most ``pool`` packets are in flight and the aggregator's two sets per slot always hold
every round someone may still ask for.

Loss recovery keeps the window moving under random loss, and resends nothing while the
stream only waits for a late peer (a RESULT comes when every worker has sent its packet, so
a peer that starts its call later, or is descheduled, stops RESULTs as a loss would). A
packet is resent once a packet transmitted after it has been answered and it has been out
for longer than that packet's round trip plus a reordering allowance (RACK, RFC 8985).
Rounds complete in transmission order on an in-order path, since every worker sends in psn
order, so this is evidence of loss; retransmissions give evidence too, so a stalled window
recovers. A shard silent (nothing sent, nothing answered) for a while resends (a probe) its
latest-sent packet, whose answer lets RACK judge the ones before it, and the one out the
longest, whose round holds every worker's window (if a resend of it was lost as well,
nothing later can be answered); each unanswered probe doubles the next wait (up to
``max_rto``). There is no per-packet timer. The while: within LOSS_MEMORY s of evidence of
loss (a RACK resend, a resend answered right away), two smoothed round trips (RFC 8985's
PTO, 1 ms at least), as silence is then likely a loss; otherwise ``rto`` at least (1 s by
default, RFC 6298's initial timer), as silence is then all but surely a late peer, whose
lateness has a long tail: a loss-free run resends nothing, and the first loss after a quiet
spell costs that once. A packet unanswered for ``timeout`` seconds ends the call with
AggregatorUnreachable.

``reduce_scatter`` is the same stream with OWNER_ONLY rounds (a packet's sums come back to the
worker whose block it is, the others get a header-only ACK); ``allgather`` sends each worker's
bytes once as GATHER packets the aggregator relays, with NACKs from the receivers and a completion
round (docs/protocol.md, Kinds; docs/architecture.md). Both run in either engine (the native
all_gather loop: host/csrc/stream.c's pn_gather_run; ``_gather`` is its specification).

Two engines implement the stream: the native one (host/csrc/stream.c, through
passing.native) and ``_stream`` below in numpy, the executable specification it is tested
against. ``engine="auto"`` takes the native one where it loads.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from . import native, quantize, wire
from .transport import BatchSocket, TransportStats, pack_address, parse_endpoint, unpack_address


class PassingError(RuntimeError):
    """Base class of PASSING's run-time errors."""


class AggregatorUnreachable(PassingError, TimeoutError):
    """No RESULT within the timeout: the aggregator is down or a peer stopped sending."""


class PassingOverflow(PassingError, OverflowError):
    """A sum left the int32 range (reported by the aggregator's OVERFLOW flag)."""


@dataclass
class Replay:
    """A network call as every worker can do it again, after a move or over another transport: its
    kind, a copy of this worker's input (an in-place output may be half written) and what else it
    takes. ``kind`` "reduce": an allreduce of ``input`` with ``op``; "scatter": a reduce_scatter of
    ``input`` (the workers' blocks one after the other) with ``op``, worker w's block of the result
    to worker w; "gather": an all_gather of the piece ``input`` (bytes) among pieces of ``sizes``
    bytes, in worker order. The same record replays on any transport (the torch backend: gloo)."""

    kind: str
    input: np.ndarray
    op: str = "sum"
    sizes: list[int] | None = None

    def copy(self) -> Replay:
        return Replay(self.kind, self.input.copy(), self.op, None if self.sizes is None else list(self.sizes))

    def scratch(self, workers: int) -> np.ndarray:
        """An output for a call done again only for the peers' sake (its result is not wanted)."""
        if self.kind == "gather":
            assert self.sizes is not None
            return np.empty(sum(self.sizes), np.uint8)
        return np.empty(self.input.size // (workers if self.kind == "scatter" else 1), self.input.dtype)


class GroupFailed(AggregatorUnreachable):
    """The controller could not move the group after its aggregator went silent: no aggregator
    is left (``dead`` empty), or peers stopped (``dead`` names them). The group is unusable.

    To carry on over another transport (the torch backend falls back to gloo), every worker
    first redoes the calls in ``redo`` (those it completed that a peer did not: the group agrees
    on them, docs/control.md) and then the interrupted call, ``current``, from its start."""

    def __init__(self, message: str, dead: list[int], redo: list[Replay], current: Replay | None) -> None:
        super().__init__(message)
        self.dead, self.redo, self.current = dead, redo, current


class FailoverLine(Protocol):
    """A worker's line to the controller for moves (passing.control.Failover is the real one)."""

    after: float  # seconds without any RESULT before the group asks to move

    def report(self, job_id: int, generation: int, call: int) -> dict[str, Any]: ...

    def close(self) -> None: ...


class _Silenced(Exception):
    """Internal: the stream gave its call up because the controller decided (a move or a failure)."""


OPS = ("sum", "avg")
NONFINITE_SHIFT = 6  # bits per count in the non-finite class round: up to 32 workers, + 1
REORDER_FRACTION = 0.25  # RACK's reordering allowance: a quarter of the round trip (RFC 8985)
REORDER_MIN = 200e-6  # and at least this: RESULTs come in batches
PROBE_MIN = 1e-3  # a probe waits at least this
MAX_PROBE_DOUBLINGS = 6  # unanswered probes double the wait, up to 64 x and max_rto; `timeout` tells a dead one
SILENCE_EVERY = 0.5  # once silent for failover.after: how often to ask the controller again
EARLY_GATHERS = 1 << 16  # GATHER packets of a call not begun yet that a worker keeps for it (more: NACKed then)
EARLY_NATIVE = 4096  # of them, what one call of the native stream can keep
LOSS_MEMORY = 10.0  # s: evidence of loss this recent makes a probe wait what the estimates say, not `rto`
INT32_MAX, INT32_MIN = np.iinfo(np.int32).max, np.iinfo(np.int32).min


def _check_reduce(x: np.ndarray, op: str, call: str) -> None:
    """The op and dtype rules of every reduction: float32 or int32, and an average only of float32."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if x.dtype not in (np.float32, np.int32):
        raise TypeError(f"{call} takes float32 or int32 arrays, got {x.dtype}")
    if x.dtype == np.int32 and op == "avg":
        raise TypeError("op 'avg' needs a float32 array (an int32 average is not an int32)")


@dataclass
class Aggregator:
    """Where one shard of the stream goes: an address and the job's slot pool there."""

    host: str
    port: int = wire.UDP_PORT
    pool: int = 256

    @property
    def packed(self) -> int:
        return pack_address(self.host, self.port)


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
    ) -> None:
        if not 0 <= job < 1 << 16:
            raise ValueError(f"job {job} outside 0..65535")
        if not 0 <= generation < wire.GENERATIONS:
            raise ValueError(f"generation {generation} outside 0..{wire.GENERATIONS - 1}")
        if not 1 <= workers <= wire.MAX_WORKERS:
            raise ValueError(f"workers must be 1..{wire.MAX_WORKERS}, got {workers}")
        if not 0 <= worker < workers:
            raise ValueError(f"worker {worker} outside 0..{workers - 1}")
        if scale != "auto" and not (isinstance(scale, (int, float)) and scale > 0):
            raise ValueError(f"scale must be 'auto' or a positive number, got {scale!r}")
        if on_overflow not in ("raise", "auto"):
            raise ValueError(f"on_overflow must be 'raise' or 'auto', got {on_overflow!r}")
        if not aggregators:
            raise ValueError("at least one aggregator is needed")
        if not 0.0 <= drop < 1.0:
            raise ValueError(f"drop must be in [0, 1), got {drop}")
        # Test impairment: this fraction of packets is lost each way, here at the host.
        self.drop, self._drop_rng = drop, np.random.default_rng(drop_seed)
        self.job, self.worker, self.workers, self.lanes = job, worker, workers, lanes
        self.generation = generation  # the allocation this group belongs to (stamped on DATA, checked on RESULT)
        self.aggregators = [self._aggregator(a, pool) for a in aggregators]
        for a in self.aggregators:
            if not 1 <= a.pool <= 1 << 16:
                raise ValueError(f"pool must be 1..65536, got {a.pool}")
        self.scale, self.on_overflow = scale, on_overflow
        if not 0 < rto <= max_rto:
            raise ValueError(f"need 0 < rto <= max_rto, got {rto} and {max_rto}")
        self.rto_min, self.max_rto, self.timeout = rto, max_rto, timeout
        self._srtt, self._rttvar = -1.0, 0.0  # the round trip: set by the first sample (RFC 6298), -1 until then
        self._last_loss = -1.0  # time.monotonic() of the latest evidence of loss (a RACK resend, a resend answered
        # right away); -1: none
        self.native = native.use_native(engine)
        self.engine = "native" if self.native else "numpy"
        # the native engine's impairment generator (splitmix64 state)
        seed = drop_seed if drop_seed is not None else np.random.SeedSequence().entropy
        self._native_rng = np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
        self._agg_ids = np.array([a.packed for a in self.aggregators], dtype=np.int64)
        # per shard: the stream position of its next packet, unwrapped (psn = position mod 2^32; slot and
        # set come from the position, so every pool size keeps p and p + pool on one slot across the wrap)
        self._next_psn = np.zeros(len(self.aggregators), dtype=np.int64)
        self._failed: str | None = None  # after a failed call the psn streams are out of step
        # Failover (docs/control.md): silent for failover.after s, the group asks the controller to
        # move it; every worker then redoes the interrupted call, and the one before it where a
        # peer had not completed that, so the inputs of the last two calls are kept (copies).
        self.failover = failover
        self.calls = 0  # network calls completed: the index the group agrees on when it moves
        self._attempt = 0  # the call now on the wire (below self.calls while redoing one)
        self._kept: dict[int, Replay] = {}
        self._decision: dict[str, Any] | None = None
        self.moves = 0
        # all_gather (docs/protocol.md, Kinds): the position of the next call's first GATHER packet (the
        # same at every worker), and GATHER packets of a call this worker has not begun yet (a faster
        # peer's), kept for it: (packets, lengths, sources) batches, at most EARLY_GATHERS packets
        self._gather_position = 0
        self._early: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._early_buffer: np.ndarray | None = None  # where the native stream puts them (EARLY_NATIVE rows)
        if isinstance(bind, BatchSocket):
            if bind.dtype != wire.packet_dtype(lanes):
                raise ValueError(f"the socket was made for other than {lanes} lanes")
            self.socket = bind
        else:
            self.socket = BatchSocket(parse_endpoint(bind, 0) if isinstance(bind, str) else bind, lanes=lanes,
                                      offload=offload)

    @classmethod
    def from_answer(cls, answer: dict, bind: str | tuple[str, int] | BatchSocket, **options) -> Group:
        """A group from the controller's join answer (passing.control.join): switch or PS alike."""
        return cls(
            job=int(answer["job_id"]), generation=int(answer["generation"]), worker=int(answer["worker"]),
            workers=int(answer["workers"]),
            aggregators=[Aggregator(a["host"], int(a["port"]), int(a["pool"])) for a in answer["aggregators"]],
            lanes=int(answer["lanes"]), bind=bind, **options,
        )

    @staticmethod
    def _aggregator(spec: str | tuple[str, int] | Aggregator, pool: int) -> Aggregator:
        if isinstance(spec, Aggregator):
            return spec
        host, port = parse_endpoint(spec, wire.UDP_PORT) if isinstance(spec, str) else spec
        return Aggregator(host, port, pool)

    @property
    def stats(self) -> TransportStats:
        return self.socket.stats

    @property
    def address(self) -> tuple[str, int]:
        return self.socket.address

    def close(self) -> None:
        if self.failover is not None:
            self.failover.close()
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
        _check_reduce(x, op, "allreduce")
        if out is not None and (out.dtype != x.dtype or out.size != x.size or not out.flags.c_contiguous
                                or not out.flags.writeable):
            raise ValueError(f"out must be a writeable C-contiguous {x.dtype} array of {x.size} elements")
        self._check_usable()
        flat = np.ascontiguousarray(x).reshape(-1)
        result = np.empty(x.shape, x.dtype) if out is None else out
        if flat.size == 0:
            return result
        self._call(Replay("reduce", flat, op), result.reshape(-1))
        return result

    # ---- sharded data parallelism (docs/protocol.md, Kinds) ------------------------------------

    def reduce_scatter(self, array: np.ndarray, op: str = "sum", out: np.ndarray | None = None) -> np.ndarray:
        """Worker w's block of the sum (or average) of ``array`` over all workers: ``array`` is the
        workers' blocks one after the other (its size a multiple of the workers), the answer block
        ``worker`` (size / workers elements, into ``out`` when given). float32 or int32, as allreduce.

        The reduce path with OWNER_ONLY rounds: each worker's block is padded to whole packets, and a
        packet's sums come back to the block's worker alone; the others get a header-only ACK. Per
        worker: up ``size``, down ``size / workers`` of sums and one ACK per packet of the others."""
        x = np.asarray(array)
        _check_reduce(x, op, "reduce_scatter")
        if x.size % self.workers:
            raise ValueError(f"reduce_scatter of {x.size} elements: not a multiple of the {self.workers} workers")
        chunk = x.size // self.workers
        if out is not None and (out.dtype != x.dtype or out.size != chunk or not out.flags.c_contiguous
                                or not out.flags.writeable):
            raise ValueError(f"out must be a writeable C-contiguous {x.dtype} array of {chunk} elements")
        self._check_usable()
        result = np.empty(chunk, x.dtype) if out is None else out
        if chunk == 0:
            return result
        self._call(Replay("scatter", np.ascontiguousarray(x).reshape(-1), op), result.reshape(-1))
        return result

    def allgather(self, array: np.ndarray) -> np.ndarray:
        """Every worker's ``array`` (the same shape and dtype at every worker), stacked: shape
        ``(workers, *array.shape)``. Any dtype, bit for bit."""
        x = np.ascontiguousarray(array)
        out = np.empty((self.workers, *x.shape), x.dtype)
        self.allgather_bytes(x.reshape(-1).view(np.uint8), [x.nbytes] * self.workers, out.reshape(-1).view(np.uint8))
        return out

    def allgather_bytes(self, piece: np.ndarray, sizes: Sequence[int], out: np.ndarray) -> np.ndarray:
        """Every worker's ``piece`` of bytes, worker w's ``sizes[w]`` bytes at ``sum(sizes[:w])`` of
        ``out`` (uint8, C-contiguous, ``sum(sizes)`` bytes). Every worker gives the same ``sizes``.

        Each worker sends its piece once as GATHER packets, which the aggregator relays to the others;
        a receiver asks for what it lacks with NACKs, and the call ends with a one-packet completion
        round through the reduce path once every worker holds every piece."""
        sizes = [int(v) for v in sizes]
        if len(sizes) != self.workers or min(sizes) < 0:
            raise ValueError(f"sizes must give {self.workers} byte counts >= 0, got {sizes}")
        if piece.dtype != np.uint8 or piece.ndim != 1 or piece.size != sizes[self.worker]:
            raise ValueError(f"piece must be {sizes[self.worker]} bytes (a 1-d uint8 array)")
        if out.dtype != np.uint8 or out.size != sum(sizes) or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(f"out must be a writeable C-contiguous uint8 array of {sum(sizes)} bytes")
        self._check_usable()
        offsets = np.r_[0, np.cumsum(sizes)]
        out.reshape(-1)[offsets[self.worker] : offsets[self.worker + 1]] = piece
        if self.workers == 1 or max(sizes) == 0:
            return out  # nobody sends anything
        self._call(Replay("gather", piece, sizes=sizes), out.reshape(-1))
        return out

    def _check_usable(self) -> None:
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
            self._gather(source, call.sizes, out, np.r_[0, np.cumsum(call.sizes)])
        elif call.kind == "scatter":  # each worker's block padded to whole packets, OWNER_ONLY rounds
            chunk = source.size // self.workers
            per = -(-chunk // self.lanes)  # packets of each worker's block
            padded = np.zeros((self.workers, per * self.lanes), source.dtype)
            padded[:, :chunk] = source.reshape(self.workers, chunk)
            flat = padded.reshape(-1)
            self._allreduce(flat, flat, call.op, owner_packets=per)
            out[:] = padded[self.worker, :chunk]
        else:
            self._allreduce(source, out, call.op)

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
        while True:
            try:
                if meet:  # moved: every worker is on the new allocation before any call is redone
                    self._attempt = redo[0] if redo else index
                    self._meet()
                    meet = False
                for k in redo:  # calls this worker completed but a peer did not: its share again
                    self._attempt = k
                    self._run(self._kept[k], self._kept[k].scratch(self.workers))
                redo = []
                self._attempt = index
                self._run(kept, out, source)
                break
            except _Silenced:
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
        self._allreduce(one, one, "sum")

    def _ask_when_silent(self, now: float, last_heard: float, check: float) -> float:
        """Failover, the same rule for the reduce and the all_gather loops (host/csrc/stream.c's
        silence_gives_up): once nothing has been heard for failover.after s since ``last_heard``, ask the
        controller at ``check``, then every SILENCE_EVERY s while it says wait; raises _Silenced when it
        decided. Returns when to ask next."""
        assert self.failover is not None
        if now - last_heard < self.failover.after:
            return last_heard + self.failover.after
        if now < check:
            return check
        if self._on_silence():
            raise _Silenced()
        return time.monotonic() + SILENCE_EVERY

    def _on_silence(self) -> bool:
        """The stream heard nothing for failover.after s: ask the controller. True gives the call up
        (the decision is in self._decision); a controller that does not answer means keep waiting."""
        assert self.failover is not None
        try:
            decision = self.failover.report(self.job, self.generation, self._attempt)
        except PassingError:
            return False  # the controller is down: the data path goes on until `timeout`
        if decision.get("state") == "wait":
            return False
        self._decision = decision
        return True

    def _move_to(self, answer: dict[str, Any]) -> None:
        """The group's new allocation (the controller's move answer): same address, same workers; a socket
        sized for the new aggregator's packets when their lane count differs (a PS of another MTU)."""
        lanes = int(answer["lanes"])
        if lanes != self.lanes:
            address, stats, offload = self.socket.address, self.socket.stats, self.socket.gso
            self.socket.close()  # what it still holds is the old allocation's: ignored anyway
            self.socket = BatchSocket(address, lanes=lanes, offload=offload)
            self.socket.stats = stats
            self.lanes = lanes
        self.job, self.generation = int(answer["job_id"]), int(answer["generation"])
        self.aggregators = [Aggregator(a["host"], int(a["port"]), int(a["pool"])) for a in answer["aggregators"]]
        self._agg_ids = np.array([a.packed for a in self.aggregators], dtype=np.int64)
        self._next_psn = np.zeros(len(self.aggregators), dtype=np.int64)
        self._gather_position = 0  # positions, like psns, count from 0 on each allocation
        self._early = []  # GATHERs of the old allocation: nobody sends them again
        self.moves += 1

    def _allreduce(self, flat: np.ndarray, out: np.ndarray, op: str, owner_packets: int | None = None) -> None:
        """The reduce path. With ``owner_packets`` every round is OWNER_ONLY: packet i's sums come back to
        worker i // owner_packets alone (the others get ACKs), so ``out`` holds only this worker's block."""
        packets = -(-flat.size // self.lanes)
        bounds = np.linspace(0, packets, len(self.aggregators) + 1).astype(np.int64)
        starts, counts = bounds[:-1], np.diff(bounds)  # packets of each aggregator's contiguous block
        if flat.dtype == np.int32:
            if any(self._pass(wire.SUM, flat, out, starts, counts, owner_packets=owner_packets)):
                raise PassingOverflow(f"job {self.job}: an int32 sum left the int32 range")
            return
        mode = self.scale
        # A fixed-scale call may be redone in auto mode: then the input must outlive the first try.
        target = out if mode == "auto" or not np.shares_memory(flat, out) else np.empty_like(out)
        classes = None
        while True:
            if mode == "auto":
                scales, nonfinite = self._auto_scales(flat, starts, counts)
                if any(nonfinite):  # counted before the data round, which may overwrite an in-place input
                    classes = self._nonfinite_classes(flat, starts, counts, nonfinite, owner_packets)
            else:
                scales, nonfinite = [float(mode)] * len(counts), [False] * len(counts)
            live = np.array([c if sc else 0 for c, sc in zip(counts, scales)], dtype=np.int64)
            overflow = self._pass(wire.SUM, flat, target, starts, live, scales, owner_packets)
            # A non-finite element travels as 0 with OVERFLOW set; an auto scale cannot saturate.
            overflow = [o and not n for o, n in zip(overflow, nonfinite)]
            if not any(overflow):
                break
            if mode != "auto" and self._anywhere(flat, starts, counts, lambda block: not np.isfinite(block).all()):
                mode = "auto"  # a non-finite input, not a large one: scale the finite values from their own max
                continue
            if mode == "auto" or self.on_overflow == "raise":
                raise PassingOverflow(
                    f"job {self.job}: the sum overflowed int32 at scale {mode}; "
                    "use scale='auto' or a smaller fixed scale (or on_overflow='auto')"
                )
            mode = "auto"  # every worker saw the same flags, so all of them redo it
        for start, count, scale in zip(starts, counts, scales):
            if not scale:  # a shard that is zero on every worker needed no SUM
                target[start * self.lanes : (start + count) * self.lanes] = 0
        if classes is not None:
            _apply_nonfinite(target, classes)
        if target is not out:
            out[:] = target
        if op == "avg":
            out /= np.float32(self.workers)

    def _auto_scales(self, flat: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> tuple[list[float], list[bool]]:
        """One MAX round per aggregator: per shard the scale of its finite values (0.0 where they
        are zero on every worker) and whether some worker holds a NaN or an infinity in it.

        Lane 0 carries max |x| of the finite values as float32 bits, lane 1 a 1 where this worker's
        block holds a non-finite value: the common all-finite case costs nothing more."""
        rows = np.zeros((len(counts), self.lanes), dtype=np.int32)
        for i, (start, count) in enumerate(zip(starts, counts)):
            block = flat[start * self.lanes : (start + count) * self.lanes]
            bits = native.max_abs_bits(block) if self.native else quantize.max_abs_bits(block)
            if bits >= quantize.INF_BITS:  # only then a second look, at the finite values alone
                rows[i, 0] = (native.max_abs_bits(block, finite_only=True) if self.native
                              else quantize.max_abs_bits(block[np.isfinite(block)]))
                rows[i, 1] = 1
            else:
                rows[i, 0] = bits
        maxima = self._max_round(rows)
        scales = []
        for m in maxima[:, 0]:
            max_abs = quantize.bits_to_float(int(m))
            scales.append(quantize.auto_scale(max_abs, self.workers) if max_abs > 0 else 0.0)
        return scales, [bool(v) for v in maxima[:, 1]]

    def _max_round(self, rows: np.ndarray) -> np.ndarray:
        """Lane-wise int32 max of one row per shard over every worker."""
        maxima = np.empty_like(rows)
        shards = np.arange(len(rows))
        self._pass(wire.MAX, rows.reshape(-1), maxima.reshape(-1), shards, np.ones(len(rows), np.int64))
        return maxima

    def _anywhere(self, flat: np.ndarray, starts: np.ndarray, counts: np.ndarray, test) -> bool:
        """Whether ``test(block)`` holds for some shard's block on some worker (one MAX round)."""
        rows = np.zeros((len(counts), self.lanes), dtype=np.int32)
        for i, (start, count) in enumerate(zip(starts, counts)):
            rows[i, 0] = int(bool(test(flat[start * self.lanes : (start + count) * self.lanes])))
        return bool(self._max_round(rows)[:, 0].any())

    def _nonfinite_classes(self, flat: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                           nonfinite: list[bool], owner_packets: int | None = None) -> np.ndarray:
        """Per element, how many workers hold NaN, +inf and -inf there: one int32 SUM round over
        the shards that hold any, each worker contributing nan + (+inf << 6) + (-inf << 12) (at most
        32 workers: each count fits its 6 bits). Shards without any get zeros."""
        codes = (np.isnan(flat).astype(np.int32) | (np.isposinf(flat).astype(np.int32) << NONFINITE_SHIFT)
                 | (np.isneginf(flat).astype(np.int32) << 2 * NONFINITE_SHIFT))
        live = np.array([c if n else 0 for c, n in zip(counts, nonfinite)], dtype=np.int64)
        summed = np.zeros_like(codes)
        self._pass(wire.SUM, codes, summed, starts, live, owner_packets=owner_packets)
        return summed

    def _pass(self, op: int, flat: np.ndarray, out: np.ndarray, starts: np.ndarray, counts: np.ndarray,
              scales: list[float] | None = None, owner_packets: int | None = None) -> list[bool]:
        """One pass of every shard's packets through its aggregator: packets [start, start + count)
        of ``flat`` (zero-padded to whole packets; float32 quantized with the shard's scale) in,
        their sums into ``out``. Returns per shard whether a RESULT overflowed. With ``owner_packets``
        the rounds are OWNER_ONLY, and
        only the rows this worker owns are written to ``out``."""
        if self.native:
            return self._pass_native(op, flat, out, starts, counts, scales, owner_packets)
        owners = None if owner_packets is None else [(start + np.arange(count)) // owner_packets
                                                      for start, count in zip(starts, counts)]
        blocks, flags = [], []
        for i, (start, count) in enumerate(zip(starts, counts)):
            block = np.zeros(count * self.lanes, dtype=flat.dtype)
            part = flat[start * self.lanes : (start + count) * self.lanes]
            block[: part.size] = part
            if scales is not None:
                q, saturated = quantize.quantize(block, scales[i] or 1.0)
                block = q
                flags.append(np.where(saturated.reshape(-1, self.lanes).any(axis=1), wire.FLAG_OVERFLOW, 0))
            blocks.append(block.reshape(-1, self.lanes))
        sums, overflow = self._stream(blocks, op, flags if scales is not None else None, owners)
        for i, (start, s) in enumerate(zip(starts, sums)):
            part = out[start * self.lanes : (start * self.lanes + s.size)]
            values = s.reshape(-1)[: part.size]
            if owners is None:
                part[:] = quantize.dequantize(values, scales[i]) if scales is not None else values
                continue
            mine = np.repeat(owners[i] == self.worker, self.lanes)[: part.size]  # the rows whose sums came here
            part[mine] = quantize.dequantize(values[mine], scales[i]) if scales is not None else values[mine]
        return overflow

    def _pass_native(self, op: int, flat: np.ndarray, out: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                     scales: list[float] | None, owner_packets: int | None = None) -> list[bool]:
        n = len(self.aggregators)
        keep = dict(  # the arrays the call points into, alive until it returns
            aggregator=self._agg_ids.astype(np.int64), pool=np.array([a.pool for a in self.aggregators], np.uint32),
            next_psn=self._next_psn.astype(np.uint64), start=np.asarray(starts, np.uint64),
            count=np.asarray(counts, np.uint64), scale=np.asarray(scales if scales is not None else [1.0] * n, float),
            overflow=np.zeros(n, np.uint8),
        )
        srtt, rttvar = ctypes.c_double(self._srtt), ctypes.c_double(self._rttvar)
        last_loss = ctypes.c_double(self._last_loss)

        call = native.StreamCall(
            fd=self.socket.fd, lanes=self.lanes, job=self.job, generation=self.generation, worker=self.worker, op=op,
            owner_packets=owner_packets or 0,
            shards=n, kind=native.IN_F32 if flat.dtype == np.float32 else native.IN_I32,
            input=native.address(flat), output=native.address(out), elements=flat.size,
            rto_min=self.rto_min, max_rto=self.max_rto, timeout=self.timeout, srtt=ctypes.pointer(srtt),
            rttvar=ctypes.pointer(rttvar), last_loss=ctypes.pointer(last_loss),
            gso=int(self.socket.gso), drop=self.drop,
            rng=self._native_rng.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64)),
        )
        if self.failover is not None:
            # ctypes keeps no reference: `keep` holds the callback until the call returns
            keep["on_silence"] = native.SILENCE_CALLBACK(lambda _ctx: int(self._on_silence()))
            call.silence, call.silence_every, call.on_silence = self.failover.after, SILENCE_EVERY, keep["on_silence"]
        for name, ctype in (("aggregator", ctypes.c_int64), ("pool", ctypes.c_uint32), ("next_psn", ctypes.c_uint64),
                            ("start", ctypes.c_uint64), ("count", ctypes.c_uint64), ("scale", ctypes.c_double)):
            setattr(call, name, keep[name].ctypes.data_as(ctypes.POINTER(ctype)))
        # a faster peer's next all_gather: its GATHERs that arrive during this call are kept for it
        room = max(0, min(EARLY_NATIVE, EARLY_GATHERS - sum(len(b[1]) for b in self._early)))
        if self._early_buffer is None or self._early_buffer.dtype != wire.packet_dtype(self.lanes):
            self._early_buffer = wire.empty(EARLY_NATIVE, self.lanes)  # once per group (and lane count)
        early = self._early_buffer
        keep["early_source"], keep["early_count"] = np.zeros(room, np.int64), np.zeros(1, np.uint32)
        call.early, call.early_cap = native.address(early) if room else None, room
        call.early_source = keep["early_source"].ctypes.data_as(ctypes.POINTER(ctypes.c_int64))
        call.early_count = keep["early_count"].ctypes.data_as(ctypes.POINTER(ctypes.c_uint32))
        report = native.StreamReport(overflow=keep["overflow"].ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
        rc = native.lib().pn_stream_run(ctypes.byref(call), ctypes.byref(report))
        kept = int(keep["early_count"][0])
        if kept:
            self._early.append((early[:kept].copy(), np.full(kept, wire.packet_size(self.lanes)),
                                keep["early_source"][:kept]))
        self._srtt, self._rttvar, self.socket.gso = srtt.value, rttvar.value, bool(call.gso)
        self._last_loss = last_loss.value
        stats = self.socket.stats
        stats.packets_sent += report.packets_sent
        stats.bytes_sent += report.bytes_sent
        stats.packets_received += report.packets_received
        stats.bytes_received += report.bytes_received
        stats.retransmissions += report.retransmissions
        stats.early_retransmissions += report.early_retransmissions
        stats.foreign_results += report.foreign_results
        stats.gso_fallbacks += report.gso_fallbacks
        if rc == native.PN_ETIMEOUT:
            raise self._unreachable(report.error_shard, report.error_psn, report.error_retries)
        if rc == native.PN_ESILENT:
            raise _Silenced()
        if rc == native.PN_ESYS:
            call_name = report.error_call.decode()
            raise OSError(report.error_errno, f"{call_name}: {os.strerror(report.error_errno)}")
        native.check(rc, "native stream")
        self._next_psn[:] = keep["next_psn"]
        return [bool(v) for v in keep["overflow"]]

    def _unreachable(self, shard: int, psn: int, retries: int) -> AggregatorUnreachable:
        host, port = unpack_address(int(self._agg_ids[shard]))
        return AggregatorUnreachable(
            f"job {self.job} worker {self.worker}: no RESULT for psn {psn & 0xFFFFFFFF} "
            f"from aggregator {host}:{port} after {retries} retransmissions in "
            f"{self.timeout:g} s: the aggregator is unreachable or a peer worker stopped sending"
        )

    def _stream(
        self, blocks: list[np.ndarray], op: int, flags: list[np.ndarray] | None = None,
        owners: list[np.ndarray] | None = None,
    ) -> tuple[list[np.ndarray], list[bool]]:
        """Aggregate one (n_i, lanes) int32 block per aggregator; all shards at once.

        Returns each shard's summed rows and whether any of its RESULTs carried OVERFLOW. With
        ``owners`` (per shard, the owner of each row) the rounds are OWNER_ONLY: a row this worker does
        not own is answered by an ACK, and its sums stay zero here.
        """
        counts = np.array([len(b) for b in blocks], dtype=np.int64)
        starts = np.r_[0, np.cumsum(counts)[:-1]]
        total = int(counts.sum())
        pools = np.array([a.pool for a in self.aggregators], dtype=np.int64)
        shard = np.repeat(np.arange(len(blocks)), counts)
        offset = np.arange(total) - starts[shard]
        psn = self._next_psn[shard] + offset

        if total == 0:
            return [b.astype(np.int32) for b in blocks], [False] * len(blocks)
        packets = wire.empty(total, self.lanes)
        hdr = packets["hdr"]
        hdr["type"], hdr["op"], hdr["job"], hdr["worker"] = wire.DATA, op, self.job, self.worker
        hdr["generation"] = self.generation
        hdr["psn"] = psn & 0xFFFFFFFF
        hdr["slot"], set_ = wire.slot_and_set(psn, pools[shard])
        hdr["flags"] = np.concatenate(flags) if flags else 0
        if owners is not None:
            hdr["set"] = wire.owner_set(np.concatenate(owners), set_)
            hdr["flags"] |= wire.FLAG_OWNER_ONLY
        else:
            hdr["set"] = set_
        at = 0
        for block in blocks:  # one pass each: int32 rows into big-endian packets
            packets["payload"][at : at + len(block)] = block
            at += len(block)
        dest = self._agg_ids[shard]
        # Self-clocking: the RESULT of row i releases row i + pool of the same shard.
        successor = np.where(offset + pools[shard] < counts[shard], np.arange(total) + pools[shard], -1)

        results = np.zeros((total, self.lanes), dtype=np.int32)
        result_flags = np.zeros(total, dtype=np.uint8)
        done = np.zeros(total, dtype=bool)
        first_sent = np.zeros(total)
        last_sent = np.zeros(total)
        retries = np.zeros(total, dtype=np.int64)  # transmissions after the first
        xmit = np.zeros(total, dtype=np.int64)  # order of each packet's latest transmission (ties of time broken)
        transmissions = 0
        rack_xmit = np.zeros(len(blocks), dtype=np.int64)  # per shard: the latest-transmitted answered packet's
        rack_rtt = np.zeros(len(blocks))  # and that packet's round trip

        now = time.monotonic()
        inflight = np.concatenate([np.arange(s, s + min(p, c)) for s, p, c in zip(starts, pools, counts)])
        inflight = inflight.astype(np.int64)
        self._send(packets, dest, inflight)
        first_sent[inflight] = last_sent[inflight] = now
        xmit[inflight] = np.arange(1, inflight.size + 1)
        transmissions = inflight.size
        next_due = now  # the loop computes the first probe's time before it waits
        last_activity = np.full(len(blocks), now)  # per shard: its latest transmission or answer
        probes = np.zeros(len(blocks), dtype=np.int64)  # per shard: probes since its last answer
        remaining = total
        last_answer = now  # the latest RESULT that answered a packet (or the call's start)
        silence_check = now + (self.failover.after if self.failover is not None else 0.0)

        def resend(positions: np.ndarray, early: bool, now: float) -> None:
            """Retransmit inflight[positions]: early (RACK: a later packet was answered) or as probes."""
            nonlocal transmissions
            rows = inflight[positions]
            packets["hdr"]["flags"][rows] |= wire.FLAG_RETRANSMIT
            self._send(packets, dest, rows)
            last_sent[rows] = now
            last_activity[shard[rows]] = now
            xmit[rows] = transmissions + 1 + np.arange(rows.size)
            transmissions += rows.size
            self.socket.stats.retransmissions += rows.size
            self.socket.stats.early_retransmissions += rows.size if early else 0
            retries[rows] += 1
            if early:  # a later packet was answered: evidence of loss
                self._last_loss = now

        while remaining:
            wait = next_due - time.monotonic() if inflight.size else 0.05
            if wait > 0:
                self.socket.wait_readable(min(wait, 0.05))
            view, lengths, sources = self.socket.recv_packets()
            if self.drop and len(view):
                keep = self._drop_rng.random(len(view)) >= self.drop
                view, lengths, sources = view[keep], lengths[keep], sources[keep]
            now = time.monotonic()
            if len(view):
                self._keep_early(view, lengths, sources, self._gather_position)  # a faster peer's next all_gather
                rows, positions = self._match(view, lengths, sources, starts, counts)
                rows, first = np.unique(rows, return_index=True)
                new = ~done[rows]
                rows, got = rows[new], view[positions[first[new]]]
                if rows.size:
                    # answered right after a resend: the resend was (most likely) needed, evidence of loss
                    if ((retries[rows] > 0) & (now - last_sent[rows] <= self._probe_timeout())).any():
                        self._last_loss = now
                    results[rows] = np.where((got["hdr"]["type"] == wire.ACK)[:, None], 0, got["payload"])
                    result_flags[rows] = got["hdr"]["flags"]
                    done[rows] = True
                    remaining -= rows.size
                    last_answer = now
                    last_activity[shard[rows]] = now
                    probes[shard[rows]] = 0
                    for sh in np.unique(shard[rows]):  # RACK: the latest-sent packet known delivered
                        latest = rows[shard[rows] == sh][np.argmax(xmit[rows[shard[rows] == sh]])]
                        if xmit[latest] > rack_xmit[sh]:
                            rack_xmit[sh], rack_rtt[sh] = xmit[latest], now - last_sent[latest]
                    clean = rows[retries[rows] == 0]  # Karn: only unambiguous RTT samples
                    if clean.size:
                        self._rtt_sample(float(np.max(now - first_sent[clean])))
                    nxt = successor[rows]
                    nxt = nxt[nxt >= 0]
                    if nxt.size:
                        self._send(packets, dest, nxt)
                        first_sent[nxt] = last_sent[nxt] = now
                        xmit[nxt] = transmissions + 1 + np.arange(nxt.size)
                        transmissions += nxt.size
                    keep = ~done[inflight]
                    inflight = np.r_[inflight[keep], nxt]
            late = now - first_sent[inflight] > self.timeout
            if late.any():
                r = int(inflight[late][0])
                raise self._unreachable(int(shard[r]), int(psn[r]), int(retries[r]))
            # a packet sent later is answered and this one is overdue for that round trip: resend it now
            overdue = rack_rtt + np.maximum(rack_rtt * REORDER_FRACTION, REORDER_MIN)
            sh = shard[inflight]
            later_answered = rack_xmit[sh] > xmit[inflight]
            early = np.flatnonzero(later_answered & (now >= last_sent[inflight] + overdue[sh]))
            if early.size:
                resend(early, True, now)
            # probe: a shard silent for a while resends the packet out the longest (its round holds every
            # worker's window: when a RACK resend of it was lost too, nothing later can be answered) and its
            # latest-sent one, whose answer lets RACK judge the ones before it; a peer that is only slow makes
            # a shard silent too, so each unanswered probe doubles the wait
            pto = self._probe_waits(probes, now)
            probe_rows = []
            for sh_i in np.unique(sh):
                if now >= last_activity[sh_i] + pto[sh_i]:
                    mine = np.flatnonzero(sh == sh_i)
                    oldest, latest = mine[np.argmin(inflight[mine])], mine[np.argmax(xmit[inflight[mine]])]
                    probe_rows += [oldest, latest] if oldest != latest else [latest]
                    probes[sh_i] += 1
            if probe_rows:
                resend(np.array(probe_rows), False, now)
            if self.failover is not None and remaining:
                silence_check = self._ask_when_silent(now, last_answer, silence_check)
            if inflight.size:  # wake for the earliest RACK deadline or probe
                live = np.unique(sh)
                pto = self._probe_waits(probes, now)
                next_due = float(np.min(last_activity[live] + pto[live]))  # after this round's probes
                rack_due = last_sent[inflight] + overdue[sh]
                if later_answered.any():
                    next_due = min(next_due, float(rack_due[later_answered].min()))
                if self.failover is not None:
                    next_due = min(next_due, silence_check)

        self._next_psn = self._next_psn + counts
        out = [results[s : s + c] for s, c in zip(starts, counts)]
        flagged = (result_flags & wire.FLAG_OVERFLOW) != 0
        if op == wire.SUM and owners is None:
            # A lane at an int32 bound is a saturated sum: the Tofino program saturates
            # without flagging it (docs/tofino.md), so the host counts it as overflow on
            # every target (an exact sum of -2^31 or 2^31-1 is taken for one too). Not in an
            # OWNER_ONLY pass: only the owner sees the sums, and every worker must agree on
            # an overflow (to redo the call alike), so there the flag alone tells.
            flagged |= ((results == INT32_MAX) | (results == INT32_MIN)).any(axis=1)
        overflow = [bool(flagged[s : s + c].any()) for s, c in zip(starts, counts)]
        return out, overflow

    def _gather(self, piece: np.ndarray, sizes: list[int], out: np.ndarray, offsets: np.ndarray) -> None:
        """The all_gather stream (docs/protocol.md, All-gather). Worker w's piece is its GATHER positions
        G .. G + counts[w] - 1 (G: this call's start, the same at every worker). A worker sends its own
        packets at most a window (its first aggregator's pool) ahead of what it holds from the slowest
        peer (all send at one pace, so a full receiver stops them all); sends its missing runs' NACKs
        after a silence (the probe rule of the reduce stream); answers the NACKs it gets by sending
        again; and, holding every piece, contributes its completion round (one DATA, lane 0 = 1), whose
        RESULT ends the call for every worker at once."""
        row_bytes = 4 * self.lanes
        counts = np.array([-(-v // row_bytes) for v in sizes], dtype=np.int64)  # packets of each piece
        start = self._gather_position
        me, aggregator = self.worker, self._agg_ids[:1]  # GATHERs travel through the first aggregator
        window = self.aggregators[0].pool
        # my packets: the piece as raw bytes, zero-padded to whole packets
        mine = int(counts[me])
        packets = wire.empty(mine, self.lanes)
        hdr = packets["hdr"]
        hdr["type"], hdr["job"], hdr["worker"], hdr["generation"] = wire.GATHER, self.job, me, self.generation
        hdr["set"] = wire.owner_set(me, 0)
        hdr["psn"] = (start + np.arange(mine)) & 0xFFFFFFFF
        body = np.zeros(mine * row_bytes, np.uint8)
        body[: piece.size] = piece
        rows_of_bytes = packets.view(np.uint8).reshape(mine, wire.packet_size(self.lanes))
        rows_of_bytes[:, wire.HEADER_SIZE :] = body.reshape(mine, row_bytes)
        dest = np.broadcast_to(aggregator, (mine,))
        # what arrives: each origin's packets in a staging area of whole rows (origin o from row base[o])
        base = np.r_[0, np.cumsum(counts)[:-1]]
        staged = np.zeros((int(counts.sum()), row_bytes), np.uint8)
        have = np.zeros(int(counts.sum()), dtype=bool)
        have[base[me] : base[me] + mine] = True
        lacking = int(counts.sum()) - mine
        # the completion round: one DATA on the first aggregator's reduce stream
        position = int(self._next_psn[0])
        slot, set_ = wire.slot_and_set(position, self.aggregators[0].pool)
        completion = wire.encode(type=wire.DATA, job=self.job, worker=me, psn=position, slot=int(slot), set=int(set_),
                                 generation=self.generation, lanes=self.lanes,
                                 payload=np.r_[1, np.zeros(self.lanes - 1, np.int64)])
        completion_sent = False

        sent = 0  # my packets sent once: a prefix
        resent_at = np.full(mine, -np.inf)  # when each was last sent again for a NACK
        now = time.monotonic()
        last_activity = last_progress = now
        silence_check = now + (self.failover.after if self.failover is not None else 0.0)
        probes = 0

        prefixes = np.zeros(self.workers, dtype=np.int64)  # per origin: how many of its packets, from its first,
        prefixes[me] = mine  # this worker holds

        def hold(view: np.ndarray, lengths: np.ndarray, sources: np.ndarray) -> int:
            """Take this call's GATHERs from the others into ``staged``; how many were new."""
            h = view["hdr"]
            ours = ((h["job"] == self.job) & (h["generation"] == self.generation) & (h["worker"] == me)
                    & (sources[:, None] == self._agg_ids[None, :]).any(axis=1))
            origin = wire.owner_of(h["set"])
            offset = (h["psn"].astype(np.int64) - start) & 0xFFFFFFFF
            valid_origin = origin < self.workers
            piece_count = counts[np.where(valid_origin, origin, 0)]
            current = (ours & wire.well_formed(view, lengths, self.lanes, wire.GATHER) & valid_origin
                       & (origin != me) & (offset < piece_count))
            rows = base[origin[current]] + offset[current]
            fresh, first = np.unique(rows[~have[rows]], return_index=True)
            if fresh.size:
                payload = view.view(np.uint8).reshape(len(view), -1)[:, wire.HEADER_SIZE :]
                staged[fresh] = payload[np.flatnonzero(current)[~have[rows]][first]]
                have[fresh] = True
            return int(fresh.size)

        early, self._early = self._early, []
        if early:  # first what arrived before this call began
            # bytes, not np.concatenate of the packets: numpy would make their fields native-endian
            lacking -= hold(np.concatenate([b[0].view(np.uint8) for b in early]).view(wire.packet_dtype(self.lanes)),
                            np.concatenate([b[1] for b in early]), np.concatenate([b[2] for b in early]))

        def send_ahead(now: float) -> None:
            nonlocal sent
            for o in range(self.workers):
                while prefixes[o] < counts[o]:  # advance past what arrived, a bounded look at a time
                    got = have[base[o] + prefixes[o] : base[o] + min(counts[o], prefixes[o] + 4 * window)]
                    prefixes[o] += got.size if got.all() else int(np.argmin(got))
                    if not got.all():
                        break
            behind = prefixes[prefixes < counts]
            limit = min(mine, (int(behind.min()) if behind.size else mine) + window)
            if limit > sent:
                self._send(packets, dest, np.arange(sent, limit))
                sent = limit

        if self.native:  # the loop below, in C
            self._gather_native(start, counts, packets, staged, have, completion, window)
        else:
            send_ahead(now)
        while not self.native:
            pto = self._probe_waits(np.array([probes]), now)[0]
            due = min(last_activity + pto, silence_check) if self.failover is not None else last_activity + pto
            self.socket.wait_readable(max(0.0, min(due - time.monotonic(), 0.05)))
            view, lengths, sources = self.socket.recv_packets()
            if self.drop and len(view):
                keep = self._drop_rng.random(len(view)) >= self.drop
                view, lengths, sources = view[keep], lengths[keep], sources[keep]
            now = time.monotonic()
            progress = False
            if len(view):
                fresh = hold(view, lengths, sources)
                if fresh:
                    lacking -= fresh
                    progress = True
                h = view["hdr"]
                ours = ((h["job"] == self.job) & (h["generation"] == self.generation) & (h["worker"] == me)
                        & (sources[:, None] == self._agg_ids[None, :]).any(axis=1))
                origin = wire.owner_of(h["set"])
                offset = (h["psn"].astype(np.int64) - start) & 0xFFFFFFFF
                # the next call's, from a peer already in it: kept for that call
                self._keep_early(view, lengths, sources, start + int(counts.max()))
                nacks = ours & wire.well_formed(view, lengths, self.lanes, wire.NACK) & (origin == me)
                for first_row, count in zip(offset[nacks].tolist(), h["slot"][nacks].tolist()):
                    asked = np.arange(first_row, min(first_row + count, sent))  # a NACK of what the window
                    asked = asked[now - resent_at[asked] > self._probe_timeout() / 2]  # will send is moot
                    if asked.size:  # several receivers may ask for one loss: sent again once per half probe
                        packets["hdr"]["flags"][asked] |= wire.FLAG_RETRANSMIT
                        self._send(packets, dest, asked)
                        resent_at[asked] = now
                        self.socket.stats.retransmissions += asked.size
                results = (ours & wire.well_formed(view, lengths, self.lanes, wire.RESULT)
                           & (h["psn"] == position & 0xFFFFFFFF) & (sources == aggregator[0]))
                if completion_sent and results.any():
                    if int(view["payload"][np.flatnonzero(results)[0], 0]) != self.workers:
                        raise PassingError(f"job {self.job}: the all_gather's completion round summed "
                                           f"{int(view['payload'][np.flatnonzero(results)[0], 0])}, not "
                                           f"{self.workers}: the workers are out of step")
                    break
            if progress:
                last_activity = last_progress = now
                probes = 0
                send_ahead(now)
            if lacking == 0 and not completion_sent:
                self._send(completion, aggregator, np.array([0]))
                completion_sent = True
                last_activity = last_progress = now
                probes = 0
            if now - last_progress > self.timeout:
                host, port = unpack_address(int(aggregator[0]))
                raise AggregatorUnreachable(
                    f"job {self.job} worker {self.worker}: all_gather made no progress through {host}:{port} in "
                    f"{self.timeout:g} s ({lacking} packets lacking): the aggregator is unreachable or a peer "
                    "stopped")
            if self.failover is not None:
                silence_check = self._ask_when_silent(now, last_progress, silence_check)
            if now >= last_activity + self._probe_waits(np.array([probes]), now)[0]:
                if completion_sent:  # its RESULT is lost, or a peer still lacks something
                    completion["hdr"]["flags"] |= wire.FLAG_RETRANSMIT
                    self._send(completion, aggregator, np.array([0]))
                    self.socket.stats.retransmissions += 1
                else:
                    self._nack_missing(have, base, counts, start, window)
                probes += 1
                last_activity = now
        self._gather_position = start + int(counts.max())
        self._next_psn[0] += 1
        for o in range(self.workers):
            if o != me:
                out[offsets[o] : offsets[o + 1]] = staged[base[o] : base[o] + counts[o]].reshape(-1)[: sizes[o]]

    def _gather_native(self, start: int, counts: np.ndarray, packets: np.ndarray, staged: np.ndarray,
                       have: np.ndarray, completion: np.ndarray, window: int) -> None:
        """``_gather``'s loop in C (host/csrc/stream.c, pn_gather_run): the same packets, the same rules."""
        room = max(0, min(EARLY_NATIVE, EARLY_GATHERS - sum(len(b[1]) for b in self._early)))
        if self._early_buffer is None or self._early_buffer.dtype != wire.packet_dtype(self.lanes):
            self._early_buffer = wire.empty(EARLY_NATIVE, self.lanes)
        keep = dict(counts=counts.astype(np.uint64), have=have.view(np.uint8), early_source=np.zeros(room, np.int64),
                    early_count=np.zeros(1, np.uint32))
        srtt, rttvar, last_loss = (ctypes.c_double(v) for v in (self._srtt, self._rttvar, self._last_loss))
        call = native.GatherCall(
            fd=self.socket.fd, lanes=self.lanes, job=self.job, generation=self.generation, worker=self.worker,
            workers=self.workers, aggregator=int(self._agg_ids[0]), window=window, start=start,
            counts=keep["counts"].ctypes.data_as(ctypes.POINTER(ctypes.c_uint64)),
            packets=native.address(packets) if len(packets) else None, staged=native.address(staged),
            have=native.address(keep["have"]), completion=native.address(completion),
            rto_min=self.rto_min, max_rto=self.max_rto, timeout=self.timeout, srtt=ctypes.pointer(srtt),
            rttvar=ctypes.pointer(rttvar), last_loss=ctypes.pointer(last_loss), gso=int(self.socket.gso),
            drop=self.drop, rng=self._native_rng.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64)),
            early=native.address(self._early_buffer) if room else None,
            early_source=keep["early_source"].ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), early_cap=room,
            early_count=keep["early_count"].ctypes.data_as(ctypes.POINTER(ctypes.c_uint32)),
        )
        if self.failover is not None:  # ctypes keeps no reference: `keep` holds the callback until the call returns
            keep["on_silence"] = native.SILENCE_CALLBACK(lambda _ctx: int(self._on_silence()))
            call.silence, call.silence_every, call.on_silence = self.failover.after, SILENCE_EVERY, keep["on_silence"]
        report = native.StreamReport(overflow=ctypes.cast(None, ctypes.POINTER(ctypes.c_uint8)))
        rc = native.lib().pn_gather_run(ctypes.byref(call), ctypes.byref(report))
        self.socket.gso = bool(call.gso)
        stats = self.socket.stats
        for name in ("packets_sent", "bytes_sent", "packets_received", "bytes_received", "retransmissions",
                     "gso_fallbacks"):
            setattr(stats, name, getattr(stats, name) + getattr(report, name))
        kept = int(keep["early_count"][0])
        if kept:
            self._early.append((self._early_buffer[:kept].copy(), np.full(kept, wire.packet_size(self.lanes)),
                                keep["early_source"][:kept].copy()))
        if rc == native.PN_ETIMEOUT:
            host, port = unpack_address(int(self._agg_ids[0]))
            raise AggregatorUnreachable(
                f"job {self.job} worker {self.worker}: all_gather made no progress through {host}:{port} in "
                f"{self.timeout:g} s: the aggregator is unreachable or a peer stopped")
        if rc == native.PN_ESILENT:
            raise _Silenced()
        if rc == native.PN_ESYS:
            raise OSError(report.error_errno, f"{report.error_call.decode()}: {os.strerror(report.error_errno)}")
        native.check(rc, "native all_gather")
        if call.completion_sum != self.workers:
            raise PassingError(f"job {self.job}: the all_gather's completion round summed {call.completion_sum}, "
                               f"not {self.workers}: the workers are out of step")

    def _nack_missing(self, have: np.ndarray, base: np.ndarray, counts: np.ndarray, start: int, window: int) -> None:
        """One NACK per origin: its first missing run, up to ``window`` packets (a peer that is only
        late is asked for no more than that)."""
        nacks = []
        for o in range(self.workers):
            got = have[base[o] : base[o] + counts[o]]
            if got.all():
                continue
            first = int(np.argmin(got))
            run = got[first : first + window]
            length = int(np.argmax(run)) if run.any() else run.size
            nacks.append((o, first, min(length, 0xFFFF)))
        if not nacks:
            return
        batch = wire.empty(len(nacks), self.lanes)
        h = batch["hdr"]
        h["type"], h["job"], h["worker"], h["generation"] = wire.NACK, self.job, self.worker, self.generation
        h["set"] = wire.owner_set(np.array([o for o, _, _ in nacks]), 0)
        h["psn"] = (start + np.array([f for _, f, _ in nacks])) & 0xFFFFFFFF
        h["slot"] = [n for _, _, n in nacks]
        self._send(batch, np.broadcast_to(self._agg_ids[:1], (len(nacks),)), np.arange(len(nacks)))

    def _keep_early(self, view: np.ndarray, lengths: np.ndarray, sources: np.ndarray, next_start: int) -> None:
        """Keep this group's GATHER packets of the all_gather that starts at position ``next_start`` or
        later, which this worker has not begun (a faster peer's), for that call (up to EARLY_GATHERS)."""
        h = view["hdr"]
        mask = (wire.well_formed(view, lengths, self.lanes, wire.GATHER) & (h["job"] == self.job)
                & (h["generation"] == self.generation) & (h["worker"] == self.worker)
                & ((h["psn"].astype(np.int64) - next_start) & 0xFFFFFFFF < 1 << 31))
        if mask.any() and sum(len(b[1]) for b in self._early) < EARLY_GATHERS:
            self._early.append((view[mask].copy(), lengths[mask].copy(), sources[mask].copy()))

    def _send(self, packets: np.ndarray, dest: np.ndarray, rows: np.ndarray) -> None:
        if self.drop:
            rows = rows[self._drop_rng.random(rows.size) >= self.drop]
        self.socket.send_batch(packets, dest[rows], rows)

    def _match(self, view, lengths, sources, starts, counts) -> tuple[np.ndarray, np.ndarray]:
        """(row, position in view) of each received RESULT that belongs to this call."""
        hdr = view["hdr"]
        valid = wire.well_formed(view, lengths, self.lanes, wire.RESULT) | wire.well_formed_ack(view, lengths)
        ours = (hdr["job"] == self.job) & (hdr["generation"] == self.generation)
        self.socket.stats.foreign_results += int((valid & ~ours).sum())  # another allocation's: never ours
        valid &= ours & (hdr["worker"] == self.worker)
        which = sources[:, None] == self._agg_ids[None, :]
        valid &= which.any(axis=1)
        s = which.argmax(axis=1)
        offset = (hdr["psn"].astype(np.int64) - self._next_psn[s]) & 0xFFFFFFFF
        valid &= offset < counts[s]
        positions = np.flatnonzero(valid)
        return (starts[s] + offset)[positions], positions

    def _rtt_sample(self, rtt: float) -> None:
        """The sample is the slowest clean RESULT of a receive batch."""
        self._srtt, self._rttvar = _smooth(self._srtt, self._rttvar, rtt)

    def _probe_timeout(self) -> float:
        """Two smoothed round trips (RFC 8985's PTO; ``rto`` before one is measured), 1 ms at least."""
        return max(self.rto_min if self._srtt < 0 else 2.0 * self._srtt, PROBE_MIN)

    def _probe_waits(self, probes: np.ndarray, now: float) -> np.ndarray:
        """Per shard, the silence before its next probe: a probe's wait where the path has shown loss in
        the last LOSS_MEMORY s, else ``rto`` at least (a late peer, not a loss); each unanswered probe
        doubles it, up to ``max_rto``."""
        wait = self._probe_timeout()
        if self._last_loss < 0 or now - self._last_loss > LOSS_MEMORY:
            wait = max(wait, self.rto_min)
        return np.minimum(wait * 2.0 ** np.minimum(probes, MAX_PROBE_DOUBLINGS), max(wait, self.max_rto))


def _smooth(srtt: float, rttvar: float, sample: float) -> tuple[float, float]:
    """RFC 6298 smoothing of the round-trip estimate; the first sample (srtt < 0: none yet) sets it."""
    if srtt < 0:
        return sample, sample / 2
    return 0.875 * srtt + 0.125 * sample, 0.75 * rttvar + 0.25 * abs(srtt - sample)


def _apply_nonfinite(out: np.ndarray, classes: np.ndarray) -> None:
    """IEEE float32 sums where non-finite values met (gloo's answers): NaN where some worker had NaN
    or where +inf and -inf met, +inf or -inf where only infinities of one sign met finite values."""
    mask = (1 << NONFINITE_SHIFT) - 1
    nan, pos, neg = classes & mask, (classes >> NONFINITE_SHIFT) & mask, (classes >> 2 * NONFINITE_SHIFT) & mask
    out[pos > 0] = np.inf
    out[neg > 0] = -np.inf
    out[(nan > 0) | ((pos > 0) & (neg > 0))] = np.nan
