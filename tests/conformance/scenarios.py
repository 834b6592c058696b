"""The aggregation scenario table (docs/protocol.md, "The aggregation state machine"), as data.

Every target that implements the state machine (the pure engine, the software
aggregator over UDP, BMv2, the Tofino review) runs this same table through
``runner.run_scenario``. Payloads are short patterns repeated to the target's lane
count, so one table serves 64-lane switches and any software lane count.

A scenario admits its jobs, then plays its steps in order. A ``Send`` says what the
header holds, which admitted (job, worker) origin sends it (by default the one the
header names; ``"stranger"`` is an origin no job admits), and what must come back: the
RESULTs, each to the listed workers of its job, and the change of the aggregator's
total counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from passing import wire

MAX32 = wire.INT32_MAX
MIN32 = wire.INT32_MIN
RT = wire.FLAG_RETRANSMIT
OVF = wire.FLAG_OVERFLOW
OWN = wire.FLAG_OWNER_ONLY


@dataclass(frozen=True)
class Up:
    """A leaf job's uplink (docs/protocol.md, "Trees across racks"): the root's job id and generation for it
    and the leaf's worker there; the root is the origin "root"."""

    job: int
    worker: int
    generation: int = 0


@dataclass(frozen=True)
class Job:
    job: int
    workers: int
    base: int
    pool: int
    generation: int = 0  # which allocation of this job id (docs/protocol.md)
    lanes: int | None = None  # int32 values of its packets; None: the target's (a switch has no other)
    role: str = "flat"  # or "leaf" (with up), "root"
    owners: tuple[int, ...] | None = None  # the owner map; None: a flat job's identity
    up: Up | None = None


@dataclass(frozen=True)
class Result:
    to: tuple[int, ...]  # worker indices of the job that receive this RESULT
    psn: int
    values: tuple[int, ...]
    job: int = 1
    op: int = wire.SUM
    flags: int = 0
    kind: int = wire.RESULT  # RESULT, ACK (compared as the header alone), or a relayed GATHER or NACK
    up: bool = False  # a leaf's packet to its root (``to`` unused): the uplink's job, generation and worker


@dataclass(frozen=True)
class Send:
    worker: int
    psn: int
    values: tuple[int, ...]
    job: int = 1
    op: int = wire.SUM
    flags: int = 0
    origin: tuple[int, int] | str | None = None  # (job, worker) whose origin sends; "stranger"; None: the header's
    slot: int | None = None  # default: psn mod pool
    set: int | None = None  # default: (psn div pool) mod 2
    generation: int | None = None  # default: the generation of the job's allocation now
    lanes: int | None = None  # default: the lane count of the job's allocation
    kind: int = wire.DATA  # DATA, or GATHER / NACK (relayed), or a kind no host sends
    owner: int = 0  # byte 9's owner: of an OWNER_ONLY round, a GATHER's sender, a NACK's addressee
    expect: tuple[Result, ...] = ()
    counters: dict[str, int] = field(default_factory=dict)  # expected change of totals


@dataclass(frozen=True)
class Admit:
    job: Job


@dataclass(frozen=True)
class Remove:
    job: int


@dataclass(frozen=True)
class Scenario:
    name: str
    jobs: tuple[Job, ...]
    steps: tuple[Send | Admit | Remove, ...]
    switch_only: bool = False  # e.g. plain L2 forwarding: no software equivalent
    software_only: bool = False  # e.g. lanes per allocation: a switch has one lane count
    tree: bool = False  # a leaf's or root's (tree_scenarios.py): software only until the P4 programs take the roles


def _both(job: Job) -> tuple[int, ...]:
    return tuple(range(job.workers))


J2 = Job(job=1, workers=2, base=0, pool=4)
J3 = Job(job=1, workers=3, base=0, pool=4)
AGG = {"aggregated": 1}
DONE = {"aggregated": 1, "completed": 1}
RELAYED = {"relayed": 1}
BITS = (MIN32, MAX32, -1, 0x7FC00000, 0x00800001, 0)  # any bit pattern (a float32 NaN among them) travels as it is


def _round(psn: int, a: tuple[int, ...], b: tuple[int, ...], total: tuple[int, ...], job: int = 1) -> tuple[Send, ...]:
    """Both workers of a 2-worker job contribute to psn; the second completes it."""
    return (
        Send(0, psn, a, job=job, counters=AGG),
        Send(1, psn, b, job=job, expect=(Result((0, 1), psn, total, job=job),), counters=DONE),
    )


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("basic_reduction", (J2,), _round(0, (1, 2, 3, -4), (10, 20, 30, 40), (11, 22, 33, 36))),
    Scenario("max_op", (J2,), (
        Send(0, 0, (5, -7, 3, 0), op=wire.MAX, counters=AGG),
        Send(1, 0, (2, -1, 9, 0), op=wire.MAX, expect=(Result((0, 1), 0, (5, -1, 9, 0), op=wire.MAX),),
             counters=DONE),
    )),
    Scenario("retransmit_after_completion", (J2,), (
        *_round(0, (1,), (2,), (3,)),
        Send(0, 0, (1,), flags=RT, expect=(Result((0,), 0, (3,)),), counters={"duplicate_answered": 1}),
        Send(1, 0, (2,), flags=RT, expect=(Result((1,), 0, (3,)),), counters={"duplicate_answered": 1}),
    )),
    Scenario("retransmit_before_completion", (J2,), (
        Send(0, 0, (7,), counters=AGG),
        Send(0, 0, (7,), flags=RT, counters={"duplicate": 1}),
        Send(1, 0, (1,), expect=(Result((0, 1), 0, (8,)),), counters=DONE),  # 8, not 15
    )),
    Scenario("both_sets_in_flight", (Job(1, 2, 0, 2),), (
        *_round(0, (1,), (2,), (3,)),
        *_round(1, (4,), (5,), (9,)),
        Send(0, 2, (100,), counters=AGG),  # worker 0 got psn 0's RESULT: slot 0, set 1
        # worker 1 lost psn 0's RESULT: set 0 of slot 0 still holds it
        Send(1, 0, (2,), flags=RT, expect=(Result((1,), 0, (3,)),), counters={"duplicate_answered": 1}),
        Send(1, 2, (200,), expect=(Result((0, 1), 2, (300,)),), counters=DONE),
        Send(0, 1, (4,), flags=RT, expect=(Result((0,), 1, (9,)),), counters={"duplicate_answered": 1}),
    )),
    Scenario("slot_reuse_many_rounds", (Job(1, 2, 0, 2),), tuple(
        step for psn in range(12) for step in _round(psn, (psn, -psn), (1000 * psn, 7), (1001 * psn, 7 - psn))
    )),
    Scenario("stale_packet", (Job(1, 2, 0, 1),), (
        *_round(0, (1,), (1,), (2,)),
        *_round(1, (2,), (2,), (4,)),
        *_round(2, (3,), (3,), (6,)),  # psn 2 replaced psn 0 in slot 0, set 0
        Send(0, 0, (50,), flags=RT, counters={"stale": 1}),
        Send(1, 1, (2,), flags=RT, expect=(Result((1,), 1, (4,)),), counters={"duplicate_answered": 1}),
        *_round(3, (4,), (4,), (8,)),  # psn 3 replaced psn 1 in slot 0, set 1
        Send(1, 1, (50,), flags=RT, counters={"stale": 1}),
        Send(0, 2, (3,), flags=RT, expect=(Result((0,), 2, (6,)),), counters={"duplicate_answered": 1}),
    )),
    Scenario("slot_reuse_by_next_job", (J2,), (
        *_round(0, (1, 1), (2, 2), (3, 3)),
        Remove(1),
        Admit(Job(job=2, workers=2, base=0, pool=4)),
        # Same slot, set and psn as job 1's completed round: a new round, not a duplicate.
        Send(0, 0, (5, 5), job=2, counters=AGG),
        Send(1, 0, (6, 6), job=2, expect=(Result((0, 1), 0, (11, 11), job=2),), counters=DONE),
    )),
    # A late DATA of the previous allocation of the same job id, from the same origin (a copy
    # still queued, a process of the old job not yet dead): whatever its psn, it is rejected
    # and touches nothing of the new allocation, whose rounds complete with exact sums.
    Scenario("late_packet_of_previous_allocation", (J2,), (
        *_round(0, (1,), (2,), (3,)),
        *_round(1, (4,), (5,), (9,)),
        Send(0, 2, (6,), counters=AGG),  # the old allocation ends with a round half done
        Remove(1),
        Admit(Job(job=1, workers=2, base=0, pool=4, generation=1)),
        Send(0, 1, (10,), counters=AGG),  # the new allocation's round 1 waits for worker 1
        Send(1, 1, (5000,), generation=0, counters={"rejected": 1}),  # same psn: would complete it wrongly
        Send(1, 0, (5000,), generation=0, flags=RT, counters={"rejected": 1}),  # older psn (completed in A)
        Send(1, 9, (5000,), generation=0, counters={"rejected": 1}),  # newer psn, same slot/set: would reset it
        Send(0, 2, (5000,), generation=0, flags=RT, counters={"rejected": 1}),  # A's half-done round
        Send(1, 1, (20,), expect=(Result((0, 1), 1, (30,)),), counters=DONE),
        *_round(2, (1,), (1,), (2,)),  # slot 2, set 0 held A's unfinished round: a fresh round now
        Send(1, 9, (7,), counters=AGG),  # B's own newer psn on slot 1, set 0 is still welcome
        Send(0, 9, (8,), expect=(Result((0, 1), 9, (15,)),), counters=DONE),
    )),
    Scenario("unknown_job", (J2,), (
        Send(0, 0, (1,), job=9, origin="stranger", counters={"rejected": 1}),
        Send(0, 0, (1,), job=9, origin=(1, 0), counters={"rejected": 1}),  # an admitted origin, wrong job id
        *_round(0, (1,), (2,), (3,)),
    )),
    Scenario("unadmitted_source", (J2,), (
        Send(0, 0, (1000,), origin="stranger", counters={"rejected": 1}),
        Send(0, 0, (1000,), origin=(1, 1), counters={"rejected": 1}),  # worker 1's origin posing as worker 0
        *_round(0, (1,), (2,), (3,)),
    )),
    Scenario("slot_out_of_range", (J2,), (
        Send(0, 4, (1,), slot=4, set=0, counters={"rejected": 1}),
        Send(0, 0, (1,), slot=65535, set=0, counters={"rejected": 1}),
        *_round(0, (1,), (2,), (3,)),
    )),
    Scenario("worker_out_of_range", (J2,), (
        Send(5, 0, (1,), origin=(1, 0), counters={"rejected": 1}),
        *_round(0, (1,), (2,), (3,)),
    )),
    Scenario("overflow", (J2,), (
        Send(0, 0, (MAX32 - 10, -5, MIN32 + 1), counters=AGG),
        Send(1, 0, (100, 5, -2), expect=(Result((0, 1), 0, (MAX32, 0, MIN32), flags=OVF),),
             counters={**DONE, "overflow": 1}),
        *_round(1, (1,), (2,), (3,)),  # the next round on other slots is clean
        *_round(4, (1,), (2,), (3,)),  # and so are slot 0's other set
        *_round(8, (1,), (2,), (3,)),  # and its first set, reused
    )),
    Scenario("overflow_flag_from_host", (J2,), (
        Send(0, 0, (MAX32,), flags=OVF, counters={**AGG, "overflow": 1}),
        Send(1, 0, (0,), expect=(Result((0, 1), 0, (MAX32,), flags=OVF),), counters=DONE),
    )),
    Scenario("single_worker", (Job(1, 1, 0, 2),), (
        Send(0, 0, (4, 5), expect=(Result((0,), 0, (4, 5)),), counters=DONE),
        Send(0, 1, (6,), expect=(Result((0,), 1, (6,)),), counters=DONE),
        Send(0, 0, (4, 5), flags=RT, expect=(Result((0,), 0, (4, 5)),), counters={"duplicate_answered": 1}),
    )),
    Scenario("max_workers", (Job(1, wire.MAX_WORKERS, 0, 2),), tuple(
        Send(w, 0, (w, 1), counters=AGG if w < wire.MAX_WORKERS - 1 else DONE,
             expect=() if w < wire.MAX_WORKERS - 1 else
             (Result(tuple(range(wire.MAX_WORKERS)), 0, (sum(range(wire.MAX_WORKERS)), wire.MAX_WORKERS)),))
        for w in range(wire.MAX_WORKERS)
    )),
    Scenario("two_jobs_isolated", (J2, Job(job=2, workers=2, base=4, pool=4)), (
        Send(0, 0, (1,), counters=AGG),
        Send(0, 0, (100,), job=2, counters=AGG),  # same slot index, other job's range
        Send(1, 0, (200,), job=2, expect=(Result((0, 1), 0, (300,), job=2),), counters=DONE),
        # job 2's worker 0 claims to be job 1's worker 0: its origin is not admitted for job 1
        Send(0, 0, (9999,), job=1, origin=(2, 0), counters={"rejected": 1}),
        Send(1, 0, (2,), expect=(Result((0, 1), 0, (3,)),), counters=DONE),
    )),
    # Lanes per allocation (a software aggregator): each job's packets and RESULTs have its own lane
    # count; a packet of another length is not the job's, and is rejected without touching its state.
    Scenario("lanes_per_allocation", (J2, Job(job=2, workers=2, base=4, pool=4, lanes=2)), (
        Send(0, 0, (1, 2), job=2, counters=AGG),
        Send(1, 0, (1,), job=2, lanes=3, counters={"rejected": 1}),  # 3 lanes: neither job's
        Send(1, 0, (10, 20), job=2, expect=(Result((0, 1), 0, (11, 22), job=2),), counters=DONE),  # 2 lanes back
        Send(0, 0, (1,), lanes=2, counters={"rejected": 1}),  # job 2's lane count, for job 1
        *_round(0, (1, 2, 3), (2, 4, 6), (3, 6, 9)),  # job 1 at the target's lane count, untouched
        *_round(1, (5, 6), (7, 8), (12, 14), job=2),
    ), software_only=True),
    # Reduce-scatter: an OWNER_ONLY round's sums go to its owner, the others get the header alone (an ACK),
    # on completion and on a retransmission after it; before completion a duplicate is dropped as ever.
    Scenario("owner_only_round", (J3,), (
        Send(0, 0, (1, 2), flags=OWN, owner=1, counters=AGG),
        Send(0, 0, (1, 2), flags=OWN | RT, owner=1, counters={"duplicate": 1}),
        Send(2, 0, (10, 20), flags=OWN, owner=1, counters=AGG),
        Send(1, 0, (100, 200), flags=OWN, owner=1, counters=DONE, expect=(
            Result((1,), 0, (111, 222)), Result((0, 2), 0, (), kind=wire.ACK))),
        Send(0, 0, (1, 2), flags=OWN | RT, owner=1, expect=(Result((0,), 0, (), kind=wire.ACK),),
             counters={"duplicate_answered": 1}),
        Send(1, 0, (100, 200), flags=OWN | RT, owner=1, expect=(Result((1,), 0, (111, 222)),),
             counters={"duplicate_answered": 1}),
        # the next psn is an ordinary round: every worker gets the sums
        Send(0, 1, (1,), counters=AGG),
        Send(1, 1, (2,), counters=AGG),
        Send(2, 1, (3,), expect=(Result((0, 1, 2), 1, (6,)),), counters=DONE),
    )),
    Scenario("owner_only_rotating_owners", (Job(1, 3, 0, 2),), tuple(
        step for psn in range(9) for step in (
            Send(0, psn, (psn,), flags=OWN, owner=psn // 3, counters=AGG),
            Send(1, psn, (10 * psn,), flags=OWN, owner=psn // 3, counters=AGG),
            Send(2, psn, (100 * psn,), flags=OWN, owner=psn // 3, counters=DONE, expect=(
                Result((psn // 3,), psn, (111 * psn,)),
                Result(tuple(w for w in range(3) if w != psn // 3), psn, (), kind=wire.ACK))),
        )
    )),
    Scenario("owner_only_overflow", (J2,), (
        Send(0, 0, (MAX32,), flags=OWN, owner=0, counters=AGG),
        Send(1, 0, (1,), flags=OWN, owner=0, counters={**DONE, "overflow": 1}, expect=(
            Result((0,), 0, (MAX32,), flags=OVF), Result((1,), 0, (), flags=OVF, kind=wire.ACK))),
    )),
    Scenario("owner_only_owner_not_a_worker", (J2,), (
        Send(0, 0, (1,), flags=OWN, owner=2, counters={"rejected": 1}),
        Send(0, 0, (1,), flags=OWN, owner=wire.MAX_OWNER, counters={"rejected": 1}),
        # without OWNER_ONLY the owner bits are carried and mean nothing
        Send(0, 0, (1,), owner=5, counters=AGG),
        Send(1, 0, (2,), owner=5, expect=(Result((0, 1), 0, (3,)),), counters=DONE),
    )),
    # All-gather: a GATHER goes unchanged (any bits) to every other worker, a NACK to its owner alone;
    # neither touches slot state, and a DATA round on the same slot, set and psn is untouched by them.
    Scenario("gather_relay", (J3,), (
        Send(0, 0, BITS, kind=wire.GATHER, owner=0, slot=0, set=0,
             expect=(Result((1, 2), 0, BITS, kind=wire.GATHER),), counters=RELAYED),
        Send(2, 7, (5, 6), kind=wire.GATHER, owner=2, slot=0, set=0,
             expect=(Result((0, 1), 7, (5, 6), kind=wire.GATHER),), counters=RELAYED),
        Send(1, 0, (0,), kind=wire.NACK, owner=0, slot=3, set=0,
             expect=(Result((0,), 0, (0,), kind=wire.NACK),), counters=RELAYED),
        Send(0, 0, BITS, kind=wire.GATHER, owner=0, flags=RT, slot=0, set=0,
             expect=(Result((1, 2), 0, BITS, kind=wire.GATHER, flags=RT),), counters=RELAYED),
        Send(0, 0, (1,), counters=AGG),
        Send(1, 0, (2,), counters=AGG),
        Send(2, 0, (3,), expect=(Result((0, 1, 2), 0, (6,)),), counters=DONE),
        Send(1, 0, BITS, kind=wire.GATHER, owner=1, slot=0, set=0,
             expect=(Result((0, 2), 0, BITS, kind=wire.GATHER),), counters=RELAYED),
    )),
    Scenario("gather_admission", (J3, Job(job=2, workers=2, base=4, pool=4)), (
        Send(0, 0, (1,), kind=wire.GATHER, owner=1, slot=0, set=0, counters={"rejected": 1}),  # not its own piece
        Send(0, 0, (1,), kind=wire.NACK, owner=0, slot=1, set=0, counters={"rejected": 1}),  # to itself
        Send(0, 0, (1,), kind=wire.NACK, owner=3, slot=1, set=0, counters={"rejected": 1}),  # to no worker
        Send(0, 0, (1,), kind=wire.GATHER, owner=0, slot=0, set=0, origin="stranger", counters={"rejected": 1}),
        Send(0, 0, (1,), kind=wire.GATHER, owner=0, slot=0, set=0, origin=(2, 0), counters={"rejected": 1}),
        Send(0, 0, (1,), kind=wire.GATHER, owner=0, slot=0, set=0, generation=1, counters={"rejected": 1}),
        Send(0, 0, (1,), job=9, kind=wire.GATHER, owner=0, slot=0, set=0, origin=(1, 0), counters={"rejected": 1}),
        # a relayed kind's slot is no slot: not checked against the pool
        Send(1, 0, (4,), kind=wire.GATHER, owner=1, slot=65535, set=1,
             expect=(Result((0, 2), 0, (4,), kind=wire.GATHER),), counters=RELAYED),
        Send(1, 0, (4,), job=2, kind=wire.GATHER, owner=1, slot=0, set=0,
             expect=(Result((0,), 0, (4,), job=2, kind=wire.GATHER),), counters=RELAYED),
        # a kind no host sends is malformed, not relayed
        Send(0, 0, (1,), kind=wire.RESULT, counters={"malformed": 1}),
        Send(0, 0, (1,), kind=wire.ACK, counters={"malformed": 1}),
        Send(0, 0, (1,), kind=6, counters={"malformed": 1}),
    )),
    Scenario("normal_forwarding", (), (), switch_only=True),
)

# received: every packet sent but a malformed one (a Send's counters need not say it: runner.py)
COUNTER_NAMES = ("received", "malformed", "rejected", "aggregated", "completed", "duplicate", "duplicate_answered",
                 "stale", "overflow", "relayed")
TREE_COUNTER_NAMES = ("sent_up", "answered", "late_answer")  # held where a target counts them


def by_name(name: str) -> Scenario:
    return next(s for s in SCENARIOS if s.name == name)
