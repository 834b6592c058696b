"""The main job (`make demo`): DDP training on backend "passing", 2 servers × 2 ranks.

Where it runs, best first:
- BMv2 in Mininet (root, BMv2, p4c, Mininet installed): the switch aggregates; the
  controller and a PS fallback host sit beside it;
- network namespaces (root): each server a namespace, the software aggregator and the
  controller in the switch's namespace;
- loopback: the software aggregator, the controller and the ranks as local processes.
It says which, trains an MLP on scikit-learn's digits (demo/train.py) with a progress
line per epoch, and ends with the accuracy next to the same run on gloo and the bytes
each server sent to the aggregator in PASSING vs flat mode.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bmv2_tests.network import Bmv2Network, compile_p4, missing_requirements, start_ps  # noqa: E402
from cluster import netns  # noqa: E402
from cluster.local import LocalServices, ensure_keys, launch_ranks, start_controller  # noqa: E402

SERVERS, RANKS = 2, 2
TRAIN = [sys.executable, str(REPO / "demo" / "train.py")]


def finish(procs: list[subprocess.Popen], timeout: float = 1800, expect_mode: str | None = None) -> int:
    """Wait for every rank (killing all after ``timeout``), showing rank 0's progress lines; with
    ``expect_mode``, every rank's group must have run in that mode (e.g. "tree")."""
    errors: list[list[str]] = [[] for _ in procs]

    def drain(rank: int) -> None:
        for line in procs[rank].stderr:
            errors[rank].append(line)
            if rank == 0 and "epoch" in line:
                print("  " + line.rstrip(), flush=True)

    readers = [threading.Thread(target=drain, args=(r,), daemon=True) for r in range(len(procs))]
    for t in readers:
        t.start()
    watchdog = threading.Timer(timeout, lambda: [p.kill() for p in procs])
    watchdog.start()
    results = []
    try:
        for rank, p in enumerate(procs):
            lines = [ln for ln in p.stdout.read().splitlines() if ln.startswith("{")]
            p.wait()
            readers[rank].join(5)
            if p.returncode != 0 or not lines:
                print(f"demo: rank {rank} FAILED ({p.returncode}):\n{''.join(errors[rank])[-3000:]}", flush=True)
                return 1
            results.append(json.loads(lines[-1]))
    finally:
        watchdog.cancel()
        for p in procs:
            if p.poll() is None:
                p.kill()
    return summarize(results, expect_mode)


def summarize(results: list[dict], expect_mode: str | None = None) -> int:
    r0 = results[0]
    print(f"demo: aggregation on {r0['mode']} ({r0['reason']})")
    modes = {r["mode"] for r in results}
    if expect_mode is not None and modes != {expect_mode}:
        print(f"demo: the ranks ran in mode {sorted(modes)}, not {expect_mode}\nFAILED", flush=True)
        return 1
    for name in ("passing", "gloo", "flat"):
        r = r0[name]
        print(f"demo: {name:8s} test accuracy {r['accuracy']:.3f}, train loss {r['loss']:.4f} "
              f"after {r['steps']} steps")
    def per_server(name: str, key: str) -> list[int]:
        return [sum(r[name][key] for r in results if r["server"] == s) for s in range(SERVERS)]

    sent = {name: per_server(name, "bytes_sent") for name in ("passing", "flat")}
    resent = {name: per_server(name, "retransmissions") for name in ("passing", "flat")}
    for s in range(SERVERS):
        p, f = sent["passing"][s], sent["flat"][s]
        print(f"demo: server {s} sent {p / 1e6:.2f} MB to the aggregator in PASSING mode, {f / 1e6:.2f} MB flat: "
              f"{f / p:.2f}× with {RANKS} ranks per server ({resent['passing'][s]} and {resent['flat'][s]} "
              "packets of these were retransmissions)")
    identical = all(r["passing"]["divergence"] == 0 for r in results)
    close = abs(r0["passing"]["accuracy"] - r0["gloo"]["accuracy"]) <= 0.02
    print("demo: ranks' parameters identical at every check" if identical else "demo: ranks DIVERGED")
    print("OK" if identical and close else "FAILED", flush=True)
    return 0 if identical and close else 1


def on_loopback(reason: str) -> int:
    print(f"demo: on the software aggregator, ranks on loopback ({reason})", flush=True)
    with LocalServices() as services:
        procs = launch_ranks([*TRAIN, "--epochs", "5"], SERVERS, RANKS, {"PASSING_CONTROLLER": services.controller})
        return finish(procs)


def on_namespaces(reason: str) -> int:
    print(f"demo: on the software aggregator, each server a network namespace ({reason})", flush=True)
    servers = [f"server{s}" for s in range(SERVERS)]
    with netns.EmulatedNetwork(servers) as net, tempfile.TemporaryDirectory(prefix="passing-demo-") as tmp:
        sw = net.switch.ip
        agg = net.popen("switch", [sys.executable, "-m", "passing.cli", "aggregator", "serve", "--listen",
                                   f"{sw}:9877", "--control", f"tcp://{sw}:9878"], stdout=subprocess.PIPE, text=True)
        agg.stdout.readline()
        controller = f"tcp://{sw}:9090"
        start_controller({"ps": [{"data": f"{sw}:9877", "control": f"tcp://{sw}:9878"}]}, Path(tmp), controller,
                         popen=lambda argv, **kw: net.popen("switch", argv, **kw))
        procs = launch_ranks([*TRAIN, "--epochs", "5"], SERVERS, RANKS, {"PASSING_CONTROLLER": controller},
                             popen_for_server=lambda s: lambda argv, **kw: net.popen(servers[s], argv, **kw),
                             env_for_server=lambda s: {"GLOO_SOCKET_IFNAME": "eth0"},
                             master_host=net.hosts[servers[0]].ip)
        return finish(procs)


# The demo's tree on BMv2 (`make demo DEMO=tree`): server 0 (h1) in rack1 under the switch as its leaf, server 1
# (h2) in rack2 under a PS leaf, and a PS root joining the racks (docs/control.md, Fabric).
TREE_PS = {"ps": "10.0.0.100", "ps2": "10.0.0.101"}
TREE_FABRIC = [
    {"name": "rack1", "switch": True, "hosts": ["h1"], "uplink": "spine"},
    {"name": "rack2", "ps": f"{TREE_PS['ps']}:9877", "hosts": ["h2"], "uplink": "spine"},
    {"name": "spine", "ps": f"{TREE_PS['ps2']}:9877"},
]


def on_bmv2(tree: bool) -> int:
    if tree:
        print("demo: on BMv2 in Mininet as a tree across two racks: rack1's leaf is the switch (server 0), rack2's a "
              "PS (server 1), the root a PS", flush=True)
    else:
        print("demo: on BMv2 in Mininet: the switch aggregates (2 server hosts, a controller host, a PS host)",
              flush=True)
    p4info, device_config = compile_p4()
    ps_hosts = TREE_PS if tree else {"ps": TREE_PS["ps"]}
    net = Bmv2Network(SERVERS, extra=(*((h, ip, False) for h, ip in ps_hosts.items()), ("ctl", "10.0.0.253", True)))
    services: list[subprocess.Popen] = []
    try:
        with tempfile.TemporaryDirectory(prefix="passing-demo-") as tmp:
            for host, ip in ps_hosts.items():
                services.append(start_ps(net.net.get(host), ip))
            topo = {**net.topology(),
                    "ps": [{"data": f"{ip}:9877", "control": f"tcp://{ip}:9878"} for ip in ps_hosts.values()]}
            if tree:
                topo["fabric"] = TREE_FABRIC
            controller = "tcp://10.0.0.253:9090"
            ctl, ready = start_controller(topo, Path(tmp), controller, ["--p4info", str(p4info), "--device-config",
                                                                         str(device_config)])
            print(f"demo: controller ready, switch {ready['switch']}", flush=True)
            try:
                # BMv2 adds ~1 k packets/s: a narrower MLP keeps an epoch to seconds. Its queues hold 64
                # packets per port: windows of 16 (a server's 2 ranks, 2 groups) keep every burst within them,
                # where a full 256-packet window is dropped in part (real loss, recovered, but loss)
                procs = launch_ranks(
                    [*TRAIN, "--epochs", "3", "--hidden", "32"], SERVERS, RANKS,
                    {"PASSING_CONTROLLER": controller, "PASSING_POOL": "16"},
                    popen_for_server=lambda s: net.net.get(net.hosts[s].name).popen,
                    env_for_server=lambda s: {"GLOO_SOCKET_IFNAME": f"{net.hosts[s].name}-eth0"},
                    master_host=net.hosts[0].ip)
                return finish(procs, expect_mode="tree" if tree else None)
            finally:
                ctl.terminate()
                ctl.wait(10)
    finally:
        for service in services:
            service.terminate()
            service.wait(10)
        net.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="store_true",
                        help="on BMv2: a tree across two racks, the switch as one rack's leaf (needs BMv2)")
    parser.add_argument("--on", choices=("auto", "bmv2", "namespaces", "loopback"), default="auto",
                        help="where to run: the best this machine has (auto), or that one")
    args = parser.parse_args(argv)
    missing = missing_requirements()
    if (args.tree or args.on == "bmv2") and missing:
        print(f"demo: BMv2 in Mininet is needed: {missing}", file=sys.stderr)
        return 2
    if args.tree and args.on not in ("auto", "bmv2"):
        print("demo: --tree runs on BMv2 only", file=sys.stderr)
        return 2
    if args.on in ("auto", "bmv2") and not missing:
        return on_bmv2(args.tree)
    why_not_netns = netns.available()
    if args.on == "namespaces" and why_not_netns:
        print(f"demo: network namespaces are needed: {why_not_netns}", file=sys.stderr)
        return 2
    if args.on in ("auto", "namespaces") and not why_not_netns:
        return on_namespaces(f"no BMv2: {missing}" if args.on == "auto" else "asked for")
    if args.on == "loopback":
        return on_loopback("asked for")
    return on_loopback(f"no BMv2: {missing}; no namespaces: {why_not_netns}")


if __name__ == "__main__":
    ensure_keys()
    sys.exit(main())
