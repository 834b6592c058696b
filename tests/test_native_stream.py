"""The native host streaming engine against its specification, the numpy engine: the same inputs
give the same bits, on the same aggregator."""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_edge_cases import allreduce_all


def tricky_floats(seed: int, size: int) -> np.ndarray:
    """Mixed magnitudes and signs, exact halves (ties of the rounding), zeros, subnormals."""
    rng = np.random.default_rng(seed)
    x = (10.0 ** rng.uniform(-6, 3, size) * rng.choice([-1.0, 1.0], size)).astype(np.float32)
    x[::7] = np.float32(0.5) + rng.integers(-1000, 1000, x[::7].size).astype(np.float32)  # ties at scale 1
    x[::11] = 0.0
    x[::13] = np.float32(1e-40)  # subnormal
    return x


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("scale", ["auto", 1.0, 1e4, 3.0])  # 3.0: not a power of two, the float64 path
def test_native_and_numpy_streams_give_the_same_bits(workers, scale):
    inputs = [tricky_floats(w, 5000) for w in range(workers)]
    args = {} if scale == "auto" else {"scale": scale, "on_overflow": "auto"}
    native = allreduce_all([x.copy() for x in inputs], shards=2, engine="native", **args)
    spec = allreduce_all([x.copy() for x in inputs], shards=2, engine="numpy", **args)
    for a, b in zip(native, spec):
        assert not isinstance(a, Exception) and not isinstance(b, Exception), (a, b)
        assert np.array_equal(a.view(np.int32), b.view(np.int32))


@pytest.mark.timeout(120)
def test_saturation_at_a_fixed_scale_is_flagged_alike():
    x = np.array([3e9, -3e9, 1.0, 2.0**31 - 64], np.float32)
    for engine in ("native", "numpy"):
        results = allreduce_all([x, x], engine=engine, scale=1.0)
        assert all("overflowed" in str(r) for r in results), (engine, results)


@pytest.mark.parametrize("size", [0, 1, 7, 64, 1001])
def test_native_max_abs_bits_matches_the_specification(size):
    from passing import native, quantize

    rng = np.random.default_rng(size)
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 1e-45, -3.4e38], np.float32)
    for trial in range(20):
        x = tricky_floats(trial, size)
        if size and trial % 2:
            x[rng.integers(0, size, 1 + size // 50)] = rng.choice(specials, 1 + size // 50)
        if size and trial % 5 == 0:  # a NaN with a payload of its own
            payload = np.array([0x7FC12345 | (trial << 31 & 0x80000000)], np.uint32)
            x[rng.integers(0, size)] = payload.view(np.float32)[0]
        assert native.max_abs_bits(x) == quantize.max_abs_bits(x), x
        assert native.max_abs_bits(x, finite_only=True) == quantize.max_abs_bits(x[np.isfinite(x)]), x
    with pytest.raises(ValueError):
        native.max_abs_bits(np.zeros(4, np.float64))
