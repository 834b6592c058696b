"""A group's servers in the whole job (docs/protocol.md, "Trees across racks", "What a host needs"): in a
flat group every server is its worker index; a leaf's group of a tree has the job's ``servers``, this
server's global ``number`` (the ``owner`` of its OWNER_ONLY rounds, GATHERs and the NACKs it answers) and
every server's number in the caller's order (``order``: the group index each joined as, the order of
reduce_scatter's blocks and all_gather's pieces). Here: the rules of those numbers, and the wire work of a
reduce_scatter and an all_gather in them, for passing.stream.Group: OWNER_ONLY rounds and GATHERs where the
tree carries owners (at most 128 servers), SUM rounds where it does not."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import wire
from .gather_stream import GatherStream
from .recovery import LossRecovery, SilenceWatch
from .reduce_path import ReducePath
from .stream_state import StreamState


def check_numbering(worker: int, workers: int, servers: int | None, number: int | None,
                    numbers: Sequence[int] | None, owner_only: bool = True) -> np.ndarray | None:
    """The rules of a group's numbers in the whole job (``Group``'s ``number``, ``numbers`` and
    ``owner_only``); the order (``numbers`` as an array), None for the global order."""
    total = workers if servers is None else servers
    if owner_only and total > wire.MAX_OWNER + 1:
        raise ValueError(f"owner_only with {total} servers: owners are 7 bits (at most {wire.MAX_OWNER + 1} "
                         "servers); a larger tree reduce-scatters and all-gathers with owner_only=False")
    if number is None:
        if numbers is not None:
            raise ValueError("numbers without this server's number")
        return None
    if not 0 <= number < total:
        raise ValueError(f"number {number} outside 0..{total - 1} (the job's servers)")
    if total == workers and number != worker:
        raise ValueError(f"number {number}: a flat group's server is numbered by its worker index {worker}")
    if numbers is None:
        return None
    order = np.array([int(v) for v in numbers], np.int64)
    if order.size != total or not np.array_equal(np.sort(order), np.arange(total)):
        raise ValueError(f"numbers must order the job's {total} servers (each of 0..{total - 1} once)")
    return order


def rank_of(state: StreamState) -> int:
    """This server's index in the caller's order of the job's servers."""
    return state.number if state.order is None else int(np.flatnonzero(state.order == state.number)[0])


def _order(state: StreamState) -> np.ndarray:
    """rank -> global number."""
    return np.arange(state.servers) if state.order is None else state.order


def scatter(state: StreamState, reduce_path: ReducePath, source: np.ndarray, out: np.ndarray, op: str) -> None:
    """A reduce_scatter on the wire: each server's block padded to whole packets, in global number order;
    OWNER_ONLY rounds, packet i's owner the server numbered i // (packets of a block); a tree without owners:
    SUM rounds, every block's sums to every server. This server's block into ``out``."""
    chunk = source.size // state.servers
    per = -(-chunk // state.lanes)  # packets of each server's block
    padded = np.zeros((state.servers, per * state.lanes), source.dtype)
    padded[_order(state), :chunk] = source.reshape(state.servers, chunk)
    flat = padded.reshape(-1)
    reduce_path.run(flat, flat, op, owner_packets=per if state.owner_only else None)
    out[:] = padded[state.number, :chunk]


def gather(state: StreamState, recovery: LossRecovery, silence: SilenceWatch | None, native: bool,
           reduce_path: ReducePath, piece: np.ndarray, sizes: list[int], out: np.ndarray) -> None:
    """An all_gather on the wire: the pieces (``sizes``, in the caller's order) as GATHERs owned by their
    servers' numbers, or in a tree without owners one SUM round; every piece into ``out`` in the caller's order."""
    starts = np.r_[0, np.cumsum(sizes)][:-1]
    if not state.owner_only:
        _gather_by_sums(state, reduce_path, piece, sizes, starts, out)
        return
    by_number = np.empty(state.servers, np.int64)
    by_number[_order(state)] = np.arange(state.servers)  # global number -> rank
    GatherStream(state, recovery, silence, piece, [sizes[r] for r in by_number]).run(out, starts[by_number], native)


def _gather_by_sums(state: StreamState, reduce_path: ReducePath, piece: np.ndarray, sizes: list[int],
                    starts: np.ndarray, out: np.ndarray) -> None:
    """An all_gather as one SUM round (a tree of more than 128 servers, whose owners the wire cannot name):
    each 16 bits of the gathered bytes in an int32 lane, this server's piece at its place and zeros elsewhere,
    so every lane's sum is the one server's bits there, exact and far from saturating."""
    total = sum(sizes)
    mine = np.zeros(total + total % 2, np.uint8)
    me = rank_of(state)
    mine[starts[me] : starts[me] + sizes[me]] = piece
    lanes = mine.view("<u2").astype(np.int32)
    reduce_path.run(lanes, lanes, "sum")
    out[:] = lanes.astype("<u2").view(np.uint8)[:total]
