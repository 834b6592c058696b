"""The C engine's calls (host/csrc/stream.c and gather.c, through passing.native): a reduce pass (pn_stream_run)
and an all_gather (pn_gather_run) marshalled from a group's state through ctypes, and what they report taken
back into it. Their numpy twins, the specifications the C loops are tested against, are
passing.reduce_stream.ReduceStream and passing.gather_stream.GatherStream."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from . import native
from .errors import AggregatorUnreachable, Silenced
from .recovery import SILENCE_EVERY, LossRecovery, SilenceWatch
from .stream_state import StreamState

# the report's counters that add up into the socket's TransportStats
REPORTED = ("packets_sent", "bytes_sent", "packets_received", "bytes_received", "retransmissions",
            "early_retransmissions", "foreign_results", "gso_fallbacks")


def reduce_pass(state: StreamState, recovery: LossRecovery, silence: SilenceWatch | None, op: int,
                flat: np.ndarray, out: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                scales: list[float] | None, owner_packets: int | None = None) -> list[bool]:
    """passing.reduce_path.ReducePath's pass in C: packets [start, start + count) of ``flat`` per shard in
    (quantized with its scale: float32), their sums straight into ``out``. Returns per shard whether a
    RESULT overflowed."""
    n = len(state.aggregators)
    keep: dict[str, Any] = dict(  # the arrays the call points into, alive until it returns
        aggregator=state.aggregator_ids.astype(np.int64),
        pool=np.array([a.pool for a in state.aggregators], np.uint32), next_psn=state.next_psn.astype(np.uint64),
        start=np.asarray(starts, np.uint64), count=np.asarray(counts, np.uint64),
        scale=np.asarray(scales if scales is not None else [1.0] * n, float), overflow=np.zeros(n, np.uint8),
    )
    call = native.StreamCall(
        op=op, owner_packets=owner_packets or 0, shards=n,
        kind=native.IN_F32 if flat.dtype == np.float32 else native.IN_I32,
        input=native.address(flat), output=native.address(out), elements=flat.size,
    )
    for name, ctype in (("aggregator", ctypes.c_int64), ("pool", ctypes.c_uint32), ("next_psn", ctypes.c_uint64),
                        ("start", ctypes.c_uint64), ("count", ctypes.c_uint64), ("scale", ctypes.c_double)):
        setattr(call, name, keep[name].ctypes.data_as(ctypes.POINTER(ctype)))
    report = native.StreamReport(overflow=keep["overflow"].ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
    _run(native.lib().pn_stream_run, call, report, state, recovery, silence, keep, "native stream",
         lambda: state.no_result(report.error_shard, report.error_psn, report.error_retries, recovery.timeout))
    state.next_psn[:] = keep["next_psn"]
    return [bool(v) for v in keep["overflow"]]


def gather(state: StreamState, recovery: LossRecovery, silence: SilenceWatch | None, start: int,
           counts: np.ndarray, packets: np.ndarray, staged: np.ndarray, have: np.ndarray, completion: np.ndarray,
           window: int) -> None:
    """passing.gather_stream.GatherStream's loop in C: the same packets, the same rules; fills ``staged``
    and ``have``, and checks the completion round's sum."""
    keep: dict[str, Any] = dict(counts=counts.astype(np.uint64), have=have.view(np.uint8))
    call = native.GatherCall(
        origins=len(counts), number=state.number, aggregator=int(state.aggregator_ids[0]), window=window, start=start,
        counts=keep["counts"].ctypes.data_as(ctypes.POINTER(ctypes.c_uint64)),
        packets=native.address(packets) if len(packets) else None, staged=native.address(staged),
        have=native.address(keep["have"]), completion=native.address(completion),
    )
    report = native.StreamReport(overflow=ctypes.cast(None, ctypes.POINTER(ctypes.c_uint8)))
    _run(native.lib().pn_gather_run, call, report, state, recovery, silence, keep, "native all_gather",
         lambda: state.gather_stalled(recovery.timeout))
    state.check_completion(call.completion_sum)


def _run(function: Callable[..., int], call: native.StreamCall | native.GatherCall, report: native.StreamReport,
         state: StreamState, recovery: LossRecovery, silence: SilenceWatch | None, keep: dict[str, Any], what: str,
         timed_out: Callable[[], AggregatorUnreachable]) -> None:
    """What both calls share: the stream's identity and socket, the loss-recovery settings and estimates
    (read and written through pointers), the failover callback and the early-GATHER buffer in; the
    estimates, the socket's counters and what was kept back out; the return code as an exception."""
    estimates = [ctypes.c_double(v) for v in (recovery.srtt, recovery.rttvar, recovery.last_loss)]
    call.srtt, call.rttvar, call.last_loss = (ctypes.pointer(v) for v in estimates)
    call.fd, call.lanes, call.job, call.generation, call.worker = (
        state.socket.fd, state.lanes, state.job, state.generation, state.worker)
    call.rto_min, call.max_rto, call.timeout = recovery.rto_min, recovery.max_rto, recovery.timeout
    call.gso, call.drop = int(state.socket.gso), state.drop
    call.xsk = state.socket.xsk.handle if state.socket.xsk is not None else None
    call.rng = state.native_rng.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64))
    if silence is not None:  # ctypes keeps no reference: `keep` holds the callback until the call returns
        keep["on_silence"] = native.SILENCE_CALLBACK(lambda _ctx: int(silence.ask()))
        call.silence, call.silence_every, call.on_silence = silence.after, SILENCE_EVERY, keep["on_silence"]
    # a faster peer's next all_gather: its GATHERs that arrive during this call are kept for it
    room, buffer = state.early.native_room(), state.early.native_buffer(state.lanes)
    keep["early_source"], keep["early_count"] = np.zeros(room, np.int64), np.zeros(1, np.uint32)
    call.early, call.early_cap = native.address(buffer) if room else None, room
    call.early_source = keep["early_source"].ctypes.data_as(ctypes.POINTER(ctypes.c_int64))
    call.early_count = keep["early_count"].ctypes.data_as(ctypes.POINTER(ctypes.c_uint32))
    rc = function(ctypes.byref(call), ctypes.byref(report))
    state.early.keep_native(int(keep["early_count"][0]), keep["early_source"], state.lanes)
    recovery.srtt, recovery.rttvar, recovery.last_loss = (v.value for v in estimates)
    state.socket.gso = bool(call.gso)
    stats = state.socket.stats
    for name in REPORTED:
        setattr(stats, name, getattr(stats, name) + getattr(report, name))
    if rc == native.PN_ETIMEOUT:
        raise timed_out()
    if rc == native.PN_ESILENT:
        raise Silenced()
    if rc == native.PN_ESYS:
        raise OSError(report.error_errno, f"{report.error_call.decode()}: {os.strerror(report.error_errno)}")
    native.check(rc, what)
