"""More than one core per rank: a group's reduce passes striped over several streams (``Group(streams=k)``).

Stream 0 is the group's own; streams 1..k-1 are each a job of their own at the same aggregators (their own slot
range there, their own psn space), with a socket of their own, and run on a thread of their own: the C loop of
each (passing.native_stream, pn_stream_run) releases the GIL, so k streams use up to k cores. Every pass splits
each shard's packets into k contiguous parts, the same way at every worker, stream s carrying part s; each part
is quantized with its shard's scale (the MAX round goes through stream 0 alone), so every element is summed as
it would be on one stream: the results are bit-identical to ``streams=1``. all_gather stays on stream 0.

Through a controller (docs/control.md, join's ``streams``) stream s is a job of its own that the controller
admits from each worker's ``udp_port`` + s (``bind_streams`` finds such ports), and the group moves as a whole:
every stream watches for silence and moves to the new allocation's jobs (``move_stripes``).

How many: one core moves ``per_core_gbit`` of payload each way (docs/benchmarks.md, section 8 of
bench/core.py: measured per lane count); a rank whose share of the server's link is ``link_gbit`` needs
``default_streams(link_gbit, lanes)`` of them.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import native_stream, wire
from .errors import PassingError, Silenced
from .recovery import LossRecovery, SilenceWatch
from .stream_state import StreamState
from .transport import BatchSocket, TransportStats

# payload Gbit/s each way per core of the native host engine over the UDP sockets on veth, by lane count, on its
# development machine after the per-packet cut (docs/benchmarks.md, "The host stage per core: the per-packet cost
# cut"): 64 and 72 lanes the medians of four alternated rounds (bench/core_percore_ab.py), 144 and 364 one run of
# bench/core.py's section 8
MEASURED_PER_CORE_GBIT = {64: 10.5, 72: 11.2, 144: 14.3, 364: 11.4}


@dataclass
class Stripe:
    """One extra stream of a group: its state (job, socket, psn streams) and its loss-recovery estimates."""

    state: StreamState
    recovery: LossRecovery


def per_core_gbit(lanes: int) -> float:
    """The measured per-core rate at the nearest lane count measured."""
    nearest = min(MEASURED_PER_CORE_GBIT, key=lambda measured: abs(measured - lanes))
    return MEASURED_PER_CORE_GBIT[nearest]


def default_streams(link_gbit: float, lanes: int, per_core: float | None = None, most: int = 16) -> int:
    """Streams a rank needs to move ``link_gbit`` of payload each way at ``lanes`` lanes: its link share over
    one core's rate (``per_core``, default the measured one), at least 1, at most ``most``."""
    if link_gbit <= 0:
        raise ValueError(f"link_gbit must be positive, got {link_gbit}")
    rate = per_core if per_core is not None else per_core_gbit(lanes)
    return max(1, min(most, math.ceil(link_gbit / rate)))


def stream_job(jobs: Sequence[int | Sequence[int]], s: int, generation: int) -> tuple[int, int]:
    """Stream s's (job id, generation) from ``stream_jobs``: a job id (the group's generation), or a pair (a
    controller's answer gives each stream its own generation)."""
    entry = jobs[s - 1]
    job, gen = (entry, generation) if isinstance(entry, (int, np.integer)) else (int(entry[0]), int(entry[1]))
    if not 0 <= job < 1 << 16:
        raise ValueError(f"stream {s}'s job {job} outside 0..65535")
    if not 0 <= gen < wire.GENERATIONS:
        raise ValueError(f"stream {s}'s generation {gen} outside 0..{wire.GENERATIONS - 1}")
    return int(job), int(gen)


def answer_options(answer: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """``Group.from_answer``'s options with the streams a controller's join answer admitted (``streams``, and
    ``stream_jobs``: each extra stream's job id and generation); a caller's ``streams`` must agree."""
    streams = int(answer.get("streams", 1))
    if options.get("streams", streams) != streams:
        raise ValueError(f"streams={options['streams']}, but the controller admitted {streams} for this group")
    if streams == 1:
        return options
    return {**options, "streams": streams, "stream_jobs": [(int(j), int(g)) for j, g in answer["stream_jobs"]]}


def bind_streams(host: str, streams: int, lanes: int = wire.DEFAULT_LANES, tries: int = 64) -> list[BatchSocket]:
    """Sockets at ``streams`` consecutive UDP ports of ``host`` (stream s at the first one's port + s, as a
    controller admits them): the first at a port the kernel picks, the others after it; where one of those is
    taken, again elsewhere (OSError after ``tries`` attempts)."""
    last: OSError | None = None
    for _ in range(tries):
        socks = [BatchSocket((host, 0), lanes=lanes)]
        try:
            port = socks[0].address[1]
            if port + streams - 1 > 65535:
                raise OSError(f"port {port} + {streams - 1} is past 65535")
            for s in range(1, streams):
                socks.append(BatchSocket((host, port + s), lanes=lanes))
            return socks
        except OSError as e:
            last = e
            for sock in socks:
                sock.close()
    raise OSError(f"no {streams} consecutive free UDP ports at {host} in {tries} tries: {last}")


def sized(sockets: list[BatchSocket], lanes: int) -> list[BatchSocket]:
    """``sockets`` for packets of ``lanes`` (an answer's): each one of another size closed and bound again at its
    port (stream s at the port the controller admitted it from)."""
    out: list[BatchSocket] = []
    try:
        for sock in sockets:
            if sock.dtype != wire.packet_dtype(lanes):
                address = sock.address
                sock.close()
                sock = BatchSocket(address, lanes=lanes)
            out.append(sock)
    except BaseException:  # none is left open: the caller closes ``sockets`` only
        for sock in out:
            sock.close()
        raise
    return out


def open_stripes(state: StreamState, recovery: LossRecovery, streams: int,
                 jobs: Sequence[int | Sequence[int]] | None, bind: tuple[str, int], io: str, offload: bool,
                 sockets: Sequence[BatchSocket] | None = None, native: bool = True) -> list[Stripe]:
    """Streams 1..streams-1 of a group whose stream 0 is ``state``: job ``jobs[s - 1]`` (default the group's
    job + s; a (job, generation) pair, or the group's generation), a socket at bind's host and port + s (port
    0: any) or ``sockets[s - 1]`` (which the stripes then own, closed on an error too), the same aggregators.
    Several streams need the native engine (``native``)."""
    out: list[Stripe] = []
    try:
        if not 1 <= streams <= 64 or not native:
            raise ValueError(f"streams={streams}: 1..64, several only on the native engine")
        if jobs is not None and len(jobs) != streams - 1:
            raise ValueError(f"stream_jobs names {len(jobs)} jobs for {streams - 1} extra streams")
        if sockets is not None and len(sockets) != streams - 1:
            raise ValueError(f"stream_sockets gives {len(sockets)} sockets for {streams - 1} extra streams")
        for s in range(1, streams):
            job, generation = stream_job(jobs, s, state.generation) if jobs is not None else (state.job + s,
                                                                                             state.generation)
            if not 0 <= job < 1 << 16:
                raise ValueError(f"stream {s}'s job {job} outside 0..65535")
            if sockets is not None:
                sock = sockets[s - 1]
                if sock.dtype != wire.packet_dtype(state.lanes):
                    raise ValueError(f"stream {s}'s socket was made for other than {state.lanes} lanes")
            else:
                sock = BatchSocket((bind[0], bind[1] + s if bind[1] else 0), lanes=state.lanes, offload=offload)
            try:
                sock.open_io(io, True)
            except BaseException:
                sock.close()
                raise
            sub = StreamState(job, state.worker, state.workers, generation, state.lanes, state.aggregators,
                              sock, state.drop, np.random.default_rng(state.drop_rng.integers(1 << 62)),
                              state.native_rng.copy() + np.uint64(s))
            # a leaf's group: the whole job's servers and this one's number there, as its first stream's
            sub.servers, sub.number, sub.order = state.servers, state.number, state.order
            sub.owner_only = state.owner_only
            out.append(Stripe(sub, LossRecovery(recovery.rto_min, recovery.max_rto, recovery.timeout)))
    except BaseException:
        close_stripes(out)
        for sock in sockets or ():  # given to the stripes: theirs to close, the unused ones too
            sock.close()
        raise
    return out


def move_streams(state: StreamState, answer: dict[str, Any], order: np.ndarray | None) -> None:
    """A move of a group (docs/control.md, Failover; ``order``: passing.numbering.check_move's): every stream goes
    to the new allocation, stream 0 (``state``) to the answer's job id, stream s to its ``stream_jobs[s - 1]``
    (a job id and generation each), at the answer's aggregators."""
    stripes: list[Stripe] = state.stripes
    jobs = answer.get("stream_jobs") or []
    if len(jobs) != len(stripes):
        raise PassingError(f"the controller moved a group of {1 + len(stripes)} streams to an allocation of "
                           f"{1 + len(jobs)}")
    state.move_to(answer, order)
    for s, stripe in enumerate(stripes, 1):
        job, generation = stream_job(jobs, s, int(answer["generation"]))
        stripe.state.move_to({**answer, "job_id": job, "generation": generation}, order)


def close_stripes(stripes: list[Stripe]) -> None:
    for stripe in stripes:
        stripe.state.socket.close()


def total_stats(first: TransportStats, stripes: list[Stripe]) -> TransportStats:
    """The counters of every stream of a group, added up."""
    total = TransportStats(**first.as_dict())
    for stripe in stripes:
        for key, value in stripe.state.socket.stats.as_dict().items():
            setattr(total, key, getattr(total, key) + value)
    return total


def striped_pass(state: StreamState, recovery: LossRecovery, silence: SilenceWatch | None, stripes: list[Stripe],
                 op: int, flat: np.ndarray, out: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                 scales: list[float] | None, owner_packets: int | None) -> list[bool]:
    """One reduce pass (passing.reduce_path's) over stream 0 and the stripes at once: shard i's packets
    [starts[i], starts[i] + counts[i]) cut into contiguous parts, part s on stream s, each on its thread.
    ``silence``: failover's watch, every stream's (they share one aggregator: the stream that finds it silent
    asks the controller, and each of the others gets the same decision once silent too)."""
    k = 1 + len(stripes)
    counts = np.asarray(counts, np.int64)
    cuts = [np.linspace(0, c, k + 1).astype(np.int64) for c in counts]  # per shard, the parts' bounds
    part_starts = [np.array([starts[i] + cuts[i][s] for i in range(len(counts))], np.int64) for s in range(k)]
    part_counts = [np.array([cuts[i][s + 1] - cuts[i][s] for i in range(len(counts))], np.int64)
                   for s in range(k)]
    results: list[list[bool] | None] = [None] * k
    errors: list[BaseException] = []

    def run(s: int) -> None:
        sub_state, sub_recovery = (state, recovery) if s == 0 else (stripes[s - 1].state, stripes[s - 1].recovery)
        try:
            results[s] = native_stream.reduce_pass(sub_state, sub_recovery, silence, op, flat, out, part_starts[s],
                                                   part_counts[s], scales, owner_packets)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,), name=f"passing-stream-{s}", daemon=True)
               for s in range(1, k)]
    for t in threads:
        t.start()
    run(0)
    for t in threads:
        t.join()
    if errors:  # a move's Silenced first: the call is redone on the new allocation, whatever else failed
        raise next((e for e in errors if isinstance(e, Silenced)), errors[0])
    return [any(r[i] for r in results if r is not None) for i in range(len(counts))]
