"""The batch job store's SQLite schema, its upgrades, and its rows as OpenAI objects (file, batch).

``files.owner`` is who uploaded a file (a hash of its API key, ``anonymous`` without auth; empty for
the batch output files the service writes): per-caller quotas count by it. A store written before
the column existed is upgraded in place when it is opened.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

BATCH_TIMESTAMPS = (
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    owner TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    output_file_id TEXT,
    error_file_id TEXT,
    errors TEXT,
    metadata TEXT,
    created_at INTEGER NOT NULL,
    expires_at INTEGER,
    in_progress_at INTEGER,
    finalizing_at INTEGER,
    completed_at INTEGER,
    failed_at INTEGER,
    expired_at INTEGER,
    cancelling_at INTEGER,
    cancelled_at INTEGER,
    num_total INTEGER NOT NULL DEFAULT 0,
    num_completed INTEGER NOT NULL DEFAULT 0,
    num_failed INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL,
    line_no INTEGER NOT NULL,
    custom_id TEXT,
    body TEXT,
    done INTEGER NOT NULL DEFAULT 0,
    is_error INTEGER NOT NULL DEFAULT 0,
    result TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (batch_id, line_no)
);
CREATE INDEX IF NOT EXISTS lines_pending ON lines (batch_id, done, line_no);
"""


def create_or_upgrade(db: sqlite3.Connection) -> None:
    """Create the tables, and add the columns a store from an older version lacks."""
    db.executescript(SCHEMA)
    columns = {row[1] for row in db.execute("PRAGMA table_info(files)")}
    if "owner" not in columns:
        db.execute("ALTER TABLE files ADD COLUMN owner TEXT NOT NULL DEFAULT ''")
    db.execute("CREATE INDEX IF NOT EXISTS files_owner ON files (owner)")


def file_object(row: sqlite3.Row) -> dict[str, Any]:
    """A ``files`` row as an OpenAI file object."""
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": row["created_at"],
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "status_details": None,
    }


def batch_object(row: sqlite3.Row) -> dict[str, Any]:
    """A ``batches`` row as an OpenAI batch object."""
    obj: dict[str, Any] = {
        "id": row["id"],
        "object": "batch",
        "endpoint": row["endpoint"],
        "errors": json.loads(row["errors"]) if row["errors"] else None,
        "input_file_id": row["input_file_id"],
        "completion_window": row["completion_window"],
        "status": row["status"],
        "output_file_id": row["output_file_id"],
        "error_file_id": row["error_file_id"],
        "created_at": row["created_at"],
        "expires_at": row["expires_at"],
    }
    obj.update({name: row[name] for name in BATCH_TIMESTAMPS})
    obj["request_counts"] = {
        "total": row["num_total"],
        "completed": row["num_completed"],
        "failed": row["num_failed"],
    }
    obj["metadata"] = json.loads(row["metadata"]) if row["metadata"] else None
    return obj
