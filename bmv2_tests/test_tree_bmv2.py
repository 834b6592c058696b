"""A two-level tree on three BMv2 switches (bmv2_tests/tree_network.py): two leaves of two servers each
under a spine, the roles written over P4Runtime by passing_controller.tree_roles; packets and whole
allreduces through it (docs/protocol.md, "Trees across racks")."""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import pytest

from passing import wire
from passing.cli import worker_inputs

from .network import REPO

pytestmark = pytest.mark.slow  # three BMv2 switches or a controller's tree: make test-all's (~1 min each file)

LEAF_JOB, ROOT_JOB = 1, 40
LEAVES = ("s1", "s2")
AGENT_PORT = 21000  # the test agents' sockets (passing-allreduce binds 20000 + w)
_generations = itertools.count(1)  # every tree a new allocation, as the controller's would be


@pytest.fixture(scope="module")
def tree():
    from .tree_network import TreeNetwork

    net = TreeNetwork(per_rack=2)
    yield net
    net.stop()


@pytest.fixture(scope="module")
def sessions(tree, pipeline):
    from passing_controller.session import Switch

    out = {}
    try:
        for name, info in tree.switches.items():
            s = out[name] = Switch(f"127.0.0.1:{info.grpc_port}")
            s.set_pipeline(pipeline)
            tree.program_plain(name, s)
        yield out
    finally:
        for s in out.values():
            s.close()


@dataclass
class Tree:
    """One tree job: leaf job LEAF_JOB at each leaf, root job ROOT_JOB at the spine, all of ``generation``."""

    generation: int
    pool: int
    entries: dict  # switch -> [(module, allocation or entries)] to remove
    before: dict  # (switch, job) -> its counters when the tree was installed (job ids are reused)

    def close(self, sessions) -> None:
        from passing_controller import admission, result_rewrite, tree_roles

        for name, items in self.entries.items():
            for kind, item in items:
                if kind == "roles":
                    tree_roles.remove(sessions[name], item)
                else:
                    admission.remove(sessions[name], item)
                    result_rewrite.remove(sessions[name], item)


def install_tree(tree, sessions, pool: int, udp_port: int = 20000) -> Tree:
    """What the controller writes for a tree job: each leaf a flat job of its rack with its uplink, the spine
    a root job whose workers are the leaves (their aggregation addresses, at the spine's ports to them)."""
    from passing_controller import admission, result_rewrite, tree_roles
    from passing_controller.allocation import Allocation, Worker
    from passing_controller.topology import Host

    from .tree_network import SPINE

    generation = next(_generations)
    spine = tree.switches[SPINE]
    t = Tree(generation, pool, {}, {})
    for r, leaf in enumerate(LEAVES):
        s = tree.switches[leaf]
        workers = tuple(Worker(w, Host(h.name, h.mac, h.ip, h.port), udp_port + w)
                        for w, h in enumerate(tree.racks[r]))
        a = Allocation(LEAF_JOB, generation, 0, pool, workers)
        admission.install(sessions[leaf], a)
        result_rewrite.install(sessions[leaf], a)
        owners = [g - 2 * r if g // 2 == r else tree_roles.UP for g in range(4)]  # servers 2r, 2r + 1 here
        roles = tree_roles.install_leaf(sessions[leaf], a, tree_roles.Uplink(
            ROOT_JOB, generation, r, s.uplink, spine.mac, spine.ip), owners)
        t.entries[leaf] = [("roles", roles), ("allocation", a)]
    leaves = tuple(Worker(r, Host(leaf, tree.switches[leaf].mac, tree.switches[leaf].ip, r + 1), wire.UDP_PORT)
                   for r, leaf in enumerate(LEAVES))
    a = Allocation(ROOT_JOB, generation, 0, pool, leaves)
    admission.install(sessions[SPINE], a)
    result_rewrite.install(sessions[SPINE], a)
    roles = tree_roles.install_root(sessions[SPINE], a, [0, 0, 1, 1])
    t.entries[SPINE] = [("roles", roles), ("allocation", a)]
    from passing_controller import counters

    for name, job in ((*LEAVES[:1], LEAF_JOB), (LEAVES[1], LEAF_JOB), (SPINE, ROOT_JOB)):
        t.before[name, job] = counters.for_job(sessions[name], job)
    return t


@pytest.fixture(scope="module")
def servers(tree):
    return Servers(tree)


@pytest.fixture
def tree_job(tree, sessions):
    t = install_tree(tree, sessions, pool=4, udp_port=AGENT_PORT)
    yield t
    t.close(sessions)


def job_counters(sessions, t: Tree, name: str, job: int) -> dict[str, int]:
    """What ``job`` counted at switch ``name`` since tree ``t`` was installed."""
    from passing_controller import counters

    now = counters.for_job(sessions[name], job)
    return {k: v - t.before[name, job][k] for k, v in now.items()}


class Servers:
    """The four servers' UDP sockets (bmv2_tests/agent.py), each sending to its leaf."""

    def __init__(self, tree, port: int = AGENT_PORT) -> None:
        self.tree = tree
        self.hosts = [h for rack in tree.racks for h in rack]
        for w, h in enumerate(self.hosts):
            tree.agent(h.name).call(op="bind", key="w", port=port + w % 2)

    def leaf_of(self, g: int) -> str:
        return LEAVES[g // 2]

    def send(self, g: int, t: Tree, psn: int, values: list[int], flags: int = 0, generation: int | None = None,
             job: int = LEAF_JOB, to: str | None = None, kind: int = wire.DATA, owner: int = 0) -> None:
        where = {"pool": t.pool} if kind == wire.DATA else {"slot": 0, "set": 0}  # a relayed kind's: no slot
        packet = wire.encode(type=kind, job=job, worker=g % 2, psn=psn, payload=np.resize(values, wire.DEFAULT_LANES),
                             flags=flags, generation=t.generation if generation is None else generation,
                             owner=owner, **where)
        ip = to or self.tree.switches[self.leaf_of(g)].ip
        self.tree.agent(self.hosts[g].name).call(op="send", key="w", to=f"{ip}:{wire.UDP_PORT}",
                                                 payload=packet.tobytes().hex())

    def received(self, wanted: int, timeout: float = 10) -> dict[int, list[np.ndarray]]:
        """Every server's packets until ``wanted`` in all arrived (or the timeout: what came)."""
        got: dict[int, list[np.ndarray]] = {g: [] for g in range(len(self.hosts))}
        deadline = time.monotonic() + timeout
        while True:  # at least one drain: received(0, timeout=0) empties the sockets
            for g, h in enumerate(self.hosts):
                for _key, payload, _src in self.tree.agent(h.name).call(op="drain")["received"]:
                    raw = bytes.fromhex(payload)
                    got[g].append({"hdr": np.frombuffer(raw[:wire.HEADER_SIZE], wire.HEADER_DTYPE)[0],  # ACK: none
                                   "payload": np.frombuffer(raw[wire.HEADER_SIZE:], ">i4")})
            if sum(map(len, got.values())) >= wanted or time.monotonic() > deadline:
                return got
            time.sleep(0.02)


def settle(sessions, t: Tree, name: str, job: int, timeout: float = 10, **least: int) -> dict[str, int]:
    """A switch's job counters once each counter named reached its value (they count what crossed it). The
    counters are read one after the other, not at once: a packet may be counted in one read and not yet in
    an earlier one, so a test waits for every counter it then compares."""
    deadline = time.monotonic() + timeout
    while True:
        c = job_counters(sessions, t, name, job)
        if all(c[k] >= v for k, v in least.items()) or time.monotonic() > deadline:
            return c
        time.sleep(0.05)


@pytest.mark.timeout(180)
def test_a_round_through_the_tree_with_a_partial_resent_and_answers_from_the_leaf(tree, sessions, servers, tree_job):
    from .tree_network import SPINE

    servers.received(0, timeout=0)  # nothing left over
    inputs = [[1, 2], [10, 20], [100, 200], [1000, 2000]]
    servers.send(0, tree_job, 0, inputs[0])
    servers.send(1, tree_job, 0, inputs[1])  # rack 1 complete: its partial goes up, the root waits
    settle(sessions, tree_job, SPINE, ROOT_JOB, aggregated=1)
    servers.send(1, tree_job, 0, inputs[1], flags=wire.FLAG_RETRANSMIT)  # unanswered: the partial again
    spine = settle(sessions, tree_job, SPINE, ROOT_JOB, duplicate=1, received=2)
    assert spine["duplicate"] == 1 and spine["completed"] == 0, spine  # a duplicate at the root: dropped
    assert servers.received(1, timeout=0.5) == {g: [] for g in range(4)}
    servers.send(2, tree_job, 0, inputs[2])
    servers.send(3, tree_job, 0, inputs[3])
    got = servers.received(4)
    total = np.resize(np.sum(inputs, axis=0), wire.DEFAULT_LANES)
    for g in range(4):
        assert len(got[g]) == 1, (g, got[g])
        p = got[g][0]
        assert p["hdr"]["type"] == wire.RESULT and p["hdr"]["job"] == LEAF_JOB and p["hdr"]["worker"] == g % 2
        assert p["hdr"]["generation"] == tree_job.generation and p["hdr"]["flags"] == 0
        assert np.array_equal(p["payload"], total), (g, p["payload"][:4])
    # a retransmission after the answer: the leaf answers from its registers, the root sees nothing
    servers.send(0, tree_job, 0, inputs[0], flags=wire.FLAG_RETRANSMIT)
    again = servers.received(1)
    assert len(again[0]) == 1 and np.array_equal(again[0][0]["payload"], total)
    s1 = job_counters(sessions, tree_job, "s1", LEAF_JOB)
    assert (s1["completed"], s1["sent_up"], s1["duplicate"], s1["answered"], s1["duplicate_answered"]) \
        == (1, 2, 1, 1, 1), s1
    s2 = job_counters(sessions, tree_job, "s2", LEAF_JOB)
    assert (s2["completed"], s2["sent_up"], s2["answered"], s2["results_sent"]) == (1, 1, 1, 2), s2
    spine = job_counters(sessions, tree_job, SPINE, ROOT_JOB)
    assert (spine["aggregated"], spine["completed"], spine["results_sent"], spine["rejected"]) == (2, 1, 2, 0), spine


@pytest.mark.timeout(180)
def test_hostile_and_stale_datagrams_change_nothing(tree, sessions, servers, tree_job):
    """A server's datagram to the root never reaches it (no switch forwards to a switch's aggregation MAC);
    a server on the spine is no admitted leaf (rejected there); a late packet of an earlier generation is
    rejected at the leaf; the round that follows is the exact sum."""
    from .tree_network import SPINE, STRANGER

    servers.received(0, timeout=0)  # nothing left over
    spine_ip, spine_mac = tree.switches[SPINE].ip, tree.switches[SPINE].mac
    tree.net.get("h1").setARP(spine_ip, spine_mac)
    before = job_counters(sessions, tree_job, SPINE, ROOT_JOB)  # the spine's, after the previous test
    # h1 as rack 1's leaf, straight to the root: job 40, worker 0, its generation
    servers.send(0, tree_job, 0, [7777], job=ROOT_JOB, to=spine_ip)
    stranger = tree.agent(STRANGER)
    stranger.call(op="bind", key="x", port=AGENT_PORT + 99)  # (the PS of the mixed tree takes 9877 there)
    forged = wire.encode(type=wire.DATA, job=ROOT_JOB, worker=0, psn=0, payload=np.full(wire.DEFAULT_LANES, 5555),
                         pool=tree_job.pool, generation=tree_job.generation)
    stranger.call(op="send", key="x", to=f"{spine_ip}:{wire.UDP_PORT}", payload=forged.tobytes().hex())
    after = settle(sessions, tree_job, SPINE, ROOT_JOB, rejected=before["rejected"] + 1,
                   received=before["received"] + 1)
    assert after["rejected"] - before["rejected"] == 1 and after["received"] - before["received"] == 1, after
    assert after["aggregated"] == before["aggregated"]
    # a late packet of the previous allocation at a leaf
    servers.send(0, tree_job, 0, [9999], generation=tree_job.generation - 1)
    s1 = settle(sessions, tree_job, "s1", LEAF_JOB, rejected=1, received=1)
    assert s1["rejected"] == 1 and s1["aggregated"] == 0, s1
    for g in range(4):
        servers.send(g, tree_job, 0, [g + 1])
    got = servers.received(4)
    for g in range(4):
        assert [int(p["payload"][0]) for p in got[g]] == [10], (g, got[g])


@pytest.mark.timeout(180)
def test_an_owner_only_round_and_a_gather_cross_the_tree(tree, sessions, servers, tree_job):
    """An OWNER_ONLY round whose owner is server 3: its RESULT reaches server 3 alone (the root answers its
    leaf with the sums, the other leaf with an ACK), ACKs reach the others; server 0's GATHER reaches the
    other three (its rack's server by its leaf, the other rack's by the root and their leaf)."""
    from .tree_network import SPINE

    servers.received(0, timeout=0)
    for g in range(4):
        servers.send(g, tree_job, 0, [g + 1], flags=wire.FLAG_OWNER_ONLY, owner=3)
    got = servers.received(4)
    kinds = {g: [(int(p["hdr"]["type"]), int(p["hdr"]["flags"]), int(p["hdr"]["worker"])) for p in got[g]]
             for g in range(4)}
    assert kinds == {0: [(wire.ACK, 0, 0)], 1: [(wire.ACK, 0, 1)], 2: [(wire.ACK, 0, 0)], 3: [(wire.RESULT, 0, 1)]}
    assert int(got[3][0]["payload"][0]) == 10
    servers.send(0, tree_job, 5, [7, 8], kind=wire.GATHER, owner=0)
    got = servers.received(3)
    for g in (1, 2, 3):
        assert len(got[g]) == 1, (g, got[g])
        h = got[g][0]["hdr"]
        assert (int(h["type"]), int(h["job"]), int(h["worker"]), int(h["psn"]), wire.owner_of(h["set"])) \
            == (wire.GATHER, LEAF_JOB, g % 2, 5, 0), (g, h)
        assert got[g][0]["payload"][:2].tolist() == [7, 8]
    assert got[0] == []
    spine = job_counters(sessions, tree_job, SPINE, ROOT_JOB)
    assert (spine["completed"], spine["relayed"], spine["results_sent"]) == (1, 1, 3), spine
    s1 = job_counters(sessions, tree_job, "s1", LEAF_JOB)
    assert (s1["answered"], s1["relayed"], s1["sent_up"], s1["results_sent"]) == (1, 1, 2, 3), s1


def run_allreduce(tree, t: Tree, size: int, tmp, extra: list[str] = ()) -> list[np.ndarray]:
    """passing-allreduce in every server against its leaf (int32: the sum is exact), rack r's inputs of
    seed r."""
    procs = []
    for r, rack in enumerate(tree.racks):
        for w, h in enumerate(rack):
            procs.append(tree.net.get(h.name).popen(
                [sys.executable, "-m", "passing.cli", "allreduce", "--aggregator",
                 f"{tree.switches[LEAVES[r]].ip}:{wire.UDP_PORT}", "--job", str(LEAF_JOB), "--generation",
                 str(t.generation), "--worker", str(w), "--workers", str(len(rack)), "--servers", "4", "--bind",
                 f"{h.ip}:{20000 + w}", "--pool", str(t.pool), "--size", str(size), "--dtype", "int32",
                 "--seed", str(r), "--out", str(tmp / f"out-{r}-{w}.npy"), "--no-check", "--timeout", "60",
                 "--no-offload", *extra],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO)))
    out = []
    for i, p in enumerate(procs):
        _, stderr = p.communicate(timeout=240)
        assert p.returncode == 0, f"server {i}: {stderr[-2000:]}"
        out.append(np.load(tmp / f"out-{i // 2}-{i % 2}.npy"))
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("drop", [0.0, 0.05], ids=["clean", "lossy-servers"])
def test_allreduce_through_the_tree_is_the_exact_sum(tree, sessions, tmp_path, drop):
    from .tree_network import SPINE

    size = 20_000
    t = install_tree(tree, sessions, pool=32)
    try:
        out = run_allreduce(tree, t, size, tmp_path, ["--drop", str(drop)] if drop else [])
        want = np.sum([worker_inputs(r, w, size, "int32") for r in range(2) for w in range(2)], axis=0)
        for i, got in enumerate(out):
            assert np.array_equal(got, want), f"server {i}: {np.flatnonzero(got != want)[:10]}"
        packets = -(-size // wire.DEFAULT_LANES)
        spine = job_counters(sessions, t, SPINE, ROOT_JOB)
        assert spine["completed"] >= packets and spine["rejected"] == 0, spine
        for leaf in LEAVES:
            c = job_counters(sessions, t, leaf, LEAF_JOB)
            assert c["answered"] == c["completed"] >= packets and c["sent_up"] >= c["completed"], (leaf, c)
            if drop:  # lost answers and lost contributions: partials re-sent, or answered from the leaf
                assert c["duplicate"] + c["duplicate_answered"] > 0, (leaf, c)
    finally:
        t.close(sessions)


@pytest.mark.timeout(400)
def test_bmv2_leaves_under_a_ps_root_with_loss_at_the_root(tree, sessions, tmp_path):
    """A mixed tree: both leaves BMv2, the root a software aggregator on the spine's host (the spine only
    forwards), which drops 5 % of what it receives and of what it sends: partials and answers lost between
    the levels, recovered by the leaves' re-sent partials; the exact sum at every server."""
    import json

    from passing_controller import l2_forward, tree_roles
    from passing_controller.topology import mac_to_int

    from .tree_network import SPINE, STRANGER

    size, pool = 20_000, 32
    ps = tree.stranger
    t = install_tree(tree, sessions, pool=pool)
    # the leaves' uplinks point at the PS instead of the spine's program: their tree_role entries again
    for r, leaf in enumerate(LEAVES):
        _, old = t.entries[leaf][0]
        tree_roles.remove(sessions[leaf], old)
        a = t.entries[leaf][1][1]
        new = tree_roles.install_leaf(sessions[leaf], a, tree_roles.Uplink(
            ROOT_JOB, t.generation, r, tree.switches[leaf].uplink, ps.mac, ps.ip))
        t.entries[leaf][0] = ("roles", new)
    # the spine forwards the PS's answers to the leaves' aggregation MACs
    to_leaves = [sessions[SPINE].table_entry(l2_forward.TABLE, {"dst_addr": mac_to_int(tree.switches[leaf].mac)},
                                             l2_forward.FORWARD, {"port": r + 1}) for r, leaf in enumerate(LEAVES)]
    sessions[SPINE].write([sessions[SPINE].update("insert", e) for e in to_leaves])
    host = tree.net.get(STRANGER)
    for leaf in LEAVES:
        host.setARP(tree.switches[leaf].ip, tree.switches[leaf].mac)
    config = tmp_path / "root.json"
    config.write_text(json.dumps({"jobs": [{
        "job": ROOT_JOB, "generation": t.generation, "pool": pool, "role": "root",
        "workers": [f"{tree.switches[leaf].ip}:{wire.UDP_PORT}" for leaf in LEAVES]}]}))
    proc = host.popen([sys.executable, "-m", "passing.cli", "aggregator", "serve", "--listen",
                       f"{ps.ip}:{wire.UDP_PORT}", "--control", "none", "--config", str(config), "--drop-ingress",
                       "0.05", "--drop-egress", "0.05", "--seed", "7"], stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, f"the PS root exited: {proc.stderr.read()[-2000:]}"
        assert json.loads(line)["event"] == "ready"
        out = run_allreduce(tree, t, size, tmp_path)
        want = np.sum([worker_inputs(r, w, size, "int32") for r in range(2) for w in range(2)], axis=0)
        for i, got in enumerate(out):
            assert np.array_equal(got, want), f"server {i}: {np.flatnonzero(got != want)[:10]}"
        for leaf in LEAVES:
            c = job_counters(sessions, t, leaf, LEAF_JOB)
            # lost partials and lost answers: partials re-sent (sent_up over completed)
            assert c["answered"] == c["completed"] > 0 and c["sent_up"] > c["completed"], (leaf, c)
    finally:
        proc.terminate()
        proc.wait(10)
        sessions[SPINE].write([sessions[SPINE].update("delete", e) for e in to_leaves])
        t.close(sessions)
