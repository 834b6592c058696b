"""passing-controller (the service) and passing-ctl (ask it things)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import zmq

from passing_protocol import rpc
from passing_protocol.keys import ClientKeys, KeysError, default_dir, load_public
from passing_protocol.metrics import MetricsServer, parse_address

from . import keys, metrics, top
from .p4runtime import Pipeline
from .ps_control import CHECK_TIMEOUT, REQUEST_TIMEOUT
from .service import Controller
from .store import StoreError
from .topology import Topology, TopologyError

KEYS_HELP = "key directory (passing-ctl keygen; default $PASSING_KEYS, else ~/.config/passing/keys)"


def controller_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="passing-controller", description="PASSING controller service")
    p.add_argument("--topology", required=True, help="topology JSON (docs/bmv2.md)")
    p.add_argument("--p4info", type=Path, help="P4Info text file (build/v1model/passing.p4info.txtpb)")
    p.add_argument("--device-config", type=Path, help="BMv2 JSON (build/v1model/passing.json) or target binary")
    p.add_argument("--store", default="passing-controller.sqlite", help="SQLite file of allocations")
    p.add_argument("--listen", default="tcp://127.0.0.1:9090",
                   help="ZeroMQ endpoint for hosts (default %(default)s: give the management address to serve "
                   "a cluster)")
    p.add_argument("--keys", type=Path, help=KEYS_HELP)
    p.add_argument("--join-timeout", type=float, default=60.0)
    p.add_argument("--pool", type=int, default=256, help="slots per group unless a join asks otherwise")
    p.add_argument("--ps-timeout", type=float, default=REQUEST_TIMEOUT, metavar="SECONDS",
                   help="a PS that does not answer a request (add_job, ...) this soon is down (default %(default)g)")
    p.add_argument("--check-timeout", type=float, default=CHECK_TIMEOUT, metavar="SECONDS",
                   help="a silent group's PS that does not answer the liveness check this soon is down; also "
                   "the bound of a PS counter read (default %(default)g)")
    p.add_argument("--metrics", metavar="ADDR:PORT", help="serve Prometheus metrics over HTTP here (docs/control.md)")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.metrics:
        try:
            parse_address(args.metrics, metrics.PORT)
        except ValueError as e:
            p.error(str(e))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if (args.p4info is None) != (args.device_config is None):
        p.error("--p4info and --device-config go together")
    try:
        directory = args.keys or default_dir()
        server_keys = keys.ServerKeys.controller(directory)
        aggregator_key = load_public(directory / "aggregator.key") if (directory / "aggregator.key").exists() \
            else None
        topo = Topology.load(args.topology)
        pipeline = Pipeline(args.p4info, args.device_config) if args.p4info else None
        ctl = Controller(topo, pipeline, args.store, args.listen, server_keys, aggregator_key, args.join_timeout,
                         args.pool, ps_timeout=args.ps_timeout, check_timeout=args.check_timeout)
    except (TopologyError, StoreError, KeysError, OSError, ValueError, zmq.ZMQError) as e:
        print(f"passing-controller: error: {e}", file=sys.stderr)
        return 2
    server = None
    if args.metrics:
        try:
            server = MetricsServer(args.metrics, lambda: metrics.controller_metrics(ctl.metrics()), metrics.PORT)
        except OSError as e:
            ctl.close()
            print(f"passing-controller: error: {e}", file=sys.stderr)
            return 2
    ctl.install_signal_handlers()
    status = ctl.status()
    print(json.dumps({"event": "ready", "endpoint": ctl.endpoint, "switch": status["switch"],
                      **({"switches": status["switches"]} if "switches" in status else {}),
                      "jobs": len(status["jobs"]), "metrics": server.address if server else None}), flush=True)
    try:
        ctl.serve()
    finally:
        if server is not None:
            server.close()
    return 0


def request(endpoint: str, cmd: str, client: ClientKeys, timeout: float = 10.0, **fields) -> dict:
    return rpc.call(endpoint, {"version": rpc.CONTROLLER_VERSION, "cmd": cmd, **fields}, timeout, client)


def ctl_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="passing-ctl", description="ask the PASSING controller")
    p.add_argument("--controller", default="tcp://127.0.0.1:9090")
    p.add_argument("--keys", type=Path, help=KEYS_HELP + "; passing-ctl uses operator.key_secret")
    sub = p.add_subparsers(dest="cmd", required=True)
    kg = sub.add_parser("keygen", help="create the key directory: controller, aggregator, operator, worker keys")
    kg.add_argument("--force", action="store_true", help="replace the keys that are there")
    sub.add_parser("status", help="everything: the switch, each aggregator up or down and why, slots, jobs")
    sub.add_parser("jobs", help="running job groups and pending joins")
    sub.add_parser("slots", help="free slots and ranges")
    s = sub.add_parser("stats", help="per-job counters")
    s.add_argument("--job-id", type=int)
    lv = sub.add_parser("leave", help="remove a job group")
    lv.add_argument("job")
    lv.add_argument("--group", type=int, default=0)
    tp = sub.add_parser("top", help="a live view of jobs, groups, modes, slots and rates (q quits)")
    tp.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    tp.add_argument("--once", action="store_true", help="print one frame as text and exit")
    args = p.parse_args(argv)
    directory = args.keys or default_dir()
    if args.cmd == "keygen":
        try:
            made = keys.keygen(directory, force=args.force)
        except (KeysError, OSError) as e:
            print(f"passing-ctl: error: {e}", file=sys.stderr)
            return 1
        print(json.dumps({"keys": str(directory), "files": [str(m) for m in made]}, indent=2))
        return 0
    try:
        client = ClientKeys.load(directory, "operator")
    except KeysError as e:
        print(f"passing-ctl: error: {e}", file=sys.stderr)
        return 2
    if args.cmd == "top":
        if not args.interval > 0:
            p.error("--interval must be positive")
        try:
            return top.once(args.controller, client) if args.once else top.run(args.controller, client, args.interval)
        except (OSError, RuntimeError, zmq.ZMQError) as e:
            print(f"passing-ctl: error: {e}", file=sys.stderr)
            return 2
    try:
        if args.cmd in ("jobs", "slots"):
            reply = request(args.controller, "status", client)
            if reply.get("ok"):
                shown = ("switch", "jobs", "pending") if args.cmd == "jobs" else ("switch", "slots", "free_slots",
                                                                                   "free_ranges")
                reply = {"ok": True, **{k: reply[k] for k in shown}}
        elif args.cmd == "status":
            reply = request(args.controller, "status", client)
        elif args.cmd == "stats":
            reply = request(args.controller, "stats", client, **({"job_id": args.job_id} if args.job_id else {}))
        else:
            reply = request(args.controller, "leave", client, job=args.job, group=args.group)
    except (OSError, zmq.ZMQError) as e:
        print(f"passing-ctl: error: {e}", file=sys.stderr)
        return 2
    if not reply.pop("ok", False):
        print(f"passing-ctl: error: {reply.get('error')}", file=sys.stderr)
        return 1
    print(json.dumps(reply, indent=2))
    return 0
