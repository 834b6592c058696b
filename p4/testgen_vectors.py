"""P4Testgen's tests of the PASSING programs, kept as data beside them (docs/tofino.md, "Executed by P4Testgen").

P4Testgen (upstream p4c, backends/p4tools) executes a P4 program symbolically and writes one test per path:
table entries, initial register values, an input packet and port, and the expected output packet and port
(or none: a drop). `make p4-testgen` runs it where it is installed and turns its output into *vectors*: one
JSON file per program (``p4/tna/testgen.json``, ``p4/t2na/testgen.json``, ``p4/v1model/testgen.json``), one
test a line, with the hash of the program (and of every file it includes) that they came from, so that a check
needing no P4 tool can hold them against the protocol (tests/conformance/testgen.py), and
bmv2_tests/test_testgen_replay_bmv2.py replays the v1model ones on BMv2. For the Tofino programs a vector also
carries what each RegisterAction wrote back (``writes``, from the path's trace), and the vectors include
*sequences*: packets chained through the registers, one P4Testgen run pinned to each (SEQUENCES).

Standard library only: this runs on a machine that has P4Testgen and nothing of PASSING installed.

    python3 p4/testgen_vectors.py generate tna        # p4testgen -> p4/tna/testgen.json
    python3 p4/testgen_vectors.py generate t2na --lanes 8    # -> p4/t2na/testgen.json (patched p4testgen)
    python3 p4/testgen_vectors.py generate v1model    # p4testgen -> p4/v1model/testgen.json
    python3 p4/testgen_vectors.py check               # exit 1 if a vector file is missing or stale
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# p4/ is no package (`p4` is p4runtime's protobuf package): the tool's other modules are its neighbours, found
# from here whether it runs as a script or is loaded from its path (tests/conformance/vector_tool.py)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from testgen_p4testgen import ingress_of, parse_ptf, run_p4testgen, without_traces, writes_of  # noqa: E402
from testgen_programs import (  # noqa: E402
    HEADER_FIELDS,
    HEADER_VARIABLES,
    P4C_SOURCE,
    PROGRAMS,
    ROOT,
    Program,
    Run,
    header_size,
    ipv4_checksum,
    program_sha256,
    sources_of,
    unpack,
)
from testgen_sequences import (  # noqa: E402
    SEQUENCES,
    Allocate,
    Allocation,
    Free,
    Send,
    lane_data,
    run_sequence,
    signed32,
    unwritten,
    written,
)
from testgen_tofino_tree import run_tofino_tree_sequence  # noqa: E402
from testgen_tree_sequences import TREE_SEQUENCES, run_tree_sequence  # noqa: E402

# what the checker (tests/conformance/testgen.py), the mutation score and the tests use of the tool, from here
__all__ = ["HEADER_FIELDS", "HEADER_VARIABLES", "PROGRAMS", "SEQUENCES", "TREE_SEQUENCES", "Allocate", "Allocation",
           "Free", "Program", "Run", "Send", "generate", "header_size", "ingress_of", "ipv4_checksum", "lane_data",
           "load_vectors", "main", "parse_ptf", "program_sha256", "run_p4testgen", "run_sequence",
           "run_tofino_tree_sequence", "run_tree_sequence", "signed32",
           "sources_of", "stale", "unpack", "unwritten", "without_traces", "write_vectors", "writes_of", "written"]


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


def generate(program: Program, max_tests: int, seed: int, defines: dict[str, int], extra: list[str],
             log_file: Path | None = None, source: Path | None = None, out: Path | None = None,
             only_sequences: bool = False) -> dict:
    """Every run of the program, then its sequences (Tofino; the v1model program's tree sequences), into its
    vector file; ``source`` and ``out``: a
    variant of the program (a mutant, tests/conformance/mutants.py) and where its vectors go."""
    runs: dict[str, dict] = {}
    tests: list[dict] = []
    if only_sequences:  # the runs' vectors as they are in the file, the sequences made again
        kept = json.loads((out or ROOT / program.vectors).read_text())
        if kept["program_sha256"] != program_sha256(source or ROOT / program.source):
            sys.exit("--only-sequences: the vector file is of another program: generate it whole")
        runs = kept["p4testgen"]["runs"]
        tests = [t for t in kept["tests"] if t["run"] != "sequence"]
    for run in program.runs if not only_sequences else ():
        log = log_file.with_name(f"{log_file.name}.{run.name}") if log_file and len(program.runs) > 1 else log_file
        found, runs[run.name] = run_p4testgen(program, run, max_tests, seed, defines, extra, log, source)
        tests += found
    sequences: dict[str, dict] = {}
    if program.sequences == "tree":  # the tree roles' sequences (testgen_tree_sequences.py, testgen_tofino_tree.py)
        runner = run_tree_sequence if program.target == "bmv2" else run_tofino_tree_sequence

        def one(name: str) -> tuple[list[dict], float]:
            started, roles, events = time.monotonic(), *TREE_SEQUENCES[name]
            return runner(program, name, roles, events, defines["PASSING_LANES"], source or ROOT / program.source,
                          []), time.monotonic() - started

        with ThreadPoolExecutor(len(TREE_SEQUENCES)) as pool:  # each sequence's runs in turn, the sequences at once
            for name, (found, seconds) in zip(TREE_SEQUENCES, pool.map(one, TREE_SEQUENCES)):
                sequences[name] = {"vectors": len(found), "seconds": round(seconds, 1)}
                tests += found
    elif program.sequences == "flat":
        for name, events in SEQUENCES.items():
            started, steps = time.monotonic(), []
            found = run_sequence(program, name, events, defines["PASSING_LANES"], source or ROOT / program.source,
                                 steps)
            sequences[name] = {"vectors": len(found), "seconds": round(time.monotonic() - started, 1)}
            tests += found
    # statements no run covered: what stays uncovered in the union (a program of sequences alone has no runs)
    left = Counter(runs[program.runs[0].name]["uncovered"] or ()) if program.runs else Counter()
    for run in program.runs[1:]:
        left &= Counter(runs[run.name]["uncovered"] or ())
    nodes = max([(r["node_coverage"] or {}).get("nodes", 0) for r in runs.values()] or [0])
    stopped = [r for r in runs.values() if r["uncovered"] is None]  # a run stopped by its budget lists none
    meta = {
        "program": program.source,
        "program_sha256": program_sha256(source or ROOT / program.source),
        "target": program.target,
        "arch": program.arch,
        "defines": defines,
        "p4testgen": {"version": _version(shutil.which("p4testgen") or "p4testgen", program),
                      "p4c_commit": _p4c_commit(),
                      "seconds": round(sum(r["seconds"] for r in runs.values()), 1), "runs": runs},
        "statement_coverage": {"nodes": nodes, "covered": nodes - sum(left.values()),
                               "uncovered": sorted(left.elements())} if not stopped else
                              {"nodes": nodes, "covered": max((r["node_coverage"] or {}).get("covered", 0)
                                                              for r in runs.values()), "uncovered": None},
        "sequences": sequences,
    }
    write_vectors(out or ROOT / program.vectors, meta, tests)
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
    gen.add_argument("--source", type=Path, help="a variant of the program (a mutant) instead of it")
    gen.add_argument("--out", type=Path, help="write the vectors there instead of beside the program")
    gen.add_argument("--only-sequences", action="store_true",
                     help="make the sequences again, keep the runs' vectors of the file (same program)")
    gen.add_argument("--log", type=Path,
                     help="write p4testgen's whole output there (LOG.<run> for each run of a program of several)")
    sub.add_parser("check", help="exit 1 when a vector file is missing or stale")
    args, extra = parser.parse_known_args(argv)  # generate: what this parser does not know goes to p4testgen
    extra = [a for a in extra if a != "--"]
    if extra and args.command != "generate":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "generate":
        meta = generate(PROGRAMS[args.program], args.max_tests, args.seed, {"PASSING_LANES": args.lanes}, extra,
                        args.log, args.source, args.out, args.only_sequences)
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
