"""Print the resource summary of a Tofino compile: `python3 p4/tna/resources.py build/tofino`
(Tofino 1) or `build/tofino2` (Tofino 2).

Reads the compiler's resources.json (schema: p4c backends/tofino compiler_interfaces,
resources_schema.py) and prints, per MAU stage in use and in total, the SRAMs, TCAMs,
stateful (meter) ALUs, statistics ALUs, gateways and logical tables in use; a total's limit
is the chip's (every stage of it, in use or not). Standard library only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = (("srams", "rams", "srams"), ("tcams", "tcams", "tcams"), ("stateful ALUs", "meter_alus", "meters"),
           ("stats ALUs", "statistic_alus", "stats"), ("gateways", "gateways", "gateways"),
           ("logical tables", "logical_tables", "ids"))


def used(stage: dict, key: str, items: str) -> int:
    block = stage.get(key) or {}
    return len(block.get(items) or [])


def summary(resources: dict) -> str:
    mau = resources["resources"]["mau"]
    stages = sorted(mau["mau_stages"], key=lambda s: s["stage_number"])
    head = ["stage", *[c[0] for c in COLUMNS]]
    rows = [[str(s["stage_number"]), *[str(used(s, key, items)) for _, key, items in COLUMNS]] for s in stages]
    totals = [sum(used(s, key, items) for s in stages) for _, key, items in COLUMNS]
    # every stage of a chip has the same units: the limit is a stage's times the chip's stages
    limits = {c[0]: 0 for c in COLUMNS}
    for name, key, _ in COLUMNS:
        block = (stages[0].get(key) or {}) if stages else {}
        limits[name] = (block.get("nAlus") or (block.get("nRows", 0) * block.get("nColumns", 0))) * mau["nStages"]
    rows.append(["total", *[f"{t}/{limits[c[0]]}" if limits[c[0]] else str(t) for t, c in zip(totals, COLUMNS)]])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [f"{resources.get('program_name', '?')}: {len(stages)} of {mau['nStages']} MAU stages in use"]
    for r in [head, *rows]:
        lines.append("  ".join(v.rjust(w) for v, w in zip(r, widths)))
    return "\n".join(lines)


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "build/tofino")
    found = sorted(out.rglob("resources.json"))
    if not found:
        print(f"no resources.json under {out}: did the compile run?", file=sys.stderr)
        return 1
    print(summary(json.loads(found[0].read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
