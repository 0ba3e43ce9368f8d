"""The batch job store: files on disk, their metadata, batches and per-line state in SQLite (WAL).

Layout of ``data_dir``: ``batch.db`` and ``files/<file id>``. Durability rules:

- A file's bytes are written to a temporary name and renamed into place before its row is
  committed, so a listed file is always complete; unlisted files are removed on open.
- Input lines are copied into the ``lines`` table while a batch is ``validating``; if the service
  stops then, validation restarts from scratch on the next start.
- A finished line's output record is committed together with the batch counters in one
  transaction. Output and error files are written from the table only at finalization, so a line
  is in them exactly once whatever happened before, and a line marked done is never run again.
- ``attempts`` counts how often a line was sent (committed before it is sent) without a clean end:
  a run that was taken back (the service stopped it, or never got it to the engine) is uncounted
  again, so for a line not done it is how often the service or its engine died while it ran.

Every method takes one lock, so the store can be used from the event loop and from worker threads.
A storage failure (disk I/O error, read-only or full disk) raises ``StoreError``: a 503 to API
callers, retried by the runner.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xservice.batch.quota import FileQuota, FileUsage, check_quota
from xservice.batch.store_schema import BATCH_TIMESTAMPS, batch_object, create_or_upgrade, file_object
from xservice.http.errors import EngineUnavailableError

ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")


class StoreError(EngineUnavailableError):
    """The store cannot be read or written now (disk I/O error, read-only or full disk): a 503
    ``batch_store_unavailable`` to API callers; the runner retries it with backoff."""

    default_code = "batch_store_unavailable"


def _is_storage_error(exc: BaseException) -> bool:
    """SQLite's run-time failures (I/O, locked, read-only, full, corrupt) and the OS's, not our bugs."""
    return isinstance(exc, (sqlite3.OperationalError, OSError)) or type(exc) is sqlite3.DatabaseError


@contextmanager
def _storage_errors() -> Iterator[None]:
    try:
        yield
    except StoreError:
        raise
    except Exception as exc:
        if not _is_storage_error(exc):
            raise
        raise StoreError(f"The batch job store is unavailable: {type(exc).__name__}: {exc}") from exc


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


@dataclass
class PendingLine:
    line_no: int
    custom_id: str
    body: dict[str, Any]
    attempts: int = 0  # runs that ended with no result because the service or engine stopped


@dataclass
class IngestedLine:
    """One input line as stored: runnable (``body``) or already failed (``result``)."""

    line_no: int
    custom_id: str | None
    body: dict[str, Any] | None = None
    result: dict[str, Any] | None = None  # the error record of a line that cannot run


class BatchStore:
    """Files and batch jobs under ``data_dir``; see the module docstring for the durability rules."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir)
        self.files_dir = self.data_dir / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        with _storage_errors():
            # isolation_level=None: autocommit; transactions are explicit (``_tx``).
            self._db = sqlite3.connect(
                self.data_dir / "batch.db", check_same_thread=False, isolation_level=None
            )
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            # NORMAL in WAL mode: a committed transaction survives a killed process (not a power cut).
            self._db.execute("PRAGMA synchronous=NORMAL")
            create_or_upgrade(self._db)
        self._remove_orphan_files()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock, _storage_errors():
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                if self._db.in_transaction:  # (SQLite already rolled back after some I/O errors)
                    self._db.execute("ROLLBACK")
                raise
            try:
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    def _query(self, sql: str, args: Iterable[Any] = ()) -> list[sqlite3.Row]:
        with self._lock, _storage_errors():
            return self._db.execute(sql, tuple(args)).fetchall()

    def _remove_orphan_files(self) -> None:
        known = {row["id"] for row in self._query("SELECT id FROM files")}
        with _storage_errors():
            for path in self.files_dir.iterdir():
                if path.name not in known:
                    path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ files

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def add_file(
        self, data: bytes, filename: str, purpose: str, owner: str = "", quota: FileQuota | None = None
    ) -> dict[str, Any]:
        """Store ``data`` as a new file of ``owner`` and return its OpenAI file object.

        With ``quota``, the check and the insert are one transaction (``FileQuotaError`` past it),
        so concurrent uploads cannot overshoot it together.
        """
        file_id = new_id("file-")
        self._write_file(file_id, data)
        try:
            with self._tx() as db:
                if quota is not None:
                    check_quota(quota, _usage(db, None), _usage(db, owner), len(data))
                self._insert_file(db, file_id, len(data), filename, purpose, owner)
        except BaseException:
            self.file_path(file_id).unlink(missing_ok=True)
            raise
        return self.get_file(file_id) or {}

    def file_usage(self, owner: str | None = None) -> FileUsage:
        """Files and bytes stored, in all (``owner`` None) or uploaded by ``owner``."""
        with self._lock, _storage_errors():
            return _usage(self._db, owner)

    def _write_file(self, file_id: str, data: bytes) -> None:
        tmp = self.files_dir / f"{file_id}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.file_path(file_id))
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StoreError(f"The batch job store cannot write a file: {exc}") from exc

    @staticmethod
    def _insert_file(
        db: sqlite3.Connection, file_id: str, size: int, filename: str, purpose: str, owner: str = ""
    ) -> None:
        db.execute(
            "INSERT INTO files (id, bytes, created_at, filename, purpose, owner) VALUES (?, ?, ?, ?, ?, ?)",
            (file_id, size, now(), filename, purpose, owner),
        )

    def get_file(self, file_id: str) -> dict[str, Any] | None:
        rows = self._query("SELECT * FROM files WHERE id = ?", (file_id,))
        return file_object(rows[0]) if rows else None

    def list_files(self, purpose: str | None = None) -> list[dict[str, Any]]:
        if purpose:
            rows = self._query("SELECT * FROM files WHERE purpose = ? ORDER BY seq DESC", (purpose,))
        else:
            rows = self._query("SELECT * FROM files ORDER BY seq DESC")
        return [file_object(r) for r in rows]

    def delete_file(self, file_id: str) -> bool:
        with self._tx() as db:
            deleted = db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0
        if deleted:
            self.file_path(file_id).unlink(missing_ok=True)
        return deleted

    # ------------------------------------------------------------------ batches

    def create_batch(
        self, input_file_id: str, endpoint: str, completion_window: str, window_s: int, metadata: Any
    ) -> dict[str, Any]:
        batch_id = new_id("batch_")
        created = now()
        with self._tx() as db:
            db.execute(
                "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, metadata,"
                " created_at, expires_at) VALUES (?, ?, ?, ?, 'validating', ?, ?, ?)",
                (
                    batch_id,
                    endpoint,
                    input_file_id,
                    completion_window,
                    json.dumps(metadata),
                    created,
                    created + window_s,
                ),
            )
        return self.get_batch(batch_id) or {}

    def get_batch(self, batch_id: str) -> dict[str, Any] | None:
        rows = self._query("SELECT * FROM batches WHERE id = ?", (batch_id,))
        return batch_object(rows[0]) if rows else None

    def list_batches(self, limit: int, after: str | None = None) -> tuple[list[dict[str, Any]], bool]:
        """Newest first, starting after the batch ``after``; returns (page, has_more)."""
        if after:
            rows = self._query(
                "SELECT * FROM batches WHERE seq < (SELECT seq FROM batches WHERE id = ?)"
                " ORDER BY seq DESC LIMIT ?",
                (after, limit + 1),
            )
        else:
            rows = self._query("SELECT * FROM batches ORDER BY seq DESC LIMIT ?", (limit + 1,))
        return [batch_object(r) for r in rows[:limit]], len(rows) > limit

    def active_batch_ids(self) -> list[str]:
        """Batches the runner still has to move on: cancellations first, then oldest first."""
        marks = ",".join("?" * len(ACTIVE_STATUSES))
        rows = self._query(
            f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY status = 'cancelling' DESC, seq ASC",
            ACTIVE_STATUSES,
        )
        return [r["id"] for r in rows]

    def batch_ids_with_status(self, status: str) -> list[str]:
        return [
            r["id"] for r in self._query("SELECT id FROM batches WHERE status = ? ORDER BY seq", (status,))
        ]

    def set_status(self, batch_id: str, status: str, *, only_from: tuple[str, ...] = ()) -> bool:
        """Move to ``status`` (stamping ``<status>_at``); with ``only_from``, only from those states."""
        stamp = f", {status}_at = ?" if f"{status}_at" in BATCH_TIMESTAMPS else ""
        args: list[Any] = [status] + ([now()] if stamp else []) + [batch_id]
        where = "id = ?"
        if only_from:
            where += f" AND status IN ({','.join('?' * len(only_from))})"
            args += list(only_from)
        with self._tx() as db:
            return db.execute(f"UPDATE batches SET status = ?{stamp} WHERE {where}", args).rowcount > 0

    def fail_batch(
        self, batch_id: str, code: str = "", message: str = "", errors: list[dict[str, Any]] | None = None
    ) -> None:
        """Move to ``failed`` with one error (``code``, ``message``) or OpenAI error entries ``errors``."""
        data = errors or [{"code": code, "message": message, "param": None, "line": None}]
        errors_obj = {"object": "list", "data": data}
        with self._tx() as db:
            db.execute(
                "UPDATE batches SET status = 'failed', failed_at = ?, errors = ? WHERE id = ?",
                (now(), json.dumps(errors_obj), batch_id),
            )

    # ------------------------------------------------------------------ lines

    def reset_lines(self, batch_id: str) -> None:
        """Forget a half-done validation (it restarts from the input file)."""
        with self._tx() as db:
            db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
            db.execute(
                "UPDATE batches SET num_total = 0, num_completed = 0, num_failed = 0 WHERE id = ?",
                (batch_id,),
            )

    def add_lines(self, batch_id: str, lines: list[IngestedLine]) -> None:
        """Insert parsed input lines (one transaction per call)."""
        rows = [
            (
                batch_id,
                ln.line_no,
                ln.custom_id,
                None if ln.body is None else json.dumps(ln.body),
                int(ln.result is not None),
                int(ln.result is not None),
                None if ln.result is None else json.dumps(ln.result),
            )
            for ln in lines
        ]
        num_failed = sum(1 for ln in lines if ln.result is not None)
        with self._tx() as db:
            db.executemany(
                "INSERT INTO lines (batch_id, line_no, custom_id, body, done, is_error, result)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
            db.execute(
                "UPDATE batches SET num_total = num_total + ?, num_failed = num_failed + ? WHERE id = ?",
                (len(lines), num_failed, batch_id),
            )

    def pending_lines(self, batch_id: str, after_line_no: int, limit: int) -> list[PendingLine]:
        rows = self._query(
            "SELECT line_no, custom_id, body, attempts FROM lines WHERE batch_id = ? AND done = 0"
            " AND line_no > ? ORDER BY line_no LIMIT ?",
            (batch_id, after_line_no, limit),
        )
        return [PendingLine(r["line_no"], r["custom_id"], json.loads(r["body"]), r["attempts"]) for r in rows]

    def start_line(self, batch_id: str, line_no: int) -> None:
        """Count an attempt before the line is sent (a crash while it runs leaves it counted)."""
        self._add_attempts(batch_id, line_no, 1)

    def take_back_line(self, batch_id: str, line_no: int) -> None:
        """Uncount the attempt of a run that ended cleanly without a result (stopped, or sent back)."""
        self._add_attempts(batch_id, line_no, -1)

    def _add_attempts(self, batch_id: str, line_no: int, delta: int) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE lines SET attempts = max(0, attempts + ?) WHERE batch_id = ? AND line_no = ?",
                (delta, batch_id, line_no),
            )

    def finish_line(self, batch_id: str, line_no: int, result: dict[str, Any], is_error: bool) -> bool:
        """Record a line's output record and count it, atomically; False if it was already done."""
        counter = "num_failed" if is_error else "num_completed"
        with self._tx() as db:
            updated = db.execute(
                "UPDATE lines SET done = 1, is_error = ?, result = ? WHERE batch_id = ? AND line_no = ?"
                " AND done = 0",
                (int(is_error), json.dumps(result), batch_id, line_no),
            ).rowcount
            if updated:
                db.execute(f"UPDATE batches SET {counter} = {counter} + 1 WHERE id = ?", (batch_id,))
        return bool(updated)

    def finalize(self, batch_id: str, status: str) -> None:
        """Write the output and error files from the finished lines and move to ``status``, atomically."""
        file_ids: dict[bool, str | None] = {}
        sizes: dict[bool, int] = {}
        for is_error in (False, True):
            rows = self._query(
                "SELECT result FROM lines WHERE batch_id = ? AND done = 1 AND is_error = ? ORDER BY line_no",
                (batch_id, int(is_error)),
            )
            if not rows:
                file_ids[is_error] = None
                continue
            data = "".join(r["result"] + "\n" for r in rows).encode()
            file_ids[is_error] = new_id("file-")
            sizes[is_error] = len(data)
            self._write_file(file_ids[is_error], data)
        with self._tx() as db:
            for is_error, file_id in file_ids.items():
                if file_id is not None:
                    kind = "error" if is_error else "output"
                    self._insert_file(
                        db, file_id, sizes[is_error], f"{batch_id}_{kind}.jsonl", "batch_output"
                    )
            db.execute(
                f"UPDATE batches SET status = ?, {status}_at = ?, output_file_id = ?, error_file_id = ?"
                " WHERE id = ?",
                (status, now(), file_ids[False], file_ids[True], batch_id),
            )

    def line_attempts(self, batch_id: str) -> dict[str, int]:
        """``custom_id -> attempts`` (for diagnostics and tests)."""
        rows = self._query("SELECT custom_id, attempts FROM lines WHERE batch_id = ?", (batch_id,))
        return {r["custom_id"]: r["attempts"] for r in rows}


def _usage(db: sqlite3.Connection, owner: str | None) -> FileUsage:
    if owner is None:
        row = db.execute("SELECT count(*), coalesce(sum(bytes), 0) FROM files").fetchone()
    else:
        row = db.execute(
            "SELECT count(*), coalesce(sum(bytes), 0) FROM files WHERE owner = ?", (owner,)
        ).fetchone()
    return FileUsage(row[0], row[1])
