"""The controller's state in SQLite, so that allocations survive a controller restart.

It also decides which job id and generation a new group gets (docs/control.md): the
least recently used free job id, with its generation one higher than last time, so a
late packet of an earlier allocation never matches a later one.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path

SCHEMA_VERSION = 3  # 3: workers carry their token digests (protocol 3); 2: job ids and generations
GENERATIONS = 1 << 16  # the wire's generation field is 16 bits wide

SCHEMA = """
CREATE TABLE IF NOT EXISTS allocation (
    job_id   INTEGER PRIMARY KEY,   -- the wire's job id of one group
    job_name TEXT NOT NULL,
    grp      INTEGER NOT NULL,      -- group index within the job (the in-host rank j)
    mode     TEXT NOT NULL,         -- 'switch' or 'ps'
    generation INTEGER NOT NULL,    -- which allocation of this job id (on the wire)
    base     INTEGER NOT NULL,
    pool     INTEGER NOT NULL,
    workers  TEXT NOT NULL,         -- JSON: [{"index", "host", "udp_port", "token": sha256 of it}]
    aggregator TEXT NOT NULL,       -- JSON: where the workers send
    UNIQUE (job_name, grp)
);
CREATE TABLE IF NOT EXISTS job_id (
    id         INTEGER PRIMARY KEY,  -- every job id ever handed out
    generation INTEGER NOT NULL,     -- of its latest allocation
    used       INTEGER NOT NULL      -- when it was last handed out (the 'use' counter): LRU order
);
CREATE TABLE IF NOT EXISTS stripe (
    job_id   INTEGER PRIMARY KEY,   -- the wire's job id of one extra stream of a group (Record.stripes)
    owner    INTEGER NOT NULL       -- the group's own job id (its allocation row)
);
CREATE TABLE IF NOT EXISTS counter (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS down (
    aggregator TEXT PRIMARY KEY,    -- 'switch' or a PS's control endpoint
    since      REAL NOT NULL,       -- wall-clock time it failed first
    retry_at   REAL NOT NULL,       -- wall-clock time after which it is tried first again
    reason     TEXT NOT NULL
);
"""


class StoreError(RuntimeError):
    """A store this controller cannot use (another schema), or no job id left."""


@dataclass
class Record:
    job_id: int
    job_name: str
    group: int
    mode: str
    generation: int
    base: int
    pool: int
    workers: list[dict]
    aggregator: dict

    @property
    def stripes(self) -> list[dict]:
        """The group's streams beyond its first (a join's ``streams``), each with its own job id, generation and
        slots at the same aggregator (base; its ``pool`` is the group's): [{"job_id", "generation", "base"}]."""
        return list(self.aggregator.get("stripes", []))

    @property
    def streams(self) -> int:
        return 1 + len(self.stripes)

    @property
    def control(self) -> str:
        """The control name of the group's aggregator (a tree's: its root's): a PS's endpoint, or a switch's,
        "switch:NAME" for a named one and "switch" for the one (whose records name none)."""
        return str(self.aggregator.get("control", "switch"))

    def lanes(self, switch_lanes: int) -> int:
        """The group's int32 lanes per packet, as allocated: a PS's, or the switch program's
        (a switch record made before chips states none: then ``switch_lanes``, the topology's)."""
        return int(self.aggregator.get("lanes", switch_lanes))


class Store:
    def __init__(self, path: str | Path) -> None:
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)  # autocommit
        (version,) = self.db.execute("PRAGMA user_version").fetchone()
        tables = self.db.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table'").fetchone()[0]
        if tables and version != SCHEMA_VERSION:
            self.db.close()
            raise StoreError(f"store {path} was written by another controller version (schema {version}, this is "
                             f"{SCHEMA_VERSION}); its allocations speak another wire protocol: end those jobs and "
                             "start with a new store")
        self.db.executescript(SCHEMA)
        self.db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        # Write-ahead log, synced at checkpoints: a commit survives the controller's crash (what a
        # restart needs) without an fsync of its own, which costs ~10 ms a commit on a VM's disk.
        self.db.execute("PRAGMA journal_mode = WAL")
        self.db.execute("PRAGMA synchronous = NORMAL")

    def close(self) -> None:
        self.db.close()

    def next(self, counter: str, start: int = 1) -> int:
        """A number never handed out before: survives restarts."""
        self.db.execute("INSERT OR IGNORE INTO counter VALUES (?, ?)", (counter, start))
        (value,) = self.db.execute("SELECT value FROM counter WHERE name = ?", (counter,)).fetchone()
        self.db.execute("UPDATE counter SET value = ? WHERE name = ?", (value + 1, counter))
        return value

    def claim_job_id(self, max_id: int, busy: set[int] | frozenset[int] = frozenset()) -> tuple[int, int]:
        """(job id, generation) for a new allocation: an id never used yet while there is one,
        else the free id whose last use is oldest, its generation one past its last. ``busy``:
        ids not in the allocation table that are not free either (being placed or torn down)."""
        with self.db:  # one transaction
            self.db.execute("BEGIN")
            return self._claim_job_id(max_id, busy)

    def _claim_job_id(self, max_id: int, busy: set[int] | frozenset[int]) -> tuple[int, int]:
        fresh = self.next("fresh_job_id")
        used = self.next("use")
        if fresh <= max_id:
            self.db.execute("INSERT INTO job_id VALUES (?, 0, ?)", (fresh, used))
            return fresh, 0
        rows = self.db.execute("SELECT id, generation FROM job_id WHERE id NOT IN (SELECT job_id FROM allocation) "
                               "AND id NOT IN (SELECT job_id FROM stripe) ORDER BY used")
        row = next((r for r in rows if r[0] not in busy), None)
        if row is None:
            raise StoreError(f"all {max_id} job ids are in use")
        job_id, generation = row[0], (row[1] + 1) % GENERATIONS
        self.db.execute("UPDATE job_id SET generation = ?, used = ? WHERE id = ?", (generation, used, job_id))
        return job_id, generation

    def mark_down(self, aggregator: str, reason: str, now: float, retry_after: float) -> None:
        self.db.execute("INSERT INTO down VALUES (?, ?, ?, ?) ON CONFLICT (aggregator) DO UPDATE SET "
                        "retry_at = excluded.retry_at, reason = excluded.reason",
                        (aggregator, now, now + retry_after, reason))

    def mark_up(self, aggregator: str) -> None:
        self.db.execute("DELETE FROM down WHERE aggregator = ?", (aggregator,))

    def down(self) -> dict[str, tuple[float, float, str]]:
        """aggregator -> (since, retry_at, reason) of those that failed and have not served since."""
        return {r[0]: (r[1], r[2], r[3]) for r in self.db.execute("SELECT * FROM down")}

    def add(self, r: Record) -> None:
        with self.db:  # one transaction: the group and its streams' job ids
            self.db.execute("BEGIN")
            self.db.execute(
                "INSERT INTO allocation VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (r.job_id, r.job_name, r.group, r.mode, r.generation, r.base, r.pool, json.dumps(r.workers),
                 json.dumps(r.aggregator)),
            )
            for stripe in r.stripes:
                self.db.execute("INSERT INTO stripe VALUES (?, ?)", (stripe["job_id"], r.job_id))

    def remove(self, job_id: int) -> None:
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute("DELETE FROM allocation WHERE job_id = ?", (job_id,))
            self.db.execute("DELETE FROM stripe WHERE owner = ?", (job_id,))

    def all(self) -> list[Record]:
        rows = self.db.execute("SELECT * FROM allocation ORDER BY job_id").fetchall()
        return [Record(r[0], r[1], r[2], r[3], r[4], r[5], r[6], json.loads(r[7]), json.loads(r[8])) for r in rows]
