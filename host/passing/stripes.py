"""More than one core per rank: a group's reduce passes striped over several streams (``Group(streams=k)``).

Stream 0 is the group's own; streams 1..k-1 are each a job of their own at the same aggregators (their own slot
range there, their own psn space), with a socket of their own, and run on a thread of their own: the C loop of
each (passing.native_stream, pn_stream_run) releases the GIL, so k streams use up to k cores. Every pass splits
each shard's packets into k contiguous parts, the same way at every worker, stream s carrying part s; each part
is quantized with its shard's scale (the MAX round goes through stream 0 alone), so every element is summed as
it would be on one stream: the results are bit-identical to ``streams=1``. all_gather stays on stream 0.

How many: one core moves ``per_core_gbit`` of payload each way (docs/benchmarks.md, section 8 of
bench/core.py: measured per lane count); a rank whose share of the server's link is ``link_gbit`` needs
``default_streams(link_gbit, lanes)`` of them.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from . import native_stream
from .recovery import LossRecovery
from .stream_state import StreamState
from .transport import BatchSocket, TransportStats

# payload Gbit/s each way per core of the native host engine over the UDP sockets on veth, by lane count: the
# medians of four runs of bench/core.py's section 8 on its development machine (docs/benchmarks.md, "The host
# stage per core"; 144 lanes: two runs)
MEASURED_PER_CORE_GBIT = {64: 7.0, 72: 6.7, 144: 8.5, 364: 9.3}


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


def open_stripes(state: StreamState, recovery: LossRecovery, streams: int, jobs: Sequence[int] | None,
                 bind: tuple[str, int], io: str, offload: bool) -> list[Stripe]:
    """Streams 1..streams-1 of a group whose stream 0 is ``state``: job ``jobs[s - 1]`` (default the group's
    job + s), a socket at bind's host and port + s (port 0: any), the same aggregators and generation."""
    if jobs is not None and len(jobs) != streams - 1:
        raise ValueError(f"stream_jobs names {len(jobs)} jobs for {streams - 1} extra streams")
    out: list[Stripe] = []
    try:
        for s in range(1, streams):
            job = jobs[s - 1] if jobs is not None else state.job + s
            if not 0 <= job < 1 << 16:
                raise ValueError(f"stream {s}'s job {job} outside 0..65535")
            sock = BatchSocket((bind[0], bind[1] + s if bind[1] else 0), lanes=state.lanes, offload=offload)
            try:
                sock.open_io(io, True)
            except BaseException:
                sock.close()
                raise
            sub = StreamState(job, state.worker, state.workers, state.generation, state.lanes, state.aggregators,
                              sock, state.drop, np.random.default_rng(state.drop_rng.integers(1 << 62)),
                              state.native_rng.copy() + np.uint64(s))
            # a leaf's group: the whole job's servers and this one's number there, as its first stream's
            sub.servers, sub.number, sub.order = state.servers, state.number, state.order
            sub.owner_only = state.owner_only
            out.append(Stripe(sub, LossRecovery(recovery.rto_min, recovery.max_rto, recovery.timeout)))
    except BaseException:
        close_stripes(out)
        raise
    return out


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


def striped_pass(state: StreamState, recovery: LossRecovery, stripes: list[Stripe], op: int, flat: np.ndarray,
                 out: np.ndarray, starts: np.ndarray, counts: np.ndarray, scales: list[float] | None,
                 owner_packets: int | None) -> list[bool]:
    """One reduce pass (passing.reduce_path's) over stream 0 and the stripes at once: shard i's packets
    [starts[i], starts[i] + counts[i]) cut into contiguous parts, part s on stream s, each on its thread."""
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
        try:  # the failover watch is stream 0's (a move of a striped group is not supported: Group refuses it)
            results[s] = native_stream.reduce_pass(sub_state, sub_recovery, None, op, flat, out, part_starts[s],
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
    if errors:
        raise errors[0]
    return [any(r[i] for r in results if r is not None) for i in range(len(counts))]
