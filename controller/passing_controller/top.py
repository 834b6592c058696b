"""`passing-ctl top`: a terminal view of the controller, refreshed every second.

It asks the controller for its `metrics` answer (docs/control.md) and shows the
aggregators with their slots, then one row per job group: mode, slots, workers, and rates
from the difference of two answers (packets the aggregator took, rounds completed, the
workers' retransmissions, allreduce calls and their mean time); under a tree's row, one row
per node (each leaf, then the root) with its own counters. curses from the standard
library: it runs in any terminal, over ssh too. `--once` prints one frame as text.
"""

from __future__ import annotations

import curses
import sys
import time
from typing import Any

from passing_protocol import rpc
from passing_protocol.keys import ClientKeys

HEADER = (f"{'JOB':<24} {'GROUP':>5} {'ID':>4} {'MODE':<6} {'SLOTS':>6} {'WORKERS':>7} {'PKT/S':>10} "
          f"{'ROUNDS/S':>9} {'RETX/S':>8} {'CALLS/S':>8} {'MS/CALL':>8}  STATE")


def fetch(controller: str, keys: ClientKeys, timeout: float = 5.0) -> dict[str, Any]:
    reply = rpc.call(controller, {"version": rpc.CONTROLLER_VERSION, "cmd": "metrics"}, timeout, keys)
    if not reply.get("ok"):
        raise RuntimeError(f"controller refused metrics: {reply.get('error')}")
    return reply


def _key(g: dict[str, Any]) -> tuple:
    return g["job"], g["group"], g["job_id"], g["generation"]


def _host_sum(g: dict[str, Any], field: str) -> float:
    return sum(h.get(field, 0.0) for h in g["hosts"].values())


def _rate(now: float, before: float | None, seconds: float) -> str:
    return "-" if before is None or seconds <= 0 else f"{max(0.0, now - before) / seconds:.1f}"


def render(snapshot: dict[str, Any], previous: dict[str, Any] | None, controller: str) -> list[str]:
    """The frame's lines: a header, the aggregators, the totals, then a row per group."""
    lines = [f"PASSING top  {controller}  {time.strftime('%H:%M:%S', time.localtime(snapshot['time']))}"
             "  (q quits)"]
    # a PS by its endpoint, a switch by its control name ("switch", or a named one's "switch:NAME")
    aggregators = [(f"ps {a['aggregator']}" if a['kind'] == 'ps' else a['aggregator']) +
                   f" {a['state']} {a['slots'] - a['free_slots']}/{a['slots']} slots used"
                   for a in snapshot["aggregators"]]
    lines.append("aggregators: " + (" | ".join(aggregators) or "none"))
    running = [g for g in snapshot["groups"] if g["running"]]
    by_mode = {m: [g for g in running if g["mode"] == m] for m in ("switch", "ps", "tree")}
    admitted = sum(snapshot["admitted"].values())
    trees = (f", {len({g['job'] for g in by_mode['tree']})} across racks" if by_mode["tree"] else "",
             f", {len(by_mode['tree'])} tree" if by_mode["tree"] else "")  # shown while a tree runs
    lines.append(f"jobs: {len({g['job'] for g in by_mode['switch']})} on the switch, "
                 f"{len({g['job'] for g in by_mode['ps']})} on a PS{trees[0]}   groups: {len(by_mode['switch'])} "
                 f"switch, {len(by_mode['ps'])} ps{trees[1]}, {snapshot['pending']} waiting   admitted {admitted}, "
                 f"refused {snapshot['joins_failed']}")
    lines += ["", HEADER]
    seconds = snapshot["time"] - previous["time"] if previous else 0.0
    before = {_key(g): g for g in previous["groups"]} if previous else {}
    for g in sorted(snapshot["groups"], key=lambda g: (not g["running"], g["job"], g["group"])):
        old = before.get(_key(g))
        values = {"received": g["counters"].get("received", 0), "completed": g["counters"].get("completed", 0),
                  "retransmissions": _host_sum(g, "retransmissions"), "calls": _host_sum(g, "calls"),
                  "call_seconds": _host_sum(g, "call_seconds")}
        was = None if old is None else {
            "received": old["counters"].get("received", 0), "completed": old["counters"].get("completed", 0),
            "retransmissions": _host_sum(old, "retransmissions"), "calls": _host_sum(old, "calls"),
            "call_seconds": _host_sum(old, "call_seconds")}
        rate = {k: _rate(v, None if was is None else was[k], seconds) for k, v in values.items()}
        calls = values["calls"] - was["calls"] if was else 0.0
        ms_per_call = f"{1000 * (values['call_seconds'] - was['call_seconds']) / calls:.1f}" if calls > 0 else "-"
        lines.append(
            f"{g['job'][:24]:<24} {g['group']:>5} {g['job_id']:>4} {g['mode']:<6} {g['pool']:>6} {g['workers']:>7} "
            f"{rate['received']:>10} {rate['completed']:>9} {rate['retransmissions']:>8} {rate['calls']:>8} "
            f"{ms_per_call:>8}  {'running' if g['running'] else 'ended'}")
        lines += node_rows(g, old, seconds)
    if not snapshot["groups"]:
        lines.append("(no job groups)")
    return lines


def node_rows(g: dict[str, Any], old: dict[str, Any] | None, seconds: float) -> list[str]:
    """A tree's rows under its group's: one per node (its leaves, then its root), with the rates of the
    packets it took, its completed rounds, the partials it sent up and the root's answers it took, and its
    late answers, duplicates and rejects so far; a node whose aggregator does not answer says so."""
    before = {n["name"]: n.get("counters", {}) for n in (old or {}).get("nodes", [])}
    rows = []
    for node in g.get("nodes", []):
        head = f"  {node['role']} {node['name']}"[:24]
        if "error" in node:
            rows.append(f"{head:<24} not answering: {node['error']}"[:160])
            continue
        c, was = node["counters"], before.get(node["name"])
        rate = {k: _rate(c.get(k, 0), None if was is None else was.get(k, 0), seconds)
                for k in ("received", "completed", "sent_up", "answered")}
        rows.append(f"{head:<24} {'':>5} {'':>4} {'':<6} {'':>6} {'':>7} {rate['received']:>10} "
                    f"{rate['completed']:>9}  up/s {rate['sent_up']} answered/s {rate['answered']} late "
                    f"{c.get('late_answer', 0)} dup {c.get('duplicate', 0)} rejected {c.get('rejected', 0)}")
    return rows


def once(controller: str, keys: ClientKeys) -> int:
    print("\n".join(render(fetch(controller, keys), None, controller)))
    return 0


def run(controller: str, keys: ClientKeys, interval: float = 1.0) -> int:
    """The live view until q (or Ctrl-C)."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise RuntimeError("top needs a terminal; --once prints one frame as text")
    try:
        curses.wrapper(_loop, controller, keys, interval)
    except KeyboardInterrupt:
        pass
    except curses.error as e:
        raise RuntimeError(f"top needs a terminal ({e}); --once prints one frame as text") from None
    return 0


def _loop(screen: curses.window, controller: str, keys: ClientKeys, interval: float) -> None:
    try:
        curses.curs_set(0)
    except curses.error:  # a terminal that cannot hide the cursor
        pass
    screen.timeout(100)  # getch waits at most this long: keys are seen between refreshes
    previous: dict[str, Any] | None = None
    lines: list[str] = [f"PASSING top  {controller}  (waiting for the controller)"]
    next_refresh = 0.0
    while True:
        if time.monotonic() >= next_refresh:
            next_refresh = time.monotonic() + interval
            try:
                snapshot = fetch(controller, keys, timeout=min(5.0, max(interval, 1.0)))
                lines = render(snapshot, previous, controller)
                previous = snapshot
            except (OSError, RuntimeError) as e:  # TimeoutError is an OSError: keep trying
                lines = [f"PASSING top  {controller}  {time.strftime('%H:%M:%S')}  (q quits)",
                         f"controller not answering: {e}"]
            _draw(screen, lines)
        key = screen.getch()
        if key in (ord("q"), ord("Q")):
            return
        if key == curses.KEY_RESIZE:
            _draw(screen, lines)


def _draw(screen: curses.window, lines: list[str]) -> None:
    height, width = screen.getmaxyx()
    screen.erase()
    for y, line in enumerate(lines[:height]):
        try:
            screen.addnstr(y, 0, line, width - 1)
        except curses.error:  # the bottom-right cell: curses cannot move past it
            pass
    screen.refresh()
