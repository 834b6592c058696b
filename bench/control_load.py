"""Control-plane load benchmark: the controller under a cluster's worth of requests (docs/control.md).

    make bench-control                 # or: python bench/control_load.py [--jobs 256] [--seconds 20]

Real processes on loopback: `passing-controller` with CURVE keys, three software aggregators,
and client processes that play the workers:

* 256 jobs × 8 workers, every worker heartbeating once a second (2 048 `alive` per second);
* 50 joins or leaves per second (1-worker groups joined and left again), each join timed;
* one failover in progress: a 2-worker group whose PS is stopped (SIGSTOP) mid-run; both its
  workers report it silent, the controller checks it (2 s) and moves the group;
* a probe that asks, every 0.2 s, for the verdict on a group whose worker 1 is alive but has
  not reported: the answer must always be "wait" (a "failed" would be a missed heartbeat).

Prints the figures next to the targets (p99 join latency <= 100 ms, no missed heartbeat
verdict, no heartbeat refused or later than 3 intervals) and writes bench/results/control_load.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cluster.local import ensure_keys, free_tcp_port, start_controller  # noqa: E402
from passing.launch import start_aggregator  # noqa: E402
from passing_protocol.keys import ClientKeys  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_P99_JOIN = 0.100  # seconds
DEAD_AFTER_BEATS = 3  # the controller's: a worker silent this many intervals is presumed dead
VERSION = 3


def dealer(endpoint: str, keys: ClientKeys) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    keys.apply(sock)
    sock.connect(endpoint)
    return sock


def send(sock: zmq.Socket, message: dict[str, Any]) -> None:
    sock.send_multipart([b"", json.dumps(message).encode()])


def receive(sock: zmq.Socket, timeout: float) -> dict[str, Any] | None:
    if not sock.poll(int(timeout * 1000)):
        return None
    return json.loads(sock.recv_multipart()[-1])


def join_all(endpoint: str, jobs: int, workers: int, secret: str) -> tuple[dict[tuple[str, int], str], dict[str, int]]:
    """Every worker of every job joins (each group answers once all of its workers have): their tokens, and
    each job's job id."""
    sock = dealer(endpoint, ClientKeys.load(role="worker"))
    for j in range(jobs):
        for w in range(workers):
            send(sock, {"version": VERSION, "cmd": "join", "job": f"load-{j}", "worker": w, "workers": workers,
                        "host": "127.0.0.1", "udp_port": 20000 + w, "pool": 2, "secret": secret})
    tokens, job_ids = {}, {}
    while len(tokens) < jobs * workers:
        reply = receive(sock, 60)
        if reply is None or not reply["ok"]:
            raise RuntimeError(f"a join failed: {reply}")
        tokens[(reply["job"], reply["worker"])] = reply["token"]
        job_ids[reply["job"]] = reply["job_id"]
    sock.close()
    return tokens, job_ids


def heartbeats(endpoint: str, members: list[tuple[str, int, str]], seconds: float, out: Any) -> None:
    """Each member says it is alive once a second, spread over the second; records, per member,
    the largest gap between two of its answered heartbeats, and every refusal."""
    sock = dealer(endpoint, ClientKeys.load(role="worker"))
    last = {}
    worst_gap, refused, sent, answered = 0.0, 0, 0, 0
    start = time.monotonic()
    period = 1.0 / len(members)
    while time.monotonic() - start < seconds:
        for i, (job, worker, token) in enumerate(members):
            due = start + (sent // len(members)) + i * period
            while (now := time.monotonic()) < due:
                reply = receive(sock, due - now)
                if reply is not None:
                    answered += 1
                    if reply["ok"]:
                        pass
                    else:
                        refused += 1
            send(sock, {"version": VERSION, "cmd": "alive", "job": job, "worker": worker, "token": token,
                        "every": 1.0})
            now = time.monotonic()
            key = (job, worker)
            if key in last:
                worst_gap = max(worst_gap, now - last[key])
            last[key] = now
            sent += 1
    while answered < sent and (reply := receive(sock, 5)) is not None:
        answered += 1
        refused += not reply["ok"]
    out.put({"sent": sent, "answered": answered, "refused": refused, "worst_gap": worst_gap})
    sock.close()


def churn(endpoint: str, rate: float, seconds: float, secret: str, out: Any) -> None:
    """Joins and leaves of 1-worker groups, ``rate`` per second in all, each join's latency timed."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    keys = ClientKeys.load(role="worker")
    latencies, failures = [], 0
    start, n = time.monotonic(), 0
    while time.monotonic() - start < seconds:
        due = start + n / rate
        time.sleep(max(0.0, due - time.monotonic()))
        job = f"churn-{n}"
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        keys.apply(sock)
        sock.connect(endpoint)
        began = time.monotonic()
        sock.send_json({"version": VERSION, "cmd": "join", "job": job, "worker": 0, "workers": 1,
                        "host": "127.0.0.1", "udp_port": 30000, "pool": 2, "secret": secret})
        reply = sock.recv_json() if sock.poll(10_000) else None
        latencies.append(time.monotonic() - began)
        if reply is None or not reply["ok"]:
            failures += 1
        else:
            sock.send_json({"version": VERSION, "cmd": "leave", "job": job, "worker": 0, "token": reply["token"]})
            if not sock.poll(10_000) or not sock.recv_json()["ok"]:
                failures += 1
        sock.close()
        n += 2  # a join and a leave
    out.put({"joins": len(latencies), "failures": failures, "latencies": latencies})


def verdicts(endpoint: str, job: str, token: str, job_id: int, generation: int, seconds: float, out: Any) -> None:
    """Worker 0 of a live group keeps reporting its aggregator silent; worker 1 beats (in the
    heartbeat load) but never reports: every answer must be "wait"."""
    keys = ClientKeys.load(role="worker")
    answers: dict[str, int] = {}
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        keys.apply(sock)
        sock.connect(endpoint)
        sock.send_json({"version": VERSION, "cmd": "stuck", "job": job, "worker": 0, "token": token,
                        "job_id": job_id, "generation": generation, "call": 0})
        reply = sock.recv_json() if sock.poll(10_000) else {"state": "no answer"}
        state = reply.get("state", reply.get("error", "?"))
        answers[state] = answers.get(state, 0) + 1
        sock.close()
        time.sleep(0.2)
    out.put(answers)


def failover(endpoint: str, job: str, tokens: list[str], job_id: int, generation: int, out: Any) -> None:
    """Both workers of a group whose PS hangs report it; returns the decision and how long it took."""
    keys = ClientKeys.load(role="worker")
    began = time.monotonic()

    def report(w: int) -> dict:
        """As a worker's stream does: ask every 0.5 s while the answer is "wait"."""
        while True:
            sock = zmq.Context.instance().socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            keys.apply(sock)
            sock.connect(endpoint)
            sock.send_json({"version": VERSION, "cmd": "stuck", "job": job, "worker": w, "token": tokens[w],
                            "job_id": job_id, "generation": generation, "call": 5})
            reply = sock.recv_json() if sock.poll(20_000) else {"state": "no answer"}
            sock.close()
            if reply.get("state") != "wait":
                return reply
            time.sleep(0.5)

    import threading

    states: list = [None, None]
    threads = [threading.Thread(target=lambda w=w: states.__setitem__(w, report(w))) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put({"states": [s.get("state") for s in states], "seconds": time.monotonic() - began})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=256)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--rate", type=float, default=50.0, help="joins + leaves per second")
    p.add_argument("--seconds", type=float, default=20.0)
    args = p.parse_args()
    ensure_keys()
    secret = os.urandom(16).hex()
    services = [start_aggregator(["--slots", "4096"]) for _ in range(3)]
    (_, a), (_, b), (hung_proc, hung) = services
    tmp = tempfile.TemporaryDirectory(prefix="passing-control-load-")
    topology = {"ps": [{"data": s["data"], "control": s["control"]} for s in (a, b, hung)]}
    ctl, ready = start_controller(topology, Path(tmp.name), f"tcp://127.0.0.1:{free_tcp_port()}")
    endpoint = ready["endpoint"]
    try:
        began = time.monotonic()
        tokens, job_ids = join_all(endpoint, args.jobs, args.workers, secret)
        setup = time.monotonic() - began
        # the group that fails over: one whose PS is the third, which will hang
        moving: list[str] = []
        generation = 0
        job_id = 0
        sock = dealer(endpoint, ClientKeys.load(role="worker"))
        while True:  # job ids spread over the PSs: join until a group lands on the third
            name = f"moving-{job_id}"
            for w in range(2):
                send(sock, {"version": VERSION, "cmd": "join", "job": name, "worker": w, "workers": 2,
                            "host": "127.0.0.1", "udp_port": 20000 + w, "pool": 2, "secret": secret})
            replies = [receive(sock, 30) for _ in range(2)]
            if replies[0]["aggregators"][0]["port"] == int(hung["data"].split(":")[1]):
                moving = [r["token"] for r in sorted(replies, key=lambda r: r["worker"])]
                generation, moving_name, moving_id = replies[0]["generation"], name, replies[0]["job_id"]
                break
            job_id += 1
        sock.close()
        members = [(job, w, t) for (job, w), t in tokens.items()]
        members += [(moving_name, w, t) for w, t in enumerate(moving)]
        half = len(members) // 2
        out: Any = mp.Queue()
        procs = [mp.Process(target=heartbeats, args=(endpoint, members[:half], args.seconds, out)),
                 mp.Process(target=heartbeats, args=(endpoint, members[half:], args.seconds, out)),
                 mp.Process(target=churn, args=(endpoint, args.rate, args.seconds, secret, out)),
                 mp.Process(target=verdicts, args=(endpoint, "load-0", tokens[("load-0", 0)], job_ids["load-0"], 0,
                                                   args.seconds, out))]
        for proc in procs:
            proc.start()
        time.sleep(args.seconds / 3)
        # The third PS hangs, and the moving group's workers notice at once (their failover_after is
        # short): a join that reaches that PS before the controller suspects it waits for its timeout,
        # as it would on a real cluster.
        os.kill(hung_proc.pid, signal.SIGSTOP)
        mover = mp.Process(target=failover, args=(endpoint, moving_name, moving, moving_id, generation, out))
        mover.start()
        results = [out.get(timeout=args.seconds + 60) for _ in range(len(procs) + 1)]
        for proc in [*procs, mover]:
            proc.join(10)
    finally:
        hung_proc.send_signal(signal.SIGCONT)
        for proc, _ in services:
            proc.terminate()
        ctl.terminate()
        ctl.wait(10)
        tmp.cleanup()
    beats = [r for r in results if "worst_gap" in r]
    joins = next(r for r in results if "latencies" in r)
    verdict = next(r for r in results if "wait" in r or "failed" in r or "no answer" in r)
    moved = next(r for r in results if "states" in r)
    lat = np.array(joins["latencies"])
    figures = {
        "machine": f"{platform.node()} {os.cpu_count()} cores", "jobs": args.jobs, "workers_per_job": args.workers,
        "setup_seconds": round(setup, 2), "seconds": args.seconds,
        "heartbeats": {"sent": sum(b["sent"] for b in beats), "answered": sum(b["answered"] for b in beats),
                       "refused": sum(b["refused"] for b in beats),
                       "rate_per_s": round(sum(b["sent"] for b in beats) / args.seconds),
                       "worst_gap_s": round(max(b["worst_gap"] for b in beats), 3)},
        "joins": {"count": joins["joins"], "failures": joins["failures"],
                  "p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 1),
                  "p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 1),
                  "max_ms": round(float(lat.max()) * 1e3, 1)},
        "verdicts": verdict, "failover": {"states": moved["states"], "seconds": round(moved["seconds"], 2)},
    }
    checks = {
        "p99 join latency <= 100 ms": figures["joins"]["p99_ms"] <= TARGET_P99_JOIN * 1e3,
        "no missed heartbeat verdict": set(verdict) == {"wait"},
        "every heartbeat answered, none refused": figures["heartbeats"]["answered"] == figures["heartbeats"]["sent"]
        and figures["heartbeats"]["refused"] == 0,
        "no heartbeat later than 3 intervals": figures["heartbeats"]["worst_gap_s"] < DEAD_AFTER_BEATS,
        "the failover moved the group": moved["states"] == ["move", "move"],
        "no join failed": joins["failures"] == 0,
    }
    figures["checks"] = checks
    print(json.dumps(figures, indent=2))
    for name, ok in checks.items():
        print(f"{'met   ' if ok else 'MISSED'} {name}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "control_load.json").write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
