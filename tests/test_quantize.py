from __future__ import annotations

import numpy as np
import pytest

from passing import quantize, wire


@pytest.mark.parametrize("workers", [1, 2, 7, 32])
@pytest.mark.parametrize("max_abs", [1e-30, 1e-3, 1.0, 3.7, 1e30])
def test_auto_scale_keeps_worst_case_sums_inside_int32(workers, max_abs):
    scale = quantize.auto_scale(max_abs, workers)
    assert np.log2(scale) == int(np.log2(scale))  # a power of two
    q, saturated = quantize.quantize(np.array([max_abs, -max_abs], np.float32), scale)
    assert not saturated.any()
    assert abs(int(q[0]) * workers) <= wire.INT32_MAX and abs(int(q[1]) * workers) <= wire.INT32_MAX
    assert int(q[0]) * workers * 4 > wire.INT32_MAX  # and uses the range: within a factor of 4


def test_quantize_saturates_and_says_so():
    q, saturated = quantize.quantize(np.array([1.0, 3e9, -3e9], np.float32), 1.0)
    assert q.tolist() == [1, wire.INT32_MAX, wire.INT32_MIN]
    assert saturated.tolist() == [False, True, True]


def test_max_abs_bits_orders_like_floats():
    x = np.array([0.5, -7.25, 3.0], np.float32)
    assert quantize.bits_to_float(quantize.max_abs_bits(x)) == 7.25
    a, b = np.float32(1e-20), np.float32(1e20)
    assert quantize.max_abs_bits(np.array([a])) < quantize.max_abs_bits(np.array([b]))
    nan_bits = quantize.max_abs_bits(np.array([1.0, np.nan], np.float32))
    assert nan_bits > quantize.max_abs_bits(np.array([np.inf], np.float32))
    assert quantize.max_abs_bits(np.array([], np.float32)) == 0


def test_round_trip_error_bound():
    rng = np.random.default_rng(0)
    x = rng.normal(size=10000).astype(np.float32)
    scale = quantize.auto_scale(float(np.abs(x).max()), 1)
    q, _ = quantize.quantize(x, scale)
    assert np.max(np.abs(quantize.dequantize(q, scale) - x)) <= quantize.error_bound(scale, 1) + 1e-7
