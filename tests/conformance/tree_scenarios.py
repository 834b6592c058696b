"""The tree's scenario table (docs/protocol.md, "Trees across racks"): a leaf and a root, each on its own
target (each row is one aggregator's view, the root an origin "root" for a leaf): the software aggregator
(tests/test_scenarios.py) and a BMv2 switch (bmv2_tests/test_tree_scenarios_bmv2.py).

The leaf below serves servers 0 and 1 of a job of four (its rack's owner map: 0 -> 0, 1 -> 1, 2 and 3 up),
and goes up to job 40 as worker 1. The root is job 40 over two leaves, servers 0 and 1 under leaf 0, 2 and
3 under leaf 1.
"""

from __future__ import annotations

from passing import wire

from .scenarios import MAX32, OVF, OWN, RT, Job, Result, Scenario, Send, Up

UP_ = -2  # a leaf's owner map: another rack's server
LEAF = Job(job=1, workers=2, base=0, pool=4, role="leaf", owners=(0, 1, UP_, UP_), up=Up(job=40, worker=1))
ROOT_JOB = Job(job=40, workers=2, base=4, pool=4, role="root", owners=(0, 0, 1, 1))
AGG = {"aggregated": 1}
UP = {"aggregated": 1, "completed": 1, "sent_up": 1}  # the round completes here: its partial goes up


def _from_root(psn: int, values: tuple[int, ...], kind: int = wire.RESULT, **kw: object) -> Send:
    return Send(1, psn, values, job=40, kind=kind, origin="root", **kw)  # type: ignore[arg-type]


TREE_SCENARIOS: tuple[Scenario, ...] = (
    Scenario("tree_leaf_round_goes_up_and_its_answer_comes_down", (LEAF,), (
        Send(0, 0, (1, 2), counters=AGG),
        Send(1, 0, (10, 20), expect=(Result((), 0, (11, 22), kind=wire.DATA, up=True),), counters=UP),
        _from_root(0, (111, 222), expect=(Result((0, 1), 0, (111, 222)),), counters={"answered": 1}),
        _from_root(0, (111, 222), counters={"late_answer": 1}),  # a second copy: nothing waits for it
        Send(0, 0, (1, 2), flags=RT, expect=(Result((0,), 0, (111, 222)),), counters={"duplicate_answered": 1}),
        _from_root(1, (5,), counters={"late_answer": 1}),  # a round the leaf does not hold
    ), tree=True),
    Scenario("tree_leaf_resends_an_unanswered_partial", (LEAF,), (
        Send(0, 0, (1,), counters=AGG),
        Send(1, 0, (2,), expect=(Result((), 0, (3,), kind=wire.DATA, up=True),), counters=UP),
        Send(1, 0, (2,), flags=RT, expect=(Result((), 0, (3,), kind=wire.DATA, flags=RT, up=True),),
             counters={"duplicate": 1, "sent_up": 1}),
        Send(0, 1, (4,), counters=AGG),
        Send(0, 1, (4,), flags=RT, counters={"duplicate": 1}),  # incomplete here: nothing goes up
        _from_root(0, (30,), expect=(Result((0, 1), 0, (30,)),), counters={"answered": 1}),
    ), tree=True),
    Scenario("tree_leaf_overflow_and_owner_elsewhere", (LEAF,), (
        Send(0, 0, (MAX32,), flags=OWN, owner=3, counters=AGG),
        Send(1, 0, (1,), flags=OWN, owner=3, counters={**UP, "overflow": 1},
             expect=(Result((), 0, (MAX32,), kind=wire.DATA, flags=OVF | OWN, up=True),)),
        _from_root(0, (), kind=wire.ACK, flags=OVF | OWN, owner=3,
                   expect=(Result((0, 1), 0, (), kind=wire.ACK, flags=OVF),), counters={"answered": 1}),
        # the slot holds a partial: a retransmission gets an ACK whatever it says
        Send(0, 0, (MAX32,), flags=RT, expect=(Result((0,), 0, (), kind=wire.ACK, flags=OVF),),
             counters={"duplicate_answered": 1}),
        # the owner here: its RESULT, an ACK for the other
        Send(0, 1, (5,), flags=OWN, owner=1, counters=AGG),
        Send(1, 1, (6,), flags=OWN, owner=1, counters=UP,
             expect=(Result((), 1, (11,), kind=wire.DATA, flags=OWN, up=True),)),
        _from_root(1, (99,), flags=OWN, owner=1, counters={"answered": 1},
                   expect=(Result((1,), 1, (99,)), Result((0,), 1, (), kind=wire.ACK))),
    ), tree=True),
    Scenario("tree_leaf_ack_carries_the_roots_overflow", (LEAF,), (
        Send(0, 2, (1,), flags=OWN, owner=3, counters=AGG),
        Send(1, 2, (2,), flags=OWN, owner=3, counters=UP,
             expect=(Result((), 2, (3,), kind=wire.DATA, flags=OWN, up=True),)),
        # the round overflowed at the root (another rack's partial): its ACK says so, and so do the rack's, now and
        # to a retransmission (the partial here did not overflow)
        _from_root(2, (), kind=wire.ACK, flags=OVF | OWN, owner=3,
                   expect=(Result((0, 1), 2, (), kind=wire.ACK, flags=OVF),), counters={"answered": 1}),
        Send(1, 2, (2,), flags=RT | OWN, owner=3, expect=(Result((1,), 2, (), kind=wire.ACK, flags=OVF),),
             counters={"duplicate_answered": 1}),
    ), tree=True),
    Scenario("tree_leaf_admission_from_its_root", (LEAF,), (
        Send(0, 0, (1,), counters=AGG),
        Send(1, 0, (2,), expect=(Result((), 0, (3,), kind=wire.DATA, up=True),), counters=UP),
        Send(1, 0, (3,), job=40, kind=wire.RESULT, origin=(1, 0), counters={"rejected": 1}),  # from a server
        Send(1, 0, (3,), job=40, kind=wire.RESULT, origin="stranger", counters={"rejected": 1}),
        _from_root(0, (3,), generation=1, counters={"rejected": 1}),  # another allocation
        Send(0, 0, (3,), job=40, kind=wire.RESULT, origin="root", counters={"rejected": 1}),  # another leaf's
        _from_root(0, (3,), slot=4, counters={"rejected": 1}),  # out of the pool
        _from_root(0, (3,), flags=OWN, owner=2, counters={"rejected": 1}),  # an owner's sums, no owner here
        Send(1, 0, (3,), job=41, kind=wire.RESULT, origin="root", counters={"malformed": 1}),  # no uplink's
        _from_root(0, (3,), expect=(Result((0, 1), 0, (3,)),), counters={"answered": 1}),
    ), tree=True),
    Scenario("tree_leaf_gather_and_nack_across_racks", (LEAF,), (
        # a server's piece: to its rack's other server, and up
        Send(0, 0, (7, 8), kind=wire.GATHER, owner=0, slot=0, set=0, counters={"relayed": 1, "sent_up": 1},
             expect=(Result((1,), 0, (7, 8), kind=wire.GATHER), Result((), 0, (7, 8), kind=wire.GATHER, up=True))),
        # a piece from another rack: to both servers here; one of this rack's own from the root: rejected
        _from_root(5, (9,), kind=wire.GATHER, owner=2, slot=0, set=0, counters={"relayed": 1},
                   expect=(Result((0, 1), 5, (9,), kind=wire.GATHER),)),
        _from_root(5, (9,), kind=wire.GATHER, owner=1, slot=0, set=0, counters={"rejected": 1}),
        # a NACK to another rack's server goes up; one from the root to a server here goes to it
        Send(1, 3, (0,), kind=wire.NACK, owner=3, slot=2, set=0, counters={"relayed": 1, "sent_up": 1},
             expect=(Result((), 3, (0,), kind=wire.NACK, up=True),)),
        _from_root(3, (0,), kind=wire.NACK, owner=0, slot=2, set=0, counters={"relayed": 1},
                   expect=(Result((0,), 3, (0,), kind=wire.NACK),)),
        _from_root(3, (0,), kind=wire.NACK, owner=3, slot=2, set=0, counters={"rejected": 1}),
    ), tree=True),
    Scenario("tree_root_owner_map", (ROOT_JOB,), (
        Send(0, 0, (1,), job=40, flags=OWN, owner=3, counters=AGG),
        Send(1, 0, (2,), job=40, flags=OWN, owner=3, counters={"aggregated": 1, "completed": 1},
             expect=(Result((1,), 0, (3,), job=40, flags=OWN), Result((0,), 0, (), job=40, flags=OWN,
                                                                       kind=wire.ACK))),
        Send(0, 0, (1,), job=40, flags=OWN | RT, owner=3, counters={"duplicate_answered": 1},
             expect=(Result((0,), 0, (), job=40, flags=OWN, kind=wire.ACK),)),
        Send(0, 1, (1,), job=40, counters=AGG),
        Send(1, 1, (2,), job=40, counters={"aggregated": 1, "completed": 1},
             expect=(Result((0, 1), 1, (3,), job=40),)),
        Send(0, 0, (4,), job=40, kind=wire.GATHER, owner=1, slot=0, set=0, counters={"relayed": 1},
             expect=(Result((1,), 0, (4,), job=40, kind=wire.GATHER),)),
        Send(0, 0, (4,), job=40, kind=wire.GATHER, owner=2, slot=0, set=0, counters={"rejected": 1}),
        Send(1, 0, (0,), job=40, kind=wire.NACK, owner=0, slot=1, set=0, counters={"relayed": 1},
             expect=(Result((0,), 0, (0,), job=40, kind=wire.NACK),)),
        Send(0, 0, (1,), job=40, flags=OWN, owner=4, counters={"rejected": 1}),  # no server of the job
    ), tree=True),
)
