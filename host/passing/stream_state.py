"""What one worker's stream is between calls: its identity in the allocation (job, generation,
worker), its aggregators and the psn stream of each, the position of its next all_gather, the GATHERs
a faster peer sent for an all_gather not begun yet, and its socket with the test impairment. A move
to another allocation (passing.stream.Group's failover) changes all of it but the worker."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import wire
from .errors import AggregatorUnreachable, PassingError
from .transport import BatchSocket, pack_address, parse_endpoint, unpack_address

EARLY_GATHERS = 1 << 16  # GATHER packets of a call not begun yet that a worker keeps for it (more: NACKed then)
EARLY_NATIVE = 4096  # of them, what one call of the native stream can keep


@dataclass
class Aggregator:
    """Where one shard of the stream goes: an address and the job's slot pool there."""

    host: str
    port: int = wire.UDP_PORT
    pool: int = 256

    @property
    def packed(self) -> int:
        return pack_address(self.host, self.port)

    @classmethod
    def parse(cls, spec: str | tuple[str, int] | Aggregator, pool: int) -> Aggregator:
        """An aggregator given as "host:port", (host, port) (with ``pool``) or an Aggregator."""
        if isinstance(spec, Aggregator):
            return spec
        host, port = parse_endpoint(spec, wire.UDP_PORT) if isinstance(spec, str) else spec
        return cls(host, port, pool)


def aggregators_of(answer: dict[str, Any]) -> list[Aggregator]:
    """The aggregators of a controller's join or move answer."""
    return [Aggregator(a["host"], int(a["port"]), int(a["pool"])) for a in answer["aggregators"]]


class EarlyGathers:
    """GATHER packets of an all_gather this worker has not begun yet (a faster peer's), kept for it as
    (packets, lengths, sources) batches, at most EARLY_GATHERS packets; every loop keeps them, the native
    ones through a buffer of EARLY_NATIVE packets."""

    def __init__(self) -> None:
        self.batches: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._buffer: np.ndarray | None = None  # where the native stream puts them

    def held(self) -> int:
        return sum(len(b[1]) for b in self.batches)

    def keep(self, view: np.ndarray, lengths: np.ndarray, sources: np.ndarray, mask: np.ndarray) -> None:
        if mask.any() and self.held() < EARLY_GATHERS:
            self.batches.append((view[mask].copy(), lengths[mask].copy(), sources[mask].copy()))

    def take(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Every batch kept, which are then no longer kept."""
        batches, self.batches = self.batches, []
        return batches

    def native_room(self) -> int:
        """How many a native call may keep: what the buffer holds, within EARLY_GATHERS in all."""
        return max(0, min(EARLY_NATIVE, EARLY_GATHERS - self.held()))

    def native_buffer(self, lanes: int) -> np.ndarray:
        """The native calls' buffer: made once per group (and lane count)."""
        if self._buffer is None or self._buffer.dtype != wire.packet_dtype(lanes):
            self._buffer = wire.empty(EARLY_NATIVE, lanes)
        return self._buffer

    def keep_native(self, count: int, sources: np.ndarray, lanes: int) -> None:
        """Keep the ``count`` packets a native call put in the buffer (their sources in ``sources``)."""
        if count:
            assert self._buffer is not None
            self.batches.append((self._buffer[:count].copy(), np.full(count, wire.packet_size(lanes)),
                                 sources[:count].copy()))


def native_rng(drop_seed: int | None) -> np.ndarray:
    """The native engine's impairment generator (splitmix64 state), seeded like the numpy one."""
    seed = drop_seed if drop_seed is not None else np.random.SeedSequence().entropy
    return np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)


class StreamState:
    """One worker's stream between calls (see the module's docstring). ``drop``: the test impairment,
    this fraction of packets lost each way, here at the host, drawn from ``drop_rng`` (numpy) and
    ``native_rng`` (the C loops: native_rng())."""

    def __init__(self, job: int, worker: int, workers: int, generation: int, lanes: int,
                 aggregators: Sequence[Aggregator], socket: BatchSocket, drop: float, drop_rng: np.random.Generator,
                 native_rng: np.ndarray) -> None:
        self.drop, self.drop_rng, self.native_rng = drop, drop_rng, native_rng
        self.job, self.worker, self.workers, self.lanes = job, worker, workers, lanes
        # the servers of the whole job, whom a sum is over (an auto scale and an average divide by them): the
        # workers, but for a leaf's group of a tree across racks (docs/protocol.md, "Trees across racks"); this
        # server's global number there (an OWNER_ONLY round's and a GATHER's owner: the worker in a flat group);
        # whether OWNER_ONLY rounds, GATHER and NACK cross the tree (a tree of more than 128 servers: no, and
        # reduce_scatter and all_gather go through SUM rounds: passing.stream.Group)
        self.servers, self.number, self.owner_only = workers, worker, True
        # the global number of each server of the job in the caller's order (the group index it joined as:
        # reduce_scatter's blocks, all_gather's pieces), None: that order is the global one
        self.order: np.ndarray | None = None
        self.generation = generation  # the allocation this group belongs to (stamped on DATA, checked on RESULT)
        self.aggregators = list(aggregators)
        self.aggregator_ids = np.array([a.packed for a in self.aggregators], dtype=np.int64)
        # per shard: the stream position of its next packet, unwrapped (psn = position mod 2^32; slot and
        # set come from the position, so every pool size keeps p and p + pool on one slot across the wrap)
        self.next_psn = np.zeros(len(self.aggregators), dtype=np.int64)
        # all_gather (docs/protocol.md, Kinds): the position of the next call's first GATHER packet (the
        # same at every worker), and the GATHERs of a call this worker has not begun yet, kept for it
        self.gather_position = 0
        self.early = EarlyGathers()
        self.socket = socket
        self.stripes: list[Any] = []  # passing.stripes.Stripe: the group's streams beyond this one (Group(streams=))

    def move_to(self, answer: dict[str, Any]) -> None:
        """The new allocation of a move answer: same address, same workers; a socket sized for the new
        aggregator's packets when their lane count differs (a PS of another MTU)."""
        lanes = int(answer["lanes"])
        if lanes != self.lanes:
            address, stats, offload = self.socket.address, self.socket.stats, self.socket.gso
            self.socket.close()  # what it still holds is the old allocation's: ignored anyway
            self.socket = BatchSocket(address, lanes=lanes, offload=offload)
            self.socket.stats = stats
            self.lanes = lanes
        self.job, self.generation = int(answer["job_id"]), int(answer["generation"])
        if "number" in answer:  # a tree's answer numbers the servers again (a flat one keeps the worker's)
            self.servers, self.number = int(answer["servers"]), int(answer["number"])
            self.owner_only = bool(answer.get("owner_only", True))
            self.order = np.array(answer["numbers"], np.int64) if answer.get("numbers") is not None else None
        self.aggregators = aggregators_of(answer)
        self.aggregator_ids = np.array([a.packed for a in self.aggregators], dtype=np.int64)
        self.next_psn = np.zeros(len(self.aggregators), dtype=np.int64)
        self.gather_position = 0  # positions, like psns, count from 0 on each allocation
        self.early.batches = []  # GATHERs of the old allocation: nobody sends them again

    # ---- the socket, through the test impairment ----------------------------------------

    def send(self, packets: np.ndarray, dest: np.ndarray, rows: np.ndarray) -> None:
        """Send ``packets[rows]`` to ``dest[rows]``, less those the impairment drops."""
        if self.drop:
            rows = rows[self.drop_rng.random(rows.size) >= self.drop]
        self.socket.send_batch(packets, dest[rows], rows)

    def receive(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What has arrived, less what the impairment drops: (packets, lengths, sources)."""
        view, lengths, sources = self.socket.recv_packets()
        if self.drop and len(view):
            keep = self.drop_rng.random(len(view)) >= self.drop
            view, lengths, sources = view[keep], lengths[keep], sources[keep]
        return view, lengths, sources

    # ---- which packets are this stream's ---------------------------------------------------

    def this_allocation(self, hdr: np.ndarray) -> np.ndarray:
        """Per header: of this allocation (job and generation); another's is never ours."""
        return (hdr["job"] == self.job) & (hdr["generation"] == self.generation)

    def addressed_here(self, hdr: np.ndarray) -> np.ndarray:
        """Per header: of this allocation and addressed to this worker."""
        return self.this_allocation(hdr) & (hdr["worker"] == self.worker)

    def shard_of(self, sources: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per source address: whether it is one of the aggregators, and which (0 where none)."""
        which = sources[:, None] == self.aggregator_ids[None, :]
        return which.any(axis=1), which.argmax(axis=1)

    def ours(self, hdr: np.ndarray, sources: np.ndarray) -> np.ndarray:
        """Per packet: addressed to this worker in this allocation, from one of its aggregators."""
        return self.addressed_here(hdr) & self.shard_of(sources)[0]

    def keep_early(self, view: np.ndarray, lengths: np.ndarray, sources: np.ndarray, next_start: int) -> None:
        """Keep this group's GATHER packets of the all_gather that starts at position ``next_start`` or
        later, which this worker has not begun (a faster peer's), for that call (up to EARLY_GATHERS)."""
        h = view["hdr"]
        mask = (wire.well_formed(view, lengths, self.lanes, wire.GATHER) & self.addressed_here(h)
                & ((h["psn"].astype(np.int64) - next_start) & 0xFFFFFFFF < 1 << 31))
        self.early.keep(view, lengths, sources, mask)

    # ---- the errors that name this stream ---------------------------------------------------

    def no_result(self, shard: int, psn: int, retries: int, timeout: float) -> AggregatorUnreachable:
        """A reduce packet unanswered for ``timeout`` s."""
        host, port = unpack_address(int(self.aggregator_ids[shard]))
        return AggregatorUnreachable(
            f"job {self.job} worker {self.worker}: no RESULT for psn {psn & 0xFFFFFFFF} "
            f"from aggregator {host}:{port} after {retries} retransmissions in "
            f"{timeout:g} s: the aggregator is unreachable or a peer worker stopped sending"
        )

    def gather_stalled(self, timeout: float, lacking: int | None = None) -> AggregatorUnreachable:
        """An all_gather that made no progress for ``timeout`` s (``lacking``: its packets still missing,
        where known)."""
        host, port = unpack_address(int(self.aggregator_ids[0]))
        missing = "" if lacking is None else f" ({lacking} packets lacking)"
        return AggregatorUnreachable(
            f"job {self.job} worker {self.worker}: all_gather made no progress through {host}:{port} in "
            f"{timeout:g} s{missing}: the aggregator is unreachable or a peer stopped")

    def check_completion(self, total: int) -> None:
        """An all_gather's completion round sums one per server of the job, or the servers are out of step."""
        if total != self.servers:
            raise PassingError(f"job {self.job}: the all_gather's completion round summed {total}, "
                               f"not {self.servers}: the workers are out of step")
