"""Loss recovery of the numpy streams: the round-trip estimate, RACK's reordering allowance, the
probe's wait, and failover's silence rule. They mirror the C engine's (host/csrc/stream_loop.c: pn_smooth,
pn_probe_timeout, pn_probe_wait, pn_silence_gives_up and the constants of stream_loop.h; stream.c's
check_timers): a change to a rule here is a change there, since the engines are tested against each other.

Loss recovery keeps the window moving under random loss, and resends nothing while the stream only
waits for a late peer (a RESULT comes when every worker has sent its packet, so a peer that starts
its call later, or is descheduled, stops RESULTs as a loss would). A packet is resent once a packet
transmitted after it has been answered and it has been out for longer than that packet's round trip
plus a reordering allowance (RACK, RFC 8985). Rounds complete in transmission order on an in-order
path, since every worker sends in psn order, so this is evidence of loss; retransmissions give
evidence too, so a stalled window recovers. A shard silent (nothing sent, nothing answered) for a
while resends (a probe) its latest-sent packet, whose answer lets RACK judge the ones before it, and
the one out the longest, whose round holds every worker's window (if a resend of it was lost as
well, nothing later can be answered); each unanswered probe doubles the next wait (up to
``max_rto``). There is no per-packet timer. The while: within LOSS_MEMORY s of evidence of loss (a
RACK resend, a resend answered right away), two smoothed round trips (RFC 8985's PTO, 1 ms at
least), as silence is then likely a loss; otherwise ``rto`` at least (1 s by default, RFC 6298's
initial timer), as silence is then all but surely a late peer, whose lateness has a long tail: a
loss-free run resends nothing, and the first loss after a quiet spell costs that once. A packet
unanswered for ``timeout`` seconds ends the call with AggregatorUnreachable.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from .errors import Silenced

REORDER_FRACTION = 0.25  # RACK's reordering allowance: a quarter of the round trip (RFC 8985)
REORDER_MIN = 200e-6  # and at least this: RESULTs come in batches
PROBE_MIN = 1e-3  # a probe waits at least this
MAX_PROBE_DOUBLINGS = 6  # unanswered probes double the wait, up to 64 x and max_rto; `timeout` tells a dead one
LOSS_MEMORY = 10.0  # s: evidence of loss this recent makes a probe wait what the estimates say, not `rto`
SILENCE_EVERY = 0.5  # once silent for failover.after: how often to ask the controller again


def smooth(srtt: float, rttvar: float, sample: float) -> tuple[float, float]:
    """RFC 6298 smoothing of the round-trip estimate; the first sample (srtt < 0: none yet) sets it."""
    if srtt < 0:
        return sample, sample / 2
    return 0.875 * srtt + 0.125 * sample, 0.75 * rttvar + 0.25 * abs(srtt - sample)


def rack_overdue(rack_rtt: np.ndarray) -> np.ndarray:
    """How long a packet may stay unanswered once a later one was: that one's round trip plus the
    reordering allowance."""
    return rack_rtt + np.maximum(rack_rtt * REORDER_FRACTION, REORDER_MIN)


class LossRecovery:
    """A group's loss-recovery settings and estimates. They outlive each call (the next one starts
    from what this one learnt) and both engines share them: the C calls read and write the estimates
    through pointers (passing.native_stream)."""

    def __init__(self, rto_min: float, max_rto: float, timeout: float) -> None:
        self.rto_min, self.max_rto, self.timeout = rto_min, max_rto, timeout
        self.srtt, self.rttvar = -1.0, 0.0  # the round trip: set by the first sample (RFC 6298), -1 until then
        self.last_loss = -1.0  # time.monotonic() of the latest evidence of loss (a RACK resend, a resend
        # answered right away); -1: none

    def sample(self, rtt: float) -> None:
        """The sample is the slowest clean RESULT of a receive batch."""
        self.srtt, self.rttvar = smooth(self.srtt, self.rttvar, rtt)

    def loss_seen(self, now: float) -> None:
        """Evidence of loss at ``now``: for LOSS_MEMORY s a silence is taken for a loss, not a late peer."""
        self.last_loss = now

    def probe_timeout(self) -> float:
        """Two smoothed round trips (RFC 8985's PTO; ``rto`` before one is measured), 1 ms at least."""
        return max(self.rto_min if self.srtt < 0 else 2.0 * self.srtt, PROBE_MIN)

    def probe_waits(self, probes: np.ndarray, now: float) -> np.ndarray:
        """Per shard, the silence before its next probe: a probe's wait where the path has shown loss in
        the last LOSS_MEMORY s, else ``rto`` at least (a late peer, not a loss); each unanswered probe
        doubles it, up to ``max_rto``."""
        wait = self.probe_timeout()
        if self.last_loss < 0 or now - self.last_loss > LOSS_MEMORY:
            wait = max(wait, self.rto_min)
        return np.minimum(wait * 2.0 ** np.minimum(probes, MAX_PROBE_DOUBLINGS), max(wait, self.max_rto))


class SilenceWatch:
    """Failover's rule, the same for the reduce and the all_gather loops (host/csrc/stream_loop.c's
    pn_silence_gives_up): once nothing has been heard for ``after`` s, ask (``ask``: the group's question to
    the controller, True when it decided), then every SILENCE_EVERY s while the answer is to wait."""

    def __init__(self, after: float, ask: Callable[[], bool]) -> None:
        self.after, self.ask = after, ask

    def first_check(self, now: float) -> float:
        """When a loop that starts at ``now`` asks first, if nothing is heard."""
        return now + self.after

    def check(self, now: float, last_heard: float, check: float) -> float:
        """Ask at ``check`` once nothing has been heard since ``last_heard`` for ``after`` s; raises
        Silenced when the controller decided. Returns when to ask next."""
        if now - last_heard < self.after:
            return last_heard + self.after
        if now < check:
            return check
        if self.ask():
            raise Silenced()
        return time.monotonic() + SILENCE_EVERY
