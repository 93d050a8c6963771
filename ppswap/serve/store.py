"""Job records in SQLite: what a restarted service lists.

One table, one row per job: its id, state, the options it was asked with (JSON), the
losses of the steps it finished, its last per-rank metrics, its error, and times.
``JobStore`` holds one ``sqlite3`` connection and runs every statement on a worker thread
(``anyio.to_thread``), one at a time (a lock), so the event loop never waits on the disk.
It keeps each record it wrote or read since it opened (it is the file's only writer
while it is open): ``get`` of such a record answers from memory, without a thread hop,
which keeps status requests cheap while a job trains.
Opening a store marks every job that was queued or running when the previous service
stopped as ``interrupted``: nothing runs it any more.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio

__all__ = ["ACTIVE_STATES", "FINAL_STATES", "JOB_STATES", "JobRecord", "JobStore"]

JOB_STATES = ("queued", "running", "finished", "failed", "cancelled", "interrupted")
ACTIVE_STATES = frozenset({"queued", "running"})
FINAL_STATES = frozenset(JOB_STATES) - ACTIVE_STATES

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    options TEXT NOT NULL,
    steps INTEGER NOT NULL,
    losses TEXT NOT NULL DEFAULT '[]',
    step_times TEXT NOT NULL DEFAULT '[]',
    metrics TEXT NOT NULL DEFAULT '[]',
    error TEXT,
    created REAL NOT NULL,
    updated REAL NOT NULL
)
"""
_COLUMNS = ("id", "state", "options", "steps", "losses", "step_times", "metrics", "error")
_JSON_COLUMNS = frozenset({"options", "losses", "step_times", "metrics"})

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class JobRecord:
    """One job as stored: ``losses`` and ``step_times`` have one entry per finished step
    (the step's mean loss and its time); ``metrics``: the last step's ``RankMetrics`` as
    dicts, one per rank."""

    id: str
    state: str
    options: Mapping[str, Any]
    steps: int
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    created: float = 0.0
    updated: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "state": self.state,
            "options": dict(self.options),
            "steps": self.steps,
            "steps_done": len(self.losses),
            "losses": self.losses,
            "loss": self.losses[-1] if self.losses else None,
            "step_times_s": self.step_times,
            "ranks": self.metrics,
            "error": self.error,
            "created": self.created,
            "updated": self.updated,
        }


class JobStore:
    """The job table of the SQLite file at ``path`` (created if missing)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(_SCHEMA)
        self.interrupted_at_open = self._interrupt_active()
        self._known: dict[str, JobRecord] = {}  # the loop's side only

    def _interrupt_active(self) -> int:
        marks = ",".join("?" * len(ACTIVE_STATES))
        cursor = self._db.execute(
            f"UPDATE jobs SET state = 'interrupted', updated = ? WHERE state IN ({marks})",
            (time.time(), *sorted(ACTIVE_STATES)),
        )
        return cursor.rowcount

    def close(self) -> None:
        with self._lock:
            self._db.close()

    async def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        def locked() -> _T:
            with self._lock:
                return fn(*args)

        return await anyio.to_thread.run_sync(locked)

    # -- statements (worker thread) ------------------------------------------------------
    def _insert(self, record: JobRecord) -> None:
        now = time.time()
        self._db.execute(
            "INSERT INTO jobs (id, state, options, steps, created, updated) VALUES (?,?,?,?,?,?)",
            (record.id, record.state, json.dumps(dict(record.options)), record.steps, now, now),
        )

    def _update(self, job_id: str, changes: dict[str, Any]) -> None:
        unknown = set(changes) - set(_COLUMNS[1:])
        if unknown:
            raise ValueError(f"unknown job column(s) {sorted(unknown)}")
        names = sorted(changes)
        values = [json.dumps(changes[n]) if n in _JSON_COLUMNS else changes[n] for n in names]
        assignments = ", ".join(f"{name} = ?" for name in names)
        self._db.execute(
            f"UPDATE jobs SET {assignments}, updated = ? WHERE id = ?",
            (*values, time.time(), job_id),
        )

    def _select(self, job_id: str | None) -> list[JobRecord]:
        columns = ", ".join((*_COLUMNS, "created", "updated"))
        if job_id is None:
            rows = self._db.execute(f"SELECT {columns} FROM jobs ORDER BY created").fetchall()
        else:
            query = f"SELECT {columns} FROM jobs WHERE id = ?"
            rows = self._db.execute(query, (job_id,)).fetchall()
        records = []
        for row in rows:
            values = dict(zip((*_COLUMNS, "created", "updated"), row, strict=True))
            for name in _JSON_COLUMNS:
                values[name] = json.loads(values[name])
            records.append(JobRecord(**values))
        return records

    # -- the loop's side -----------------------------------------------------------------
    async def insert(self, record: JobRecord) -> None:
        await self._call(self._insert, record)
        self._known.pop(record.id, None)  # read back once, with its times

    async def update(self, job_id: str, **changes: Any) -> None:
        await self._call(self._update, job_id, changes)
        known = self._known.get(job_id)
        if known is not None:  # as a read would give it: JSON columns copied through JSON
            stored = {
                k: json.loads(json.dumps(v)) if k in _JSON_COLUMNS else v
                for k, v in changes.items()
            }
            self._known[job_id] = dataclasses.replace(known, **stored, updated=time.time())

    async def get(self, job_id: str) -> JobRecord | None:
        known = self._known.get(job_id)
        if known is not None:
            return known
        found = await self._call(self._select, job_id)
        if not found:
            return None
        self._known[job_id] = found[0]
        return found[0]

    async def all(self) -> list[JobRecord]:
        return await self._call(self._select, None)
