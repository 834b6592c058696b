r"""Section 8's rows (bench/core_percore.py) for two or more builds of the native library, alternated (issue 46).

On a machine others load, one run of each build apart says little: this runs the rows of every build in turn,
round after round, in the same place (a veth pair between two namespaces, root; or loopback), and prints each row
as it comes and the medians over the rounds. A build is NAME=PATH, a shared object as `make setup` builds it
(host/passing/_native*.so: copy it aside before changing the sources); PASSING_NATIVE_LIB hands it to the worker
and the aggregator alike.

    cp host/passing/_native.cpython-311-x86_64-linux-gnu.so /tmp/main.so   # then change, make setup
    sudo .venv/bin/python bench/core_percore_ab.py main=/tmp/main.so \
        new=host/passing/_native.cpython-311-x86_64-linux-gnu.so

Each row prints the per-core figure and the wall-clock one (payload each way per second of the call's wall time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import core_percore  # noqa: E402


def build(text: str) -> tuple[str, Path]:
    name, _, path = text.partition("=")
    if not name or not path or not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: a build is NAME=PATH of a shared object that exists")
    return name, Path(path).resolve()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("builds", type=build, nargs="+", metavar="NAME=PATH")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--lanes", type=int, nargs="+", default=[64, 72])
    p.add_argument("--elements", type=int, default=16 * 1024 * 1024)
    p.add_argument("--iterations", type=int, default=5, help="timed calls per row (after 2 warm-up calls)")
    p.add_argument("--pool", type=int, default=512)
    p.add_argument("--loopback", action="store_true", help="on loopback instead of a veth pair")
    p.add_argument("--out", type=Path, help="the rows as JSON")
    args = p.parse_args()
    if not args.loopback and os.geteuid() != 0:
        print("core_percore_ab: the veth pair needs root (or --loopback)", file=sys.stderr)
        return 1
    where = core_percore._Where(not args.loopback)
    rows: dict[str, list[dict[str, Any]]] = {}
    try:
        for r in range(args.rounds):
            for name, path in args.builds:
                os.environ["PASSING_NATIVE_LIB"] = str(path)
                for lanes in args.lanes:
                    load = os.getloadavg()[0]
                    row = core_percore.percore_run(where, "udp", lanes, args.elements, args.iterations, args.pool,
                                                   False)
                    if "error" in row:
                        print(f"round {r} {name} {lanes}: FAILED: {row['error']}", flush=True)
                        continue
                    row.update(build=name, round=r, loadavg=load)
                    rows.setdefault(f"{name}/{lanes}", []).append(row)
                    print(f"round {r} {name:>8} {lanes:>4} lanes: {row['gbit_per_core_each_way']:6.2f} Gbit/s per "
                          f"core each way, {row['gbit_wall_each_way']:6.2f} wall; user "
                          f"{row['worker_user_s'] * 1e3:5.1f} ms, system "
                          f"{row['worker_system_s'] * 1e3:5.1f} ms a call; exact {row['ok']}; retransmissions "
                          f"{row['retransmissions']}; load {load:.2f}", flush=True)
    finally:
        where.close()
    print(f"== medians over the rounds of each row's median ({'loopback' if args.loopback else 'veth'}, UDP) ==")
    for key, got in rows.items():
        rates = [g["gbit_per_core_each_way"] for g in got]
        walls = [g["gbit_wall_each_way"] for g in got]
        print(f"{key:>14}: {np.median(rates):6.2f} Gbit/s per core ({', '.join(f'{v:.2f}' for v in rates)}), "
              f"{np.median(walls):6.2f} wall ({', '.join(f'{v:.2f}' for v in walls)}); user "
              f"{np.median([g['worker_user_s'] for g in got]) * 1e3:5.1f} ms, system "
              f"{np.median([g['worker_system_s'] for g in got]) * 1e3:5.1f} ms a call")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
