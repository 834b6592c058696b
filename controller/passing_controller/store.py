"""The controller's state in SQLite, so that allocations survive a controller restart."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS allocation (
    job_id   INTEGER PRIMARY KEY,   -- the wire's job id of one group
    job_name TEXT NOT NULL,
    grp      INTEGER NOT NULL,      -- group index within the job (the in-host rank j)
    mode     TEXT NOT NULL,         -- 'switch' or 'ps'
    epoch    INTEGER NOT NULL,
    base     INTEGER NOT NULL,
    pool     INTEGER NOT NULL,
    workers  TEXT NOT NULL,         -- JSON: [{"index", "host", "udp_port"}]
    aggregator TEXT NOT NULL,       -- JSON: where the workers send
    UNIQUE (job_name, grp)
);
CREATE TABLE IF NOT EXISTS counter (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


@dataclass
class Record:
    job_id: int
    job_name: str
    group: int
    mode: str
    epoch: int
    base: int
    pool: int
    workers: list[dict]
    aggregator: dict


class Store:
    def __init__(self, path: str | Path) -> None:
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)  # autocommit
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    def next(self, counter: str, start: int = 1) -> int:
        """A number never handed out before (epochs, job ids): survives restarts."""
        self.db.execute("INSERT OR IGNORE INTO counter VALUES (?, ?)", (counter, start))
        (value,) = self.db.execute("SELECT value FROM counter WHERE name = ?", (counter,)).fetchone()
        self.db.execute("UPDATE counter SET value = ? WHERE name = ?", (value + 1, counter))
        return value

    def add(self, r: Record) -> None:
        self.db.execute(
            "INSERT INTO allocation VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (r.job_id, r.job_name, r.group, r.mode, r.epoch, r.base, r.pool, json.dumps(r.workers),
             json.dumps(r.aggregator)),
        )

    def remove(self, job_id: int) -> None:
        self.db.execute("DELETE FROM allocation WHERE job_id = ?", (job_id,))

    def all(self) -> list[Record]:
        rows = self.db.execute("SELECT * FROM allocation ORDER BY job_id").fetchall()
        return [Record(r[0], r[1], r[2], r[3], r[4], r[5], r[6], json.loads(r[7]), json.loads(r[8])) for r in rows]
