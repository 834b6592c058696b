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
    bits = np.abs(x.astype(np.float32, copy=False)).view(np.int32)
    return int(bits.max())


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


def quantize(x: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Round x * scale to int32, saturating. Returns (values, saturated mask)."""
    scaled = np.rint(x.astype(np.float64) * scale)
    saturated = (scaled > wire.INT32_MAX) | (scaled < wire.INT32_MIN)
    return np.clip(scaled, wire.INT32_MIN, wire.INT32_MAX).astype(np.int32), saturated


def dequantize(q: np.ndarray, scale: float) -> np.ndarray:
    return (q.astype(np.float64) / scale).astype(np.float32)


def error_bound(scale: float, workers: int) -> float:
    """Largest |sum(quantized)/scale - exact sum| (rounding only, before the float32 cast)."""
    return workers * 0.5 / scale
