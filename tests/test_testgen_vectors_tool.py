"""p4/testgen_vectors.py, the tool `make p4-testgen` runs: P4Testgen's PTF output -> vectors, and the program hash
that tells stale vectors (docs/tofino.md, issue 27). Runs without P4Testgen: the PTF texts below have the forms its
tofino and bmv2 targets write."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("testgen_vectors", ROOT / "p4" / "testgen_vectors.py")
tool = importlib.util.module_from_spec(_spec)
sys.modules["testgen_vectors"] = tool  # p4/ is no package (`p4` is p4runtime's protobuf package)
_spec.loader.exec_module(tool)

PTF = """
class AbstractTest(BfRuntimeTest):
    def setupCtrlPlane(self):
        pass

class Test1(AbstractTest):
    '''
    [Parser] TnaIngressParser ... a trace, megabytes in real output
    '''

    def setupCtrlPlane(self):
        self.setRegisterValue('PassingIngress.slot_tag', [('PassingIngress.slot_tag.tag', 0x00000007), \
('PassingIngress.slot_tag.epoch', 0x00010000)], 5)
        self.setRegisterValue('PassingIngress.slot_overflow', 0x01, 5)
        # Table PassingIngress.admission
        self.insertTableEntry(
            'PassingIngress.admission',
            [
                gc.KeyTuple('job', 0x0001),
                gc.KeyTuple('ingress_port', 0x003),
            ],
            'PassingIngress.admit',
            [
                gc.DataTuple('pool', 0x0004),
            ]
        )
        self.insertTableEntry('PassingIngress.t', [gc.KeyTuple('k', 0x0A, 0x0F), gc.KeyTuple('r', low=1, high=9)],
                              'PassingIngress.a', [])

    def sendPacket(self):
        ig_port = 3
        pkt = b'\\x01\\x02'
        send_packet(self, ig_port, pkt)

    def verifyPackets(self):
        eg_port = 68
        exp_pkt = b'\\x0A\\x0B\\x0C'
        exp_pkt = Mask(exp_pkt)
        exp_pkt.set_do_not_care(8, 4)
        verify_packet(self, exp_pkt, eg_port)

class Test0(AbstractTest):
    '''
    trace
    '''

    def setupCtrlPlane(self):
        pass

    def sendPacket(self):
        ig_port = 0
        pkt = b'\\xFF'
        send_packet(self, ig_port, pkt)

    def verifyPackets(self):
        pass
"""


# The bmv2 target's form: P4Runtime table_add calls, the expected packet inside Mask(...), no registers.
BMV2_PTF = """
class AbstractTest(bt.P4RuntimeTest):
    def setupCtrlPlane(self):
        pass

class Test1(AbstractTest):
    '''
    Date generated: 2026-11-25-14:30:00.000
    Trace:
    [Parser] V1Parser ... megabytes in real output
    '''

    def setupCtrlPlane(self):
        # Simple noop that is always called as filler.
        pass
        self.table_add(
            ('PassingIngress.admission',
            [
                self.Exact('job', 0x244F),
                self.Exact('ingress_port', 0x003),
            ]),
            ('PassingIngress.admit',
            [
                ('base', 0x00000000),
                ('pool', 0x8478),
            ])
            , None

        )
        self.table_add(
            ('PassingIngress.t',
            [
                self.Ternary('k', 0x0A, 0x0F),
                self.Lpm('ip', 0x0A000000, 8),
                self.Range('r', 1, 9),
            ]),
            ('NoAction',
            [
            ])
            , 3

        )


    def sendPacket(self):
        ig_port = 3
        pkt = b'\\x01\\x02'
        ptfutils.send_packet(self, ig_port, pkt)

    def verifyPackets(self):
        eg_port = 5
        exp_pkt = Mask(b'\\x0A\\x0B\\x0C')
        exp_pkt.set_do_not_care(8, 4)
        ptfutils.verify_packet(self, exp_pkt, eg_port)
        bt.testutils.log.info("Verifying no other packets ...")
        ptfutils.verify_no_other_packets(self, self.device_id, timeout=self.packet_wait_time)

    def runTest(self):
        self.runTestImpl()


class Test2(AbstractTest):
    '''
    Trace:
    '''

    def setupCtrlPlane(self):
        # Simple noop that is always called as filler.
        pass


    def sendPacket(self):
        ig_port = 0
        pkt = b'\\xFF'
        ptfutils.send_packet(self, ig_port, pkt)

    def verifyPackets(self):
        ptfutils.verify_no_other_packets(self, self.device_id, timeout=self.packet_wait_time)
"""


def test_bmv2_ptf_tests_become_vectors_of_the_same_form(tmp_path):
    path = tmp_path / "passing.py"
    path.write_text(BMV2_PTF)
    text = tool.without_traces(path)
    assert "megabytes" not in text and "Date generated" not in text
    test, dropped = tool.parse_ptf(text)
    assert dropped == {"id": 2, "tables": [], "registers": [], "input": {"port": 0, "packet": "ff"}, "expect": None}
    assert test["registers"] == []
    assert test["tables"] == [
        {"table": "PassingIngress.admission", "key": {"job": {"value": 0x244F}, "ingress_port": {"value": 3}},
         "action": "PassingIngress.admit", "params": {"base": 0, "pool": 0x8478}},
        {"table": "PassingIngress.t", "key": {"k": {"value": 10, "mask": 15},
                                              "ip": {"value": 0x0A000000, "prefix_len": 8},
                                              "r": {"low": 1, "high": 9}},
         "action": "NoAction", "params": {}, "priority": 3},
    ]
    assert test["input"] == {"port": 3, "packet": "0102"}
    assert test["expect"] == {"port": 5, "packet": "0a0b0c", "dont_care_bits": [[8, 4]]}


def test_a_bmv2_clone_session_is_an_unknown_call():
    filler = "        # Simple noop that is always called as filler.\n        pass\n        self.table_add("
    text = BMV2_PTF.replace(filler, "        self.insert_pre_clone_session(5, [2])\n        self.table_add(", 1)
    with pytest.raises(ValueError, match="insert_pre_clone_session"):
        tool.parse_ptf(text)


def test_ptf_tests_become_vectors_in_test_order():
    tests = tool.parse_ptf(PTF)
    assert [t["id"] for t in tests] == [0, 1]
    dropped, test = tests
    assert dropped["expect"] is None and dropped["input"] == {"port": 0, "packet": "ff"}
    assert dropped["tables"] == [] and dropped["registers"] == []
    assert test["registers"] == [
        {"register": "PassingIngress.slot_tag", "index": 5, "value": {"tag": 7, "epoch": 0x10000}},
        {"register": "PassingIngress.slot_overflow", "index": 5, "value": 1},
    ]
    assert test["tables"] == [
        {"table": "PassingIngress.admission", "key": {"job": {"value": 1}, "ingress_port": {"value": 3}},
         "action": "PassingIngress.admit", "params": {"pool": 4}},
        {"table": "PassingIngress.t", "key": {"k": {"value": 10, "mask": 15}, "r": {"low": 1, "high": 9}},
         "action": "PassingIngress.a", "params": {}},
    ]
    assert test["input"] == {"port": 3, "packet": "0102"}
    assert test["expect"] == {"port": 68, "packet": "0a0b0c", "dont_care_bits": [[8, 4]]}


def test_a_control_plane_call_the_parser_does_not_know_is_an_error():
    text = PTF.replace("self.setRegisterValue('PassingIngress.slot_overflow', 0x01, 5)",
                       "self.setDirectRegisterValue('PassingIngress.t', 0x01)")
    with pytest.raises(ValueError, match="setDirectRegisterValue"):
        tool.parse_ptf(text)


def test_the_hash_covers_the_program_and_every_file_it_includes(tmp_path):
    copy = tmp_path / "p4"
    shutil.copytree(ROOT / "p4", copy, ignore=shutil.ignore_patterns("*.py", "*.json"))
    program = copy / "tna" / "passing.p4"
    names = {p.name for p in tool.sources_of(program)}
    assert {"passing.p4", "headers.p4", "lanes.p4", "parser.p4", "constants.p4"} <= names
    before = tool.program_sha256(program)
    assert before == tool.program_sha256(ROOT / "p4" / "tna" / "passing.p4")  # where it lies does not matter
    constants = copy / "include" / "constants.p4"
    text = constants.read_text()
    # a comment, or white space, changes no test: the vectors stay fresh
    constants.write_text(text.replace("#define PASSING_UDP_PORT 9877", "#define  PASSING_UDP_PORT   9877 // here"))
    assert tool.program_sha256(program) == before
    constants.write_text(text + "\n/* a comment added to an included file */\n")
    assert tool.program_sha256(program) == before
    constants.write_text(text + "\n#define PASSING_SOMETHING_NEW 1\n")  # a change in an included file
    assert tool.program_sha256(program) != before


def test_a_variant_of_a_shared_file_is_part_of_the_hash_of_the_programs_that_take_it_alone(tmp_path):
    copy = tmp_path / "p4"
    shutil.copytree(ROOT / "p4", copy, ignore=shutil.ignore_patterns("*.py", "*.json"))
    tna, t2na = copy / "tna" / "passing.p4", copy / "t2na" / "passing.p4"
    assert "PASSING_PARSE_HEADER_ONLY" in (copy / "include" / "parser.p4").read_text()
    assert "#define PASSING_PARSE_HEADER_ONLY" in t2na.read_text()
    assert "PASSING_PARSE_HEADER_ONLY" not in tna.read_text()
    before = {p: tool.program_sha256(p) for p in (tna, t2na)}
    parser = copy / "include" / "parser.p4"
    text = parser.read_text()
    variant = ("#ifdef PASSING_PARSE_HEADER_ONLY\nconst bit<8> ONLY_THE_TREE = 1;\n"
               "#else\nconst bit<8> ALL_BUT = 2;\n#endif\n")
    parser.write_text(text + variant)
    assert tool.program_sha256(tna) != before[tna]  # its #else branch
    assert tool.program_sha256(t2na) != before[t2na]
    parser.write_text(text + variant.replace("#else\nconst bit<8> ALL_BUT = 2;\n", ""))
    assert tool.program_sha256(tna) == before[tna]  # a program that does not define it does not see it
    assert tool.program_sha256(t2na) != before[t2na]
    parser.write_text(text + "#ifndef PASSING_PARSE_HEADER_ONLY\nconst bit<8> ALL_BUT = 2;\n#endif\n")
    assert tool.program_sha256(tna) != before[tna]
    assert tool.program_sha256(t2na) == before[t2na]
    parser.write_text(text + "#ifdef PASSING_SOMETHING_ELSE\nconst bit<8> X = 1;\n#endif\n")  # not a variant
    assert tool.program_sha256(tna) != before[tna]
    parser.write_text(text + "#endif\n")
    with pytest.raises(ValueError, match="without its #if"):
        tool.program_sha256(tna)


def test_vectors_written_are_read_back_and_judged_by_the_hash(tmp_path, monkeypatch):
    monkeypatch.setattr(tool, "ROOT", tmp_path)
    shutil.copytree(ROOT / "p4", tmp_path / "p4", ignore=shutil.ignore_patterns("*.py", "*.json"))
    program = tool.PROGRAMS["tna"]
    assert "is missing" in tool.stale(program)
    tests = tool.parse_ptf(PTF)
    meta = {"program": program.source, "program_sha256": tool.program_sha256(tmp_path / program.source)}
    tool.write_vectors(tmp_path / program.vectors, meta, tests)
    assert tool.load_vectors(program)["tests"] == tests
    assert tool.stale(program) is None
    (tmp_path / program.source).write_text((tmp_path / program.source).read_text() + "\n/* a comment */\n")
    assert tool.stale(program) is None  # comments change no test
    (tmp_path / program.source).write_text((tmp_path / program.source).read_text() + "\nconst bit<8> NEW = 1;\n")
    assert "generated from another" in tool.stale(program)


TRACE = """
    [Control PassingIngress start]
    [P4Testgen MethodCall]: *.copy_in("TnaIngressDeparser");
    [Control TnaIngressDeparser start]
    [MethodCall]: pkt.emit<bridged_h>(hdr.bridged);
    [Emit]: {$headerValid:true;;    pad0:0;  ingress_port:2;  slot_set:748;  second_pass:1;  }
    [MethodCall]: pkt.emit<ethernet_h>(hdr.ethernet);
    [Invalid emit: { dst_addr = TaintedExpression(bit<48>) }]
    [MethodCall]: pkt.emit<udp_h>(hdr.udp);
    [Emit]: {$headerValid:true;;    src_port:0;  dst_port:9877;  length:280;  checksum:Taint;  }
    [P4Testgen MethodCall]: *.copy_out("TnaIngressDeparser");
    [P4Testgen AssignmentStatement]: *eg_intr_md.egress_port = 68;
    [P4Testgen MethodCall]: *.StartEgress();
    [MethodCall]: pkt.emit<udp_h>(hdr.udp);
    [Emit]: {$headerValid:true;;    src_port:1;  }
"""


def test_the_trace_gives_what_the_ingress_deparser_emitted_and_the_port():
    ingress = tool.ingress_of(TRACE, "TnaIngressDeparser")
    assert ingress == {"port": 68, "dropped": False, "emit": [
        {"header": "bridged_h", "fields": {"pad0": 0, "ingress_port": 2, "slot_set": 748, "second_pass": 1}},
        {"header": "udp_h", "fields": {"src_port": 0, "dst_port": 9877, "length": 280, "checksum": "Taint"}},
    ]}  # the invalid ethernet is not emitted; the egress's emits are not the ingress's


def test_a_packet_dropped_at_the_traffic_manager_has_no_port():
    trace = TRACE.replace("*eg_intr_md.egress_port = 68;", '*eg_intr_md.egress_port = "Taint";').replace(
        "*.StartEgress();", "*.tofino_drop();\n    [Packet marked dropped.]")
    ingress = tool.ingress_of(trace, "TnaIngressDeparser")
    assert ingress["dropped"] and ingress["port"] is None
    assert tool.ingress_of("no deparser here", "TnaIngressDeparser") is None


def test_ptf_tests_carry_their_ingress_output_when_asked():
    text = PTF.replace("    trace\n", TRACE)
    tests = tool.parse_ptf(text, "TnaIngressDeparser")
    assert tests[0]["ingress"]["port"] == 68
    assert "ingress" not in tool.parse_ptf(text)[0]


def test_a_run_stopped_by_its_budget_keeps_the_tests_p4testgen_finished(tmp_path):
    keep = sys.modules["testgen_p4testgen"]._keep_complete_tests  # loaded by the tool, from p4/
    whole = "\nclass Test{n}(AbstractTest):\n    def runTest(self):\n        self.runTestImpl()\n"
    ptf = tmp_path / "passing.py"
    for text, printed, kept in [
        ("".join(whole.format(n=n) for n in (1, 2)) + "\nclass Test3(AbstractTest):\n    def setUp", 3, 2),  # cut
        ("".join(whole.format(n=n) for n in (1, 2, 3)), 2, 2),  # the third's coverage line never came
        ("".join(whole.format(n=n) for n in (1, 2)), 2, 2),
    ]:
        ptf.write_text("import ptf\n" + text)
        keep(tmp_path, printed)
        assert ptf.read_text().count("\nclass Test") == kept and ptf.read_text().rstrip().endswith("runTestImpl()")
