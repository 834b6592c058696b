"""Two-level aggregation trees (docs/protocol.md, "Trees across racks") on the numpy engine, held against an
independent model of the document (tests/tree_model.py) packet for packet, and end to end against the exact
sums: random streams with loss, duplication, reordering and hostile datagrams at both levels, every kind
(SUM, MAX, OWNER_ONLY rounds, GATHER and NACK relays), overflow across levels, and the admission rules."""

from __future__ import annotations

import numpy as np
import pytest

from passing import native, wire
from passing.aggregator.engine import ConfigError, JobSpec
from passing.aggregator.jobs import UP, Uplink
from passing.aggregator.native_engine import make_engine
from tests.tree_harness import HOST, LEAF, ROOT, STRANGER, Round, Tree, check_answer, run
from tests.tree_model import HEADER, Header

KINDS = ("model", "numpy")
# the model against each engine: the C engine where it is built (tests/test_native_engine.py plays the trees with
# the numpy engine against the C one too)
IMPLEMENTATIONS = [KINDS, pytest.param(("model", "native"), marks=pytest.mark.skipif(
    not native.available(), reason="the native library is not built"))]


@pytest.fixture(params=IMPLEMENTATIONS, ids=lambda k: k[1])
def kinds(request) -> tuple[str, ...]:
    return request.param


def random_rounds(rng: np.random.Generator, count: int, servers: int, lanes: int, wide: float = 0.0,
                  owner_only: float = 0.3) -> list[Round]:
    rounds = []
    for _ in range(count):
        op = int(rng.choice([wire.SUM, wire.MAX]))
        owner = int(rng.integers(servers)) if rng.random() < owner_only else None
        if rng.random() < wide:  # near the int32 limits: saturation at either level
            values = rng.integers(wire.INT32_MIN, wire.INT32_MAX, (servers, lanes), dtype=np.int64, endpoint=True)
        else:
            values = rng.integers(-1000, 1000, (servers, lanes), dtype=np.int64)
        rounds.append(Round(op, owner, values))
    return rounds


def play(seed: int, kinds: tuple[str, ...] = KINDS, loss: float = 0.15) -> Tree:
    rng = np.random.default_rng(seed)
    sizes = [int(k) for k in rng.integers(1, 5, int(rng.integers(2, 4)))]
    lanes = int(rng.choice([1, 3, 8]))
    pool = int(rng.integers(1, 5))
    tree = Tree(kinds, sizes, lanes, pool, rng, same_ids=bool(seed % 2))
    rounds = random_rounds(rng, int(rng.integers(6, 16)), sum(sizes), lanes, wide=0.2)
    run(tree, rounds, rng, loss=loss, dup=0.1, hostility=0.5, gathers=0.3)
    for node in tree.nodes.values():
        node.check_outcomes()
    return tree


@pytest.mark.parametrize("seed", range(24))
def test_random_streams_through_a_tree_match_the_model_and_the_exact_sums(seed, kinds):
    play(seed, kinds)


def test_the_random_streams_reach_every_outcome():
    """The streams above are worth their time: between them, every counter of every role moves."""
    totals: dict[str, int] = {}
    roots: dict[str, int] = {}
    for seed in range(8):
        tree = play(seed)
        for node in tree.leaves:
            for name, n in node.impls[0].counters().items():
                totals[name] = totals.get(name, 0) + n
        for name, n in tree.root.impls[0].counters().items():
            roots[name] = roots.get(name, 0) + n
    for name in ("malformed", "rejected", "aggregated", "completed", "duplicate", "duplicate_answered", "stale",
                 "results_sent", "relayed", "sent_up", "answered", "late_answer", "overflow"):
        assert totals[name] > 0, name
    for name in ("rejected", "aggregated", "completed", "duplicate", "duplicate_answered", "results_sent",
                 "relayed", "overflow"):
        assert roots[name] > 0, f"root {name}"
    assert roots["sent_up"] == roots["answered"] == 0


def test_a_lossless_tree_answers_each_round_once_per_host(kinds):
    rng = np.random.default_rng(5)
    tree = Tree(kinds, [3, 1, 2], 4, 2, rng)
    rounds = random_rounds(rng, 9, 6, 4)
    run(tree, rounds, rng, loss=0.0, dup=0.0)
    root = tree.root.impls[0].counters(tree.root_job)
    assert root["completed"] == 9 and root["results_sent"] == 9 * 3 and root["rejected"] == 0
    for node in tree.leaves:
        c = node.impls[0].counters()
        assert c["completed"] == c["answered"] == c["sent_up"] == 9
        assert c["duplicate"] == c["late_answer"] == 0


def test_a_leaf_resends_its_partial_when_a_retransmission_finds_its_round_unanswered(kinds):
    """The root's RESULT is lost on its way to leaf 0: a server's retransmission makes the leaf send its
    partial up again; the root answers that leaf alone; the leaf's servers get the sum."""
    rng = np.random.default_rng(1)
    tree = Tree(kinds, [2, 1], 2, 1, rng)
    r = Round(wire.SUM, None, np.array([[1, 2], [10, 20], [100, 200]], np.int64))
    h0, h1, h2 = tree.hosts
    for h in tree.hosts:
        h.next = 1
    ups = tree.leaves[0].process([(tree.packet(h0, 0, r), h0.origin), (tree.packet(h1, 0, r), h1.origin)])
    assert len(ups) == 1 and ups[0][1] == ROOT
    down = tree.root.process([(ups[0][0], LEAF)])
    assert down == []  # leaf 1 has not contributed
    (up1,) = tree.leaves[1].process([(tree.packet(h2, 0, r), h2.origin)])
    down = tree.root.process([(up1[0], LEAF + 1)])
    assert [d for _, d, _ in down] == [LEAF, LEAF + 1]  # the copy for leaf 0 is lost here
    for data, _, _ in tree.leaves[1].process([(down[1][0], ROOT)]):
        check_answer(tree, h2, data, [r])
    resend = bytearray(tree.packet(h0, 0, r))
    resend[3] |= wire.FLAG_RETRANSMIT
    (again,) = tree.leaves[0].process([(bytes(resend), h0.origin)])
    assert again[0][3] & wire.FLAG_RETRANSMIT and again[1] == ROOT
    (answer,) = tree.root.process([(again[0], LEAF)])  # a duplicate of a complete round: answered to leaf 0
    assert answer[1] == LEAF and not answer[2]
    out = tree.leaves[0].process([(answer[0], ROOT)])
    assert [d for _, d, _ in out] == [h0.origin, h1.origin]
    for data, dest, _ in out:
        check_answer(tree, tree.by_origin[dest], data, [r])
    assert tree.leaves[0].process([(down[0][0], ROOT)]) == []  # the first copy, late: dropped
    assert tree.leaves[0].impls[0].counters()["late_answer"] == 1
    (late,) = tree.leaves[0].process([(tree.packet(h1, 0, r, wire.FLAG_RETRANSMIT), h1.origin)])
    assert late[1] == h1.origin and not late[2]  # answered from the leaf's own state now
    check_answer(tree, h1, late[0], [r])


def test_owner_only_rounds_send_the_sums_to_the_owner_alone_across_racks(kinds):
    rng = np.random.default_rng(2)
    tree = Tree(kinds, [2, 2], 2, 2, rng)
    rounds = [Round(wire.SUM, owner, rng.integers(-50, 50, (4, 2))) for owner in (0, 3, 1, 2)]
    got: dict[int, list[int]] = {h.number: [] for h in tree.hosts}
    inflight = [(tree.packet(h, p, rounds[p]), h.origin, LEAF + h.leaf) for p in range(2) for h in tree.hosts]
    for h in tree.hosts:
        h.next = 2
    while inflight:
        data, origin, dest = inflight.pop(0)
        if dest in tree.nodes:
            inflight += [(d, dest, to) for d, to, _ in tree.nodes[dest].process([(data, origin)])]
        else:
            h = tree.by_origin[dest]
            check_answer(tree, h, data, rounds)
            got[h.number].append(data[1])
    assert sorted(got[0]) == [wire.RESULT, wire.ACK] and sorted(got[3]) == [wire.RESULT, wire.ACK]
    assert got[1] == got[2] == [wire.ACK, wire.ACK]
    root = tree.root.impls[0].counters()
    assert root["results_sent"] == 4  # one RESULT to the owner's leaf, one ACK to the other, per round


def test_gather_and_nack_cross_the_racks_once_each(kinds):
    rng = np.random.default_rng(3)
    tree = Tree(kinds, [2, 3], 2, 2, rng)
    sender = tree.hosts[1]  # rack 0

    def deliver(data: bytes, origin: int) -> dict[int, list[bytes]]:
        got: dict[int, list[bytes]] = {}
        inflight = [(data, origin, LEAF + tree.by_origin[origin].leaf)]
        while inflight:
            d, o, to = inflight.pop(0)
            if to in tree.nodes:
                inflight += [(x, to, dest) for x, dest, _ in tree.nodes[to].process([(d, o)])]
            else:
                check_answer(tree, tree.by_origin[to], d, [])
                got.setdefault(to, []).append(d)
        return got

    piece = Header(wire.VERSION, wire.GATHER, 0, 0, sender.job, 0, sender.worker, sender.number << 1,
                   sender.generation, 17).pack([5, -6])
    got = deliver(piece, sender.origin)
    assert sorted(got) == sorted(h.origin for h in tree.hosts if h is not sender)
    assert all(len(v) == 1 and v[0][16:] == piece[16:] for v in got.values())
    asker = tree.hosts[4]  # rack 1 asks server 0 of rack 0
    nack = Header(wire.VERSION, wire.NACK, 0, 0, asker.job, 3, asker.worker, 0 << 1, asker.generation,
                  9).pack([0, 0])
    assert list(deliver(nack, asker.origin)) == [tree.hosts[0].origin]
    bad = Header(wire.VERSION, wire.GATHER, 0, 0, sender.job, 0, sender.worker, 3 << 1, sender.generation,
                 1).pack([0, 0])
    assert deliver(bad, sender.origin) == {}  # a piece of another server's: rejected at the leaf


def test_overflow_composes_across_levels(kinds):
    """Saturation at a leaf or at the root: the RESULT is flagged at every server; a sum that fits is exact."""
    rng = np.random.default_rng(4)
    big = wire.INT32_MAX - 10
    cases = [
        np.array([[big], [20], [0], [0]]),  # saturates at leaf 0
        np.array([[big], [0], [20], [0]]),  # saturates at the root
        np.array([[big], [20], [-30], [0]]),  # exact sum fits, a partial saturated: flagged all the same
        np.array([[big], [-20], [10], [5]]),  # never leaves int32: exact
    ]
    rounds = [Round(wire.SUM, None, v.astype(np.int64)) for v in cases]
    tree = Tree(kinds, [2, 2], 1, 4, rng)
    flags: dict[int, set[int]] = {}
    for h in tree.hosts:
        h.next = 4
    inflight = [(tree.packet(h, p, rounds[p]), h.origin, LEAF + h.leaf) for p in range(4) for h in tree.hosts]
    while inflight:
        data, origin, dest = inflight.pop(0)
        if dest in tree.nodes:
            inflight += [(d, dest, to) for d, to, _ in tree.nodes[dest].process([(data, origin)])]
        else:
            check_answer(tree, tree.by_origin[dest], data, rounds)
            flags.setdefault(Header(*HEADER.unpack(data[:16])).psn, set()).add(data[3])
    assert flags == {0: {wire.FLAG_OVERFLOW}, 1: {wire.FLAG_OVERFLOW}, 2: {wire.FLAG_OVERFLOW}, 3: {0}}


def test_the_root_takes_nothing_but_its_leaves_and_a_leaf_nothing_down_but_its_root(kinds):
    rng = np.random.default_rng(6)
    tree = Tree(kinds, [1, 1], 1, 1, rng)
    h = tree.hosts[0]
    r = Round(wire.SUM, None, np.array([[1], [2]], np.int64))
    (up,) = tree.leaves[0].process([(tree.packet(h, 0, r), h.origin)])
    assert tree.root.process([(up[0], STRANGER), (up[0], h.origin), (up[0], LEAF + 1)]) == []
    root = tree.root.impls[0].counters(tree.root_job)
    assert root["rejected"] == 3 and root["aggregated"] == 0
    forged = bytearray(up[0])
    forged[1] = wire.RESULT
    forged[8] = 0
    assert tree.leaves[0].process([(bytes(forged), h.origin), (bytes(forged), STRANGER)]) == []
    assert tree.leaves[0].impls[0].counters(h.job)["rejected"] == 2
    forged[4:6] = (999).to_bytes(2, "big")  # a RESULT for no uplink here: no host sends one
    before = tree.leaves[0].impls[0].counters()["malformed"]
    assert tree.leaves[0].process([(bytes(forged), ROOT)]) == []
    assert tree.leaves[0].impls[0].counters()["malformed"] == before + 1


@pytest.mark.parametrize(("spec", "error"), [
    (JobSpec(1, 0, 2, [1, 2], role="branch"), "role"),
    (JobSpec(1, 0, 2, [1, 2], role="leaf"), "needs an uplink"),
    (JobSpec(1, 0, 2, [1, 2], up=Uplink(2, 0, 0, 9)), "needs an uplink"),
    (JobSpec(1, 0, 2, [1, 2], role="root", owners=[0, 1, 2]), "owner map"),
    (JobSpec(1, 0, 2, [1, 2], role="root", owners=[0, UP]), "owner map"),
    (JobSpec(1, 0, 2, [1, 2], role="leaf", owners=[0] * 129, up=Uplink(2, 0, 0, 9)), "at most 128"),
    (JobSpec(1, 0, 2, [1, 2], role="leaf", up=Uplink(2, 0, 32, 9)), "uplink worker"),
    (JobSpec(1, 0, 2, [1, 2], role="leaf", up=Uplink(1 << 16, 0, 0, 9)), "out of range"),
    (JobSpec(1, 0, 2, [1, 2], role="leaf", up=Uplink(2, 0, 0, 2)), "none of the job's workers"),
])
def test_tree_admission_errors(spec, error, kinds):
    with pytest.raises(ConfigError, match=error):
        make_engine(8, 2, engine=kinds[1]).add_job(spec)


def test_two_leaf_jobs_cannot_share_an_uplink_job(kinds):
    e = make_engine(8, 2, engine=kinds[1])
    e.add_job(JobSpec(1, 0, 2, [HOST], role="leaf", up=Uplink(5, 0, 0, ROOT)))
    with pytest.raises(ConfigError, match="already goes up to job 5"):
        e.add_job(JobSpec(2, 2, 2, [HOST + 1], role="leaf", up=Uplink(5, 0, 1, ROOT)))
    e.remove_job(1)
    e.add_job(JobSpec(2, 2, 2, [HOST + 1], role="leaf", up=Uplink(5, 0, 1, ROOT)))  # free again


def test_after_an_ack_from_the_root_a_leaf_answers_only_acks_and_takes_only_other_racks_pieces(kinds):
    """A leaf answered by an ACK holds a partial, never the sums: a retransmission gets an ACK whatever its
    flags say. A GATHER from the root of a piece of this rack's own server is rejected."""
    rng = np.random.default_rng(8)
    tree = Tree(kinds, [1, 1], 1, 1, rng)
    h0, h1 = tree.hosts
    r = Round(wire.SUM, 1, np.array([[3], [4]], np.int64))  # owner: server 1, rack 1
    h0.next = h1.next = 1
    (up0,) = tree.leaves[0].process([(tree.packet(h0, 0, r), h0.origin)])
    (up1,) = tree.leaves[1].process([(tree.packet(h1, 0, r), h1.origin)])
    assert tree.root.process([(up0[0], LEAF)]) == []
    down = tree.root.process([(up1[0], LEAF + 1)])
    assert [(d[1], d[0][1]) for d in down] == [(LEAF, wire.ACK), (LEAF + 1, wire.RESULT)]
    (ack,) = tree.leaves[0].process([(down[0][0], ROOT)])
    check_answer(tree, h0, ack[0], [r])
    plain = Round(wire.SUM, None, r.values)  # the same round resent without OWNER_ONLY
    (again,) = tree.leaves[0].process([(tree.packet(h0, 0, plain, wire.FLAG_RETRANSMIT), h0.origin)])
    assert again[0][1] == wire.ACK and len(again[0]) == 16
    own = Header(wire.VERSION, wire.GATHER, 0, 0, tree.root_job, 0, 0, 0 << 1, down[0][0][10] << 8 | down[0][0][11],
                 5).pack([1])
    assert tree.leaves[0].process([(own, ROOT)]) == []
    assert tree.leaves[0].impls[0].counters(h0.job)["rejected"] == 1


def test_a_tree_job_without_an_owner_map_takes_no_owner_only_round_nor_gather(kinds):
    """A tree too large for 7-bit owners is given no map: OWNER_ONLY rounds, GATHERs and NACKs are counted
    drops there, never delivered by a flat job's identity."""
    e = make_engine(8, 2, engine=kinds[1])
    e.add_job(JobSpec(1, 0, 2, [HOST, HOST + 1], role="leaf", up=Uplink(5, 0, 0, ROOT)))
    packets = [Header(wire.VERSION, wire.DATA, 0, wire.FLAG_OWNER_ONLY, 1, 0, 0, 1 << 1, 0, 0).pack([1, 2]),
               Header(wire.VERSION, wire.GATHER, 0, 0, 1, 0, 0, 0, 0, 0).pack([1, 2]),
               Header(wire.VERSION, wire.NACK, 0, 0, 1, 1, 0, 1 << 1, 0, 0).pack([0, 0]),
               Header(wire.VERSION, wire.DATA, 0, 0, 1, 0, 0, 0, 0, 0).pack([1, 2])]
    batch = np.frombuffer(b"".join(packets), dtype=wire.packet_dtype(2))
    out = e.process(batch, np.array([HOST] * 4))
    assert len(out) == 0 and e.counters(1)["rejected"] == 3 and e.counters(1)["aggregated"] == 1
