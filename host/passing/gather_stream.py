"""The all_gather stream (docs/protocol.md, All-gather): each worker sends its piece once as GATHER
packets that the aggregator relays to the others, receivers ask for what they lack with NACKs, and a
one-packet completion round through the reduce path ends the call. GatherStream builds the call's
packets and buffers for either engine and runs the numpy loop, the executable specification of the C
one (host/csrc/gather.c's pn_gather_run, through passing.native_stream)."""

from __future__ import annotations

import time

import numpy as np

from . import native_stream, wire
from .recovery import LossRecovery, SilenceWatch
from .stream_state import StreamState


class GatherStream:
    """One all_gather. The pieces are the job's servers', by global number (a flat group's: its workers;
    a tree's: docs/protocol.md, "Trees across racks"): server o's is its GATHER positions G .. G + counts[o]
    - 1 (G: this call's start, the same at every worker), its packets' ``owner`` o; ``sizes`` in that order.
    A worker sends its own packets at most a window (its first aggregator's pool) ahead of what it holds from
    the slowest peer (all send at one pace, so a full receiver stops them all); sends its missing runs' NACKs
    after a silence (the probe rule of the reduce stream); answers the NACKs it gets by sending again; and,
    holding every piece, contributes its completion round (one DATA, lane 0 = 1), whose RESULT ends the call
    for every worker at once."""

    def __init__(self, state: StreamState, recovery: LossRecovery, silence: SilenceWatch | None,
                 piece: np.ndarray, sizes: list[int]) -> None:
        self.state, self.recovery, self.silence = state, recovery, silence
        lanes, me = state.lanes, state.number  # my piece's origin: my global number (the header's worker: my bit)
        row_bytes = 4 * lanes
        self.sizes = sizes
        self.counts = counts = np.array([-(-v // row_bytes) for v in sizes], dtype=np.int64)  # packets per piece
        self.start = state.gather_position
        self.aggregator = state.aggregator_ids[:1]  # GATHERs travel through the first aggregator
        self.window = state.aggregators[0].pool
        # my packets: the piece as raw bytes, zero-padded to whole packets
        self.mine = mine = int(counts[me])
        self.packets = wire.empty(mine, lanes)
        hdr = self.packets["hdr"]
        hdr["type"], hdr["job"], hdr["generation"] = wire.GATHER, state.job, state.generation
        hdr["worker"] = state.worker  # my bit at my aggregator
        hdr["set"] = wire.owner_set(me, 0)
        hdr["psn"] = (self.start + np.arange(mine)) & 0xFFFFFFFF
        body = np.zeros(mine * row_bytes, np.uint8)
        body[: piece.size] = piece
        rows_of_bytes = self.packets.view(np.uint8).reshape(mine, wire.packet_size(lanes))
        rows_of_bytes[:, wire.HEADER_SIZE :] = body.reshape(mine, row_bytes)
        self.dest = np.broadcast_to(self.aggregator, (mine,))
        # what arrives: each origin's packets in a staging area of whole rows (origin o from row base[o])
        self.base = np.r_[0, np.cumsum(counts)[:-1]]
        self.staged = np.zeros((int(counts.sum()), row_bytes), np.uint8)
        self.have = np.zeros(int(counts.sum()), dtype=bool)
        self.have[self.base[me] : self.base[me] + mine] = True
        self.lacking = int(counts.sum()) - mine
        # the completion round: one DATA on the first aggregator's reduce stream
        self.position = int(state.next_psn[0])
        slot, set_ = wire.slot_and_set(self.position, state.aggregators[0].pool)
        self.completion = wire.encode(type=wire.DATA, job=state.job, worker=state.worker, psn=self.position,
                                      slot=int(slot), set=int(set_), generation=state.generation, lanes=lanes,
                                      payload=np.r_[1, np.zeros(lanes - 1, np.int64)])
        self.sent = 0  # my packets sent once: a prefix
        self.resent_at = np.full(mine, -np.inf)  # when each was last sent again for a NACK
        self.prefixes = np.zeros(len(sizes), dtype=np.int64)  # per origin: how many of its packets, from its
        self.prefixes[me] = mine  # first, this worker holds

    def run(self, out: np.ndarray, starts: np.ndarray, native: bool) -> None:
        """The call, in the native engine or the numpy loop; every other server's piece into ``out``, piece
        o's at ``starts[o]`` (this server's own is already there)."""
        state = self.state
        now = time.monotonic()
        early = state.early.take()
        if early:  # first what arrived before this call began
            # bytes, not np.concatenate of the packets: numpy would make their fields native-endian
            view = np.concatenate([b[0].view(np.uint8) for b in early]).view(wire.packet_dtype(state.lanes))
            sources = np.concatenate([b[2] for b in early])
            self.lacking -= self._hold(view, np.concatenate([b[1] for b in early]),
                                       state.ours(view["hdr"], sources))
        if native:  # the loop below, in C
            native_stream.gather(state, self.recovery, self.silence, self.start, self.counts, self.packets,
                                 self.staged, self.have, self.completion, self.window)
        else:
            self._send_ahead()
            self._loop(now)
        state.gather_position = self.start + int(self.counts.max())
        state.next_psn[0] += 1
        for o in range(len(self.sizes)):
            if o != state.number:
                piece = self.staged[self.base[o] : self.base[o] + self.counts[o]].reshape(-1)
                out[starts[o] : starts[o] + self.sizes[o]] = piece[: self.sizes[o]]

    def _loop(self, now: float) -> None:
        state, recovery, silence = self.state, self.recovery, self.silence
        last_activity = last_progress = now
        silence_check = silence.first_check(now) if silence is not None else now
        probes = 0
        completion_sent = False
        while True:
            pto = recovery.probe_waits(np.array([probes]), now)[0]
            due = min(last_activity + pto, silence_check) if silence is not None else last_activity + pto
            state.socket.wait_readable(max(0.0, min(due - time.monotonic(), 0.05)))
            view, lengths, sources = state.receive()
            now = time.monotonic()
            progress = False
            if len(view):
                h = view["hdr"]
                ours = state.ours(h, sources)
                fresh = self._hold(view, lengths, ours)
                if fresh:
                    self.lacking -= fresh
                    progress = True
                # the next call's, from a peer already in it: kept for that call
                state.keep_early(view, lengths, sources, self.start + int(self.counts.max()))
                self._answer_nacks(view, lengths, ours, now)
                results = (ours & wire.well_formed(view, lengths, state.lanes, wire.RESULT)
                           & (h["psn"] == self.position & 0xFFFFFFFF) & (sources == self.aggregator[0]))
                if completion_sent and results.any():
                    state.check_completion(int(view["payload"][np.flatnonzero(results)[0], 0]))
                    break
            if progress:
                last_activity = last_progress = now
                probes = 0
                self._send_ahead()
            if self.lacking == 0 and not completion_sent:
                state.send(self.completion, self.aggregator, np.array([0]))
                completion_sent = True
                last_activity = last_progress = now
                probes = 0
            if now - last_progress > recovery.timeout:
                raise state.gather_stalled(recovery.timeout, self.lacking)
            if silence is not None:
                silence_check = silence.check(now, last_progress, silence_check)
            if now >= last_activity + recovery.probe_waits(np.array([probes]), now)[0]:
                if completion_sent:  # its RESULT is lost, or a peer still lacks something
                    self.completion["hdr"]["flags"] |= wire.FLAG_RETRANSMIT
                    state.send(self.completion, self.aggregator, np.array([0]))
                    state.socket.stats.retransmissions += 1
                else:
                    self._nack_missing()
                probes += 1
                last_activity = now

    def _hold(self, view: np.ndarray, lengths: np.ndarray, ours: np.ndarray) -> int:
        """Take this call's GATHERs from the others (``ours``: the packets of this stream) into
        ``staged``; how many were new."""
        state, h = self.state, view["hdr"]
        origin = wire.owner_of(h["set"])
        offset = (h["psn"].astype(np.int64) - self.start) & 0xFFFFFFFF
        valid_origin = origin < len(self.counts)
        piece_count = self.counts[np.where(valid_origin, origin, 0)]
        current = (ours & wire.well_formed(view, lengths, state.lanes, wire.GATHER) & valid_origin
                   & (origin != state.number) & (offset < piece_count))
        rows = self.base[origin[current]] + offset[current]
        fresh, first = np.unique(rows[~self.have[rows]], return_index=True)
        if fresh.size:
            payload = view.view(np.uint8).reshape(len(view), -1)[:, wire.HEADER_SIZE :]
            self.staged[fresh] = payload[np.flatnonzero(current)[~self.have[rows]][first]]
            self.have[fresh] = True
        return int(fresh.size)

    def _answer_nacks(self, view: np.ndarray, lengths: np.ndarray, ours: np.ndarray, now: float) -> None:
        """Send again what a NACK to this worker asks for, of what it has sent."""
        h = view["hdr"]
        offset = (h["psn"].astype(np.int64) - self.start) & 0xFFFFFFFF
        nacks = (ours & wire.well_formed(view, lengths, self.state.lanes, wire.NACK)
                 & (wire.owner_of(h["set"]) == self.state.number))
        for first_row, count in zip(offset[nacks].tolist(), h["slot"][nacks].tolist()):
            asked = np.arange(first_row, min(first_row + count, self.sent))  # a NACK of what the window
            asked = asked[now - self.resent_at[asked] > self.recovery.probe_timeout() / 2]  # will send is moot
            if asked.size:  # several receivers may ask for one loss: sent again once per half probe
                self.packets["hdr"]["flags"][asked] |= wire.FLAG_RETRANSMIT
                self.state.send(self.packets, self.dest, asked)
                self.resent_at[asked] = now
                self.state.socket.stats.retransmissions += asked.size

    def _send_ahead(self) -> None:
        """Send my packets up to a window ahead of the slowest peer's prefix."""
        counts, prefixes, have, base = self.counts, self.prefixes, self.have, self.base
        for o in range(len(counts)):
            while prefixes[o] < counts[o]:  # advance past what arrived, a bounded look at a time
                got = have[base[o] + prefixes[o] : base[o] + min(counts[o], prefixes[o] + 4 * self.window)]
                prefixes[o] += got.size if got.all() else int(np.argmin(got))
                if not got.all():
                    break
        behind = prefixes[prefixes < counts]
        limit = min(self.mine, (int(behind.min()) if behind.size else self.mine) + self.window)
        if limit > self.sent:
            self.state.send(self.packets, self.dest, np.arange(self.sent, limit))
            self.sent = limit

    def _nack_missing(self) -> None:
        """One NACK per origin: its first missing run, up to ``window`` packets (a peer that is only
        late is asked for no more than that)."""
        state, nacks = self.state, []
        for o in range(len(self.counts)):
            got = self.have[self.base[o] : self.base[o] + self.counts[o]]
            if got.all():
                continue
            first = int(np.argmin(got))
            run = got[first : first + self.window]
            length = int(np.argmax(run)) if run.any() else run.size
            nacks.append((o, first, min(length, 0xFFFF)))
        if not nacks:
            return
        batch = wire.empty(len(nacks), state.lanes)
        h = batch["hdr"]
        h["type"], h["job"], h["worker"], h["generation"] = wire.NACK, state.job, state.worker, state.generation
        h["set"] = wire.owner_set(np.array([o for o, _, _ in nacks]), 0)
        h["psn"] = (self.start + np.array([f for _, f, _ in nacks])) & 0xFFFFFFFF
        h["slot"] = [n for _, _, n in nacks]
        state.send(batch, np.broadcast_to(state.aggregator_ids[:1], (len(nacks),)), np.arange(len(nacks)))
