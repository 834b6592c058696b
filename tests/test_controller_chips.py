"""A switch's chip gives its groups its P4 program's lanes (docs/control.md, Lanes: packets sized to
the aggregator): "bmv2", "tofino" and "tofino2" 64 each, one table (topology.CHIP_LANES); a program
rebuilt with another PASSING_LANES gives its own, when the topology says so ("lanes_override").

End to end with real processes and sockets: the controller (its ZeroMQ socket), workers that join
through passing.control and allreduce through Group.from_answer over UDP, and a software aggregator
process that stands for the switch's data plane at its program's lane count. Only the P4Runtime
session is a stand-in (``ProgramOnAggregator``): what the controller writes into the switch's
admission and result_rewrite tables becomes that aggregator's job, admitted with the lanes the
*switch program* parses, not the controller's. A controller that gave the workers another lane
count would have every packet dropped there as malformed, and the allreduce would time out.
"""

from __future__ import annotations

import copy
import random
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from passing import wire
from passing.aggregator.control_channel import ControlClient
from passing.control import join, leave
from passing.launch import free_udp_ports
from passing_controller import admission, result_rewrite
from passing_controller import switch as switch_link
from passing_controller.p4runtime import SwitchError
from passing_controller.topology import CHIP_LANES, DEFAULT_CHIP, Topology, TopologyError, ip_to_int
from tests.cluster import run_threads, start_aggregator
from tests.keys import ask
from tests.test_controller_ps_fallback import Running

SWITCH = {"p4runtime": "127.0.0.1:9559", "aggregation_mac": "02:00:00:00:00:fe", "aggregation_ip": "10.0.0.254"}
HOSTS = [{"name": "local", "mac": "02:00:00:00:00:01", "ip": "127.0.0.1", "port": 1}]


def topology(**switch: Any) -> Topology:
    return Topology.from_dict({"switch": {**SWITCH, **switch}, "hosts": copy.deepcopy(HOSTS)})


# ---- the topology ----------------------------------------------------------------------------


def test_each_chip_gives_its_programs_lanes_and_no_chip_keeps_todays():
    assert CHIP_LANES == {"bmv2": 64, "tofino": 64, "tofino2": 64}
    assert (topology().chip, topology().lanes) == (DEFAULT_CHIP, 64) == ("bmv2", 64)  # topologies before chips
    for chip, lanes in CHIP_LANES.items():
        assert (topology(chip=chip).chip, topology(chip=chip).lanes) == (chip, lanes)
        assert topology(chip=chip, lanes=lanes).lanes == lanes  # stating the program's own count is fine
    # a program rebuilt with another PASSING_LANES: only when said so
    assert topology(chip="tofino", lanes=32, lanes_override=True).lanes == 32
    assert topology(chip="tofino2", lanes=128, lanes_override=True).lanes == 128


@pytest.mark.parametrize("switch,message", [
    ({"chip": "tofino3"}, r"\"chip\" 'tofino3' is not a known chip: one of 'bmv2' \(64 lanes\), 'tofino' \(64 "
                          r"lanes\), 'tofino2' \(64 lanes\)"),
    ({"chip": "Tofino2"}, "not a known chip"),  # names are exact: no guessing
    ({"chip": 2}, "not a known chip"),
    ({"chip": "tofino2", "lanes": 72}, "\"lanes\" 72 disagrees with chip 'tofino2', whose PASSING program has 64 "
                                       "lanes.*\"lanes_override\": true"),
    ({"lanes": 128}, "disagrees with chip 'bmv2'"),  # no chip: bmv2's 64, and 128 is not it
    ({"chip": "tofino", "lanes_override": True}, "no \"lanes\""),
    ({"chip": "tofino", "lanes": 32, "lanes_override": "yes"}, "must be true or false"),
    ({"chip": "tofino", "lanes": 0, "lanes_override": True}, r"integer 1\.\.1024"),
    ({"chip": "tofino", "lanes": 64.0}, "integer"),
    ({"chip": "tofino", "lanes": "64"}, "integer"),
])
def test_a_chip_or_lanes_that_cannot_be_right_is_a_clear_error(switch, message):
    with pytest.raises(TopologyError, match=message):
        topology(**switch)


def test_a_chip_outside_the_switch_object_is_refused_not_ignored():
    for raw in ({"switch": SWITCH, "hosts": HOSTS, "chip": "tofino2"},
                {"ps": [{"data": "10.0.0.100:9877", "control": "tcp://10.0.0.100:9878"}], "lanes_override": True}):
        with pytest.raises(TopologyError, match="belong in the \"switch\" object"):
            Topology.from_dict(copy.deepcopy(raw))
    with pytest.raises(TopologyError, match="\"switch\" must be an object"):
        Topology.from_dict({"switch": "tofino2", "hosts": []})


# ---- end to end: a job on a "tofino2" switch entry rebuilt at 32 lanes streams 32-lane packets ------
# (`make p4-tofino2 TOFINO2_LANES=32`: a lane count no other chip has, so the packets show whose it is)
REBUILT = 32


@dataclass
class ProgramOnAggregator:
    """The controller's P4Runtime session, standing in for a switch whose data plane is the software
    aggregator at ``data`` (its ``control`` channel) running ``lanes`` lanes, the switch program's own
    count. A group's admission and result_rewrite entries become that aggregator's job (base, pool,
    generation from the admission entries; each worker's address from its rewrite entry); deleting them
    removes it. Every other entry is kept and read back as written; every counter reads 0. ``hosts``: the
    topology's hosts (a worker's address from its rewrite entry's IP). ``dead``: the switch is gone (killed,
    unplugged): every write and read fails as a lost P4Runtime session's would."""

    control: str
    lanes: int
    hosts: list[dict] = field(default_factory=lambda: HOSTS)
    dead: bool = False
    entries: list[tuple] = field(default_factory=list)
    jobs: dict[int, dict] = field(default_factory=dict)  # job id -> the add_job it got
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.p4info = type("P4Info", (), {"tables": {admission.TABLE}})()
        self.client = ControlClient(self.control)

    def fetch_pipeline(self) -> None:
        pass  # "runs the PASSING pipeline": the controller reconciles instead of loading one

    def set_pipeline(self, pipeline: Any) -> None:
        raise AssertionError("the stand-in runs the pipeline already")

    def close(self) -> None:
        pass

    @staticmethod
    def table_entry(table: str, match: dict, action: str | None = None, params: dict | None = None) -> tuple:
        return ("table", table, tuple(sorted(match.items())), action, tuple(sorted((params or {}).items())))

    @staticmethod
    def multicast_group(group: int, replicas: list[tuple[int, int]]) -> tuple:
        return ("multicast", group, tuple(replicas))

    @staticmethod
    def update(kind: str, entity: tuple) -> tuple:
        return (kind, entity)

    def _alive(self) -> None:
        if self.dead:
            raise SwitchError("P4Runtime call to the stand-in failed: UNAVAILABLE: the switch is gone")

    def write(self, updates: list[tuple]) -> None:
        self._alive()
        with self.lock:
            for kind, entity in updates:
                if kind == "insert":
                    assert entity not in self.entries, entity
                    self.entries.append(entity)
                else:
                    self.entries.remove(entity)
            touched = {dict(e[2])["job"] for _, e in updates if e[0] == "table" and e[1] == result_rewrite.TABLE}
            for job in touched:
                self._program(job)

    def _program(self, job: int) -> None:
        """(lock held) The aggregator's job ``job`` as the tables now say: admitted, or removed."""
        admitted = [(dict(e[2]), dict(e[4])) for e in self.entries
                    if e[0] == "table" and e[1] == admission.TABLE and dict(e[2])["job"] == job]
        rewrites = sorted((dict(e[2])["worker"], dict(e[4])) for e in self.entries
                          if e[0] == "table" and e[1] == result_rewrite.TABLE and dict(e[2])["job"] == job)
        if job in self.jobs:
            self.client.request("remove_job", job=job)
            del self.jobs[job]
        if admitted and rewrites:
            match, params = admitted[0]
            ips = {ip_to_int(h["ip"]): h["ip"] for h in self.hosts}
            spec = {"job": job, "generation": match["generation"], "base": params["base"], "pool": params["pool"],
                    "workers": [f"{ips[r['ip']]}:{r['port']}" for _, r in rewrites], "lanes": self.lanes}
            self.client.request("add_job", job=spec)
            self.jobs[job] = spec

    def read_table(self, table: str) -> list[tuple]:
        self._alive()
        with self.lock:
            return [e for e in self.entries if e[0] == "table" and e[1] == table]

    def read_multicast_groups(self) -> list[tuple]:
        with self.lock:
            return [e for e in self.entries if e[0] == "multicast"]

    def has_counter(self, counter: str) -> bool:
        return counter not in {f"PassingIngress.{n}" for n in ("sent_up", "answered", "late_answer")}  # as TNA

    def read_counter(self, counter: str) -> dict[int, int]:
        self._alive()
        return {}

    def read_counter_cells(self, cells: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        self._alive()
        return {cell: 0 for cell in cells}


@pytest.fixture
def tofino2_data_plane():
    """A software aggregator at a loopback address of its own on the PASSING port (a switch's groups are
    told <aggregation_ip>:9877), standing for a Tofino 2 program rebuilt at REBUILT lanes."""
    address = f"127.{random.randrange(1, 255)}.{random.randrange(1, 255)}.{random.randrange(2, 255)}"
    proc, ready = start_aggregator(["--listen", f"{address}:9877"], host=address)
    yield address, ProgramOnAggregator(ready["control"], lanes=REBUILT)
    proc.terminate()
    proc.wait(10)


@pytest.mark.timeout(120)
def test_a_job_on_a_tofino2_switch_gets_its_programs_lanes_end_to_end(tofino2_data_plane, tmp_path, monkeypatch):
    address, program = tofino2_data_plane
    monkeypatch.setattr(switch_link, "connect", lambda *args, **kwargs: program)
    topo = topology(chip="tofino2", lanes=REBUILT, lanes_override=True, aggregation_ip=address)
    assert topo.lanes == REBUILT
    running = Running(topo, tmp_path / "ctl.sqlite")
    workers, elements = 3, 5000
    ports = free_udp_ports(workers)
    data = [np.arange(elements, dtype=np.float32) * (w + 1) - 7 for w in range(workers)]

    def work(w: int) -> tuple:
        from passing import Group

        answer = join(running.endpoint, "resnet-t2", w, workers, host="127.0.0.1", udp_port=ports[w], timeout=30)
        with Group.from_answer(answer, bind=("127.0.0.1", ports[w]), timeout=10) as g:
            result = g.allreduce(data[w])
            status = ask(running.endpoint, "status")
            return answer, result, g.stats.as_dict(), status

    try:
        results = run_threads(work, workers)
        for r in results:
            assert not isinstance(r, Exception), r
            answer, result, stats, status = r
            assert (answer["mode"], answer["lanes"]) == ("switch", REBUILT), answer
            assert answer["aggregators"][0]["host"] == address
            assert np.array_equal(result, sum(data)), "the sum through the rebuilt program"
            # what went on the wire: DATA packets of the rebuilt program's lanes, every one of them
            assert stats["bytes_sent"] == stats["packets_sent"] * wire.packet_size(REBUILT), stats
        (job,) = program.jobs.values()
        assert job["lanes"] == REBUILT and len(job["workers"]) == workers
        status = results[0][3]
        assert {"aggregator": "switch", "state": "up", "chip": "tofino2", "lanes": REBUILT}.items() <= \
            next(a for a in status["aggregators"] if a["aggregator"] == "switch").items()
        assert [(j["mode"], j["lanes"]) for j in status["jobs"]] == [("switch", REBUILT)]
        for answer, *_ in results:
            leave(running.endpoint, "resnet-t2", 0, answer["worker"], answer["token"])
        assert program.jobs == {} and ask(running.endpoint, "status")["jobs"] == []  # its entries went too
    finally:
        running.stop()


@pytest.mark.timeout(120)
def test_a_store_of_switch_groups_with_other_lanes_is_refused_at_start(tofino2_data_plane, tmp_path, monkeypatch):
    """The switch's chip changed in the topology while groups ran on it: their workers send packets of
    the old size, which the new program would not parse. The controller refuses to start, and says so."""
    address, program = tofino2_data_plane
    monkeypatch.setattr(switch_link, "connect", lambda *args, **kwargs: program)
    store = tmp_path / "ctl.sqlite"
    rebuilt = {"chip": "tofino2", "lanes": REBUILT, "lanes_override": True}
    running = Running(topology(**rebuilt, aggregation_ip=address), store)
    try:
        (port,) = free_udp_ports(1)
        answer = join(running.endpoint, "left-running", 0, 1, host="127.0.0.1", udp_port=port, timeout=30)
        assert (answer["mode"], answer["lanes"]) == ("switch", REBUILT)
    finally:
        running.stop()
    with pytest.raises(TopologyError, match=r"another lane count than the topology's switch \(chip 'tofino', 64 "
                                            r"lanes\): left-running group 0 \(32 lanes\).*--store"):
        Running(topology(chip="tofino", aggregation_ip=address), store)
    running = Running(topology(**rebuilt, aggregation_ip=address), store)  # the program it was placed under
    try:
        assert [(j["job"], j["lanes"]) for j in ask(running.endpoint, "status")["jobs"]] == [("left-running", REBUILT)]
    finally:
        running.stop()


def test_the_chip_table_is_the_programs_lane_counts():
    """CHIP_LANES is written beside the programs it stands for: each number is the one its P4 source (or the
    Makefile that builds it) says."""
    repo = Path(__file__).resolve().parent.parent

    def define(path: str, pattern: str) -> int:
        found = re.findall(pattern, (repo / path).read_text(), flags=re.MULTILINE)
        assert len(found) == 1, (path, pattern)
        return int(found[0])

    assert CHIP_LANES == {
        "bmv2": define("p4/include/constants.p4", r"^#define PASSING_LANES (\d+)\b"),
        "tofino": define("Makefile", r"^TOFINO_LANES \?= (\d+)\b"),
        "tofino2": define("p4/t2na/passing.p4", r"^#define PASSING_T2NA_LANES (\d+)\b"),
    }
