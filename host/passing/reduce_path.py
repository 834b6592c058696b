"""The reduce path: one allreduce of a flat array (or a reduce_scatter's OWNER_ONLY rounds) through a
group's aggregators. int32 is summed exactly; float32 travels as int32 through scaling rounds: a MAX
round picks a power-of-two scale per aggregator (``scale="auto"``), or a fixed scale is redone in auto
mode where it overflows (``on_overflow="auto"``), and a class round carries NaN and infinities so the
sums are IEEE's, as gloo's are. Each round is one pass of the numpy stream (passing.reduce_stream) or
of the C one (passing.native_stream)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from . import native, native_stream, quantize, stripes, wire
from .errors import PassingOverflow
from .recovery import LossRecovery, SilenceWatch
from .reduce_stream import ReduceStream
from .stream_state import StreamState

NONFINITE_SHIFT = 6  # bits per count in the non-finite class round: up to 63 servers (a flat job's 32, + 1)
TREE_NONFINITE_SHIFT = 10  # a job of more servers (a tree across racks: up to 1 023): three counts in 30 bits
WIDE_NONFINITE_SHIFT = 11  # 1 024 servers (32 racks of 32): 11-bit counts, two rounds (nan and +inf; -inf)


def nonfinite_shift(servers: int) -> int:
    """The bits of each count in the non-finite class round of a job of ``servers`` servers."""
    for shift in (NONFINITE_SHIFT, TREE_NONFINITE_SHIFT):
        if servers < 1 << shift:
            return shift
    return WIDE_NONFINITE_SHIFT


def nonfinite_codes(flat: np.ndarray, shift: int) -> list[np.ndarray]:
    """What a server contributes to the class round(s), per element: nan + (+inf << shift) + (-inf << 2 shift)
    in one int32 where three counts fit 31 bits, else nan + (+inf << shift) and -inf in two."""
    nan, pos, neg = (np.isnan(flat).astype(np.int32), np.isposinf(flat).astype(np.int32),
                     np.isneginf(flat).astype(np.int32))
    if 3 * shift <= 31:
        return [nan | (pos << shift) | (neg << 2 * shift)]
    return [nan | (pos << shift), neg]


def nonfinite_classes(sums: list[np.ndarray], shift: int) -> np.ndarray:
    """The class round's sums (of ``nonfinite_codes``) as one array of the three counts (apply_nonfinite's)."""
    if len(sums) == 1:
        return sums[0]
    return sums[0].astype(np.int64) | (sums[1].astype(np.int64) << 2 * shift)


class ReducePath:
    """The reduce path of one call of a group (its state, loss recovery and failover watch), with the
    group's engine and scaling options."""

    def __init__(self, state: StreamState, recovery: LossRecovery, silence: SilenceWatch | None, native: bool,
                 scale: str | float, on_overflow: str) -> None:
        self.state, self.recovery, self.silence, self.native = state, recovery, silence, native
        self.scale, self.on_overflow = scale, on_overflow

    def run(self, flat: np.ndarray, out: np.ndarray, op: str, owner_packets: int | None = None) -> None:
        """Sum (``op`` "avg": average) ``flat`` over the workers into ``out``. With ``owner_packets`` every
        round is OWNER_ONLY: packet i's sums come back to worker i // owner_packets alone (the others get
        ACKs), so ``out`` holds only this worker's block."""
        lanes, job = self.state.lanes, self.state.job
        packets = -(-flat.size // lanes)
        bounds = np.linspace(0, packets, len(self.state.aggregators) + 1).astype(np.int64)
        starts, counts = bounds[:-1], np.diff(bounds)  # packets of each aggregator's contiguous block
        if flat.dtype == np.int32:
            if any(self._pass(wire.SUM, flat, out, starts, counts, owner_packets=owner_packets)):
                raise PassingOverflow(f"job {job}: an int32 sum left the int32 range")
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
                    f"job {job}: the sum overflowed int32 at scale {mode}; "
                    "use scale='auto' or a smaller fixed scale (or on_overflow='auto')"
                )
            mode = "auto"  # every worker saw the same flags, so all of them redo it
        for start, count, scale in zip(starts, counts, scales):
            if not scale:  # a shard that is zero on every worker needed no SUM
                target[start * lanes : (start + count) * lanes] = 0
        if classes is not None:
            apply_nonfinite(target, classes, nonfinite_shift(self.state.servers))
        if target is not out:
            out[:] = target
        if op == "avg":
            out /= np.float32(self.state.servers)

    def _auto_scales(self, flat: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> tuple[list[float], list[bool]]:
        """One MAX round per aggregator: per shard the scale of its finite values (0.0 where they
        are zero on every worker) and whether some worker holds a NaN or an infinity in it.

        Lane 0 carries max |x| of the finite values as float32 bits, lane 1 a 1 where this worker's
        block holds a non-finite value: the common all-finite case costs nothing more."""
        lanes = self.state.lanes
        rows = np.zeros((len(counts), lanes), dtype=np.int32)
        for i, (start, count) in enumerate(zip(starts, counts)):
            block = flat[start * lanes : (start + count) * lanes]
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
            scales.append(quantize.auto_scale(max_abs, self.state.servers) if max_abs > 0 else 0.0)
        return scales, [bool(v) for v in maxima[:, 1]]

    def _max_round(self, rows: np.ndarray) -> np.ndarray:
        """Lane-wise int32 max of one row per shard over every worker."""
        maxima = np.empty_like(rows)
        shards = np.arange(len(rows))
        self._pass(wire.MAX, rows.reshape(-1), maxima.reshape(-1), shards, np.ones(len(rows), np.int64))
        return maxima

    def _anywhere(self, flat: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                  test: Callable[[np.ndarray], bool]) -> bool:
        """Whether ``test(block)`` holds for some shard's block on some worker (one MAX round)."""
        lanes = self.state.lanes
        rows = np.zeros((len(counts), lanes), dtype=np.int32)
        for i, (start, count) in enumerate(zip(starts, counts)):
            rows[i, 0] = int(bool(test(flat[start * lanes : (start + count) * lanes])))
        return bool(self._max_round(rows)[:, 0].any())

    def _nonfinite_classes(self, flat: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                           nonfinite: list[bool], owner_packets: int | None = None) -> np.ndarray:
        """Per element, how many servers hold NaN, +inf and -inf there: one int32 SUM round over
        the shards that hold any, each server contributing nan + (+inf << 6) + (-inf << 12) (at most
        63 servers: each count fits its 6 bits; a tree's job of more: 10-bit counts; of 1 024: 11-bit
        counts, in two rounds). Shards without any get zeros."""
        shift = nonfinite_shift(self.state.servers)
        live = np.array([c if n else 0 for c, n in zip(counts, nonfinite)], dtype=np.int64)
        sums = []
        for codes in nonfinite_codes(flat, shift):
            sums.append(np.zeros_like(codes))
            self._pass(wire.SUM, codes, sums[-1], starts, live, owner_packets=owner_packets)
        return nonfinite_classes(sums, shift)

    def _pass(self, op: int, flat: np.ndarray, out: np.ndarray, starts: np.ndarray, counts: np.ndarray,
              scales: list[float] | None = None, owner_packets: int | None = None) -> list[bool]:
        """One pass of every shard's packets through its aggregator: packets [start, start + count)
        of ``flat`` (zero-padded to whole packets; float32 quantized with the shard's scale) in,
        their sums into ``out``. Returns per shard whether a RESULT overflowed. With ``owner_packets``
        the rounds are OWNER_ONLY, and only the rows this worker owns are written to ``out``."""
        if self.native and self.state.stripes:  # several streams, a thread each (passing.stripes)
            return stripes.striped_pass(self.state, self.recovery, self.silence, self.state.stripes, op, flat, out,
                                        starts, counts, scales, owner_packets)
        if self.native:
            return native_stream.reduce_pass(self.state, self.recovery, self.silence, op, flat, out, starts, counts,
                                             scales, owner_packets)
        lanes = self.state.lanes
        owners = None if owner_packets is None else [(start + np.arange(count)) // owner_packets
                                                      for start, count in zip(starts, counts)]
        blocks, flags = [], []
        for i, (start, count) in enumerate(zip(starts, counts)):
            block = np.zeros(count * lanes, dtype=flat.dtype)
            part = flat[start * lanes : (start + count) * lanes]
            block[: part.size] = part
            if scales is not None:
                q, saturated = quantize.quantize(block, scales[i] or 1.0)
                block = q
                flags.append(np.where(saturated.reshape(-1, lanes).any(axis=1), wire.FLAG_OVERFLOW, 0))
            blocks.append(block.reshape(-1, lanes))
        sums, overflow = ReduceStream(self.state, self.recovery, self.silence, blocks, op,
                                      flags if scales is not None else None, owners).run()
        for i, (start, s) in enumerate(zip(starts, sums)):
            part = out[start * lanes : (start * lanes + s.size)]
            values = s.reshape(-1)[: part.size]
            if owners is None:
                part[:] = quantize.dequantize(values, scales[i]) if scales is not None else values
                continue
            mine = np.repeat(owners[i] == self.state.number, lanes)[: part.size]  # the rows whose sums came here
            part[mine] = quantize.dequantize(values[mine], scales[i]) if scales is not None else values[mine]
        return overflow


def apply_nonfinite(out: np.ndarray, classes: np.ndarray, shift: int = NONFINITE_SHIFT) -> None:
    """IEEE float32 sums where non-finite values met (gloo's answers): NaN where some worker had NaN
    or where +inf and -inf met, +inf or -inf where only infinities of one sign met finite values."""
    mask = (1 << shift) - 1
    nan, pos, neg = classes & mask, (classes >> shift) & mask, (classes >> 2 * shift) & mask
    out[pos > 0] = np.inf
    out[neg > 0] = -np.inf
    out[(nan > 0) | ((pos > 0) & (neg > 0))] = np.nan
