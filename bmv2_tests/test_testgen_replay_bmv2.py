"""P4Testgen's tests of the v1model program (p4/v1model/testgen.json, written by `make p4-testgen`) replayed on a
real simple_switch_grpc running build/v1model/passing.json: BMv2 must do what P4Testgen expected, vector by vector
(docs/tofino.md, "Executed by P4Testgen"; issue 27).

One switch for all vectors (bare_switch: a namespace of its own, ports 0-7 as veth pairs). A vector: its table
entries over P4Runtime, its frame on its port, then behind it on the same port one marker frame per port, which
a fixed l2_forward entry of the marker's sends out of that port. BMv2 keeps the order of one input port through
its ingress and on each output port, so once every marker is back, whatever the vector's frame made has arrived:
a drop is known without waiting on the clock. Then the vector's entries are deleted and every register is reset
(P4Testgen's bmv2 model starts registers at 0, as BMv2 does), so nothing leaks into the next vector.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.conformance.testgen import masked_difference

from .network import REPO

if "testgen_vectors" not in sys.modules:  # p4/ is no package (`p4` is p4runtime's protobuf package)
    _spec = importlib.util.spec_from_file_location("testgen_vectors", REPO / "p4" / "testgen_vectors.py")
    sys.modules["testgen_vectors"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["testgen_vectors"])
testgen_vectors = sys.modules["testgen_vectors"]

PROGRAM = testgen_vectors.PROGRAMS["v1model"]
VECTORS = testgen_vectors.load_vectors(PROGRAM)["tests"] if (REPO / PROGRAM.vectors).exists() else []
PORTS = 8  # the vectors' ports: p4testgen --port-ranges 0:7 (testgen_vectors.PROGRAMS)

# Vectors where BMv2 and P4Testgen's model of it genuinely differ: id -> why. Each is run and must still differ
# (strict xfail), so a fix on either side shows.
KNOWN_DIFFERENCES: dict[int, str] = {}

MARKER_TYPE = b"\x88\xb5"  # IEEE 802 local experimental EtherType: no parser state of the program takes it


def marker_mac(port: int) -> bytes:
    return bytes([0x0E, 0x70, 0x61, 0x73, 0x73, port])  # locally administered


def marker(port: int) -> bytes:
    return (marker_mac(port) + bytes(6) + MARKER_TYPE + b"passing replay marker").ljust(60, b"\0")


def is_marker(port: int, frame: bytes) -> bool:
    return frame == marker(port)


def describe(frames: list[tuple[int, bytes]]) -> str:
    return "; ".join(f"port {p}: {f.hex()}" for p, f in frames) or "nothing"


class Replay:
    def __init__(self, switch, p4runtime) -> None:
        from passing_controller.session import Switch

        self.switch, self.p4runtime, self.update = switch, p4runtime, Switch.update
        self.registers = sorted(p4runtime.p4info.registers)
        # the markers' forwarding stays installed: a vector's frame to a marker's address would take it
        used = {bytes.fromhex(v["input"]["packet"])[:6] for v in VECTORS}
        used |= {t["key"]["dst_addr"]["value"].to_bytes(6, "big") for v in VECTORS for t in v["tables"]
                 if t["table"] == "PassingIngress.l2_forward"}
        clash = sorted(p for p in range(PORTS) if marker_mac(p) in used)
        assert not clash, f"vectors use the marker addresses of ports {clash}: pick other marker addresses"
        p4runtime.write([self.update("insert", p4runtime.table_entry(
            "PassingIngress.l2_forward", {"dst_addr": marker_mac(p)}, "PassingIngress.forward", {"port": p}))
            for p in range(PORTS)])

    def entry(self, table: dict):
        if table.get("default") or any(set(k) != {"value"} for k in table["key"].values()):
            raise NotImplementedError(f"only exact entries are replayed (the v1model program has no other): {table}")
        return self.p4runtime.table_entry(table["table"], {k: m["value"] for k, m in table["key"].items()},
                                          table["action"], table["params"])

    def run(self, vector: dict) -> list[tuple[int, bytes]]:
        """What the switch sent, (port, frame) each, for the vector's input on its entries."""
        return self.run_chain([vector])[0]

    def run_chain(self, chain: list[dict]) -> list[list[tuple[int, bytes]]]:
        """What the switch sent for each vector of a chain (a tree sequence: the packets one after the other on the
        registers the earlier ones left, with every entry any of them hit installed), or of one vector."""
        for vector in chain:
            port = vector["input"]["port"]
            assert 0 <= port < PORTS, f"input port {port} is not one of the replay's (0-{PORTS - 1})"
        tables = chain[0]["tables"] if len(chain) == 1 else \
            list({repr((t["table"], sorted(t["key"].items()))): t for v in chain for t in v["tables"]}.values())
        entries = [self.entry(t) for t in tables]
        inserted = []
        try:
            # one update per Write: a vector may hold one entry twice, and the entries it did insert are
            # deleted after it
            for e in entries:
                self.p4runtime.write([self.update("insert", e)])
                inserted.append(e)
            sent = []
            for vector in chain:
                port = vector["input"]["port"]
                self.switch.send(port, bytes.fromhex(vector["input"]["packet"]))
                for p in range(PORTS):
                    self.switch.send(port, marker(p))
                sent.append(self.switch.receive(is_marker, PORTS, timeout=30))
            return sent
        finally:
            for e in inserted:
                self.p4runtime.write([self.update("delete", e)])
            for register in self.registers:
                self.switch.thrift.register_reset(register)


def _replay(pipeline):
    from passing_controller.session import Switch

    from .bare_switch import NamespacedSwitch

    switch = NamespacedSwitch(PORTS)
    try:
        p4runtime = Switch(switch.p4runtime_address, timeout=30)
        try:
            p4runtime.set_pipeline(pipeline)
            yield Replay(switch, p4runtime)
        finally:
            p4runtime.close()
    finally:
        switch.stop()


@pytest.fixture(scope="module")
def replay(pipeline):
    yield from _replay(pipeline)


@pytest.fixture(scope="module")
def tree_replay(tmp_path_factory):
    """The program at the tree sequences' lanes (p4/v1model/testgen_tree.json: 4), on a switch of its own."""
    from passing_controller.p4runtime import Pipeline

    out = tmp_path_factory.mktemp("v1model-tree")
    lanes = testgen_vectors.load_vectors(TREE)["defines"]["PASSING_LANES"]
    subprocess.run(["p4c-bm2-ss", "--arch", "v1model", "--std", "p4-16", f"-DPASSING_LANES={lanes}",
                    "--p4runtime-files", str(out / "passing.p4info.txtpb"), "-o", str(out / "passing.json"),
                    str(REPO / TREE.source)], check=True)
    yield from _replay(Pipeline(out / "passing.p4info.txtpb", out / "passing.json"))


def test_the_vectors_are_those_of_the_program():
    assert testgen_vectors.stale(PROGRAM) is None, testgen_vectors.stale(PROGRAM)
    assert VECTORS, f"{PROGRAM.vectors} has no tests"


QUICK_EVERY = 4  # `make test` replays every fourth vector; make test-all (CI) every one


def _param(vector: dict):
    reason = KNOWN_DIFFERENCES.get(vector["id"])
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    if vector["id"] % QUICK_EVERY:
        marks.append(pytest.mark.slow)
    return pytest.param(vector, id=f"test{vector['id']}", marks=marks)


def _agrees(vector: dict, got: list[tuple[int, bytes]]) -> None:
    expect = vector["expect"]
    if expect is None:
        assert not got, f"P4Testgen: dropped; BMv2 sent {describe(got)}"
        return
    assert [p for p, _ in got] == [expect["port"]], \
        f"P4Testgen: one frame on port {expect['port']}; BMv2 sent {describe(got)}"
    difference = masked_difference(bytes.fromhex(expect["packet"]), got[0][1], expect["dont_care_bits"])
    assert difference is None, f"port {expect['port']}: {difference}"


@pytest.mark.parametrize("vector", [_param(v) for v in VECTORS])
def test_bmv2_does_what_p4testgen_expected(replay, vector):
    _agrees(vector, replay.run(vector))


TREE = testgen_vectors.PROGRAMS["v1model_tree"]
TREE_VECTORS = testgen_vectors.load_vectors(TREE)["tests"] if (REPO / TREE.vectors).exists() else []


@pytest.mark.slow  # a second compile of the program (at the sequences' lanes) and a second switch
@pytest.mark.parametrize("name", sorted({v["sequence"] for v in TREE_VECTORS}))
def test_bmv2_runs_each_tree_sequence_as_p4testgen_expected(tree_replay, name):
    """A tree sequence's packets in order on one switch, from registers at 0 (the first step's): each does what
    its pinned run expected on the registers the earlier ones left (p4/testgen_tree_sequences.py)."""
    chain = sorted((v for v in TREE_VECTORS if v.get("sequence") == name), key=lambda v: v["step"])
    for vector, got in zip(chain, tree_replay.run_chain(chain)):
        try:
            _agrees(vector, got)
        except AssertionError as e:
            raise AssertionError(f"step {vector['step']}: {e}") from e


def test_a_batch_that_fails_in_part_names_the_update_that_failed(replay):
    """A Write whose second update fails (the entry exists already) raises at once, naming it: p4runtime-shell's
    own formatting of such an error loops forever, which would hang the controller (session._write_error)."""
    from passing_controller.p4runtime import SwitchError

    entry = replay.p4runtime.table_entry("PassingIngress.l2_forward", {"dst_addr": 0x0E7061737399},
                                         "PassingIngress.forward", {"port": 1})
    try:
        with pytest.raises(SwitchError, match="update 1: ALREADY_EXISTS"):
            replay.p4runtime.write([replay.update("insert", entry), replay.update("insert", entry)])
    finally:
        replay.p4runtime.write([replay.update("delete", entry)])
