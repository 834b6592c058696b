"""The replay record of a network call: what every worker needs to do the call again, after a
move (passing.stream.Group's failover) or over another transport (the torch backend's gloo)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Replay:
    """A network call as every worker can do it again, after a move or over another transport: its
    kind, a copy of this worker's input (an in-place output may be half written) and what else it
    takes. ``kind`` "reduce": an allreduce of ``input`` with ``op``; "scatter": a reduce_scatter of
    ``input`` (the workers' blocks one after the other) with ``op``, worker w's block of the result
    to worker w; "gather": an all_gather of the piece ``input`` (bytes) among pieces of ``sizes``
    bytes, in worker order. The same record replays on any transport (the torch backend: gloo)."""

    kind: str
    input: np.ndarray
    op: str = "sum"
    sizes: list[int] | None = None

    def copy(self) -> Replay:
        return Replay(self.kind, self.input.copy(), self.op, None if self.sizes is None else list(self.sizes))

    def scratch(self, workers: int) -> np.ndarray:
        """An output for a call done again only for the peers' sake (its result is not wanted)."""
        if self.kind == "gather":
            assert self.sizes is not None
            return np.empty(sum(self.sizes), np.uint8)
        return np.empty(self.input.size // (workers if self.kind == "scatter" else 1), self.input.dtype)
