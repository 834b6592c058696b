"""The main job (`make demo`): a multi-host PASSING allreduce, on BMv2 when it is here.

With BMv2, p4c and Mininet installed (and root): 4 hosts around a BMv2 switch, the
controller in a host of its own, a software aggregator host for the fallback; every host
joins job "demo" through the controller and allreduces 100 000 float32 three times through
the switch. Otherwise: the software aggregator and 4 worker processes on loopback.
Either way every result is checked against the exact sum, and the run says which it was.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bmv2_tests.network import Bmv2Network, compile_p4, missing_requirements  # noqa: E402

WORKERS = 4
SIZE = 100_000
CONTROLLER = "tcp://10.0.0.253:9090"


def on_software_aggregator(reason: str) -> int:
    print(f"demo: on the software aggregator on loopback ({reason})", flush=True)
    return subprocess.call([str(Path(sys.executable).parent / "passing-local"), "--workers", str(WORKERS),
                            "--size", "1000000", "--iterations", "3"])


def on_bmv2() -> int:
    print("demo: on BMv2 in Mininet (4 hosts, a controller host, a PS host)", flush=True)
    p4info, device_config = compile_p4()
    net = Bmv2Network(WORKERS, extra=(("ps", "10.0.0.100", False), ("ctl", "10.0.0.253", True)))
    procs: list[subprocess.Popen] = []
    try:
        with tempfile.TemporaryDirectory(prefix="passing-demo-") as tmp:
            topo = net.topology()
            topo["ps"] = [{"data": "10.0.0.100:9877", "control": "tcp://10.0.0.100:9878"}]
            (Path(tmp) / "topology.json").write_text(json.dumps(topo))
            ps = net.net.get("ps").popen([sys.executable, "-m", "passing.cli", "aggregator", "serve", "--listen",
                                          "10.0.0.100:9877", "--control", "tcp://10.0.0.100:9878"],
                                         stdout=subprocess.PIPE, text=True)
            procs.append(ps)
            ps.stdout.readline()
            ctl = subprocess.Popen([str(Path(sys.executable).parent / "passing-controller"), "--topology",
                                    str(Path(tmp) / "topology.json"), "--p4info", str(p4info), "--device-config",
                                    str(device_config), "--store", str(Path(tmp) / "controller.sqlite"),
                                    "--listen", CONTROLLER], stdout=subprocess.PIPE, text=True)
            procs.append(ctl)
            print("controller:", ctl.stdout.readline().strip(), flush=True)
            workers = [net.net.get(h.name).popen(
                [sys.executable, "-m", "passing.cli", "allreduce", "--controller", CONTROLLER, "--job-name", "demo",
                 "--worker", str(w), "--workers", str(WORKERS), "--bind", f"{h.ip}:20000", "--size", str(SIZE),
                 "--iterations", "3", "--pool", "64", "--leave"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True) for w, h in enumerate(net.hosts[:WORKERS])]
            ok = True
            for w, p in enumerate(workers):
                out, err = p.communicate(timeout=600)
                if p.returncode != 0:
                    print(f"worker {w}: FAILED: {err.strip()}", flush=True)
                    ok = False
                    continue
                r = json.loads(out.splitlines()[-1])
                ok &= r["ok"]
                print(f"worker {w} ({net.hosts[w].name}, {r['mode']}): {r['seconds'] * 1e3:.0f} ms per allreduce, "
                      f"max error {r['max_error']:.3g} (bound {r['bound']:.3g}), "
                      f"{r['retransmissions']} retransmissions, {'ok' if r['ok'] else 'WRONG'}", flush=True)
            print("OK" if ok else "FAILED", flush=True)
            return 0 if ok else 1
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        net.stop()


if __name__ == "__main__":
    missing = missing_requirements()
    sys.exit(on_software_aggregator(missing) if missing else on_bmv2())
