"""Every target's P4Info agrees on every name the controller uses (docs/tofino.md).

Compiles p4/v1model (p4c-bm2-ss) and, with `make p4-tofino` and `make p4-tofino2`, p4/tna and
p4/t2na (p4c-barefoot, then bfas: does it fit Tofino 1, Tofino 2?) into a temporary directory;
those tests are skipped when a compiler is missing. The review trace of the scenario table
through the TNA program (docs/tofino.md) is checked for completeness everywhere.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
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
# and those of the tree roles, on a program that takes them (docs/tofino.md, "The tree roles")
TREE_REGISTERS = ("PassingIngress.slot_phase",)


def test_every_scenario_is_traced_through_tna():
    from tests.conformance.scenarios import SCENARIOS

    doc = (REPO / "docs" / "tofino.md").read_text()
    traced = set(re.findall(r"^\| `(\w+)` \|", doc, re.M))
    missing = [s.name for s in SCENARIOS if s.name not in traced and not s.software_only]
    assert not missing, f"docs/tofino.md traces no TNA path for {missing}"


def test_every_tree_scenario_is_traced_through_t2na():
    from tests.conformance.tree_scenarios import TREE_SCENARIOS

    doc = (REPO / "docs" / "tofino.md").read_text()
    traced = set(re.findall(r"^\| `(\w+)` \|", doc, re.M))
    missing = [s.name for s in TREE_SCENARIOS if s.name not in traced]
    assert not missing, f"docs/tofino.md traces no Tofino 2 path for {missing}"


def load(path: Path):
    from google.protobuf import text_format
    from p4.config.v1 import p4info_pb2

    return text_format.Parse(path.read_text(), p4info_pb2.P4Info())


@dataclass(frozen=True)
class Chip:
    """A Tofino program and the make target that builds it (Makefile)."""

    program: str  # p4/<program>/passing.p4
    make_target: str
    out_variable: str  # where the make target puts its build
    binary: str  # what bfas writes once the program fits
    stages: int  # MAU stages per gress
    tree: bool  # takes the tree roles (docs/tofino.md, "The tree roles"; Tofino 1 does not fit them)


CHIPS = {
    "tna": Chip("tna", "p4-tofino", "TOFINO_OUT", "tofino.bin", 12, tree=False),
    "t2na": Chip("t2na", "p4-tofino2", "TOFINO2_OUT", "tofino2.bin", 20, tree=True),
}


def t2na_lanes() -> int:
    """The Tofino 2 program's lanes per packet: written once, as PASSING_T2NA_LANES in p4/t2na/passing.p4."""
    source = (REPO / "p4" / "t2na" / "passing.p4").read_text()
    found = re.search(r"^#define PASSING_T2NA_LANES (\d+)\b", source, re.M)
    assert found, "p4/t2na/passing.p4 defines no PASSING_T2NA_LANES"
    return int(found.group(1))


def test_t2na_lane_count_is_written_once():
    lanes = t2na_lanes()
    assert lanes % 8 == 0 and lanes >= 64, lanes  # four lane pairs (SALUs) per stage
    make = subprocess.run(["make", "-s", "-n", "p4-tofino2"], cwd=REPO, capture_output=True, text=True)
    assert f"-DPASSING_LANES={lanes} " in make.stdout, "make p4-tofino2 does not build the program's lane count"


@pytest.fixture(scope="module")
def v1model_p4info(tmp_path_factory):
    out = tmp_path_factory.mktemp("p4info")
    subprocess.run(["p4c-bm2-ss", "--arch", "v1model", "--std", "p4-16", "--p4runtime-files",
                    str(out / "v1model.txtpb"), "-o", str(out / "v1model.json"), "p4/v1model/passing.p4"],
                   cwd=REPO, check=True, capture_output=True)
    return load(out / "v1model.txtpb")


# Each Tofino build takes a minute or more (Tofino 2's with the tree roles 7 to 10 on 2 cores): `make test` (the
# 6-minute bar) leaves them to make test-all (CI), and the first test of each, which builds it, gets 30 minutes
# instead of the suite's 5
@pytest.fixture(scope="module", params=[pytest.param(name, marks=[pytest.mark.slow, pytest.mark.timeout(1800)])
                                        for name in sorted(CHIPS)])
def compiled(request, tmp_path_factory, v1model_p4info):
    """(v1model P4Info, the Tofino program's P4Info, its build directory, its Chip), one Tofino program at a time."""
    chip = CHIPS[request.param]
    out = tmp_path_factory.mktemp(chip.program)
    # the build users run (Makefile), so the flags are those of `make p4-tofino` / `make p4-tofino2`
    build = subprocess.run(["make", "-s", chip.make_target, f"{chip.out_variable}={out}", f"PYTHON={sys.executable}"],
                           cwd=REPO, capture_output=True, text=True)
    errors = [line for line in (build.stdout + build.stderr).splitlines() if "error" in line]
    assert build.returncode == 0, f"make {chip.make_target} fails: {errors or build.stderr[-3000:]}"
    return v1model_p4info, load(out / "passing.p4info.txtpb"), out, chip


@needs_compilers
def test_program_fits_its_chip(compiled):
    """p4c-barefoot places tables even past the chip's stages; bfas (run by the make target, which must have
    succeeded) is what refuses, so a binary means the program fits."""
    out, chip = compiled[2], compiled[3]
    assert (out / "pipe" / chip.binary).stat().st_size > 0
    resources = json.loads(next(out.rglob("resources.json")).read_text())
    assert resources["resources"]["mau"]["nStages"] == chip.stages


@needs_compilers
def test_lane_pairs_match_the_lane_count(compiled):
    """One lane_pair_<k> register per two lanes: TOFINO_LANES' default (64) on Tofino 1, PASSING_T2NA_LANES on 2."""
    chip = compiled[3]
    pairs = [r for r in compiled[1].registers if r.preamble.name.startswith("PassingIngress.lane_pair_")]
    lanes = t2na_lanes() if chip.program == "t2na" else 64
    assert len(pairs) == lanes // 2, (chip.program, len(pairs))


# constant tables both programs have alike (the controller writes none of them; P4Testgen's vectors name them)
SHARED_CONST_TABLES = ("PassingIngress.worker_bit",)
SHARED_CONST_ACTIONS = ("PassingIngress.set_worker_bit",)


def controller_names(tree: bool = False) -> tuple[list[str], list[str], list[str]]:
    """The tables, actions and counters the controller writes or reads; with ``tree``, the tree roles' too
    (controller tree_roles.py, counters.TREE)."""
    from passing_controller import admission, aggregator_address, counters, l2_forward, result_rewrite, tree_roles

    tables = [admission.TABLE, result_rewrite.TABLE, l2_forward.TABLE, aggregator_address.TABLE, *SHARED_CONST_TABLES]
    actions = [admission.ACTION, result_rewrite.ACTION, l2_forward.FORWARD, l2_forward.FLOOD, "NoAction",
               *SHARED_CONST_ACTIONS]
    names = list(counters.NAMES)
    if tree:
        tables += [tree_roles.ROLE_TABLE, tree_roles.UPLINK_TABLE, tree_roles.OWNER_TABLE]
        actions += [tree_roles.LEAF, tree_roles.ROOT, tree_roles.FROM_UPLINK, tree_roles.OWNER_WORKER,
                    tree_roles.OWNER_UP]
        names += [f"PassingIngress.{n}" for n in counters.TREE]
    return tables, actions, names


def test_the_tree_names_are_the_controllers():
    """The tree roles' names the P4Info tests hold every program to are those the controller writes and reads
    (no compiler needed): tree_roles.COUNTERS is counters.TREE, and the v1model program declares each."""
    from passing_controller import counters, tree_roles

    assert tuple(tree_roles.COUNTERS) == tuple(counters.TREE)
    source = (REPO / "p4" / "v1model" / "passing.p4").read_text()
    tables, actions, names = controller_names(tree=True)
    for name in (*tables[-3:], *actions[-5:], *names[-3:], *TREE_REGISTERS):
        short = name.split(".", 1)[1]
        assert re.search(rf"\b{short}\b", source), f"p4/v1model/passing.p4 has no {short}"


def by_name(entities) -> dict:
    return {e.preamble.name: e for e in entities}


@needs_compilers
def test_tables_agree_on_keys(compiled):
    v1, tofino = (by_name(p.tables) for p in compiled[:2])
    program = compiled[3].program
    tables, _, _ = controller_names(compiled[3].tree)
    for name in tables:
        assert name in v1 and name in tofino, f"table {name} missing: v1model {name in v1}, {program} {name in tofino}"
        keys = [[(m.name, m.bitwidth, m.match_type) for m in t.match_fields] for t in (v1[name], tofino[name])]
        assert keys[0] == keys[1], f"{name}: v1model keys {keys[0]} != {program} keys {keys[1]}"


@needs_compilers
def test_actions_agree_on_parameters(compiled):
    v1, tofino = (by_name(p.actions) for p in compiled[:2])
    program = compiled[3].program
    _, actions, _ = controller_names(compiled[3].tree)
    for name in actions:
        assert name in v1 and name in tofino, f"action {name} missing: v1model {name in v1}, {program} {name in tofino}"
        params = [[(q.name, q.bitwidth) for q in a.params] for a in (v1[name], tofino[name])]
        assert params[0] == params[1], f"{name}: v1model {params[0]} != {program} {params[1]}"


@needs_compilers
def test_counters_and_registers_exist_on_both(compiled):
    v1_counters, tofino_counters = (by_name(p.counters) for p in compiled[:2])
    program = compiled[3].program
    _, _, counter_names = controller_names(compiled[3].tree)
    for name in counter_names:
        assert name in v1_counters and name in tofino_counters, f"counter {name} missing ({program})"
        assert v1_counters[name].size == tofino_counters[name].size, (program, name)
    v1_registers, tofino_registers = (by_name(p.registers) for p in compiled[:2])
    for name in SHARED_REGISTERS + (TREE_REGISTERS if compiled[3].tree else ()):
        assert name in v1_registers and name in tofino_registers, f"register {name} missing ({program})"
        assert v1_registers[name].size == tofino_registers[name].size, (program, name)


@needs_compilers
def test_tree_roles_only_where_the_chip_takes_them(compiled):
    """A program without the roles must not have half of them: the controller configures a tree on a switch
    whose P4Info has tree_role (tree_switch.supported), which then needs every table, action and counter."""
    from passing_controller import tree_roles

    tofino, chip = compiled[1], compiled[3]
    tables = by_name(tofino.tables)
    assert (tree_roles.ROLE_TABLE in tables) == chip.tree, chip.program
    if not chip.tree:
        tree_tables = {tree_roles.ROLE_TABLE, tree_roles.UPLINK_TABLE, tree_roles.OWNER_TABLE}
        assert not tree_tables & set(tables), (chip.program, tree_tables & set(tables))
