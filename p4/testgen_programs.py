"""The PASSING programs as p4/testgen_vectors.py sees them: the header layout (what the checker unpacks and the
sequences pin), the programs and P4Testgen's runs of each, the files a program includes and the hash that tells
its vectors stale. Standard library only."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# p4/include/headers.p4, in wire order: (field, bits). What the checker unpacks and the sequences pin.
HEADER_FIELDS = {
    "ethernet_h": (("dst_addr", 48), ("src_addr", 48), ("ether_type", 16)),
    "ipv4_h": (("version", 4), ("ihl", 4), ("diffserv", 8), ("total_len", 16), ("identification", 16),
               ("flags", 3), ("frag_offset", 13), ("ttl", 8), ("protocol", 8), ("hdr_checksum", 16),
               ("src_addr", 32), ("dst_addr", 32)),
    "udp_h": (("src_port", 16), ("dst_port", 16), ("length", 16), ("checksum", 16)),
    "passing_h": (("version", 8), ("type", 8), ("op", 8), ("flags", 8), ("job", 16), ("slot", 16),
                  ("worker", 8), ("owner", 7), ("set", 1), ("generation", 16), ("psn", 32)),
    "bridged_h": (("pad0", 7), ("ingress_port", 9), ("slot_set", 16), ("group", 16), ("pad1", 3),
                  ("relay", 1), ("flood", 1), ("result_multicast", 1), ("second_pass", 1), ("answer", 1)),
}
HEADER_VARIABLES = {"ethernet_h": "ethernet", "ipv4_h": "ipv4", "udp_h": "udp", "passing_h": "passing",
                    "bridged_h": "bridged", "lanes_h": "lanes"}  # headers_t's member of each header type


def header_size(header: str) -> int:
    return sum(bits for _, bits in HEADER_FIELDS[header]) // 8


def unpack(header: str, raw: bytes) -> dict[str, int]:
    fields = HEADER_FIELDS[header]
    width = sum(bits for _, bits in fields)
    value = int.from_bytes(raw[:width // 8], "big")
    out = {}
    for name, bits in fields:
        width -= bits
        out[name] = value >> width & ((1 << bits) - 1)
    return out


def ipv4_checksum(header: bytes) -> int:
    """RFC 791's checksum of a 20-byte IPv4 header (its checksum field taken as 0)."""
    words = [int.from_bytes(header[i:i + 2], "big") for i in range(0, 20, 2) if i != 10]
    total = sum(words)
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


@dataclass(frozen=True)
class Run:
    """One p4testgen run over a program: its name (a vector's ``run``), the defines and the arguments; ``seconds``:
    stop it then and keep the tests it wrote (a search for statements no path reaches does not end)."""

    name: str
    defines: dict
    args: tuple[str, ...]
    seconds: int | None = None


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
    sequences: str | None = None  # runs pinned to the packets of SEQUENCES ("flat") or TREE_SEQUENCES ("tree")


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
# p4/include/tofino_tree_common.p4's hook: no entry of uplink, tree_role or owner_map
FLAT_ONLY = {"PASSING_PIN_TREE": "false"}
_V1MODEL_SEARCH = ("--path-selection", "RANDOM_BACKTRACK", "--port-ranges", "0:7", "--packet-size-range", "0:12000")
PROGRAMS = {
    "tna": Program("tna", "p4/tna/passing.p4", "p4/tna/testgen.json", "tofino", "tna", "PTF", "TnaIngressDeparser",
                   (Run("first_pass", {"PASSING_TESTGEN": 1, "PASSING_TESTGEN_DATA": 1}, _TNA_SEARCH),
                    Run("second_pass", {"PASSING_TESTGEN": 2, "PASSING_TESTGEN_DATA": 1}, _TNA_SEARCH)),
                   sequences="flat"),
    # Tofino 2: one pass (no recirculation), so one run over any port. Flat jobs alone: no entry of the tree roles'
    # tables (the checker holds a Tofino vector to the reference's flat job; the roles are held on BMv2). The roles'
    # statements stay uncovered, and the greedy search for them does not end (14 minutes here): stopped at 300 s
    "t2na": Program("t2na", "p4/t2na/passing.p4", "p4/t2na/testgen.json", "tofino2", "t2na", "PTF",
                    "TnaIngressDeparser",
                    (Run("first_pass", {"PASSING_TESTGEN": 1, "PASSING_TESTGEN_DATA": 1, **FLAT_ONLY},
                         ("--path-selection", "GREEDY_STATEMENT_SEARCH", "--only-covering-tests",
                          "--port-ranges", "0:63"), seconds=300),),
                    sequences="flat"),
    # its tree sequences alone (testgen_tofino_tree.py), at the flat vectors' 8 lanes
    "t2na_tree": Program("t2na_tree", "p4/t2na/passing.p4", "p4/t2na/testgen_tree.json", "tofino2", "t2na", "PTF",
                         "TnaIngressDeparser", (), sequences="tree"),
    "v1model": Program("v1model", "p4/v1model/passing.p4", "p4/v1model/testgen.json", "bmv2", "v1model", "PTF", None,
                       (Run("all", {}, _V1MODEL_SEARCH), Run("in_domain", {"PASSING_TESTGEN": 1}, _V1MODEL_SEARCH))),
    # the same program's tree sequences alone (testgen_tree_sequences.py), at 4 lanes (`--lanes 4`): a pinned run
    # at 64 takes minutes of CPU, and the lanes are one macro unrolled (as the Tofino mutants' 4 lanes)
    "v1model_tree": Program("v1model_tree", "p4/v1model/passing.p4", "p4/v1model/testgen_tree.json", "bmv2", "v1model",
                            "PTF", None, (), sequences="tree"),
}
# p4c-barefoot defines it for tna.p4 and t2na.p4; p4testgen does not
TARGET_DEFINES = {"tofino": {"__TARGET_TOFINO__": 1}, "tofino2": {"__TARGET_TOFINO__": 2}}
# tna.p4, t2na.p4 and their Tofino includes come with the Tofino backend's sources (docs/tofino.md)
TARGET_INCLUDES = {"tofino": ("backends/tofino/bf-p4c/p4include",), "tofino2": ("backends/tofino/bf-p4c/p4include",)}
P4C_SOURCE = Path(os.environ.get("P4C_SOURCE", "/opt/src/p4c"))  # the p4c checkout P4Testgen was built from

PIN_FILE = "passing_pin.p4"
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
        todo += [(path.parent / name).resolve() for name in _INCLUDE.findall(path.read_text())
                 if name != PIN_FILE]  # written for each pinned run (p4/include/testgen.p4), not part of the program
    return seen


_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)

# Macros a program defines to take a shared file's variant (p4/include/parser.p4's PASSING_PARSE_HEADER_ONLY: the
# programs with the tree roles parse a header-only datagram). A program that does not define one never sees the
# text it guards, so that text is no part of its hash: a variant added for one program leaves the others' vectors
# fresh.
PROGRAM_VARIANTS = ("PASSING_PARSE_HEADER_ONLY",)
_DEFINE = re.compile(r"^\s*#\s*define\s+(\w+)", re.MULTILINE)
_CONDITIONAL = re.compile(r"^\s*#\s*(ifdef|ifndef|if|elif|else|endif)\b\s*(\w*)")


def _as_seen(text: str, defined: set[str]) -> str:
    """The text without what a variant the program does not take guards (#ifdef/#ifndef VARIANT ... #else ...
    #endif), and without those directives."""
    kept = []
    stack: list[bool | None] = []  # per open conditional: a variant's branch taken (True/False), None for others
    for line in text.splitlines():
        match = _CONDITIONAL.match(line)
        directive, name = match.groups() if match else (None, "")
        if directive in ("ifdef", "ifndef") and name in PROGRAM_VARIANTS:
            stack.append((name in defined) == (directive == "ifdef"))
            continue
        if directive in ("ifdef", "ifndef", "if"):
            stack.append(None)
        elif directive in ("else", "elif", "endif"):
            if not stack:
                raise ValueError(f"#{directive} without its #if: {line.strip()}")
            if stack[-1] is not None:
                if directive == "elif":
                    raise ValueError(f"#elif in a program variant's conditional: {line.strip()}")
                if directive == "else":
                    stack[-1] = not stack[-1]
                else:
                    stack.pop()
                continue
            if directive == "endif":
                stack.pop()
        if all(taken is not False for taken in stack):
            kept.append(line)
    return "\n".join(kept)


def program_sha256(program: Path) -> str:
    """What a vector file is stale against: the program and everything it includes as the program sees them
    (PROGRAM_VARIANTS), without comments and with runs of white space as one (a comment or a re-indented line
    changes no test)."""
    sources = [(path, _COMMENT.sub(" ", path.read_text())) for path in sources_of(program)]
    defined = {name for _, text in sources for name in _DEFINE.findall(text) if name in PROGRAM_VARIANTS}
    digest = hashlib.sha256()
    for path, text in sources:
        name = os.path.relpath(path, program.resolve().parent)
        text = " ".join(_as_seen(text, defined).split())
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    return digest.hexdigest()
