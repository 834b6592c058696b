"""The collectives a PASSING process group hands to the device's backend (gloo for CPU tensors, NCCL
for CUDA ones), called from Python through the backend's own binding (backend.py says why), on dense
memory only.

torch 2.13's gloo treats a tensor that is not contiguous (a 1-D view with a step, a slice of a
matrix's rows) as if it were: its all_reduce sums the storage, overwriting elements outside the view,
and other collectives write or read the wrong elements. So every such tensor of a call goes as a
contiguous copy, and the copies are written back into the caller's tensors once the call is done,
before its work completes. That last step is ours, in a callback of gloo's future: gloo's barrier
does not wait for it, so the process group's does (``Finishing``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._C._distributed_c10d import Backend as C10dBackend

from .work import PassingWork

Tensor = torch.Tensor


class Finishing:
    """What a process group's barrier waits for beyond what gloo's own barrier does: the works whose
    outputs a callback of ours finishes (copied back, divided), and gloo's works that have no future
    (its reduce_scatters'), whose outputs gloo's barrier does not wait for (measured: torch 2.13, an
    async reduce_scatter_tensor's output read after barrier() was incomplete every time)."""

    def __init__(self) -> None:
        self._works: list[PassingWork | Any] = []

    def add(self, work: PassingWork | Any) -> None:
        self._works = self.pending() + [work]

    def pending(self) -> list[PassingWork | Any]:
        return [w for w in self._works if not (w.ran.is_set() if isinstance(w, PassingWork) else w.is_completed())]


def call(backend: C10dBackend, name: str, args: tuple[Any, ...], finishing: Finishing,
         then: Callable[[], None] | None = None, kwargs: dict[str, Any] | None = None) -> Any:
    """``backend.<name>(*args)`` with every tensor in ``args`` (in lists too) that is not contiguous
    replaced by a contiguous copy, written back once the call is done; then ``then()``. The work is
    gloo's own when there is nothing to write back or do."""
    swapped: list[tuple[Tensor, Tensor]] = []
    dense = _dense(args, swapped)
    work = getattr(backend, name)(*dense, **(kwargs or {}))
    if not swapped and then is None:
        if not _has_future(work):
            finishing.add(work)
        return work
    result = PassingWork()
    finishing.add(result)
    originals = {id(copy): tensor for tensor, copy in swapped}

    def finish(value: Any) -> None:
        try:
            for tensor, copy in swapped:
                tensor.copy_(copy)
            if then is not None:
                then()
        except BaseException as e:  # handed to whoever waits on the work
            result.fail(e)
            return
        result.complete([originals.get(id(t), t) for t in value] if isinstance(value, list) else value)

    try:
        future = work.get_future()
    except RuntimeError:  # a work with no future (gloo's reduce_scatter's): done here, in the caller's thread
        try:
            work.wait()
        except BaseException as e:
            result.fail(e)
            return result
        finish([])
        return result

    def done(f: torch.futures.Future) -> None:
        try:
            value = f.value()
        except BaseException as e:  # handed to whoever waits on the work
            result.fail(e)
            return
        finish(value)

    future.then(done)
    return result


def _has_future(work: Any) -> bool:
    try:
        work.get_future()
    except RuntimeError:  # "Work::getFuture not implemented"
        return False
    return True


def _dense(value: Any, swapped: list[tuple[Tensor, Tensor]]) -> Any:
    if isinstance(value, Tensor):
        if value.layout == torch.strided and not value.is_contiguous():
            copy = value.contiguous()
            swapped.append((value, copy))
            return copy
        return value
    if isinstance(value, list):
        return [_dense(v, swapped) for v in value]
    if isinstance(value, tuple):
        return tuple(_dense(v, swapped) for v in value)
    return value
