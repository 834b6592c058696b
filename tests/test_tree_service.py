"""A two-level tree of software aggregators on loopback (docs/protocol.md, "Trees across racks"): two
`passing-aggregator` processes as leaves and one as the root, configured over their control channels as a
controller would, real UDP sockets, several worker processes per leaf (`passing.cli allreduce`, unchanged
hosts), loss at every aggregator. Every worker's allreduce must equal the flat sum over all servers. The job
objects are the controller's fabric plan's (passing_controller.fabric)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from passing import native, wire
from passing.aggregator.control_channel import ControlClient
from passing.cli import worker_inputs
from passing.launch import free_udp_ports
from passing.quantize import auto_scale
from passing_controller.fabric import Fabric, plan
from tests.cluster import start_aggregator
from tests.zygote import CLI_PRELOAD, shared

SIZES = (3, 2)  # servers under leaf 0 and leaf 1
ROOT_JOB, LEAF_JOB = 40, 1
POOL, LANES, ELEMENTS = 8, 16, 3000
SCALE = 1e6  # fixed: |x| <= 100 over 5 servers stays inside int32 at either level


def engines() -> tuple[str, str, str]:
    """(root, leaf 0, leaf 1): both engines in one tree where the C one is built."""
    return ("numpy", "native", "numpy") if native.available() else ("numpy", "numpy", "numpy")


def worker_cmd(rack: int, worker: int, leaf: str, bind: str, out: Path, dtype: str, seed: int) -> list[str]:
    """A worker of rack ``rack``; "auto": float32 scaled for the job's servers (--servers) by a MAX round."""
    scale = ["--servers", str(sum(SIZES)), "--scale", "auto"] if dtype == "auto" else ["--scale", str(SCALE)]
    return [sys.executable, "-m", "passing.cli", "allreduce", "--job", str(LEAF_JOB), "--generation", "0",
            "--worker", str(worker), "--workers", str(SIZES[rack]), "--aggregator", leaf, "--bind", bind,
            "--pool", str(POOL), "--lanes", str(LANES), "--size", str(ELEMENTS),
            "--dtype", "float32" if dtype == "auto" else dtype, *scale,
            "--seed", str(seed + rack), "--timeout", "60", "--out", str(out), "--no-check"]


@pytest.fixture
def tree():
    """Three aggregators with loss each way; yields (root, leaves) as (process, ready line) pairs."""
    procs = []
    try:
        for i, engine in enumerate(engines()):
            procs.append(start_aggregator(["--lanes", str(LANES), "--engine", engine, "--drop-ingress", "0.03",
                                           "--drop-egress", "0.03", "--duplicate", "0.02", "--seed", str(7 + i)]))
        yield procs[0], procs[1:]
    finally:
        for proc, _ in procs:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def configure(root: dict, leaves: list[dict], hosts: list[list[str]]) -> None:
    """What a controller writes, from its fabric's plan (passing_controller.fabric): the root job over the
    leaves, a leaf job per rack with its uplink. The group's workers join interleaved across the racks."""
    names = [[f"rack{r}-{w}" for w in range(k)] for r, k in enumerate(SIZES)]
    fabric = Fabric.from_list([
        *({"name": f"leaf{r}", "ps": leaf["data"], "hosts": names[r], "uplink": "spine"}
          for r, leaf in enumerate(leaves)),
        {"name": "spine", "ps": root["data"]}], [], [root["data"], *(leaf["data"] for leaf in leaves)], False)
    order = sorted(((w, r) for r, k in enumerate(SIZES) for w in range(k)))  # r0w0, r1w0, r0w1, ...
    placed = plan(fabric, [names[r][w] for w, r in order])
    assert placed.root is not None and [rack.node.name for rack in placed.racks] == ["leaf0", "leaf1"]
    data = {"spine": root["data"], **{f"leaf{r}": leaf["data"] for r, leaf in enumerate(leaves)}}
    objects = placed.job_objects(LEAF_JOB, 0, POOL, LANES, [hosts[r][w] for w, r in order], data, root_job=ROOT_JOB)
    ControlClient(root["control"]).request("add_job", job=objects["spine"])
    for r, leaf in enumerate(leaves):
        ControlClient(leaf["control"]).request("add_job", job=objects[f"leaf{r}"])


@pytest.mark.parametrize("dtype", ["int32", "float32", "auto"])
def test_a_tree_of_software_aggregators_gives_the_flat_sum_under_loss(tree, tmp_path, dtype):
    (_, root), leaves = tree
    leaves = [ready for _, ready in leaves]
    ports = iter(free_udp_ports(sum(SIZES)))
    hosts = [[f"127.0.0.1:{next(ports)}" for _ in range(k)] for k in SIZES]
    configure(root, leaves, hosts)
    assert ControlClient(root["control"]).request("ping")["roles"] == ["flat", "leaf", "root"]
    seed = 11
    procs = {}
    for rack, k in enumerate(SIZES):
        for w in range(k):
            out = tmp_path / f"result-{rack}-{w}.npy"
            procs[out] = shared(CLI_PRELOAD).popen(
                worker_cmd(rack, w, leaves[rack]["data"], hosts[rack][w], out, dtype, seed),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    for proc in procs.values():
        _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        assert proc.returncode == 0, err
    inputs = [worker_inputs(seed + rack, w, ELEMENTS, "float32" if dtype == "auto" else dtype)
              for rack, k in enumerate(SIZES) for w in range(k)]
    flat = np.sum(inputs, axis=0, dtype=np.float64)
    for out in procs:
        got = np.load(out)
        if dtype == "int32":
            assert np.array_equal(got, flat.astype(np.int32)), out.name
        elif dtype == "float32":  # the scaled sum: each of the 5 values rounds by at most half a step
            assert np.max(np.abs(got - flat)) <= sum(SIZES) * 0.5 / SCALE + 1e-5 * np.max(np.abs(flat)), out.name
        else:  # the scale a MAX round through the tree picked for 5 servers: the same bound at that scale
            scale = auto_scale(float(np.max(np.abs(inputs))), sum(SIZES))
            assert np.max(np.abs(got - flat)) <= sum(SIZES) * 0.5 / scale + 1e-5 * np.max(np.abs(flat)), out.name
    root_stats = ControlClient(root["control"]).request("stats")
    job = root_stats["jobs"][str(ROOT_JOB)]
    packets = -(-ELEMENTS // LANES)
    assert job["completed"] >= packets and job["rejected"] == 0
    resent = dropped = 0
    for leaf in leaves:
        stats = ControlClient(leaf["control"]).request("stats")
        c = stats["jobs"][str(LEAF_JOB)]
        assert c["sent_up"] >= packets and c["answered"] >= packets and c["rejected"] == 0
        resent += c["sent_up"] - c["completed"]  # partials sent up again for a server's retransmission
        dropped += stats["injected"]["ingress_dropped"] + stats["injected"]["egress_dropped"]
    assert dropped > 0 and resent > 0  # the loss happened, and the leaves recovered it upward

    # a datagram at the root from anything but an admitted leaf: dropped and counted
    stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        hdr = np.zeros(1, dtype=wire.packet_dtype(LANES))
        hdr["hdr"][0] = (wire.VERSION, wire.DATA, 0, 0, ROOT_JOB, 0, 0, 0, 0, 0)
        host, port = root["data"].rsplit(":", 1)
        for _ in range(20):  # the root's ingress loses some: send until one is counted
            stranger.sendto(hdr.tobytes(), (host, int(port)))
            time.sleep(0.05)
            if ControlClient(root["control"]).request("stats")["jobs"][str(ROOT_JOB)]["rejected"] > 0:
                break
        else:
            raise AssertionError("the root did not count a stranger's datagram")
    finally:
        stranger.close()


def test_a_leafs_group_takes_the_jobs_servers_and_numbers_and_refuses_what_it_cannot_do():
    from passing import Group
    from passing.errors import PassingError
    from passing.reduce_path import apply_nonfinite, nonfinite_shift

    for bad in (1, 1025):
        with pytest.raises(ValueError, match="servers must be 2..1024"):
            Group(1, 0, 2, ["127.0.0.1:9"], bind="127.0.0.1:0", servers=bad)
    for numbering, error in [({"number": 40}, "number 40 outside 0..39"), ({"number": -1}, "outside"),
                             ({"numbers": list(range(40))}, "numbers without this server's number"),
                             ({"number": 3, "numbers": [0, 1, 2]}, "must order the job's 40 servers"),
                             ({"number": 3, "numbers": [0] * 40}, "each of 0..39 once"),
                             ({"servers": 129, "number": 0}, "owner_only with 129 servers: owners are 7 bits")]:
        with pytest.raises(ValueError, match=error):
            Group(1, 0, 2, ["127.0.0.1:9"], bind="127.0.0.1:0", **{"servers": 40, **numbering})
    with pytest.raises(ValueError, match="a flat group's server is numbered by its worker index 0"):
        Group(1, 0, 2, ["127.0.0.1:9"], bind="127.0.0.1:0", number=1)
    with Group(1, 0, 2, ["127.0.0.1:9"], bind="127.0.0.1:0", servers=40) as g:  # no number: allreduce only
        assert g.servers == 40
        for call in (lambda: g.reduce_scatter(np.zeros(40, np.float32)), lambda: g.allgather(np.zeros(2))):
            with pytest.raises(PassingError, match="needs this server's number in the job"):
                call()
    with Group(1, 1, 2, ["127.0.0.1:9"], bind="127.0.0.1:0", servers=4, number=2, numbers=[3, 2, 0, 1]) as g:
        assert (g.servers, g.rank, g.worker) == (4, 1, 1)  # the caller's index 1 is the server numbered 2
        with pytest.raises(ValueError, match="not a multiple of the 4 servers"):
            g.reduce_scatter(np.zeros(6, np.float32))
        with pytest.raises(ValueError, match="sizes must give 4 byte counts"):
            g.allgather_bytes(np.zeros(1, np.uint8), [1, 1], np.zeros(2, np.uint8))
    # the class round's counts: 6 bits up to 63 servers, 10 beyond (three counts of up to 1 023 in 30 bits)
    assert nonfinite_shift(63) == 6 and nonfinite_shift(64) == 10 and nonfinite_shift(1023) == 10
    out = np.zeros(4, np.float32)
    classes = np.array([0, 900, 900 << 10, 1000 << 20], np.int32)  # none, NaN, +inf, -inf from many servers
    apply_nonfinite(out, classes, 10)
    assert out[0] == 0 and np.isnan(out[1]) and out[2] == np.inf and out[3] == -np.inf


@pytest.mark.parametrize("servers", [63, 64, 1023, 1024])
def test_the_class_round_counts_every_server_of_the_largest_tree(servers):
    """Every server holding the same non-finite value at an element (a loss scale too high does that) must
    give IEEE's answer: the class round's sums, taken here as an aggregator sums them (int32, each in range),
    decode to the counts. 1 024 servers need 11-bit counts: two rounds (10 bits would read 1 024 NaN as +inf)."""
    from passing.reduce_path import apply_nonfinite, nonfinite_classes, nonfinite_codes, nonfinite_shift

    shift = nonfinite_shift(servers)
    assert shift == (6 if servers < 64 else 10 if servers < 1024 else 11)
    inputs = np.zeros((servers, 6), np.float32)
    inputs[:, 1], inputs[:, 2], inputs[:, 3] = np.nan, np.inf, -np.inf  # on every server
    inputs[0, 4], inputs[1:, 4] = np.inf, -np.inf  # +inf meets -inf: NaN
    inputs[-1, 5] = np.nan  # on one server alone
    rounds = [nonfinite_codes(x, shift) for x in inputs]
    sums = []
    for k in range(len(rounds[0])):
        total = np.sum([r[k].astype(np.int64) for r in rounds], axis=0)
        assert total.max() <= np.iinfo(np.int32).max  # an aggregator's int32 sum: no saturation
        sums.append(total.astype(np.int32))
    out = np.ones(6, np.float32)
    apply_nonfinite(out, nonfinite_classes(sums, shift), shift)
    assert out[0] == 1  # finite: left as the data round made it
    assert np.isnan(out[1]) and out[2] == np.inf and out[3] == -np.inf and np.isnan(out[4]) and np.isnan(out[5])


LEAF_OBJECT = {"job": 1, "pool": 4, "workers": ["10.0.0.1:2000", "10.0.0.2:2000"], "role": "leaf",
               "owners": [0, 1, -2], "up": {"job": 40, "generation": 3, "worker": 1, "root": "10.0.9.1:9877"}}


def test_tree_job_objects_round_trip_and_refuse_what_they_cannot_be():
    from passing.aggregator.control_channel import job_from_json, job_to_json
    from passing.aggregator.engine import AggregationEngine, ConfigError

    spec = AggregationEngine(16, 8).add_job(job_from_json(LEAF_OBJECT))
    again = job_to_json(spec)
    assert again["up"] == LEAF_OBJECT["up"] and again["owners"] == [0, 1, -2] and again["role"] == "leaf"
    assert job_from_json(again) == spec
    flat = job_to_json(job_from_json({"job": 2, "pool": 4, "workers": ["10.0.0.1:2000"]}))
    assert not {"role", "owners", "up"} & set(flat)  # a flat job's object reads as it always did
    for change, error in [
        ({"rack": 1}, "unknown keys"),
        ({"role": "spine"}, "'role' must be one of"),
        ({"owners": "0,1"}, "'owners' must be a list"),
        ({"owners": [0] * 129}, "at most 128"),
        ({"owners": [0, 1.0]}, "'owners' must be a list"),
        ({"up": {"job": 40, "generation": 3, "worker": 1}}, "'up' must be"),
        ({"up": {**LEAF_OBJECT["up"], "worker": 32}}, "worker 32 outside"),
        ({"up": {**LEAF_OBJECT["up"], "root": "10.0.9.1:0"}}, "UDP port 0"),
        ({"up": {**LEAF_OBJECT["up"], "generation": -1}}, "generation -1 outside"),
    ]:
        with pytest.raises(ConfigError, match=error):
            job_from_json({**LEAF_OBJECT, **change})
    with pytest.raises(ConfigError, match="needs an uplink"):  # the engine's rules after the object's
        AggregationEngine(16, 8).add_job(job_from_json({**LEAF_OBJECT, "up": None}))
