"""The argument rules of a group's calls (passing.stream.Group), checked before any packet is sent."""

from __future__ import annotations

import numpy as np

OPS = ("sum", "avg")


def check_reduce(x: np.ndarray, op: str, call: str) -> None:
    """The op and dtype rules of every reduction: float32 or int32, and an average only of float32."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if x.dtype not in (np.float32, np.int32):
        raise TypeError(f"{call} takes float32 or int32 arrays, got {x.dtype}")
    if x.dtype == np.int32 and op == "avg":
        raise TypeError("op 'avg' needs a float32 array (an int32 average is not an int32)")


def check_out(out: np.ndarray, dtype: np.dtype, size: int, unit: str = "elements") -> None:
    """The rules of an output given by the caller, which is written in place: its dtype and size,
    C-contiguous, writeable."""
    if out.dtype != dtype or out.size != size or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"out must be a writeable C-contiguous {dtype} array of {size} {unit}")
