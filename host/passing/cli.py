"""Command-line entry points.

passing-aggregator serve|stats|jobs|add-job|remove-job   the software aggregator
passing-allreduce                                        one worker's allreduce, self-checked
passing-local                                            aggregator + N workers on loopback
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from passing_protocol.metrics import MetricsServer, parse_address

from . import control, metrics, native, quantize, wire
from .aggregator.control_channel import ControlClient, job_from_json, load_config
from .aggregator.engine import ConfigError
from .aggregator.server import DEFAULT_MAX_LANES, DEFAULT_SLOTS, Impairment, SoftwareAggregator
from .errors import PassingError
from .keys import AggregatorKeys, ClientKeys
from .launch import free_udp_ports
from .stream import Group
from .transport import parse_endpoint

# ---- passing-aggregator ---------------------------------------------------------------

KEYS_HELP = "key directory (passing-ctl keygen; default $PASSING_KEYS, else ~/.config/passing/keys)"


def aggregator_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="passing-aggregator", description="PASSING software aggregator (PS fallback)")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the aggregator until SIGINT/SIGTERM")
    s.add_argument("--listen", default=f"127.0.0.1:{wire.UDP_PORT}",
                   help="UDP address (port 0: any free port; default %(default)s: give the data network's address)")
    s.add_argument("--control", default="tcp://127.0.0.1:9878",
                   help="ZeroMQ control endpoint ('none' to disable; default %(default)s)")
    s.add_argument("--config", help="JSON file: {lanes, max_lanes, slots, jobs: [{job, base, pool, workers, lanes}]}")
    s.add_argument("--slots", type=int, help=f"slots of state (default {DEFAULT_SLOTS})")
    s.add_argument("--lanes", type=int,
                   help=f"int32 values per packet of a job that states none (default {wire.DEFAULT_LANES})")
    s.add_argument("--max-lanes", type=int,
                   help=f"the largest packet a job may use, in lanes (default {DEFAULT_MAX_LANES}, at least --lanes)")
    s.add_argument("--drop-ingress", type=float, default=0.0, help="probability of dropping a received packet")
    s.add_argument("--drop-egress", type=float, default=0.0, help="probability of dropping a sent RESULT")
    s.add_argument("--duplicate", type=float, default=0.0, help="probability of duplicating a packet, each way")
    s.add_argument("--reorder", action="store_true", help="shuffle every batch, each way")
    s.add_argument("--seed", type=int, default=0, help="seed of the loss/duplication generator")
    s.add_argument("--no-offload", action="store_true", help="no UDP GSO/GRO: one syscall datagram per packet")
    s.add_argument("--io", choices=("auto", "udp", "xdp"), default="auto",
                   help="I/O path: AF_XDP beside the UDP socket where it can run (auto, the default), or forced")
    s.add_argument("--engine", choices=native.ENGINES, default="auto",
                   help="native: the data path in C; numpy: in Python; auto: native where it loads (default)")
    s.add_argument("--metrics", metavar="ADDR:PORT", help="serve Prometheus metrics over HTTP here (port 0: any)")
    s.add_argument("--keys", type=Path, help=KEYS_HELP + "; serve uses aggregator.key_secret and admits controller.key")
    s.add_argument("-v", "--verbose", action="store_true")
    for name, helptext in (("stats", "print counters"), ("jobs", "list admitted jobs"),
                           ("add-job", "admit a job"), ("remove-job", "remove a job")):
        c = sub.add_parser(name, help=helptext)
        c.add_argument("--control", default="tcp://127.0.0.1:9878")
        c.add_argument("--keys", type=Path, help=KEYS_HELP + "; the controller's key (controller.key_secret) is used")
        if name == "stats":
            c.add_argument("--job", type=int)
        if name == "add-job":
            c.add_argument("spec", help='JSON: {"job": 1, "base": 0, "pool": 256, "workers": ["ip:port", ...], '
                                        '"generation": N (optional: the next one of this job id), '
                                        '"lanes": L (optional: the aggregator\'s --lanes)}')
        if name == "remove-job":
            c.add_argument("job", type=int)
    args = p.parse_args(argv)
    if args.cmd == "serve" and args.metrics:
        try:
            parse_address(args.metrics, metrics.PORT)
        except ValueError as e:
            p.error(str(e))
    try:
        if args.cmd == "serve":
            return _serve(args)
        client = ControlClient(args.control, keys=ClientKeys.load(args.keys, role="controller", server="aggregator"))
        if args.cmd == "stats":
            reply = client.request("stats", **({"job": args.job} if args.job is not None else {}))
        elif args.cmd == "jobs":
            reply = client.request("jobs")
        elif args.cmd == "add-job":
            reply = client.request("add_job", job=json.loads(args.spec))
        else:
            reply = client.request("remove_job", job=args.job)
        reply.pop("ok")
        print(json.dumps(reply, indent=2))
        return 0
    except (ConfigError, OSError, ValueError, native.NativeUnavailable) as e:  # TimeoutError is an OSError
        print(f"passing-aggregator: error: {e}", file=sys.stderr)
        return 2


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = load_config(args.config) if args.config else {}
    rng = np.random.default_rng(args.seed)
    server = SoftwareAggregator(
        listen=args.listen,
        control=None if args.control == "none" else args.control,
        slots=args.slots or config.get("slots", DEFAULT_SLOTS),
        lanes=args.lanes or config.get("lanes", wire.DEFAULT_LANES),
        max_lanes=args.max_lanes or config.get("max_lanes", DEFAULT_MAX_LANES),
        jobs=[job_from_json(j) for j in config.get("jobs", [])],
        ingress=Impairment(args.drop_ingress, args.duplicate, args.reorder, rng),
        egress=Impairment(args.drop_egress, args.duplicate, args.reorder, rng),
        offload=not args.no_offload,
        engine=args.engine,
        io=args.io,
        keys=None if args.control == "none" else AggregatorKeys.load(args.keys),
    )
    exporter = None
    if args.metrics:
        try:
            exporter = MetricsServer(args.metrics, lambda: metrics.aggregator_metrics(server.metrics()), metrics.PORT)
        except OSError:
            server.close()
            raise
    server.install_signal_handlers()
    host, port = server.address
    print(json.dumps({"event": "ready", "data": f"{host}:{port}", "control": server.control_endpoint,
                      "lanes": server.lanes, "max_lanes": server.engine.lanes, "slots": server.engine.slots,
                      "engine": server.engine_name, "io": server.socket.io_path,
                      "io_reason": server.socket.io_reason,
                      "metrics": exporter.address if exporter else None}), flush=True)
    try:
        server.serve()
    finally:
        if exporter is not None:
            exporter.close()
    print(json.dumps({"event": "stopped", **server.stats()}), flush=True)
    return 0


# ---- passing-allreduce --------------------------------------------------------------------


def worker_inputs(seed: int, worker: int, size: int, dtype: str) -> np.ndarray:
    """The deterministic input of one worker: every worker can recompute everyone's."""
    rng = np.random.default_rng([seed, worker])
    if dtype == "int32":
        return rng.integers(-1000, 1000, size, dtype=np.int32)
    magnitude = 10.0 ** rng.uniform(-4, 2, size)  # mixed sign and magnitude
    return (magnitude * rng.choice([-1.0, 1.0], size)).astype(np.float32)


def allreduce_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="passing-allreduce", description="one worker's allreduce, checked")
    p.add_argument("--job", type=int, default=1, help="wire job id (without --controller)")
    p.add_argument("--generation", type=int, default=0,
                   help="the job's allocation generation at the aggregator (without --controller)")
    p.add_argument("--worker", type=int, required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--servers", type=int, help="the job's servers where --aggregator is a leaf of a tree across "
                   "racks and --workers its rack's (an auto scale and an average are for them; default --workers)")
    p.add_argument("--aggregator", action="append", help="host:port (repeat for shards), without --controller")
    p.add_argument("--controller", help="join through this controller (tcp://host:port) instead of --aggregator; "
                   "the job's secret comes from $PASSING_JOB_SECRET, the worker key from the key directory "
                   "(docs/security.md)")
    p.add_argument("--job-name", default="passing-allreduce", help="job name to join with --controller")
    p.add_argument("--group", type=int, default=0, help="group index to join with --controller")
    p.add_argument("--leave", action="store_true",
                   help="leave the job at the end; the controller ends it when every worker has (--controller)")
    p.add_argument("--drop", type=float, default=0.0, help="test: drop this fraction of packets each way, here")
    p.add_argument("--failover-after", type=float, default=5.0,
                   help="with --controller: seconds without a RESULT before the group asks to move (0: off)")
    p.add_argument("--gate", help="test: between iterations, wait until this file exists")
    p.add_argument("--until", help="test: after --iterations, go on until this file exists at any worker (they "
                   "agree through a one-element allreduce per call, so every worker makes the same calls)")
    p.add_argument("--bind", required=True, help="this worker's admitted address, ip:port")
    p.add_argument("--pool", type=int, default=256)
    p.add_argument("--lanes", type=int, default=wire.DEFAULT_LANES)
    p.add_argument("--size", type=int, default=1 << 20, help="elements")
    p.add_argument("--dtype", choices=("float32", "int32"), default="float32")
    p.add_argument("--iterations", type=int, default=1)
    p.add_argument("--warmup", type=int, default=0, help="untimed allreduces first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--scale", default="auto", help="'auto' or a fixed number")
    p.add_argument("--op", choices=("sum", "avg"), default="sum")
    p.add_argument("--out", help="save the result here (.npy)")
    p.add_argument("--no-check", action="store_true", help="skip recomputing the expected sum locally")
    p.add_argument("--no-offload", action="store_true", help="no UDP GSO/GRO")
    p.add_argument("--engine", choices=native.ENGINES, default="auto",
                   help="host streaming engine: native (C), numpy, or auto (native where it loads)")
    p.add_argument("--io", choices=("auto", "udp", "xdp"), default="auto",
                   help="I/O path: AF_XDP beside the UDP socket where it can run (auto, the default), or forced")
    p.add_argument("--streams", type=int, default=1,
                   help="stripe the reduce passes over this many streams, stream s from --bind's port + s and a job "
                        "of its own (--job + s; with --controller, the controller's): passing.stripes")
    args = p.parse_args(argv)
    if (args.controller is None) == (args.aggregator is None):
        p.error("give either --aggregator or --controller")
    scale: str | float = args.scale if args.scale == "auto" else float(args.scale)
    x = worker_inputs(args.seed, args.worker, args.size, args.dtype)
    options = dict(scale=scale, timeout=args.timeout, offload=not args.no_offload, drop=args.drop,
                   drop_seed=args.seed * 1000 + args.worker, engine=args.engine, io=args.io)
    mode = "direct"
    try:
        if args.controller:
            host, port = parse_endpoint(args.bind, 0)
            answer = control.join(args.controller, args.job_name, args.worker, args.workers, host, port,
                                  group=args.group, pool=args.pool, timeout=args.timeout, streams=args.streams)
            mode, token = answer["mode"], str(answer["token"])
            line = (control.Failover(args.controller, args.job_name, args.group, args.worker, token,
                                     after=args.failover_after) if args.failover_after > 0 else None)
            group = Group.from_answer(answer, bind=args.bind, failover=line, streams=args.streams, **options)
        else:
            group = Group(args.job, args.worker, args.workers, args.aggregator, pool=args.pool, lanes=args.lanes,
                          generation=args.generation, bind=args.bind, servers=args.servers, streams=args.streams,
                          **options)
        with group as g:
            for _ in range(args.warmup):
                g.allreduce(x, op=args.op)
            start = time.perf_counter()
            calls = 0
            while calls < args.iterations or (args.until and not seen_by_any(g, Path(args.until))):
                if calls and args.gate:
                    while not Path(args.gate).exists():
                        time.sleep(0.05)
                out = g.allreduce(x, op=args.op)
                calls += 1
            elapsed = (time.perf_counter() - start) / calls
            stats = g.stats.as_dict()
        if args.controller and args.leave:
            control.leave(args.controller, args.job_name, args.group, args.worker, token)
    except (PassingError, OSError, ValueError) as e:
        print(f"passing-allreduce: worker {args.worker}: error: {e}", file=sys.stderr)
        return 1
    if args.out:
        np.save(args.out, out)
    report = {"worker": args.worker, "mode": mode, "engine": group.engine, "io": group.io_path,
              "io_reason": group.io_reason, "streams": group.streams, "elements": args.size, "seconds": elapsed,
              "gbit_per_s": args.size * 4 * 8 / elapsed / 1e9, "ok": True, "moves": group.moves, "calls": calls,
              **stats}
    if not args.no_check:
        inputs = [worker_inputs(args.seed, w, args.size, args.dtype) for w in range(args.workers)]
        expected = np.sum(inputs, axis=0, dtype=np.float64) / (args.workers if args.op == "avg" else 1)
        error = float(np.max(np.abs(out - expected))) if args.size else 0.0
        bound = float_error_bound(inputs, expected, args.op) if args.dtype == "float32" else 0.0
        report.update(max_error=error, bound=bound, ok=error <= bound)
    print(json.dumps(report), flush=True)
    return 0 if report["ok"] else 1


def seen_by_any(group: Group, path: Path) -> bool:
    """Whether any worker of the group sees ``path``: the sum of everyone's one-element flag, the
    same at every worker, so all of them take the same decision."""
    return bool(group.allreduce(np.array([path.exists()], dtype=np.float32))[0] > 0)


def float_error_bound(inputs: list[np.ndarray], expected: np.ndarray, op: str = "sum") -> float:
    """Worst-case |error| of an auto-scaled float32 sum: rounding plus the float32 cast.

    Every shard's scale comes from its own max |x| over all workers, at most the
    global one, so the global one gives a scale no larger and a bound no smaller.
    """
    max_input = max(float(np.max(np.abs(x))) for x in inputs) if expected.size else 0.0
    if max_input == 0:
        return 0.0
    workers = len(inputs)
    rounding = quantize.error_bound(quantize.auto_scale(max_input, workers), workers)
    if op == "avg":
        rounding /= workers
    return rounding + float(np.max(np.abs(expected))) * 2.0**-23


# ---- passing-local ------------------------------------------------------------------------


def local_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="passing-local",
                                description="run an aggregator and N allreduce workers on loopback")
    p.add_argument("--workers", type=int, default=4, help="worker processes (1..32)")
    p.add_argument("--size", type=int, default=1 << 20, help="float32 elements per allreduce")
    p.add_argument("--pool", type=int, default=256, help="slots of the job: packets in flight per worker")
    p.add_argument("--iterations", type=int, default=3, help="allreduces per worker")
    p.add_argument("--drop", type=float, default=0.0, help="loss probability each way at the aggregator")
    args = p.parse_args(argv)
    ports = free_udp_ports(args.workers)
    workers = [f"127.0.0.1:{port}" for port in ports]
    rng = np.random.default_rng(0)
    # In this process, with the job admitted up front: no control socket, so no keys to set up.
    agg = SoftwareAggregator(listen=("127.0.0.1", 0), control=None, jobs=[job_from_json(
        {"job": 1, "pool": args.pool, "workers": workers})], ingress=Impairment(args.drop, rng=rng),
        egress=Impairment(args.drop, rng=rng))
    data = "{}:{}".format(*agg.address)
    serving = threading.Thread(target=agg.serve, name="passing-local-aggregator", daemon=True)
    serving.start()
    try:
        print(f"aggregator at {data}, {args.workers} workers, {args.size} float32 each", flush=True)
        generation = agg.engine.jobs()[0].generation
        procs = [
            subprocess.Popen([sys.executable, "-m", "passing.cli", "allreduce", "--worker", str(w), "--workers",
                              str(args.workers), "--aggregator", data, "--bind", workers[w],
                              "--generation", str(generation), "--pool",
                              str(args.pool), "--size", str(args.size), "--iterations", str(args.iterations)],
                             stdout=subprocess.PIPE, text=True)
            for w in range(args.workers)
        ]
        ok = True
        for proc in procs:
            out, _ = proc.communicate()
            ok &= proc.returncode == 0
            for line in out.splitlines():
                r = json.loads(line)
                print(f"worker {r['worker']}: {r['seconds'] * 1e3:.1f} ms per allreduce, "
                      f"{r['gbit_per_s']:.3f} Gbit/s, max error {r['max_error']:.3g} (bound {r['bound']:.3g}), "
                      f"{r['retransmissions']} retransmissions, {'ok' if r['ok'] else 'WRONG'}", flush=True)
        print("aggregator:", json.dumps(agg.stats()["totals"]), flush=True)
        print("OK" if ok else "FAILED", flush=True)
        return 0 if ok else 1
    finally:
        agg.stop()
        serving.join(10)


def main(argv: list[str] | None = None) -> int:
    """`python -m passing.cli {aggregator,allreduce,local} ...`"""
    argv = sys.argv[1:] if argv is None else argv
    commands = {"aggregator": aggregator_main, "allreduce": allreduce_main, "local": local_main}
    if not argv or argv[0] not in commands:
        print(f"usage: python -m passing.cli {{{','.join(commands)}}} ...", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
