"""End to end on BMv2 in Mininet: the controller programs the switch, workers join and allreduce.

Hosts h1..h4 run workers, `ps` runs a software aggregator (the fallback), `ctl` is a host
in the root namespace where passing-controller runs: it reaches BMv2's gRPC port on
localhost and the hosts through the switch, like the control channel of a real rack.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from passing import wire
from passing.cli import float_error_bound, worker_inputs
from tests.cluster import LocalCluster

from .network import AGGREGATION_IP, REPO

HOSTS = 4
EXTRA = (("ps", "10.0.0.100", False), ("ctl", "10.0.0.253", True))
CONTROLLER = "tcp://10.0.0.253:9090"
VENV_BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def network():
    from .network import Bmv2Network

    net = Bmv2Network(HOSTS, extra=EXTRA)
    yield net
    net.stop()


@pytest.fixture(scope="module")
def ps(network):
    from .network import start_ps

    proc = start_ps(network.net.get("ps"), "10.0.0.100")
    yield proc
    proc.terminate()
    proc.wait(10)


PS = [{"data": "10.0.0.100:9877", "control": "tcp://10.0.0.100:9878"}]  # the host ps's software aggregator


class ControllerProcess:
    """The real passing-controller process, on ``network``'s topology (its ``topology()``: one switch, or the
    three of tree_network.TreeNetwork) with the software aggregators ``ps``, run on the host ctl; the one
    helper every BMv2 test of the controller starts it with (and asks it with ``ctl``)."""

    def __init__(self, network, pipeline, tmp: Path, ps: list[dict] = PS) -> None:
        topo = network.topology()
        topo["ps"] = list(ps)
        self.topology = tmp / "topology.json"
        self.topology.write_text(json.dumps(topo))
        self.store = tmp / "controller.sqlite"
        self.pipeline = pipeline
        self.proc: subprocess.Popen | None = None

    def start(self) -> dict:
        self.proc = subprocess.Popen(
            [str(VENV_BIN / "passing-controller"), "--topology", str(self.topology), "--p4info",
             str(self.pipeline.p4info), "--device-config", str(self.pipeline.device_config), "--store",
             str(self.store), "--listen", CONTROLLER, "--join-timeout", "60"],
            stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line, "passing-controller exited"
        return json.loads(line)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def ctl(self, *args: str) -> dict:
        out = subprocess.run([str(VENV_BIN / "passing-ctl"), "--controller", CONTROLLER, *args],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)


@pytest.fixture(scope="module")
def controller(network, pipeline, ps, tmp_path_factory):
    c = ControllerProcess(network, pipeline, tmp_path_factory.mktemp("controller"))
    ready = c.start()
    assert ready["switch"] == "connected", ready
    yield c
    c.stop()


def wait_running(controller: ControllerProcess, name: str, procs: list, completed: int = 1,
                 timeout: float = 90.0) -> dict:
    """The running group ``name`` (its `jobs` entry) once its aggregator has completed ``completed`` rounds
    (a tree's: its root's, whose rounds complete only with every leaf's partials); an AssertionError when a
    worker of ``procs`` ended first or the time ran out."""
    deadline = time.monotonic() + timeout
    while True:
        jobs = [j for j in controller.ctl("jobs")["jobs"] if j["job"] == name]
        if jobs and controller.ctl("stats", "--job-id", str(jobs[0]["job_id"])).get(
                str(jobs[0]["job_id"]), {}).get("completed", 0) >= completed:
            return jobs[0]
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), f"group {name} did not run"
        time.sleep(0.1)


def run_workers(network, tmp: Path, job: str, hosts: list[str], size: int, extra: list[str] = (),
                wait: bool = True) -> list:
    procs = []
    for w, h in enumerate(hosts):
        ip = network.net.get(h).IP()
        procs.append(network.net.get(h).popen(
            [sys.executable, "-m", "passing.cli", "allreduce", "--controller", CONTROLLER, "--job-name", job,
             "--worker", str(w), "--workers", str(len(hosts)), "--bind", f"{ip}:{20000 + w}", "--size", str(size),
             "--out", str(tmp / f"{job}-{w}.npy"), "--no-check", "--timeout", "60", "--pool", "64", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO)))
    return procs if not wait else finish(procs, tmp, job)


def finish(procs, tmp: Path, job: str) -> list:
    out = []
    for w, p in enumerate(procs):
        stdout, stderr = p.communicate(timeout=240)
        assert p.returncode == 0, f"worker {w} of {job}: {stderr}"
        out.append((json.loads(stdout.splitlines()[-1]), np.load(tmp / f"{job}-{w}.npy")))
    return out


def expected(workers: int, size: int) -> tuple[np.ndarray, float]:
    inputs = [worker_inputs(0, w, size, "float32") for w in range(workers)]
    total = np.sum(inputs, axis=0, dtype=np.float64)
    return total, float_error_bound(inputs, total)


def finish_within_bound(procs, tmp: Path, job: str, size: int) -> list[dict]:
    """``finish``, every worker's result checked within float32's bound of the sum of the workers' inputs; their
    reports."""
    total, bound = expected(len(procs), size)
    reports = []
    for report, r in finish(procs, tmp, job):
        assert np.max(np.abs(r - total)) <= bound
        reports.append(report)
    return reports


@pytest.mark.timeout(600)
@pytest.mark.parametrize("workers", [2, 4])
def test_allreduce_through_bmv2_matches_the_software_aggregator(network, controller, tmp_path, workers):
    size = 20_000
    results = run_workers(network, tmp_path, f"flat{workers}", [f"h{i + 1}" for i in range(workers)], size,
                          extra=["--leave"])
    total, bound = expected(workers, size)
    for report, r in results:
        assert report["mode"] == "switch"
        assert np.max(np.abs(r - total)) <= bound
    # the same inputs through the software aggregator give the very same bits
    c = LocalCluster(tmp_path, workers=workers, pool=64)
    try:
        software = c.results(size)
    finally:
        c.close()
    for (_, r), s in zip(results, software):
        assert np.array_equal(r, s)


@pytest.mark.slow  # 9 s (make test-all)
@pytest.mark.timeout(600)
def test_streams_through_bmv2_are_a_job_each_and_give_one_streams_bits(network, controller, tmp_path):
    """--streams 3: the controller admits a job per stream on the switch (each its own slots, admission and
    rewrite entries from the worker's port + s), and the sums are the bits of one stream (docs/control.md)."""
    size = 20_000
    procs = run_workers(network, tmp_path, "striped", ["h1", "h2"], size, extra=["--streams", "3", "--engine",
                                                                                 "native"], wait=False)
    deadline = time.monotonic() + 60
    while not (jobs := [j for j in controller.ctl("jobs")["jobs"] if j["job"] == "striped"]):
        assert time.monotonic() < deadline, "the striped group did not join"
        time.sleep(0.2)
    (job,) = jobs
    assert job["mode"] == "switch" and len(job["stripes"]) == 2, job
    ranges = sorted([(job["base"], job["pool"])] + [(s["base"], job["pool"]) for s in job["stripes"]])
    assert all(a + n <= b for (a, n), (b, _) in zip(ranges, ranges[1:])), ranges  # disjoint slots
    results = finish(procs, tmp_path, "striped")
    counts = controller.ctl("stats", "--job-id", str(job["job_id"]))[str(job["job_id"])]
    controller.ctl("leave", "striped")
    # every stream's counters moved (the switch's per-job counters: the job's own, and each stream's)
    assert counts["completed"] > 0 and len(counts["streams"]) == 2, counts
    assert all(stream["completed"] > 0 for stream in counts["streams"]), counts
    c = LocalCluster(tmp_path, workers=2, pool=64)
    try:
        software = c.results(size)
    finally:
        c.close()
    for (report, r), s in zip(results, software):
        assert report["mode"] == "switch" and report["streams"] == 3, report
        assert np.array_equal(r, s)


@pytest.mark.timeout(600)
def test_loss_at_the_hosts(network, controller, tmp_path):
    size = 20_000
    results = run_workers(network, tmp_path, "lossy", ["h1", "h2", "h3"], size, extra=["--drop", "0.05", "--leave"])
    total, bound = expected(3, size)
    for report, r in results:
        assert report["retransmissions"] > 0
        assert np.max(np.abs(r - total)) <= bound


@pytest.mark.timeout(600)
def test_two_jobs_at_once_on_disjoint_ranges(network, controller, tmp_path):
    size = 20_000
    a = run_workers(network, tmp_path, "job-a", ["h1", "h2"], size, wait=False)
    b = run_workers(network, tmp_path, "job-b", ["h3", "h4"], size, wait=False)
    deadline = time.monotonic() + 60
    while len(controller.ctl("jobs")["jobs"]) < 2:
        assert time.monotonic() < deadline, "the two jobs did not both join"
        time.sleep(0.2)
    jobs = {j["job"]: j for j in controller.ctl("jobs")["jobs"]}
    ra, rb = jobs["job-a"], jobs["job-b"]
    assert ra["mode"] == rb["mode"] == "switch"
    assert ra["base"] + ra["pool"] <= rb["base"] or rb["base"] + rb["pool"] <= ra["base"]
    total, bound = expected(2, size)
    for _, r in finish(a, tmp_path, "job-a") + finish(b, tmp_path, "job-b"):
        assert np.max(np.abs(r - total)) <= bound
    for job in ("job-a", "job-b"):
        controller.ctl("leave", job)


@pytest.mark.timeout(600)
def test_controller_restart_between_two_allreduces(network, controller, tmp_path):
    size = 20_000
    gate = tmp_path / "restarted"
    procs = run_workers(network, tmp_path, "restart", ["h1", "h2"], size, extra=["--iterations", "2", "--gate",
                                                                                  str(gate)], wait=False)
    packets = -(-size // 64) + 1
    deadline = time.monotonic() + 60
    while True:  # the first allreduce is done when its rounds have completed
        jobs = [j for j in controller.ctl("jobs")["jobs"] if j["job"] == "restart"]
        if jobs:
            stats = controller.ctl("stats", "--job-id", str(jobs[0]["job_id"]))
            if stats[str(jobs[0]["job_id"])]["completed"] >= packets:
                break
        assert time.monotonic() < deadline, "the first allreduce did not finish"
        time.sleep(0.2)
    controller.stop()
    ready = controller.start()
    assert ready["switch"] == "connected" and ready["jobs"] >= 1
    gate.touch()
    total, bound = expected(2, size)
    for _, r in finish(procs, tmp_path, "restart"):
        assert np.max(np.abs(r - total)) <= bound
    controller.ctl("leave", "restart")


@pytest.mark.timeout(600)
def test_exhausted_slots_fall_back_to_the_ps(network, controller, tmp_path):
    size = 5_000
    big = run_workers(network, tmp_path, "big", ["h1", "h2"], size, extra=["--pool", "1000"], wait=False)
    deadline = time.monotonic() + 60
    while not any(j["job"] == "big" for j in controller.ctl("jobs")["jobs"]):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    results = run_workers(network, tmp_path, "small", ["h3", "h4"], size, extra=["--pool", "100", "--leave"])
    total, bound = expected(2, size)
    for report, r in results:
        assert report["mode"] == "ps"
        assert np.max(np.abs(r - total)) <= bound
    for report, _ in finish(big, tmp_path, "big"):
        assert report["mode"] == "switch"
    controller.ctl("leave", "big")


def hostile_packets(rng: np.random.Generator, count: int, template: np.ndarray, pool: int) -> list[str]:
    """Full-size datagrams (hex): random bytes, and the running job's DATA with one field wrong."""
    out = []
    for i in range(count):
        if i % 2:
            out.append(rng.bytes(template.nbytes).hex())
            continue
        p = template.copy()
        hdr, kind = p["hdr"], (i // 2) % 6
        if kind == 0:
            hdr["job"] = int(hdr["job"][0]) + 1 + int(rng.integers(0, 500))  # no such job
        elif kind == 1:
            hdr["generation"] = (int(hdr["generation"][0]) + 1 + int(rng.integers(0, 1000))) % wire.GENERATIONS
        elif kind == 2:
            hdr["worker"] = 1  # worker 1 (admitted on h2's port) posing from h1's
        elif kind == 3:
            hdr["slot"] = pool + int(rng.integers(0, 100))  # outside the job's slots
        elif kind == 4:
            hdr["version"] = int(rng.choice([0, 1, 2, 255]))  # any but wire.VERSION
        else:
            hdr["type"] = wire.RESULT
        out.append(p.tobytes().hex())
    return out


@pytest.mark.timeout(600)
def test_hostile_datagrams_leave_a_running_job_exact_and_are_counted(network, controller, tmp_path):
    """docs/reliability.md: thousands of random and mutated datagrams at the switch, from a stranger
    and from a running job's own ingress port, while that job runs: its workers go on calling
    allreduce (8 calls at least) until the attack is over, however fast the switch is."""
    size = 20_000
    before = controller.ctl("stats")["switch_totals"]
    over = tmp_path / "attack-over"
    procs = run_workers(network, tmp_path, "hostile", ["h1", "h2"], size,
                        extra=["--iterations", "8", "--until", str(over)], wait=False)
    deadline = time.monotonic() + 60
    while not (jobs := [j for j in controller.ctl("jobs")["jobs"] if j["job"] == "hostile"]):
        assert time.monotonic() < deadline, "the job did not join"
        time.sleep(0.2)
    job = jobs[0]
    template = wire.encode(type=wire.DATA, job=job["job_id"], worker=0, psn=np.array([3]), pool=job["pool"],
                           payload=np.full(wire.DEFAULT_LANES, 10**6, np.int64), generation=job["generation"])
    rng = np.random.default_rng(5)
    sent = 0
    for host in ("h4", "h1"):  # h4: a stranger; h1: worker 0's ingress port, another UDP port
        agent = network.agent(host)
        agent.call(op="bind", key="hostile", port=31000)
        for _ in range(40):  # paced: BMv2's queues drop a burst's excess before its parser counts it
            sent += agent.call(op="send_many", key="hostile", to=f"{AGGREGATION_IP}:9877",
                               payloads=hostile_packets(rng, 50, template, job["pool"]))["sent"]
            time.sleep(0.03)
    assert all(p.poll() is None for p in procs), "the job ended before the attack did (a worker failed?)"
    over.touch()
    total, bound = expected(2, size)
    reports = finish(procs, tmp_path, "hostile")
    for _, r in reports:
        assert np.max(np.abs(r - total)) <= bound
    calls = {report["calls"] for report, _ in reports}
    assert len(calls) == 1 and min(calls) >= 8, calls
    after = controller.ctl("stats")["switch_totals"]
    counted = sum(after[k] - before[k] for k in ("malformed", "rejected"))
    assert sent == 4000 and counted == sent, (sent, {k: after[k] - before[k] for k in after})
    print(f"hostile on BMv2: {sent} datagrams, {after['malformed'] - before['malformed']} malformed, "
          f"{after['rejected'] - before['rejected']} rejected; the job's {min(calls)} calls within the bound")
    controller.ctl("leave", "hostile")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine,drop", [("native", 0.0), ("numpy", 0.0), ("native", 0.05)])
def test_reduce_scatter_and_all_gather_through_bmv2(network, controller, tmp_path, engine, drop):
    """Issue 28 on the switch: OWNER_ONLY rounds (each block's sums to its worker, header-only ACKs to
    the others) and GATHERs relayed through the job's multicast group, NACKs to their owner; exact,
    also with packets dropped at the hosts. The switch's counters, read by the controller, show it."""
    from . import sharded_worker

    workers = 3
    job = f"sharded-{engine}-{int(drop * 100)}"
    before = controller.ctl("stats")["switch_totals"]
    procs = []
    for w in range(workers):
        host = network.net.get(f"h{w + 1}")
        procs.append(host.popen(
            [sys.executable, "-m", "bmv2_tests.sharded_worker", "--controller", CONTROLLER, "--job-name", job,
             "--worker", str(w), "--workers", str(workers), "--bind", f"{host.IP()}:{20000 + w}",
             "--engine", engine, "--drop", str(drop), "--rto", "0.2" if drop else "5",
             "--out", str(tmp_path / f"{w}.npz")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO)))
    reports = []
    for w, p in enumerate(procs):
        stdout, stderr = p.communicate(timeout=240)
        assert p.returncode == 0, f"worker {w}: {stderr}"
        reports.append(json.loads(stdout.splitlines()[-1]))
    assert {r["mode"] for r in reports} == {"switch"} and {r["engine"] for r in reports} == {engine}
    ins = [sharded_worker.inputs(0, w, workers) for w in range(workers)]
    total = np.sum([x for x, _ in ins], axis=0, dtype=np.int64)  # no int32 bound is reached
    gathered = np.concatenate([piece for _, piece in ins])
    for w in range(workers):
        got = np.load(tmp_path / f"{w}.npz")
        block = sharded_worker.BLOCK
        assert np.array_equal(got["block"], total[w * block : (w + 1) * block])
        assert np.array_equal(got["gathered"], gathered)
    after = controller.ctl("stats")["switch_totals"]  # the workers have left: no job to ask for
    counted = {k: after[k] - before[k] for k in after}
    packets = -(-sharded_worker.BLOCK // wire.DEFAULT_LANES)  # of each block
    gathers = sum(-(-sharded_worker.gather_size(w) // (4 * wire.DEFAULT_LANES)) for w in range(workers))
    # every round of the reduce_scatter and the all_gather's completion round; each GATHER relayed at
    # least once (and any NACK, resent GATHER)
    assert counted["completed"] == workers * packets + 1, counted
    assert counted["relayed"] >= gathers and counted["rejected"] == counted["malformed"] == 0, counted
    if drop == 0.0:  # each round answered to every worker (sums or ACK), each GATHER to the 2 others;
        # nothing resent: without loss the hosts wait 5 s before a probe or NACK (a late peer is no loss)
        assert counted["relayed"] == gathers, counted
        assert counted["results_sent"] == workers * counted["completed"] + (workers - 1) * gathers, counted
    print(f"sharded on BMv2 ({engine}, drop {drop}): {counted['completed']} rounds, {counted['relayed']} relayed, "
          f"{counted['results_sent']} sent")


@pytest.mark.slow  # 8 training steps through BMv2: make test-all's
@pytest.mark.timeout(600)
def test_fsdp2_through_bmv2_trains_as_on_gloo(network, controller):
    """An unmodified FSDP2 (fully_shard) training on backend "passing", 2 single-rank servers h1 and h2:
    its reduce_scatter and all_gather go through the switch (OWNER_ONLY rounds, GATHERs relayed), the
    switch's counters say so, and the losses are gloo's, step by step."""
    from cluster.local import collect, launch_ranks
    from tests.test_torch_sharded import check_fsdp_reports

    servers = ["h1", "h2"]
    before = controller.ctl("stats")["switch_totals"]
    # one rank per server: the in-host stage around the switch is the loopback and namespace tests' (2 x 2)
    # 8 steps at a learning rate of 0.5 (the loss falls to 0.65-0.69 of its first): every step's
    # collectives cross BMv2 (~1 k packets/s)
    procs = launch_ranks([sys.executable, "-m", "tests.torch_sharded_worker", "fsdp", "8", "0.5"], 2, 1,
                         {"PASSING_CONTROLLER": CONTROLLER, "PASSING_POOL": "16", "PASSING_TIMEOUT": "60"},
                         popen_for_server=lambda s: network.net.get(servers[s]).popen,
                         env_for_server=lambda s: {"GLOO_SOCKET_IFNAME": f"{servers[s]}-eth0"},
                         master_host=network.net.get("h1").IP())
    outcomes = collect(procs, 480)
    for rank, (rc, report, stderr) in enumerate(outcomes):
        assert rc == 0 and report is not None, f"rank {rank} failed ({rc}):\n{stderr[-3000:]}"
    check_fsdp_reports([report for _, report, _ in outcomes], mode="switch")
    after = controller.ctl("stats")["switch_totals"]
    counted = {k: after[k] - before[k] for k in after}
    # the all_gathers' GATHERs were relayed and the reduce_scatters' (and completion) rounds completed
    assert counted["relayed"] > 0 and counted["completed"] > 0, counted
    assert counted["rejected"] == counted["malformed"] == 0, counted
