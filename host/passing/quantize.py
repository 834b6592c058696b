"""float32 <-> int32 scaling for integer aggregation.

The aggregator adds int32 values, so floats are multiplied by a scale and rounded.
``auto`` picks the largest power of two for which the sum of ``workers`` values of at
most the global max |x| cannot leave the int32 range; the global max comes from one
MAX round through the aggregator. Non-negative float32 bit patterns order like the
integers they read as, so the aggregator's integer max works on them unchanged.
"""

from __future__ import annotations

import math

import numpy as np

from . import wire


def max_abs_bits(x: np.ndarray) -> int:
    """max |x| as the int32 that has its float32 bit pattern (NaN sorts above inf)."""
    if x.size == 0:
        return 0
    x = x.astype(np.float32, copy=False)
    hi, lo = x.max(), x.min()  # two passes, no temporary the size of x (np.abs would make one)
    if np.isnan(hi) or np.isnan(lo):
        return int(np.array([np.nan], np.float32).view(np.int32)[0] & 0x7FFFFFFF)
    return int(np.array([max(abs(hi), abs(lo))], np.float32).view(np.int32)[0])


INF_BITS = 0x7F800000  # |x| bits at or above this: infinity or NaN


def bits_to_float(bits: int) -> float:
    return float(np.array([bits], dtype=np.int32).view(np.float32)[0])


def auto_scale(max_abs: float, workers: int) -> float:
    """Power-of-two scale so that ``workers`` values of magnitude <= max_abs sum inside int32.

    Rounding can add 1/2 per value: the limit keeps one unit per worker of headroom.
    """
    if not math.isfinite(max_abs) or max_abs <= 0:
        raise ValueError(f"cannot scale for max |x| = {max_abs}")
    limit = (wire.INT32_MAX - workers) // workers
    return 2.0 ** math.floor(math.log2(limit / max_abs))


def _float32_exact(scale: float) -> bool:
    """Scaling by a power of two inside float32's normal range is exact in float32."""
    mantissa, exponent = math.frexp(scale)
    return mantissa == 0.5 and -120 < exponent < 120


def quantize(x: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Round x * scale to int32, saturating. Returns (values, saturated mask).

    A NaN or an infinity becomes 0 and counts as saturated: its packet carries OVERFLOW, and
    the stream restores IEEE semantics from a class round (passing.reduce_path)."""
    if _float32_exact(scale):  # the common (auto) case: half the memory traffic of float64
        scaled = np.multiply(x, np.float32(scale), dtype=np.float32)
        limit = np.float32(2.0**31)  # int32 ends just below it
    else:
        scaled = np.multiply(x, scale, dtype=np.float64)
        limit = 2.0**31
    np.rint(scaled, out=scaled)
    nonfinite = ~np.isfinite(x)
    saturated = (scaled >= limit) | (scaled < -limit)
    np.clip(scaled, -limit, np.nextafter(limit, 0, dtype=scaled.dtype), out=scaled)
    scaled[nonfinite] = 0
    q = scaled.astype(np.int32)
    if saturated.any():
        q[saturated] = np.where(scaled[saturated] > 0, wire.INT32_MAX, wire.INT32_MIN)
        q[nonfinite] = 0
    return q, saturated | nonfinite


def dequantize(q: np.ndarray, scale: float) -> np.ndarray:
    if _float32_exact(scale):  # one rounding either way: bit-identical to the float64 path
        return np.multiply(q, np.float32(1.0 / scale), dtype=np.float32)
    return (q.astype(np.float64) / scale).astype(np.float32)


def error_bound(scale: float, workers: int) -> float:
    """Largest |sum(quantized)/scale - exact sum| (rounding only, before the float32 cast)."""
    return workers * 0.5 / scale
