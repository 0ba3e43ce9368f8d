"""Files API quotas: per caller and in all, on count and bytes, checked with the insert (no overshoot
under concurrent uploads), a 409 in OpenAI's shape naming the quota; deleting frees it."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.xservice.batch.helpers import completion_line, openai_client, start_batch_server, wait_batch
from xservice.batch.quota import ANONYMOUS, FileQuota, FileQuotaError, FileUsage, caller_id, check_quota
from xservice.batch.store import BatchStore

QUOTAS = {"max_files": 4, "max_files_per_caller": 4, "max_file_bytes_per_caller": 2048}


def _jsonl(tag: str, num_lines: int = 1, prompt_chars: int = 8) -> bytes:
    lines = [completion_line(f"{tag}-{i}", "p" * prompt_chars, max_tokens=2) for i in range(num_lines)]
    return "".join(json.dumps(ln) + "\n" for ln in lines).encode()


@pytest.fixture(scope="module")
def quota_server(launch_server, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    handle = start_batch_server(launch_server, model_dir, tmp_path_factory.mktemp("batch-data"), batch=QUOTAS)
    yield handle
    handle.stop()


def _upload(server: Any, data: bytes) -> tuple[int, dict[str, Any]]:
    with server.client() as http:
        resp = http.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
    return resp.status_code, resp.json()


def _refused(result: tuple[int, dict[str, Any]], quota: str) -> None:
    status, body = result
    assert status == 409, body
    error = body["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "file_quota_exceeded",
        "file",
    )
    assert quota in error["message"], error


def test_quotas_on_bytes_and_count(quota_server: Any) -> None:
    client = openai_client(quota_server)
    first = _upload(quota_server, _jsonl("a"))
    second = _upload(quota_server, _jsonl("b"))
    assert first[0] == second[0] == 200
    _refused(
        _upload(quota_server, _jsonl("big", num_lines=10, prompt_chars=150)),
        "batch.max_file_bytes_per_caller",
    )
    # A batch's output file counts toward the store's total (not the caller's): 3 files, then 4.
    batch = client.batches.create(
        input_file_id=first[1]["id"], endpoint="/v1/completions", completion_window="24h"
    )
    assert wait_batch(client, batch.id).status == "completed"
    assert _upload(quota_server, _jsonl("c"))[0] == 200
    _refused(_upload(quota_server, _jsonl("d")), "batch.max_files")
    # Deleting frees the quota.
    client.files.delete(second[1]["id"])
    assert _upload(quota_server, _jsonl("e"))[0] == 200
    assert len(client.files.list().data) == 4


def test_concurrent_uploads_do_not_overshoot(quota_server: Any) -> None:
    client = openai_client(quota_server)
    for f in client.files.list().data:
        client.files.delete(f.id)
    for tag in "xyz":
        assert _upload(quota_server, _jsonl(tag))[0] == 200
    with ThreadPoolExecutor(8) as pool:  # one slot left, eight uploads at once
        results = list(pool.map(lambda i: _upload(quota_server, _jsonl(f"r{i}")), range(8)))
    assert sorted(status for status, _ in results) == [200] + [409] * 7, results
    assert len(client.files.list().data) == QUOTAS["max_files"]
    with pytest.raises(openai.ConflictError):
        with open(__file__, "rb") as f:  # through the OpenAI client too (not even a batch file: quota first)
            client.files.create(file=f, purpose="batch")


def test_check_quota_and_callers() -> None:
    quota = FileQuota(max_files=10, max_bytes=1000, max_files_per_caller=2, max_bytes_per_caller=100)
    check_quota(quota, FileUsage(9, 899), FileUsage(1, 99), 1)  # every limit reached exactly: fine
    for total, mine, size, name in (
        (FileUsage(10, 0), FileUsage(0, 0), 1, "batch.max_files"),
        (FileUsage(0, 999), FileUsage(0, 0), 2, "batch.max_total_file_bytes"),
        (FileUsage(2, 0), FileUsage(2, 0), 1, "batch.max_files_per_caller"),
        (FileUsage(1, 50), FileUsage(1, 50), 51, "batch.max_file_bytes_per_caller"),
    ):
        with pytest.raises(FileQuotaError, match=name):
            check_quota(quota, total, mine, size)
    assert caller_id("Bearer k1", auth_enabled=False) == caller_id(None, auth_enabled=False) == ANONYMOUS
    one, two = caller_id("Bearer k1", True), caller_id("Bearer k2", True)
    assert one != two and one.startswith("key-") and "k1" not in one


def test_a_store_from_before_owners_is_upgraded(tmp_path: Path) -> None:
    """A store written before ``files.owner`` existed opens, keeps its files and counts them."""
    tmp_path.joinpath("files").mkdir()
    tmp_path.joinpath("files", "file-old").write_bytes(b"x" * 10)
    with sqlite3.connect(tmp_path / "batch.db") as db:
        db.execute(
            "CREATE TABLE files (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, bytes INTEGER"
            " NOT NULL, created_at INTEGER NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL)"
        )
        db.execute(
            "INSERT INTO files (id, bytes, created_at, filename, purpose) VALUES ('file-old', 10, 0, 'a', 'batch')"
        )
    store = BatchStore(tmp_path)
    try:
        assert [f["id"] for f in store.list_files()] == ["file-old"]
        store.add_file(b"y" * 5, "b.jsonl", "batch", owner=ANONYMOUS)
        assert store.file_usage() == FileUsage(2, 15) and store.file_usage(ANONYMOUS) == FileUsage(1, 5)
    finally:
        store.close()
