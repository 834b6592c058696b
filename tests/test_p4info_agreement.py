"""Both targets' P4Info agree on every name the controller uses (docs/tofino.md).

Compiles p4/v1model (p4c-bm2-ss) and, with `make p4-tofino`, p4/tna (p4c-barefoot, then
bfas: does it fit Tofino 1?) into a temporary directory; those tests are skipped when a
compiler is missing. The review trace of the scenario table through the TNA program
(docs/tofino.md) is checked for completeness everywhere.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

needs_compilers = pytest.mark.skipif(
    not all(shutil.which(tool) for tool in ("p4c-bm2-ss", "p4c-barefoot", "bfas", "p4c-gen-conf")),
    reason="p4c-bm2-ss, p4c-barefoot, bfas or p4c-gen-conf not found (docs/tofino.md: p4c with its Tofino backend)",
)

# registers both programs keep per slot/set (BMv2 also has slot_epoch, which TNA pairs with the tag;
# the lanes are one register on BMv2, one per lane on TNA: docs/tofino.md)
SHARED_REGISTERS = ("PassingIngress.slot_tag", "PassingIngress.slot_bitmap", "PassingIngress.slot_overflow")


def test_every_scenario_is_traced_through_tna():
    from tests.conformance.scenarios import SCENARIOS

    doc = (REPO / "docs" / "tofino.md").read_text()
    traced = set(re.findall(r"^\| `(\w+)` \|", doc, re.M))
    missing = [s.name for s in SCENARIOS if s.name not in traced and not s.software_only]
    assert not missing, f"docs/tofino.md traces no TNA path for {missing}"


def load(path: Path):
    from google.protobuf import text_format
    from p4.config.v1 import p4info_pb2

    return text_format.Parse(path.read_text(), p4info_pb2.P4Info())


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("p4info")
    subprocess.run(["p4c-bm2-ss", "--arch", "v1model", "--std", "p4-16", "--p4runtime-files",
                    str(out / "v1model.txtpb"), "-o", str(out / "v1model.json"), "p4/v1model/passing.p4"],
                   cwd=REPO, check=True, capture_output=True)
    tofino = out / "tofino"
    # the build users run (Makefile), so the flags are those of `make p4-tofino`
    tna = subprocess.run(["make", "-s", "p4-tofino", f"TOFINO_OUT={tofino}", f"PYTHON={sys.executable}"],
                         cwd=REPO, capture_output=True, text=True)
    errors = [line for line in (tna.stdout + tna.stderr).splitlines() if "error" in line]
    assert tna.returncode == 0, f"make p4-tofino fails: {errors or tna.stderr[-3000:]}"
    return load(out / "v1model.txtpb"), load(tofino / "passing.p4info.txtpb"), tofino


@needs_compilers
def test_tna_program_fits_tofino1(compiled):
    """p4c-barefoot places tables even past the chip's 12 stages; bfas (run by `make p4-tofino`,
    which must have succeeded) is what refuses, so a binary means the program fits."""
    assert (compiled[2] / "pipe" / "tofino.bin").stat().st_size > 0


# constant tables both programs have alike (the controller writes none of them; P4Testgen's vectors name them)
SHARED_CONST_TABLES = ("PassingIngress.worker_bit",)
SHARED_CONST_ACTIONS = ("PassingIngress.set_worker_bit",)


def controller_names() -> tuple[list[str], list[str], list[str]]:
    from passing_controller import admission, aggregator_address, counters, l2_forward, result_rewrite

    tables = [admission.TABLE, result_rewrite.TABLE, l2_forward.TABLE, aggregator_address.TABLE, *SHARED_CONST_TABLES]
    actions = [admission.ACTION, result_rewrite.ACTION, l2_forward.FORWARD, l2_forward.FLOOD, "NoAction",
               *SHARED_CONST_ACTIONS]
    return tables, actions, list(counters.NAMES)


def by_name(entities) -> dict:
    return {e.preamble.name: e for e in entities}


@needs_compilers
def test_tables_agree_on_keys(compiled):
    v1, tna = (by_name(p.tables) for p in compiled[:2])
    tables, _, _ = controller_names()
    for name in tables:
        assert name in v1 and name in tna, f"table {name} missing: v1model {name in v1}, tna {name in tna}"
        keys = [[(m.name, m.bitwidth, m.match_type) for m in t.match_fields] for t in (v1[name], tna[name])]
        assert keys[0] == keys[1], f"{name}: v1model keys {keys[0]} != tna keys {keys[1]}"


@needs_compilers
def test_actions_agree_on_parameters(compiled):
    v1, tna = (by_name(p.actions) for p in compiled[:2])
    _, actions, _ = controller_names()
    for name in actions:
        assert name in v1 and name in tna, f"action {name} missing: v1model {name in v1}, tna {name in tna}"
        params = [[(q.name, q.bitwidth) for q in a.params] for a in (v1[name], tna[name])]
        assert params[0] == params[1], f"{name}: v1model {params[0]} != tna {params[1]}"


@needs_compilers
def test_counters_and_registers_exist_on_both(compiled):
    v1_counters, tna_counters = (by_name(p.counters) for p in compiled[:2])
    _, _, counter_names = controller_names()
    for name in counter_names:
        assert name in v1_counters and name in tna_counters, f"counter {name} missing"
        assert v1_counters[name].size == tna_counters[name].size, name
    v1_registers, tna_registers = (by_name(p.registers) for p in compiled[:2])
    for name in SHARED_REGISTERS:
        assert name in v1_registers and name in tna_registers, f"register {name} missing"
        assert v1_registers[name].size == tna_registers[name].size, name
