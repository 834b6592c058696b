"""P4Testgen's tests of the PASSING programs, kept as data beside them (docs/tofino.md, "Executed by P4Testgen").

P4Testgen (upstream p4c, backends/p4tools) executes a P4 program symbolically and writes one test per path:
table entries, initial register values, an input packet and port, and the expected output packet and port
(or none: a drop). `make p4-testgen` runs it where it is installed and turns its output into *vectors*: one
JSON file per program (``p4/tna/testgen.json``, ``p4/v1model/testgen.json``), one test a line, with the hash
of the program (and of every file it includes) that they came from, so that a check needing no P4 tool can hold
them against the protocol (tests/conformance/testgen.py), and bmv2_tests/test_testgen_replay_bmv2.py replays the
v1model ones on BMv2.

Standard library only: this runs on a machine that has P4Testgen and nothing of PASSING installed.

    python3 p4/testgen_vectors.py generate tna        # p4testgen -> p4/tna/testgen.json
    python3 p4/testgen_vectors.py generate v1model    # p4testgen -> p4/v1model/testgen.json
    python3 p4/testgen_vectors.py check               # exit 1 if a vector file is missing or stale
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Run:
    """One p4testgen run over a program: its name (a vector's ``run``), the defines and the arguments."""

    name: str
    defines: dict
    args: tuple[str, ...]


@dataclass(frozen=True)
class Program:
    name: str
    source: str  # relative to the repository root
    vectors: str
    target: str  # p4testgen --target
    arch: str  # p4testgen --arch
    test_backend: str  # the output format whose parser is below
    ingress_deparser: str | None  # the control whose output a vector records from the trace (see ingress_of)
    runs: tuple[Run, ...]


# The tofino target writes initial registers only in PTF (its STF has none). Greedy statement search, and only
# tests that cover something new, until nothing new is found. The two passes of a round are two runs, each kept
# to its own inputs by the preconditions of p4/include/testgen.p4: ports 0-63 and the recirculation port 68 of
# pipe 0 (an output port outside --port-ranges is a P4Testgen error, so 68 must be in them).
# The bmv2 target writes no registers in any format: its registers start at 0, as BMv2's do. Its PTF tests go
# through P4Runtime, as the replay on BMv2 does; the replay has ports 0-7 (input and output, --port-ranges) and
# frames of at most 1500 bytes (veth MTU; --packet-size-range is in bits). The v1model program's paths do not end
# in depth-first order (its constant tables multiply them), and greedy search stops early: random backtracking.
# Two runs: "all" without preconditions (with the registers at 0, only admission entries no controller writes,
# epoch 0, reach the paths of a round under way, which BMv2 must run as P4Testgen expects all the same; the
# checker counts such vectors as outside the protocol), and "in_domain" with them, for the checker.
_TNA_SEARCH = ("--path-selection", "GREEDY_STATEMENT_SEARCH", "--only-covering-tests",
               "--port-ranges", "0:63,68:68")
_V1MODEL_SEARCH = ("--path-selection", "RANDOM_BACKTRACK", "--port-ranges", "0:7", "--packet-size-range", "0:12000")
PROGRAMS = {
    "tna": Program("tna", "p4/tna/passing.p4", "p4/tna/testgen.json", "tofino", "tna", "PTF", "TnaIngressDeparser",
                   (Run("first_pass", {"PASSING_TESTGEN": 1}, _TNA_SEARCH),
                    Run("second_pass", {"PASSING_TESTGEN": 2}, _TNA_SEARCH))),
    "v1model": Program("v1model", "p4/v1model/passing.p4", "p4/v1model/testgen.json", "bmv2", "v1model", "PTF", None,
                       (Run("all", {}, _V1MODEL_SEARCH), Run("in_domain", {"PASSING_TESTGEN": 1}, _V1MODEL_SEARCH))),
}
TARGET_DEFINES = {"tofino": {"__TARGET_TOFINO__": 1}}  # p4c-barefoot defines it for tna.p4; p4testgen does not
# tna.p4 and its Tofino includes come with the Tofino backend's sources (docs/tofino.md)
TARGET_INCLUDES = {"tofino": ("backends/tofino/bf-p4c/p4include",)}
P4C_SOURCE = Path(os.environ.get("P4C_SOURCE", "/opt/src/p4c"))  # the p4c checkout P4Testgen was built from

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def sources_of(program: Path) -> list[Path]:
    """The program and every file it includes with ``#include "..."``, transitively, in a fixed order."""
    seen: list[Path] = []
    todo = [program.resolve()]
    while todo:
        path = todo.pop(0)
        if path in seen:
            continue
        seen.append(path)
        todo += [(path.parent / name).resolve() for name in _INCLUDE.findall(path.read_text())]
    return seen


def program_sha256(program: Path) -> str:
    """What a vector file is stale against: the bytes of the program and of everything it includes."""
    digest = hashlib.sha256()
    for path in sources_of(program):
        name = os.path.relpath(path, program.resolve().parent)
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


# ---- P4Testgen's PTF output -> vectors ---------------------------------------------------------------------


def _value(node: ast.expr) -> object:
    return ast.literal_eval(node)


def _call_name(node: ast.expr) -> str:
    """'insertTableEntry' for self.insertTableEntry(...), 'KeyTuple' for gc.KeyTuple(...)."""
    if isinstance(node, ast.Call):
        node = node.func
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _key(node: ast.Call) -> tuple[str, dict]:
    """tofino: gc.KeyTuple(name, value[, mask] | low=, high= | prefix_len=); bmv2: self.Exact(name, value),
    self.Ternary(name, value, mask), self.Lpm(name, value, prefix_len), self.Range(name, low, high)."""
    name, *args = (_value(a) for a in node.args)
    kw = {k.arg: _value(k.value) for k in node.keywords}
    kind = _call_name(node)
    if kind == "Optional":
        raise ValueError(f"key {name}: optional matches are not kept in vectors")
    if kind == "Range":
        return name, {"low": args[0], "high": args[1]}
    if "low" in kw:
        return name, {"low": kw["low"], "high": kw["high"]}
    if kind == "Lpm":
        return name, {"value": args[0], "prefix_len": args[1]}
    if "prefix_len" in kw:
        return name, {"value": args[0], "prefix_len": kw["prefix_len"]}
    if len(args) == 2:
        return name, {"value": args[0], "mask": args[1]}
    return name, {"value": args[0]}


def _table_call(call: ast.Call) -> dict:
    kind = _call_name(call)
    if kind == "table_add":  # bmv2: ((table, [keys]), (action, [(param, value)]), priority)
        (table, keys), (action, data) = (arg.elts for arg in call.args[:2])
        entry = {"table": _value(table), "key": dict(_key(k) for k in keys.elts), "action": _value(action),
                 "params": {_value(d.elts[0]): _value(d.elts[1]) for d in data.elts}}
        priority = _value(call.args[2]) if len(call.args) > 2 else None
        return entry if priority is None else {**entry, "priority": priority}
    if kind == "insertTableEntry":
        table, keys, action, data = call.args
        return {"table": _value(table), "key": dict(_key(k) for k in keys.elts),
                "action": _value(action), "params": {_value(d.args[0]): _value(d.args[1]) for d in data.elts}}
    table, action, data = call.args  # overrideDefaultEntry
    return {"table": _value(table), "default": True, "action": _value(action),
            "params": {_value(d.args[0]): _value(d.args[1]) for d in data.elts}}


def _register_call(call: ast.Call) -> dict:
    name, value, index = call.args
    raw = _value(value)
    if isinstance(raw, list):  # a struct register: [('reg.field', value), ...]
        raw = {field.rsplit(".", 1)[1]: v for field, v in raw}
    return {"register": _value(name), "index": _value(index), "value": raw}


def _assignments(body: list[ast.stmt]) -> dict[str, object]:
    out: dict[str, object] = {}
    for stmt in body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
            value = stmt.value
            if _call_name(value) == "Mask" and isinstance(value, ast.Call):
                value = value.args[0]  # bmv2: exp_pkt = Mask(b'...'); tofino: exp_pkt = b'...', then Mask(exp_pkt)
            try:
                out[stmt.targets[0].id] = _value(value)
            except ValueError:
                pass  # exp_pkt = Mask(exp_pkt)
    return out


def _dont_care(body: list[ast.stmt]) -> list[list[int]]:
    return [[_value(s.value.args[0]), _value(s.value.args[1])] for s in body
            if isinstance(s, ast.Expr) and _call_name(s.value) == "set_do_not_care"]


_EMIT_CALL = re.compile(r"\[MethodCall\]: \w+\.emit<(\w+)>")
_FIELD = re.compile(r"(\w+):([^;]*);")


def ingress_of(trace: str, deparser: str) -> dict | None:
    """From a test's path trace: what the ingress deparser emitted (each valid header and its fields, in order)
    and what the traffic manager was told: ``port``, or ``dropped``. None when the path never left the ingress
    deparser. (P4Testgen's output packet is what its egress made of it; its egress parser does not read what
    the ingress deparser emitted: docs/tofino.md.)"""
    start = trace.find(f'copy_in("{deparser}")')
    if start < 0:
        return None
    emitted: list[dict] = []
    header = None
    port: int | str | None = None
    dropped = False
    for line in trace[start:].splitlines():
        line = line.strip()
        if (call := _EMIT_CALL.search(line)) is not None:
            header = call[1]
        elif line.startswith("[Emit]:") and header is not None:
            fields = {k: (int(v) if v.strip().lstrip("-").isdigit() else v.strip())
                      for k, v in _FIELD.findall(line) if k != "headerValid"}
            emitted.append({"header": header, "fields": fields})
            header = None
        elif line.startswith("[Invalid emit"):
            header = None
        elif "egress_port = " in line and port is None:
            value = line.rsplit("= ", 1)[1].rstrip(";").strip('"')
            port = int(value) if value.isdigit() else value
        elif line.startswith("[Packet marked dropped"):
            dropped = True
            break
        elif "StartEgress" in line:
            break
    return {"emit": emitted, "port": None if dropped else port, "dropped": dropped}


_TABLE_CALLS = ("insertTableEntry", "overrideDefaultEntry", "table_add")


def without_traces(path: Path) -> str:
    """A PTF file without its tests' path traces (the triple-quoted blocks, megabytes per test), read line by
    line: a run of hundreds of bmv2 tests writes gigabytes."""
    kept, in_trace = [], False
    with path.open() as lines:
        for line in lines:
            if line.strip() == "'''":
                in_trace = not in_trace
            elif not in_trace:
                kept.append(line)
    return "".join(kept)


def parse_ptf(text: str, deparser: str | None = None) -> list[dict]:
    """Every test of a P4Testgen PTF file (of the tofino or the bmv2 target), in test order; with ``deparser``,
    each test also carries ``ingress`` (ingress_of) from its trace."""
    tests = []
    traces = {int(m[1]): m[2] for m in re.finditer(r"class Test(\d+)\(.*?'{3}(.*?)'{3}", text, flags=re.S)} \
        if deparser is not None else {}
    text = re.sub(r"'{3}.*?'{3}", "", text, flags=re.S)  # the path traces: megabytes each, not kept
    for cls in ast.parse(text).body:
        match = re.fullmatch(r"Test(\d+)", cls.name) if isinstance(cls, ast.ClassDef) else None
        if not match:
            continue
        methods = {f.name: f.body for f in cls.body if isinstance(f, ast.FunctionDef)}
        calls = [s.value for s in methods.get("setupCtrlPlane", []) if isinstance(s, ast.Expr)
                 and isinstance(s.value, ast.Call)]
        tables = [_table_call(c) for c in calls if _call_name(c) in _TABLE_CALLS]
        registers = [_register_call(c) for c in calls if _call_name(c) == "setRegisterValue"]
        unknown = sorted({_call_name(c) for c in calls} - {*_TABLE_CALLS, "setRegisterValue"})
        if unknown:
            raise ValueError(f"Test{match[1]}: control-plane calls this parser does not know: {unknown}")
        send = _assignments(methods.get("sendPacket", []))
        verify_body = methods.get("verifyPackets", [])
        verify = _assignments(verify_body)
        test: dict = {"id": int(match[1]), "tables": tables, "registers": registers,
                      "input": {"port": send["ig_port"], "packet": bytes(send["pkt"]).hex()}}
        if "eg_port" in verify:
            test["expect"] = {"port": verify["eg_port"], "packet": bytes(verify["exp_pkt"]).hex(),
                              "dont_care_bits": _dont_care(verify_body)}
        else:
            test["expect"] = None  # no packet leaves the switch
        if deparser is not None:
            test["ingress"] = ingress_of(traces.get(test["id"], ""), deparser)
        tests.append(test)
    return sorted(tests, key=lambda t: t["id"])


# ---- the vector files ----------------------------------------------------------------------------------------


def write_vectors(path: Path, meta: dict, tests: list[dict]) -> None:
    """JSON with one test a line, so that a regeneration diffs test by test."""
    lines = ["{", *[f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in meta.items()], '  "tests": [']
    lines += [f"    {json.dumps(t, sort_keys=True)}{',' if i < len(tests) - 1 else ''}" for i, t in enumerate(tests)]
    lines += ["  ]", "}", ""]
    path.write_text("\n".join(lines))


def load_vectors(program: Program) -> dict:
    return json.loads((ROOT / program.vectors).read_text())


def stale(program: Program) -> str | None:
    """Why the program's vectors are stale, or None when they were generated from the program as it is."""
    path = ROOT / program.vectors
    if not path.exists():
        return f"{program.vectors} is missing: run make p4-testgen"
    want = program_sha256(ROOT / program.source)
    have = load_vectors(program).get("program_sha256")
    if have != want:
        return f"{program.vectors} was generated from another {program.source} (sha256 {have}, now {want}): " \
               "run make p4-testgen"
    return None


# ---- generation -------------------------------------------------------------------------------------------


_COVERAGE = re.compile(r"Nodes covered: ([0-9.]+) \((\d+)/(\d+)\)")  # p4testgen's line after each test


def _uncovered(log: str) -> list[str]:
    """The statements of the last "Not covered program nodes" list p4testgen printed (--print-coverage)."""
    blocks = log.split("Not covered program nodes:")
    if len(blocks) < 2:
        return []
    lines = []
    for line in blocks[-1].splitlines()[1:]:
        if not line.startswith("\t"):
            break
        lines.append(line.strip().replace(str(ROOT) + "/", ""))
    return lines


def run_p4testgen(program: Program, run: Run, max_tests: int, seed: int, defines: dict[str, int],
                  extra: list[str], log_file: Path | None) -> tuple[list[dict], dict]:
    tool = shutil.which("p4testgen")
    if tool is None:
        sys.exit("make p4-testgen: p4testgen not found; build p4c with its test tools (docs/tofino.md)")
    includes = [f"-I{P4C_SOURCE / d}" for d in TARGET_INCLUDES.get(program.target, ())]
    with tempfile.TemporaryDirectory(prefix="passing-testgen-") as out:
        args = [tool, "--target", program.target, "--arch", program.arch, "--std", "p4-16", *includes,
                *[f"-D{k}={v}" for k, v in {**TARGET_DEFINES.get(program.target, {}), **defines,
                                            **run.defines}.items()],
                "--test-backend", program.test_backend, "--seed", str(seed), "--max-tests", str(max_tests),
                "--track-coverage", "STATEMENTS", "--print-coverage", *run.args, *extra,
                "--out-dir", out, str(ROOT / program.source)]
        started = time.monotonic()
        done = subprocess.run(args, capture_output=True, text=True)
        seconds = time.monotonic() - started
        log = done.stdout + done.stderr
        if log_file is not None:
            log_file.write_text(log)
        if done.returncode != 0:
            sys.exit(f"p4testgen failed ({done.returncode}):\n{log[-5000:]}")
        # the tofino target's traces give each test's ingress output; the bmv2 target's are gigabytes
        tests = [t for f in sorted(Path(out).glob("*.py")) for t in
                 (parse_ptf(f.read_text(), program.ingress_deparser) if program.ingress_deparser
                  else parse_ptf(without_traces(f)))]
    for t in tests:
        t["run"] = run.name
    coverage = _COVERAGE.findall(log)
    meta = {"defines": run.defines,
            "args": [a if a != out else "<out>" for a in args[1:-1] if not a.startswith("-I")],
            "seconds": round(seconds, 1), "tests": len(tests),
            "node_coverage": {"fraction": float(coverage[-1][0]), "covered": int(coverage[-1][1]),
                              "nodes": int(coverage[-1][2])} if coverage else None,
            "uncovered": _uncovered(log)}
    return tests, meta


def generate(program: Program, max_tests: int, seed: int, defines: dict[str, int], extra: list[str],
             log_file: Path | None = None) -> dict:
    runs: dict[str, dict] = {}
    tests: list[dict] = []
    for run in program.runs:
        log = log_file.with_name(f"{log_file.name}.{run.name}") if log_file and len(program.runs) > 1 else log_file
        found, runs[run.name] = run_p4testgen(program, run, max_tests, seed, defines, extra, log)
        tests += found
    # statements no run covered: what stays uncovered in the union
    left = Counter(runs[program.runs[0].name]["uncovered"])
    for run in program.runs[1:]:
        left &= Counter(runs[run.name]["uncovered"])
    nodes = max((r["node_coverage"] or {}).get("nodes", 0) for r in runs.values())
    meta = {
        "program": program.source,
        "program_sha256": program_sha256(ROOT / program.source),
        "target": program.target,
        "arch": program.arch,
        "defines": defines,
        "p4testgen": {"version": _version(shutil.which("p4testgen") or "p4testgen", program),
                      "p4c_commit": _p4c_commit(),
                      "seconds": round(sum(r["seconds"] for r in runs.values()), 1), "runs": runs},
        "statement_coverage": {"nodes": nodes, "covered": nodes - sum(left.values()),
                               "uncovered": sorted(left.elements())},
    }
    write_vectors(ROOT / program.vectors, meta, tests)
    return meta


def _p4c_commit() -> str | None:
    """The p4c checkout P4Testgen was built from (its --version says "<null>")."""
    done = subprocess.run(["git", "-C", str(P4C_SOURCE), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or None


def _version(tool: str, program: Program) -> str:
    run = subprocess.run([tool, "--target", program.target, "--arch", program.arch, "--version"],
                         capture_output=True, text=True)
    return (run.stdout or run.stderr).strip().splitlines()[-1] if (run.stdout or run.stderr) else "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="run p4testgen on a program and write its vectors")
    gen.add_argument("program", choices=sorted(PROGRAMS))
    gen.add_argument("--max-tests", type=int, default=0, help="0: until every path is explored")
    gen.add_argument("--seed", type=int, default=1)
    gen.add_argument("--lanes", type=int, default=64, help="PASSING_LANES of the program")
    gen.add_argument("--log", type=Path,
                     help="write p4testgen's whole output there (LOG.<run> for each run of a program of several)")
    sub.add_parser("check", help="exit 1 when a vector file is missing or stale")
    args, extra = parser.parse_known_args(argv)  # generate: what this parser does not know goes to p4testgen
    extra = [a for a in extra if a != "--"]
    if extra and args.command != "generate":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "generate":
        meta = generate(PROGRAMS[args.program], args.max_tests, args.seed, {"PASSING_LANES": args.lanes}, extra,
                        args.log)
        summary = {"program": meta["program"], "seconds": meta["p4testgen"]["seconds"],
                   "tests": {name: r["tests"] for name, r in meta["p4testgen"]["runs"].items()},
                   "covered": f'{meta["statement_coverage"]["covered"]}/{meta["statement_coverage"]["nodes"]}'}
        print(json.dumps(summary, indent=2))
        return 0
    problems = [p for p in (stale(prog) for prog in PROGRAMS.values()) if p]
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
