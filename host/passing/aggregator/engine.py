"""The aggregation state machine (docs/protocol.md), one target-independent implementation.

Besides DATA rounds it relays the stateless kinds (docs/protocol.md, Kinds): a GATHER goes
unchanged to every other worker of its job, a NACK to its owner; and an OWNER_ONLY round's
completion is a RESULT for its owner and a header-only ACK for every other worker.

The software aggregator (PS fallback) runs it behind UDP sockets, the tests run it
directly, and the P4 programs implement the very same rules in switch registers.

A job may also be a leaf or the root of a two-level tree (docs/protocol.md, "Trees across racks";
its entry in passing.aggregator.jobs): a leaf's completed round goes up to its root as one DATA
packet, and the root's RESULT or ACK, matched by the uplink's job id, is delivered to the leaf's
workers; owners go through each job's owner map. One engine, either role, by the job entry.

State per slot and set: the ``epoch`` of the allocation that wrote it (job id and
generation), a round ``tag`` (the psn being aggregated), a worker ``bitmap``, an
``overflow`` bit and ``lanes`` accumulators. ``lanes`` is the engine's width, the largest
packet a job may use; each job has a lane count of its own, at most that, and uses the
first that many accumulators of its slots (its packets and RESULTs are that long).
A batch of DATA packets is processed in arrival order with numpy: packets that hit
distinct slot/sets are independent, so the batch is split into waves in which every
slot/set occurs at most once (the k-th packet for a slot/set goes to wave k), and each
wave is one set of vectorised array operations. RESULTs come out in the arrival order of the
packets that caused them (a completion's replicas in worker order): the order a switch or a
packet-by-packet engine emits them in, so a host sees rounds complete in the order its peers
sent them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import wire
from .jobs import COUNTERS, NO_SOURCE, UP, ConfigError, JobSpec, JobTable, Uplink, check_admission
from .jobs import C as _C

__all__ = ["COUNTERS", "NO_SOURCE", "AggregationEngine", "ConfigError", "Emission", "JobSpec", "Uplink",
           "check_admission"]


@dataclass
class Emission:
    """Packets to send: the first ``lengths[i]`` bytes of ``packets[i]`` go to origin ``dest[i]``.

    ``packets`` has the engine's width (its lanes); a RESULT of a job with fewer lanes is as long as
    that job's packets, an ACK is its header alone, and the bytes of a row past its length are not
    part of it."""

    packets: np.ndarray
    dest: np.ndarray
    multicast: np.ndarray  # True for a replica of a completion, False for a unicast answer (or a leaf's packet up)
    lengths: np.ndarray  # bytes of each RESULT: its job's packet size

    def __len__(self) -> int:
        return len(self.packets)


class AggregationEngine:
    """Slots x 2 sets x lanes of integer accumulators shared by several jobs (``lanes``: the
    widest packet a job may use; each job uses its own lane count's worth of each slot)."""

    def __init__(self, slots: int, lanes: int = wire.DEFAULT_LANES, max_jobs: int = 1024) -> None:
        if slots < 1 or lanes < 1 or max_jobs < 1:
            raise ConfigError("slots, lanes and max_jobs must be >= 1")
        self.slots = slots
        self.lanes = lanes
        n = slots * 2  # flat index = slot * 2 + set
        self.acc = np.zeros((n, lanes), dtype=np.int32)
        self.tag = np.zeros(n, dtype=np.int64)
        self.bitmap = np.zeros(n, dtype=np.int64)
        self.state_epoch = np.full(n, -1, dtype=np.int64)  # -1: never used
        self.overflow = np.zeros(n, dtype=bool)
        # whether the round is answered: 0 not yet (a leaf's round until the root's answer), 1 with the sums
        # in acc (at completion, or a RESULT from the root), 2 by an ACK from the root (acc holds a partial)
        self.phase = np.zeros(n, dtype=np.int8)
        self.totals = np.zeros(len(COUNTERS), dtype=np.int64)
        self._jobs = JobTable(max_jobs)
        self._last_generation: dict[int, int] = {}  # job id -> generation of its latest allocation here

    # ---- admission -------------------------------------------------------------

    def add_job(self, spec: JobSpec) -> JobSpec:
        jobs = self._jobs
        check_admission(spec, jobs.by_id, self.slots, self.lanes, jobs.capacity, self._last_generation)
        jobs.add(spec)
        return spec

    def remove_job(self, job: int) -> JobSpec:
        return self._jobs.remove(job)

    def jobs(self) -> list[JobSpec]:
        return sorted(self._jobs.by_id.values(), key=lambda s: s.job)

    def counters(self, job: int | None = None) -> dict[str, int]:
        """Totals, or one admitted job's counters (unattributable drops are in totals only)."""
        if job is None:
            row = self.totals
        else:
            if job not in self._jobs.by_id:
                raise ConfigError(f"job {job} is not admitted")
            row = self._jobs.counters[self._jobs.index[job]]
        return {name: int(row[i]) for i, name in enumerate(COUNTERS)}

    # ---- data path ---------------------------------------------------------------

    def process(self, batch: np.ndarray, sources: np.ndarray, lengths: np.ndarray | None = None) -> Emission:
        """Apply a batch of received packets in order; return the RESULTs to send.

        ``batch`` is a packet array of any lane count up to this engine's, one row per
        datagram, ``sources`` the origin of each packet, ``lengths`` the received datagram
        sizes (default: the row size). A datagram is as many lanes long as its length says
        (the rest of its row is not read); its job must have that many. At a leaf, what comes
        down from its root (RESULT, ACK, and GATHER and NACK from the root's origin) is matched
        by its uplink's job id (docs/protocol.md, "Trees across racks").
        """
        n = len(batch)
        sources = np.asarray(sources, dtype=np.int64)
        row = batch.dtype.itemsize
        if lengths is None:
            lengths = np.full(n, row)
        lengths = np.asarray(lengths, dtype=np.int64)
        hdr = batch["hdr"]
        jobs = self._jobs
        # framing: a whole packet of a kind hosts send, 1..lanes lanes, that fits its row (a longer one was cut short)
        lanes = np.where(lengths <= row, wire.lanes_of(lengths, self.lanes), 0)
        kind = hdr["type"]
        is_data = kind == wire.DATA
        relay = (kind == wire.GATHER) | (kind == wire.NACK)
        framed = (lanes > 0) & (is_data | relay)
        d = jobs.index[hdr["job"]]
        down = None  # what comes down from a root, where some job here is a leaf
        aggregating_kind = is_data
        if jobs.leaves:
            answer = (kind == wire.RESULT) | (kind == wire.ACK)
            aggregating_kind = is_data | answer
            ud = jobs.up_index[hdr["job"]]  # the leaf job whose uplink has this job id, if any
            from_root = (ud >= 0) & (jobs.up_source[np.maximum(ud, 0)] == sources)
            down = answer | (relay & from_root)  # a RESULT or ACK comes from nowhere else
            framed = np.where(down, (ud >= 0) & np.where(kind == wire.ACK, lengths == wire.HEADER_SIZE, lanes > 0),
                              framed)
            d = np.where(down, ud, d)
        ok = framed & (hdr["version"] == wire.VERSION)
        worker = hdr["worker"].astype(np.int64)
        slot = hdr["slot"].astype(np.int64)
        known = ok & (d >= 0)
        dc = np.where(known, d, 0)
        owner = jobs.owners[dc, wire.owner_of(hdr["set"])]  # the owner as a worker here (owner map; UP, NOT_OWNER)
        owner_only = is_data & ((hdr["flags"] & wire.FLAG_OWNER_ONLY) != 0)
        admitted = (
            known
            & (hdr["generation"] == jobs.generation[dc])  # a late packet of an earlier allocation: rejected
            & (worker < jobs.workers[dc])
            & (jobs.sources[dc, np.minimum(worker, wire.MAX_WORKERS - 1)] == sources)
            & (lanes == jobs.lanes[dc])  # as long as the job's packets
            & (~is_data | (slot < jobs.pool[dc]))  # a relayed kind's slot is no slot
            & (~owner_only | (owner >= 0) | (owner == UP))
            & ((kind != wire.GATHER) | (owner == worker))  # a piece of the sender's own
            & ((kind != wire.NACK) | ((owner != worker) & ((owner >= 0) | (owner == UP))))
        )
        if down is not None and down.any():
            admitted = np.where(down, known & self._down_admitted(hdr, dc, owner, sources, lanes), admitted)
        tally = _Tally(self)
        tally.total("received", int(ok.sum()))
        tally.total("malformed", n - int(ok.sum()))
        tally.total("rejected", int((ok & ~known).sum()))  # no job to charge them to
        tally.jobs("rejected", d[known & ~admitted])

        out: list[Emission] = []
        causes: list[np.ndarray] = []  # per RESULT, the batch index of the packet that caused it
        # Jobs of one lane count at a time: a job's packets all have its lane count, and jobs share no
        # slot, so this is arrival order per slot.
        relayed = np.flatnonzero(admitted & relay)
        if relayed.size:
            came_down = np.zeros(relayed.size, dtype=bool) if down is None else down[relayed]
            emitted, cause = self._relay(batch[relayed], d[relayed], np.where(came_down, -1, worker[relayed]),
                                         owner[relayed], came_down, tally)
            out.append(emitted)
            causes.append(relayed[cause])
        aggregating = admitted & aggregating_kind
        job_lanes = jobs.lanes[dc]
        for count in np.unique(job_lanes[aggregating]):
            idx = np.flatnonzero(aggregating & (job_lanes == count))
            key = (jobs.base[d[idx]] + slot[idx]) * 2 + (hdr["set"][idx] & 1)
            # Rank of each packet among those for the same slot/set, in arrival order.
            order = np.argsort(key, kind="stable")
            sorted_key = key[order]
            first = np.r_[True, sorted_key[1:] != sorted_key[:-1]]
            position = np.arange(order.size)
            rank = np.empty_like(order)
            rank[order] = position - np.maximum.accumulate(np.where(first, position, 0))
            for r in range(int(rank.max()) + 1):
                in_wave = rank == r
                wave = idx[in_wave]  # ascending = arrival order
                emitted, cause = self._wave(batch[wave], d[wave], worker[wave], owner[wave], key[in_wave], tally,
                                            int(count))
                out.append(emitted)
                causes.append(wave[cause])
        tally.commit()
        if not out:
            return self._empty_emission()
        emission = _concat(out, self.lanes)
        order = np.argsort(np.concatenate(causes), kind="stable")  # arrival order of the causing packets
        return Emission(emission.packets[order], emission.dest[order], emission.multicast[order],
                        emission.lengths[order])

    def _down_admitted(self, hdr: np.ndarray, dc: np.ndarray, owner: np.ndarray, sources: np.ndarray,
                       lanes: np.ndarray) -> np.ndarray:
        """Admission of what comes down to leaf job ``dc`` from its root: the uplink's generation, worker and
        origin, the job's lanes (an ACK: the header alone), a RESULT's or ACK's slot in the pool, a GATHER's
        piece from another rack, a NACK's and an OWNER_ONLY RESULT's owner in this rack."""
        jobs = self._jobs
        kind = hdr["type"]
        owner_only = (hdr["flags"] & wire.FLAG_OWNER_ONLY) != 0
        return (
            (hdr["generation"] == jobs.up_generation[dc])
            & (hdr["worker"] == jobs.up_worker[dc])
            & (jobs.up_source[dc] == sources)
            & ((kind == wire.ACK) | (lanes == jobs.lanes[dc]))
            & (((kind != wire.RESULT) & (kind != wire.ACK)) | (hdr["slot"] < jobs.pool[dc]))
            & ((kind != wire.GATHER) | (owner == UP))
            & ((kind != wire.NACK) | (owner >= 0))
            & ((kind != wire.RESULT) | ~owner_only | (owner >= 0))
        )

    def _relay(self, pkts: np.ndarray, d: np.ndarray, worker: np.ndarray, owner: np.ndarray, down: np.ndarray,
               tally: _Tally) -> tuple[Emission, np.ndarray]:
        """Admitted GATHER and NACK packets: no state, one replica per receiver (a GATHER's: every worker
        but its sender, in worker order; a NACK's: its owner), each with ``worker`` = its receiver and
        otherwise the packet as sent; at a leaf, a host's GATHER and a NACK to another rack also go up (last),
        and what came down (``worker`` -1: no sender here) goes to this rack's servers with the job's own job
        id and generation. Returns them and, for each, the index of its packet in ``pkts``."""
        jobs = self._jobs
        gather = pkts["hdr"]["type"] == wire.GATHER
        receivers = [np.flatnonzero(np.arange(jobs.workers[j]) != w) if g else np.array([o] if o >= 0 else [])
                     for j, w, o, g in zip(d.tolist(), worker.tolist(), owner.tolist(), gather.tolist())]
        goes_up = ~down & jobs.leaf[d] & (gather | (owner == UP))
        counts = np.array([r.size for r in receivers], dtype=np.int64) + goes_up
        src = np.repeat(np.arange(len(pkts)), counts)
        up = np.zeros(src.size, dtype=bool)
        up[np.cumsum(counts)[goes_up] - 1] = True  # a packet's copy up comes after its replicas
        dest_worker = np.zeros(src.size, dtype=np.int64)
        dest_worker[~up] = np.concatenate([*receivers, np.zeros(0)]).astype(np.int64)
        out = wire.empty(src.size, self.lanes)
        out["hdr"] = pkts["hdr"][src]
        ds = d[src]
        out["hdr"]["worker"] = np.where(up, jobs.up_worker[ds], dest_worker)
        out["hdr"]["job"] = np.where(up, jobs.up_job[ds], jobs.job_id[ds])
        out["hdr"]["generation"] = np.where(up, jobs.up_generation[ds], jobs.generation[ds])
        width = pkts["payload"].shape[1]  # the batch's rows may be narrower than the engine's
        out["payload"][:, :width] = pkts["payload"][src]
        tally.jobs("relayed", d)
        tally.jobs("results_sent", ds[~up])
        tally.jobs("sent_up", ds[up])
        return Emission(
            packets=out,
            dest=np.where(up, jobs.up_source[ds], jobs.sources[ds, np.where(up, 0, dest_worker)]),
            multicast=~up,
            lengths=(wire.HEADER_SIZE + 4 * jobs.lanes[ds]).astype(np.int64),
        ), src

    def _wave(self, pkts: np.ndarray, d: np.ndarray, worker: np.ndarray, owner: np.ndarray, k: np.ndarray,
              tally: _Tally, lanes: int) -> tuple[Emission, np.ndarray]:
        """Packets of jobs of ``lanes`` lanes that all hit distinct slot/sets: one vectorised step of the
        state machine, on their first ``lanes`` accumulators (DATA, and a leaf's RESULTs and ACKs from its
        root). Returns the RESULTs (and partials up) and, for each, the index in ``pkts`` of the packet that
        caused it."""
        jobs = self._jobs
        hdr = pkts["hdr"]
        payload = pkts["payload"][:, :lanes]
        acc = self.acc[:, :lanes]
        psn = hdr["psn"].astype(np.int64)
        leaf = jobs.leaf[d]
        tree = bool(leaf.any())  # a leaf's rounds (only they have answers from a root): the tree's steps too
        data = hdr["type"] == wire.DATA if tree else np.ones(len(pkts), dtype=bool)
        wbit = np.where(data, np.left_shift(1, np.where(data, worker, 0)), 0) if tree else np.left_shift(1, worker)
        job_epoch = jobs.epoch[d]
        bitmap = self.bitmap[k]
        same_epoch = self.state_epoch[k] == job_epoch
        ahead = (psn - self.tag[k]) & 0xFFFFFFFF  # serial-number distance to the slot's round
        fresh = ~same_epoch | ((ahead != 0) & (ahead < 1 << 31))
        same_round = same_epoch & (ahead == 0)
        has_bit = (bitmap & wbit) != 0
        contrib = same_round & ~has_bit
        dup = same_round & has_bit
        if tree:
            fresh, contrib, dup = fresh & data, contrib & data, dup & data
        answered = dup & (bitmap == jobs.full[d])
        pending = down = None
        if tree:  # the phase of a leaf's round: answered by its root or not (other jobs' rounds never read it)
            phase = self.phase[k]
            pending = answered & leaf & (phase == 0)  # complete at a leaf, no answer from the root yet: re-send up
            answered = answered & ~pending
            # from the root: the answer of a round complete here and waiting for it; anything else is late
            down = ~data & same_round & (bitmap == jobs.full[d]) & (phase == 0)
        flagged = (hdr["flags"] & wire.FLAG_OVERFLOW) != 0

        # A new round: the first write resets the slot/set, no separate clearing pass.
        fk = k[fresh]
        acc[fk] = payload[fresh]
        self.tag[fk] = psn[fresh]
        self.state_epoch[fk] = job_epoch[fresh]
        self.bitmap[fk] = wbit[fresh]
        self.overflow[fk] = flagged[fresh]
        if tree:
            self.phase[fk] = 0

        # A contribution to the current round: saturating add (SUM) or max (MAX), in int32.
        ck = k[contrib]
        current = acc[ck]
        incoming = payload[contrib].astype(np.int32)
        lane_overflow = flagged[contrib]
        is_max = hdr["op"][contrib] == wire.MAX
        if is_max.all():
            combined = np.maximum(current, incoming)
        else:
            with np.errstate(over="ignore"):
                combined = current + incoming  # wraps: a wrap is a sign that neither input has
            wrapped = ((current ^ combined) & (incoming ^ combined)) < 0
            if wrapped.any():
                combined[wrapped] = np.where(current[wrapped] < 0, wire.INT32_MIN, wire.INT32_MAX)
                lane_overflow = lane_overflow | (wrapped.any(axis=1) & ~is_max)
            if is_max.any():
                combined[is_max] = np.maximum(current[is_max], incoming[is_max])
        acc[ck] = combined
        self.bitmap[ck] |= wbit[contrib]
        self.overflow[ck] |= lane_overflow

        if tree:  # the root's answer: a RESULT's sums replace the partial, either answer's flag the partial's (the
            # whole round's, which the rack's RESULTs and ACKs carry); after an ACK only ACKs go out
            result = down & (hdr["type"] == wire.RESULT)
            acc[k[result]] = payload[result]
            self.overflow[k[down]] = flagged[down]
            self.phase[k[down]] = np.where(result[down], 1, 2)
            tally.jobs("answered", d[down])
            tally.jobs("late_answer", d[~data & ~down])

        done = (fresh | contrib) & (self.bitmap[k] == jobs.full[d])
        tally.jobs("aggregated", d[fresh | contrib])
        tally.jobs("completed", d[done])
        tally.jobs("duplicate", d[dup & ~answered])
        tally.jobs("duplicate_answered", d[answered])
        tally.jobs("stale", d[data & ~fresh & ~same_round])
        tally.jobs("overflow", d[fresh & flagged])
        tally.jobs("overflow", d[contrib][lane_overflow])

        # Completion: one replica per worker of the job (replication id = worker); a leaf's goes up instead.
        ans_i = np.flatnonzero(answered)
        if pending is None or down is None:  # no leaf's round in the wave: every completion is answered here
            done_i = np.flatnonzero(done)
            if done_i.size + ans_i.size == 0:
                return self._empty_emission(), np.zeros(0, np.int64)
            return (self._answers(pkts, d, worker, owner, k, done_i, ans_i, tally, lanes, tree),
                    np.r_[np.repeat(done_i, jobs.workers[d[done_i]]), ans_i])
        done_i = np.flatnonzero((done & ~leaf) | down)
        up_i = np.flatnonzero((done & leaf) | pending)
        parts, causes = [], []
        if done_i.size + ans_i.size:
            parts.append(self._answers(pkts, d, worker, owner, k, done_i, ans_i, tally, lanes, tree))
            causes.append(np.r_[np.repeat(done_i, jobs.workers[d[done_i]]), ans_i])
        if up_i.size:
            parts.append(self._up(pkts, d, k, up_i, pending[up_i], tally, lanes))
            causes.append(up_i)
        if not parts:
            return self._empty_emission(), np.zeros(0, np.int64)
        return _concat(parts, self.lanes), np.concatenate(causes)

    def _answers(self, pkts: np.ndarray, d: np.ndarray, worker: np.ndarray, owner: np.ndarray, k: np.ndarray,
                 done_i: np.ndarray, ans_i: np.ndarray, tally: _Tally, lanes: int, tree: bool) -> Emission:
        """The RESULTs of the rounds answered in a wave: every worker's replica of each round in ``done_i``
        (in worker order), then an answer to the sender of each retransmission in ``ans_i`` (``tree``: the
        wave has a leaf's rounds)."""
        jobs = self._jobs
        hdr = pkts["hdr"]
        acc = self.acc[:, :lanes]
        reps = jobs.workers[d[done_i]]
        src = np.r_[np.repeat(done_i, reps), ans_i]
        dest_worker = np.r_[np.arange(reps.sum()) - np.repeat(np.cumsum(reps) - reps, reps), worker[ans_i]]
        res = wire.empty(src.size, self.lanes)
        rh = res["hdr"]
        for name in ("op", "job", "generation", "slot", "set", "psn"):
            rh[name] = hdr[name][src]
        # An OWNER_ONLY round's sums go to its owner; every other worker gets the header alone, an ACK.
        ack = ((hdr["flags"][src] & wire.FLAG_OWNER_ONLY) != 0) & (dest_worker != owner[src])
        if tree:
            rh["job"] = jobs.job_id[d[src]]  # a leaf's answer from its root goes out with the leaf's own
            rh["generation"] = jobs.generation[d[src]]
            ack = ack | (jobs.leaf[d[src]] & (self.phase[k[src]] == 2))  # a leaf answered by an ACK holds no sums
        rh["type"] = np.where(ack, wire.ACK, wire.RESULT)
        rh["worker"] = dest_worker
        rh["flags"] = self.overflow[k[src]] * wire.FLAG_OVERFLOW
        if jobs.roots:  # a root's answers down to its leaves keep OWNER_ONLY
            rh["flags"] |= jobs.root[d[src]] * (hdr["flags"][src] & wire.FLAG_OWNER_ONLY)
        res["payload"][:, :lanes] = np.where(ack[:, None], 0, acc[k[src]])
        tally.jobs("results_sent", d[src])
        return Emission(
            packets=res,
            dest=jobs.sources[d[src], dest_worker],
            multicast=np.arange(src.size) < src.size - ans_i.size,
            lengths=np.where(ack, wire.HEADER_SIZE, wire.packet_size(lanes)).astype(np.int64),
        )

    def _up(self, pkts: np.ndarray, d: np.ndarray, k: np.ndarray, up_i: np.ndarray, resent: np.ndarray,
            tally: _Tally, lanes: int) -> Emission:
        """A leaf's partials up, one DATA each (docs/protocol.md, "Trees across racks"): the round's op,
        slot, owner, set and psn; the uplink's job, generation and worker; OVERFLOW of the partial, the
        OWNER_ONLY of the packet that sent it, RETRANSMIT on a re-send."""
        jobs = self._jobs
        hdr = pkts["hdr"]
        du, ku = d[up_i], k[up_i]
        out = wire.empty(up_i.size, self.lanes)
        uh = out["hdr"]
        for name in ("op", "slot", "set", "psn"):
            uh[name] = hdr[name][up_i]
        uh["type"] = wire.DATA
        uh["job"], uh["generation"], uh["worker"] = jobs.up_job[du], jobs.up_generation[du], jobs.up_worker[du]
        uh["flags"] = (self.overflow[ku] * wire.FLAG_OVERFLOW | (hdr["flags"][up_i] & wire.FLAG_OWNER_ONLY)
                       | resent * wire.FLAG_RETRANSMIT)
        out["payload"][:, :lanes] = self.acc[ku, :lanes]
        tally.jobs("sent_up", du)
        return Emission(packets=out, dest=jobs.up_source[du], multicast=np.zeros(up_i.size, dtype=bool),
                        lengths=np.full(up_i.size, wire.packet_size(lanes), dtype=np.int64))

    def _empty_emission(self) -> Emission:
        return Emission(wire.empty(0, self.lanes), np.zeros(0, np.int64), np.zeros(0, bool), np.zeros(0, np.int64))


class _Tally:
    """Counter updates of one batch, applied with a single bincount."""

    def __init__(self, engine: AggregationEngine) -> None:
        self.engine = engine
        self.parts: list[np.ndarray] = []

    def total(self, name: str, count: int) -> None:
        self.engine.totals[_C[name]] += count

    def jobs(self, name: str, dense: np.ndarray) -> None:
        if dense.size:
            self.parts.append(dense * len(COUNTERS) + _C[name])

    def commit(self) -> None:
        if not self.parts:
            return
        counters = self.engine._jobs.counters
        flat = np.bincount(np.concatenate(self.parts), minlength=counters.size).reshape(counters.shape)
        counters += flat
        self.engine.totals += flat.sum(axis=0)


def _concat(parts: list[Emission], lanes: int) -> Emission:
    parts = [p for p in parts if len(p)] or parts[:1]
    if len(parts) == 1:
        return parts[0]
    # Not np.concatenate: numpy promotes structured dtypes to native byte order.
    packets = wire.empty(sum(len(p) for p in parts), lanes)
    at = 0
    for p in parts:
        packets[at : at + len(p)] = p.packets
        at += len(p)
    return Emission(
        packets=packets,
        dest=np.concatenate([p.dest for p in parts]),
        multicast=np.concatenate([p.multicast for p in parts]),
        lengths=np.concatenate([p.lengths for p in parts]),
    )
