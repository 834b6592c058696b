"""The native data path (host/csrc/): loading it, and its narrow C ABI through ctypes.

The library is built from source when the ``passing`` distribution is installed. ctypes
rather than an extension module: the ABI stays plain C functions over buffers (the same
library serves the C tests, the sanitizer build and the fuzz harness), and ctypes
releases the GIL for the duration of every call. ``PASSING_NATIVE_LIB`` points at
another build of it (the sanitizer build of ``make sanitize``).

Engines are chosen per group and per aggregator (``engine="native"|"numpy"``); the
default, ``"auto"``, uses the native one and falls back to numpy, with one warning that
says why, where the library cannot be loaded.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
import warnings
from pathlib import Path

import numpy as np

ENGINES = ("auto", "native", "numpy")

PN_OK = 0
PN_EINVAL, PN_ENOMEM, PN_EEXIST, PN_ENOENT, PN_ERANGE, PN_EFULL, PN_ESYS, PN_ETIMEOUT, PN_ESILENT = range(-1, -10, -1)
ERRORS = {
    PN_EINVAL: "bad argument", PN_ENOMEM: "out of memory", PN_EEXIST: "already admitted",
    PN_ENOENT: "not admitted", PN_ERANGE: "slot range outside the engine or overlapping another job",
    PN_EFULL: "no room for another job", PN_ESYS: "system call failed", PN_ETIMEOUT: "timed out",
    PN_ESILENT: "given up after silence",
}
COUNTERS = 11
IN_F32, IN_I32 = 0, 1


class NativeUnavailable(RuntimeError):
    """The native library cannot be loaded here (the reason is the message)."""


class ServerStats(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "packets_sent", "bytes_sent", "packets_received", "bytes_received", "ingress_dropped",
        "ingress_duplicated", "egress_dropped", "egress_duplicated", "batches", "send_errors", "gso_fallbacks")] + [
        ("last_errno", ctypes.c_int32)]


_p = ctypes.c_void_p
_u32p, _u64p, _i64p, _dp = (ctypes.POINTER(t) for t in (ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int64,
                                                         ctypes.c_double))


# int on_silence(void *ctx): 0 keeps the call waiting, nonzero gives it up (PN_ESILENT)
SILENCE_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class StreamCall(ctypes.Structure):
    _fields_ = [
        ("fd", ctypes.c_int), ("lanes", ctypes.c_uint32), ("job", ctypes.c_uint32),
        ("generation", ctypes.c_uint32), ("worker", ctypes.c_uint32), ("op", ctypes.c_uint32),
        ("owner_packets", ctypes.c_uint32), ("shards", ctypes.c_uint32), ("aggregator", _i64p), ("pool", _u32p),
        ("next_psn", _u64p), ("start", _u64p), ("count", _u64p),
        ("kind", ctypes.c_int32), ("input", _p), ("output", _p), ("elements", ctypes.c_uint64), ("scale", _dp),
        ("rto_min", ctypes.c_double), ("max_rto", ctypes.c_double), ("timeout", ctypes.c_double),
        ("srtt", _dp), ("rttvar", _dp), ("last_loss", _dp),
        ("gso", ctypes.c_int32), ("drop", ctypes.c_double), ("rng", _u64p),
        ("silence", ctypes.c_double), ("silence_every", ctypes.c_double), ("on_silence", SILENCE_CALLBACK),
        ("silence_ctx", _p), ("early", _p), ("early_source", _i64p), ("early_cap", ctypes.c_uint32),
        ("early_count", _u32p), ("xsk", _p),
    ]


class GatherCall(ctypes.Structure):
    _fields_ = [
        ("fd", ctypes.c_int), ("lanes", ctypes.c_uint32), ("job", ctypes.c_uint32),
        ("generation", ctypes.c_uint32), ("worker", ctypes.c_uint32), ("origins", ctypes.c_uint32),
        ("number", ctypes.c_uint32), ("aggregator", ctypes.c_int64), ("window", ctypes.c_uint32),
        ("start", ctypes.c_uint64),
        ("counts", _u64p), ("packets", _p), ("staged", _p), ("have", _p), ("completion", _p),
        ("rto_min", ctypes.c_double), ("max_rto", ctypes.c_double), ("timeout", ctypes.c_double),
        ("srtt", _dp), ("rttvar", _dp), ("last_loss", _dp),
        ("gso", ctypes.c_int32), ("drop", ctypes.c_double), ("rng", _u64p),
        ("early", _p), ("early_source", _i64p), ("early_cap", ctypes.c_uint32), ("early_count", _u32p),
        ("completion_sum", ctypes.c_int32), ("silence", ctypes.c_double), ("silence_every", ctypes.c_double),
        ("on_silence", SILENCE_CALLBACK), ("silence_ctx", _p), ("xsk", _p),
    ]


class Tree(ctypes.Structure):
    """pn_tree: a job's role in a two-level tree (passing.aggregator.jobs)."""

    _fields_ = [("role", ctypes.c_uint32), ("owners", ctypes.c_int32 * 128), ("up_job", ctypes.c_uint32),
                ("up_generation", ctypes.c_uint32), ("up_worker", ctypes.c_uint32), ("up_source", ctypes.c_int64)]


class StreamReport(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "packets_sent", "bytes_sent", "packets_received", "bytes_received", "retransmissions",
        "early_retransmissions", "foreign_results", "gso_fallbacks")] + [
        ("overflow", ctypes.POINTER(ctypes.c_uint8)), ("error_shard", ctypes.c_uint32),
        ("error_psn", ctypes.c_uint32), ("error_retries", ctypes.c_uint32), ("error_errno", ctypes.c_int32),
        ("error_call", ctypes.c_char * 16),
    ]


_PROTOTYPES = {
    "pn_packet_size": (ctypes.c_size_t, [ctypes.c_uint32]),
    "pn_engine_new": (_p, [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32]),
    "pn_engine_free": (None, [_p]),
    "pn_engine_add_job": (ctypes.c_int, [_p, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32,
                                         ctypes.c_uint32, _p, ctypes.c_uint32]),
    "pn_engine_add_tree_job": (ctypes.c_int, [_p, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32,
                                              ctypes.c_uint32, ctypes.c_uint32, _p, ctypes.c_uint32,
                                              ctypes.POINTER(Tree)]),
    "pn_engine_remove_job": (ctypes.c_int, [_p, ctypes.c_uint32]),
    "pn_engine_counters": (ctypes.c_int, [_p, ctypes.c_int64, _p]),
    "pn_engine_process": (ctypes.c_size_t, [_p, _p, ctypes.c_size_t, _p, _p, ctypes.c_size_t, _p, _p, _p, _p,
                                            ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]),
    "pn_server_new": (_p, [_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_int]),
    "pn_server_free": (None, [_p]),
    "pn_server_use_xsk": (ctypes.c_int, [_p, _p]),
    "pn_server_impair": (ctypes.c_int, [_p, ctypes.c_int, ctypes.c_double, ctypes.c_double, ctypes.c_int,
                                        ctypes.c_uint64]),
    "pn_server_run": (ctypes.c_int, [_p]),
    "pn_server_stop": (None, [_p]),
    "pn_server_get_stats": (None, [_p, ctypes.POINTER(ServerStats)]),
    "pn_stream_run": (ctypes.c_int, [ctypes.POINTER(StreamCall), ctypes.POINTER(StreamReport)]),
    "pn_gather_run": (ctypes.c_int, [ctypes.POINTER(GatherCall), ctypes.POINTER(StreamReport)]),
    "pn_max_abs_bits": (ctypes.c_uint32, [_p, ctypes.c_size_t, ctypes.c_int]),
    "pn_copy_f32": (None, [_p, _p, ctypes.c_size_t]),
    "pn_sum_f32": (None, [_p, ctypes.POINTER(_p), ctypes.c_uint32, ctypes.c_size_t]),
}

_lib: ctypes.CDLL | None = None
_error: str | None = None
_warned = False


def library_path() -> Path:
    override = os.environ.get("PASSING_NATIVE_LIB")
    if override:
        return Path(override)
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"_native{suffix}"
        if candidate.exists():
            return candidate
    raise NativeUnavailable(f"no compiled native library in {here} (reinstall the package: "
                            "pip install -e host, or make setup, builds it with the machine's C compiler)")


def lib() -> ctypes.CDLL:
    """The loaded library, or NativeUnavailable with the reason."""
    global _lib, _error
    if _lib is not None:
        return _lib
    if _error is not None:
        raise NativeUnavailable(_error)
    try:
        path = library_path()
        loaded = ctypes.CDLL(str(path))
        for name, (restype, argtypes) in _PROTOTYPES.items():
            fn = getattr(loaded, name)
            fn.restype, fn.argtypes = restype, argtypes
    except (NativeUnavailable, OSError, AttributeError) as e:
        _error = f"the native data path cannot be loaded: {e}"
        raise NativeUnavailable(_error) from None
    _lib = loaded
    return _lib


def available() -> bool:
    try:
        lib()
        return True
    except NativeUnavailable:
        return False


def use_native(engine: str) -> bool:
    """Resolve an ``engine`` option: True for the native engine, False for numpy."""
    global _warned
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "numpy":
        return False
    if engine == "native":
        lib()  # raises NativeUnavailable with the reason
        return True
    try:
        lib()
        return True
    except NativeUnavailable as e:
        if not _warned:
            warnings.warn(f"{e}; using the numpy engines (slower)", RuntimeWarning, stacklevel=3)
            _warned = True
        return False


def check(code: int, what: str) -> None:
    if code != PN_OK:
        raise RuntimeError(f"{what}: {ERRORS.get(code, f'error {code}')}")


def address(array) -> int:
    """The data pointer of a numpy array (for the ctypes calls)."""
    return array.__array_interface__["data"][0]


def max_abs_bits(x: np.ndarray, finite_only: bool = False) -> int:
    """passing.quantize.max_abs_bits in one pass of C (a contiguous float32 array)."""
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        raise ValueError("max_abs_bits: a contiguous float32 array")
    return int(lib().pn_max_abs_bits(address(x), x.size, int(finite_only)))


def copy_f32(dst: int, src: int, n: int) -> None:
    """n float32 from address ``src`` to address ``dst`` (not overlapping): pn_copy_f32."""
    lib().pn_copy_f32(dst, src, n)


def sum_f32(dst: int, sources: list[int], n: int) -> None:
    """dst = sources[0] + sources[1] + ..., in that order, over n float32 at those addresses
    (dst overlapping none of them): pn_sum_f32."""
    lib().pn_sum_f32(dst, (_p * len(sources))(*sources), len(sources), n)
