"""One worker of tests/test_xdp.py, in its network namespace: a Group over the I/O path asked for, a fixed
program of collectives (float32 and int32 allreduce, reduce_scatter, allgather), and a JSON line with a digest
of every output, the path it ran on and its XSK's counters.

    python -m tests.xdp_worker '{"worker": 0, "workers": 2, "aggregator": "10.55.0.1:5000", ...}'
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

from passing import Group


def inputs(seed: int, worker: int, elements: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, worker])
    return (rng.standard_normal(elements, dtype=np.float32),
            rng.integers(-1 << 20, 1 << 20, elements, dtype=np.int32))


def main(spec: dict) -> None:
    w, n, elements = spec["worker"], spec["workers"], spec["elements"]
    f, i = inputs(spec["seed"], w, elements)
    outputs: dict[str, np.ndarray] = {}
    with Group(1, w, n, [spec["aggregator"]], pool=spec["pool"], lanes=spec["lanes"], generation=0,
               bind=spec["bind"], engine="native", io=spec["io"], drop=spec["drop"], drop_seed=w,
               timeout=spec.get("timeout", 30.0)) as g:
        print("ready", flush=True)
        for call in range(spec["calls"]):
            outputs[f"allreduce_f32_{call}"] = g.allreduce(f)
            outputs[f"allreduce_i32_{call}"] = g.allreduce(i)
        outputs["reduce_scatter"] = g.reduce_scatter(i[: elements - elements % n])
        outputs["allgather"] = g.allgather(f[: 1000 + w * 0])
        xsk = g.socket.xsk.stats() if g.socket.xsk is not None else {}
        report = {"worker": w, "io": g.io_path, "io_reason": g.io_reason, "xsk": xsk,
                  "stats": g.stats.as_dict(),
                  "digest": {k: hashlib.sha256(v.tobytes()).hexdigest() for k, v in outputs.items()},
                  "int_sum": [int(v) for v in outputs["allreduce_i32_0"][:8]]}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
