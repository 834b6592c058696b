"""reduce_scatter and all_gather across racks (docs/protocol.md, "Trees across racks", "What a host needs"):
hosts name themselves by their global number, as the owner of OWNER_ONLY rounds, GATHERs and NACKs, through
a tree of software aggregators (a PS leaf per rack, a PS root) with loss at the hosts.

* With the real controller (tests/test_controller_tree.Services): the group's workers join interleaved across
  two racks, and take their numbers from the join answers; every reduce_scatter block equals the reference
  (int32 exactly, float32 within the quantisation bound) and every all_gather is bit for bit.
* A tree without owner maps (what the controller places for more than 128 servers: owners are 7 bits): the
  hosts reduce-scatter and all-gather through SUM rounds, with the same results, and no OWNER_ONLY round, GATHER
  or NACK reaches an aggregator (which would drop them)."""

from __future__ import annotations

import numpy as np
import pytest

from passing import Group, native
from passing.aggregator.control_channel import ControlClient
from passing.control import join, leave
from passing.launch import free_udp_ports
from passing.quantize import auto_scale, error_bound
from passing_controller.fabric import Fabric, plan
from tests.cluster import run_threads, start_aggregator
from tests.keys import ask
from tests.test_controller_tree import Services, assert_freed, host_ip

RACKS = [0, 1, 1, 0, 1, 0]  # the rack of each group worker: interleaved, so numbers differ from indices
SERVERS = len(RACKS)
CHUNK = 301  # elements of each server's block: not whole packets
ENGINES = ["numpy", "native"] if native.available() else ["numpy"]
LOSSY = {"drop": 0.05, "rto": 0.02, "max_rto": 0.2, "timeout": 30}


def inputs(w: int) -> dict[str, np.ndarray]:
    """Group worker w's inputs: reduce_scatter's (int32, float32), its all_gather piece of its own size
    (bytes) and an array of float64 to stack."""
    rng = np.random.default_rng(1000 + w)
    return {"int": rng.integers(-10_000, 10_000, SERVERS * CHUNK).astype(np.int32),
            "float": rng.uniform(-3, 3, SERVERS * CHUNK).astype(np.float32),
            "piece": rng.integers(0, 256, 97 * w + 5).astype(np.uint8),  # sizes differ, none a whole packet
            "stack": rng.standard_normal(33)}


def calls(g: Group, mine: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The collectives every worker runs, in one order, on its group (an allreduce between them: the streams
    stay in step across kinds)."""
    sizes = [97 * w + 5 for w in range(SERVERS)]
    out = np.empty(sum(sizes), np.uint8)
    got = {"int": g.reduce_scatter(mine["int"]), "float": g.reduce_scatter(mine["float"])}
    got["avg"] = g.reduce_scatter(mine["float"], op="avg")
    got["sum"] = g.allreduce(mine["int"][:CHUNK])
    got["piece"] = g.allgather_bytes(mine["piece"], sizes, out)
    got["stack"] = g.allgather(mine["stack"])
    got["retransmissions"] = np.array(g.stats.retransmissions)
    return got


def check(results: list, ranks: list[int]) -> None:
    """Every worker's results against the references; ``ranks[w]``: the block worker w asked for."""
    every = [inputs(w) for w in range(SERVERS)]
    ints = np.sum([x["int"] for x in every], axis=0, dtype=np.int64)
    floats = np.sum([x["float"].astype(np.float64) for x in every], axis=0)
    scale = auto_scale(max(float(np.max(np.abs(x["float"]))) for x in every), SERVERS)
    bound = error_bound(scale, SERVERS) + 1e-6 * float(np.max(np.abs(floats)))
    pieces = np.concatenate([x["piece"] for x in every])
    stack = np.stack([x["stack"] for x in every])
    for w, got in enumerate(results):
        assert isinstance(got, dict), (w, got)
        block = slice(ranks[w] * CHUNK, (ranks[w] + 1) * CHUNK)
        assert got["int"].dtype == np.int32 and np.array_equal(got["int"], ints[block]), w
        assert got["float"].shape == (CHUNK,) and np.max(np.abs(got["float"] - floats[block])) <= bound, w
        assert np.max(np.abs(got["avg"] - floats[block] / SERVERS)) <= bound / SERVERS, w
        assert np.array_equal(got["sum"], ints[:CHUNK]), w
        assert np.array_equal(got["piece"], pieces), w  # bit for bit, in group worker order
        assert got["stack"].tobytes() == stack.tobytes(), w
    assert sum(int(got["retransmissions"]) for got in results) > 0  # the loss happened, and was recovered


@pytest.mark.slow  # ~15 s a run: five services and six workers under loss
@pytest.mark.timeout(180)
@pytest.mark.parametrize("engine", ENGINES)
def test_reduce_scatter_and_all_gather_through_the_controllers_tree_under_loss(tmp_path, engine):
    services = Services(tmp_path)
    try:
        endpoint, ready = services.endpoint, services.ready
        ports = free_udp_ports(SERVERS)
        rank_of = [sum(1 for r in RACKS[:w] if r == RACKS[w]) for w in range(SERVERS)]  # index in its rack
        answers: dict[int, dict] = {}

        def work(w: int) -> dict[str, np.ndarray]:
            ip = host_ip(RACKS[w], rank_of[w])
            answer = answers[w] = join(endpoint, "sharded", w, SERVERS, host=ip, udp_port=ports[w], pool=8,
                                       timeout=60)
            try:
                with Group.from_answer(answer, bind=(ip, ports[w]), engine=engine, drop_seed=w, **LOSSY) as g:
                    assert (g.servers, g.rank, g.workers) == (SERVERS, w, 3)
                    return calls(g, inputs(w))
            finally:
                leave(endpoint, "sharded", 0, w, answer["token"])

        results = run_threads(work, SERVERS, timeout=150)
        check(results, list(range(SERVERS)))
        # the numbers: rack0's workers 0, 3, 5 first, then rack1's 1, 2, 4
        numbers = [0, 3, 4, 1, 5, 2]
        for w, a in answers.items():
            assert a["mode"] == "tree" and a["owner_only"] and a["numbers"] == numbers and a["number"] == numbers[w]
        stats = [ControlClient(r["control"]).request("stats")["totals"] for r in ready]
        assert all(s["relayed"] > 0 for s in stats), stats  # GATHERs and NACKs crossed both levels
        assert all(s["rejected"] == 0 and s["malformed"] == 0 for s in stats), stats
        assert_freed(ready)
        assert ask(endpoint, "status")["jobs"] == []
    finally:
        services.stop()


LEAF_JOB, ROOT_JOB, POOL, LANES = 3, 50, 8, 64


@pytest.fixture
def ownerless_tree():
    """Two PS leaves and a PS root (``start_aggregator``); yields their ready lines, root last."""
    procs = [start_aggregator(["--lanes", str(LANES)]) for _ in range(3)]
    try:
        yield [line for _, line in procs]
    finally:
        for proc, _ in procs:
            proc.terminate()
            proc.wait(10)


@pytest.mark.slow  # ~10 s a run: three services and six workers under loss
@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ENGINES)
def test_a_tree_without_owners_reduce_scatters_and_all_gathers_through_sum_rounds(ownerless_tree, engine):
    """The job objects a controller writes for a tree of more than 128 servers (no owner maps), here for six:
    hosts told ``owner_only`` false give the same results through SUM rounds; the aggregators, which would
    drop an OWNER_ONLY round or a GATHER of such a job, relay nothing and reject nothing."""
    *leaves, root = ownerless_tree
    names = [f"rack{r}-{w}" for w, r in enumerate(RACKS)]
    fabric = Fabric.from_list([
        *({"name": f"leaf{r}", "ps": leaf["data"], "hosts": [n for n, k in zip(names, RACKS) if k == r],
           "uplink": "spine"} for r, leaf in enumerate(leaves)),
        {"name": "spine", "ps": root["data"]}], [], [root["data"], *(leaf["data"] for leaf in leaves)], False)
    placed = plan(fabric, names)
    numbers = [0] * SERVERS
    for rack in placed.racks:
        for local, w in enumerate(rack.hosts):
            numbers[w] = rack.first + local
    ports = free_udp_ports(SERVERS)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    data = {"spine": root["data"], "leaf0": leaves[0]["data"], "leaf1": leaves[1]["data"]}
    objects = placed.job_objects(LEAF_JOB, 0, POOL, LANES, addresses, data, root_job=ROOT_JOB)
    for name, ready in (("spine", root), ("leaf0", leaves[0]), ("leaf1", leaves[1])):
        job = {k: v for k, v in objects[name].items() if k != "owners"}  # > 128 servers: no owner map
        ControlClient(ready["control"]).request("add_job", job=job)

    def work(w: int) -> dict[str, np.ndarray]:
        rack = next(r for r in placed.racks if w in r.hosts)
        leaf = data[rack.node.name]
        with Group(LEAF_JOB, rack.hosts.index(w), len(rack.hosts), [leaf], pool=POOL, lanes=LANES,
                   bind=addresses[w], servers=SERVERS, number=numbers[w], numbers=numbers, owner_only=False,
                   engine=engine, drop_seed=w, **LOSSY) as g:
            return calls(g, inputs(w))

    check(run_threads(work, SERVERS, timeout=100), list(range(SERVERS)))
    for ready in ownerless_tree:
        totals = ControlClient(ready["control"]).request("stats")["totals"]
        assert totals["relayed"] == 0 and totals["rejected"] == 0 and totals["completed"] > 0, totals
