"""The numpy reduce stream: one pass of a group's int32 rows through its aggregators, all shards at
once; the executable specification of the C loop (host/csrc/stream.c's pn_stream_run) it is tested
against.

Per aggregator the window is self-clocked: psn p uses slot p mod pool, and p + pool is sent only once
the RESULT of p is in, so at most ``pool`` packets are in flight and the aggregator's two sets per slot
always hold every round someone may still ask for. Lost packets are resent by the rules of
passing.recovery (RACK on evidence, probes after a silence)."""

from __future__ import annotations

import time

import numpy as np

from . import wire
from .recovery import LossRecovery, SilenceWatch, rack_overdue
from .stream_state import StreamState

INT32_MAX, INT32_MIN = np.iinfo(np.int32).max, np.iinfo(np.int32).min


class ReduceStream:
    """One pass: aggregate one (n_i, lanes) int32 block per aggregator. With ``flags`` (per shard, per
    row) the DATA packets carry them (OVERFLOW where quantizing saturated). With ``owners`` (per shard,
    the owner of each row) the rounds are OWNER_ONLY: a row this worker does not own is answered by an
    ACK, and its sums stay zero here."""

    def __init__(self, state: StreamState, recovery: LossRecovery, silence: SilenceWatch | None,
                 blocks: list[np.ndarray], op: int, flags: list[np.ndarray] | None = None,
                 owners: list[np.ndarray] | None = None) -> None:
        self.state, self.recovery, self.silence = state, recovery, silence
        self.blocks, self.op, self.flags, self.owners = blocks, op, flags, owners
        self.counts = np.array([len(b) for b in blocks], dtype=np.int64)
        self.starts = np.r_[0, np.cumsum(self.counts)[:-1]]
        self.total = int(self.counts.sum())
        self.pools = np.array([a.pool for a in state.aggregators], dtype=np.int64)
        self.shard = np.repeat(np.arange(len(blocks)), self.counts)  # per row: its shard
        self.offset = np.arange(self.total) - self.starts[self.shard]  # and its place in the shard
        self.psn = state.next_psn[self.shard] + self.offset  # unwrapped

    def run(self) -> tuple[list[np.ndarray], list[bool]]:
        """Each shard's summed rows, and whether any of its RESULTs carried OVERFLOW."""
        if self.total == 0:
            return [b.astype(np.int32) for b in self.blocks], [False] * len(self.blocks)
        shards, total = len(self.blocks), self.total
        self.packets = self._packets()
        self.dest = self.state.aggregator_ids[self.shard]
        # Self-clocking: the RESULT of row i releases row i + pool of the same shard.
        self.successor = np.where(self.offset + self.pools[self.shard] < self.counts[self.shard],
                                  np.arange(total) + self.pools[self.shard], -1)
        self.results = np.zeros((total, self.state.lanes), dtype=np.int32)
        self.result_flags = np.zeros(total, dtype=np.uint8)
        self.done = np.zeros(total, dtype=bool)
        self.first_sent = np.zeros(total)
        self.last_sent = np.zeros(total)
        self.retries = np.zeros(total, dtype=np.int64)  # transmissions after the first
        self.xmit = np.zeros(total, dtype=np.int64)  # order of each packet's latest transmission (ties of time broken)
        self.rack_xmit = np.zeros(shards, dtype=np.int64)  # per shard: the latest-transmitted answered packet's
        self.rack_rtt = np.zeros(shards)  # and that packet's round trip

        now = time.monotonic()
        windows = zip(self.starts, self.pools, self.counts)  # each shard's first window
        self.inflight = np.concatenate([np.arange(s, s + min(p, c)) for s, p, c in windows]).astype(np.int64)
        self.state.send(self.packets, self.dest, self.inflight)
        self.first_sent[self.inflight] = self.last_sent[self.inflight] = now
        self.xmit[self.inflight] = np.arange(1, self.inflight.size + 1)
        self.transmissions = self.inflight.size
        self.next_due = now  # the loop computes the first probe's time before it waits
        self.last_activity = np.full(shards, now)  # per shard: its latest transmission or answer
        self.probes = np.zeros(shards, dtype=np.int64)  # per shard: probes since its last answer
        self.remaining = total
        self.last_answer = now  # the latest RESULT that answered a packet (or the call's start)
        self.silence_check = self.silence.first_check(now) if self.silence is not None else now

        while self.remaining:
            wait = self.next_due - time.monotonic() if self.inflight.size else 0.05
            if wait > 0:
                self.state.socket.wait_readable(min(wait, 0.05))
            view, lengths, sources = self.state.receive()
            now = time.monotonic()
            if len(view):
                self.state.keep_early(view, lengths, sources, self.state.gather_position)  # a peer's next all_gather
                self._take_answers(view, lengths, sources, now)
            self._recover(now)
        return self._finish()

    def _packets(self) -> np.ndarray:
        """Every row's DATA packet: header from its position, int32 rows into big-endian payloads."""
        packets = wire.empty(self.total, self.state.lanes)
        hdr = packets["hdr"]
        hdr["type"], hdr["op"], hdr["job"], hdr["worker"] = wire.DATA, self.op, self.state.job, self.state.worker
        hdr["generation"] = self.state.generation
        hdr["psn"] = self.psn & 0xFFFFFFFF
        hdr["slot"], set_ = wire.slot_and_set(self.psn, self.pools[self.shard])
        hdr["flags"] = np.concatenate(self.flags) if self.flags else 0
        if self.owners is not None:
            hdr["set"] = wire.owner_set(np.concatenate(self.owners), set_)
            hdr["flags"] |= wire.FLAG_OWNER_ONLY
        else:
            hdr["set"] = set_
        at = 0
        for block in self.blocks:  # one pass each: int32 rows into big-endian packets
            packets["payload"][at : at + len(block)] = block
            at += len(block)
        return packets

    def _match(self, view: np.ndarray, lengths: np.ndarray, sources: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row, position in view) of each received RESULT (or ACK) that belongs to this pass."""
        state, hdr = self.state, view["hdr"]
        valid = wire.well_formed(view, lengths, state.lanes, wire.RESULT) | wire.well_formed_ack(view, lengths)
        state.socket.stats.foreign_results += int((valid & ~state.this_allocation(hdr)).sum())  # never ours
        from_aggregator, s = state.shard_of(sources)
        valid &= state.addressed_here(hdr) & from_aggregator
        offset = (hdr["psn"].astype(np.int64) - state.next_psn[s]) & 0xFFFFFFFF
        valid &= offset < self.counts[s]
        positions = np.flatnonzero(valid)
        return (self.starts[s] + offset)[positions], positions

    def _take_answers(self, view: np.ndarray, lengths: np.ndarray, sources: np.ndarray, now: float) -> None:
        """Record the RESULTs of rows not answered before; each releases its shard's next row."""
        rows, positions = self._match(view, lengths, sources)
        rows, first = np.unique(rows, return_index=True)
        new = ~self.done[rows]
        rows, got = rows[new], view[positions[first[new]]]
        if not rows.size:
            return
        # answered right after a resend: the resend was (most likely) needed, evidence of loss
        if ((self.retries[rows] > 0) & (now - self.last_sent[rows] <= self.recovery.probe_timeout())).any():
            self.recovery.loss_seen(now)
        self.results[rows] = np.where((got["hdr"]["type"] == wire.ACK)[:, None], 0, got["payload"])
        self.result_flags[rows] = got["hdr"]["flags"]
        self.done[rows] = True
        self.remaining -= rows.size
        self.last_answer = now
        shard = self.shard
        self.last_activity[shard[rows]] = now
        self.probes[shard[rows]] = 0
        for sh in np.unique(shard[rows]):  # RACK: the latest-sent packet known delivered
            latest = rows[shard[rows] == sh][np.argmax(self.xmit[rows[shard[rows] == sh]])]
            if self.xmit[latest] > self.rack_xmit[sh]:
                self.rack_xmit[sh], self.rack_rtt[sh] = self.xmit[latest], now - self.last_sent[latest]
        clean = rows[self.retries[rows] == 0]  # Karn: only unambiguous RTT samples
        if clean.size:
            self.recovery.sample(float(np.max(now - self.first_sent[clean])))
        nxt = self.successor[rows]
        nxt = nxt[nxt >= 0]
        if nxt.size:
            self.state.send(self.packets, self.dest, nxt)
            self.first_sent[nxt] = self.last_sent[nxt] = now
            self.xmit[nxt] = self.transmissions + 1 + np.arange(nxt.size)
            self.transmissions += nxt.size
        keep = ~self.done[self.inflight]
        self.inflight = np.r_[self.inflight[keep], nxt]

    def _recover(self, now: float) -> None:
        """The timers after a receive: the timeout, RACK resends, probes, failover's question, and when
        to wake next."""
        inflight, shard = self.inflight, self.shard
        late = now - self.first_sent[inflight] > self.recovery.timeout
        if late.any():
            r = int(inflight[late][0])
            raise self.state.no_result(int(shard[r]), int(self.psn[r]), int(self.retries[r]), self.recovery.timeout)
        # a packet sent later is answered and this one is overdue for that round trip: resend it now
        overdue = rack_overdue(self.rack_rtt)
        sh = shard[inflight]
        later_answered = self.rack_xmit[sh] > self.xmit[inflight]
        early = np.flatnonzero(later_answered & (now >= self.last_sent[inflight] + overdue[sh]))
        if early.size:
            self._resend(early, True, now)
        # probe: a shard silent for a while resends the packet out the longest (its round holds every
        # worker's window: when a RACK resend of it was lost too, nothing later can be answered) and its
        # latest-sent one, whose answer lets RACK judge the ones before it; a peer that is only slow makes
        # a shard silent too, so each unanswered probe doubles the wait
        pto = self.recovery.probe_waits(self.probes, now)
        probe_rows = []
        for sh_i in np.unique(sh):
            if now >= self.last_activity[sh_i] + pto[sh_i]:
                mine = np.flatnonzero(sh == sh_i)
                oldest, latest = mine[np.argmin(inflight[mine])], mine[np.argmax(self.xmit[inflight[mine]])]
                probe_rows += [oldest, latest] if oldest != latest else [latest]
                self.probes[sh_i] += 1
        if probe_rows:
            self._resend(np.array(probe_rows), False, now)
        if self.silence is not None and self.remaining:
            self.silence_check = self.silence.check(now, self.last_answer, self.silence_check)
        if inflight.size:  # wake for the earliest RACK deadline or probe
            live = np.unique(sh)
            pto = self.recovery.probe_waits(self.probes, now)
            self.next_due = float(np.min(self.last_activity[live] + pto[live]))  # after this round's probes
            rack_due = self.last_sent[inflight] + overdue[sh]
            if later_answered.any():
                self.next_due = min(self.next_due, float(rack_due[later_answered].min()))
            if self.silence is not None:
                self.next_due = min(self.next_due, self.silence_check)

    def _resend(self, positions: np.ndarray, early: bool, now: float) -> None:
        """Retransmit inflight[positions]: early (RACK: a later packet was answered) or as probes."""
        rows = self.inflight[positions]
        self.packets["hdr"]["flags"][rows] |= wire.FLAG_RETRANSMIT
        self.state.send(self.packets, self.dest, rows)
        self.last_sent[rows] = now
        self.last_activity[self.shard[rows]] = now
        self.xmit[rows] = self.transmissions + 1 + np.arange(rows.size)
        self.transmissions += rows.size
        stats = self.state.socket.stats
        stats.retransmissions += rows.size
        stats.early_retransmissions += rows.size if early else 0
        self.retries[rows] += 1
        if early:  # a later packet was answered: evidence of loss
            self.recovery.loss_seen(now)

    def _finish(self) -> tuple[list[np.ndarray], list[bool]]:
        """Advance the psn streams past this pass; each shard's sums and whether it overflowed."""
        self.state.next_psn = self.state.next_psn + self.counts
        out = [self.results[s : s + c] for s, c in zip(self.starts, self.counts)]
        flagged = (self.result_flags & wire.FLAG_OVERFLOW) != 0
        if self.op == wire.SUM and self.owners is None:
            # A lane at an int32 bound is a saturated sum: the Tofino program saturates
            # without flagging it (docs/tofino.md), so the host counts it as overflow on
            # every target (an exact sum of -2^31 or 2^31-1 is taken for one too). Not in an
            # OWNER_ONLY pass: only the owner sees the sums, and every worker must agree on
            # an overflow (to redo the call alike), so there the flag alone tells.
            flagged |= ((self.results == INT32_MAX) | (self.results == INT32_MIN)).any(axis=1)
        overflow = [bool(flagged[s : s + c].any()) for s, c in zip(self.starts, self.counts)]
        return out, overflow
