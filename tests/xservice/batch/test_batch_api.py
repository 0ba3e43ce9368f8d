"""Files + Batches API through a real service: results match the online endpoints, bad lines go to the
error file, online requests preempt batch lines, cancel, and the ``xllm batch`` / ``xllm run-batch`` CLIs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.xservice.batch.helpers import (
    WAIT_TIMEOUT_S,
    chat_line,
    completion_line,
    openai_client,
    read_file,
    start_batch_server,
    submit,
    wait_batch,
    write_jsonl,
)


def comparable(body: dict[str, Any]) -> dict[str, Any]:
    """A response without what differs per request: id, created and prefix-cache hits."""
    out = {k: v for k, v in body.items() if k not in ("id", "created")}
    out["usage"] = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
    return out


# ---------------------------------------------------------------------- the module's server

MAX_FILE_BYTES = 64 * 1024
MAX_NUM_SEQS = 4  # small, so an online request has to preempt a running batch line


@pytest.fixture(scope="module")
def batch_server(launch_server, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    data_dir = tmp_path_factory.mktemp("batch-data")
    handle = start_batch_server(
        launch_server,
        model_dir,
        data_dir,
        batch={"max_file_bytes": MAX_FILE_BYTES, "max_concurrent_lines": 8},
        scheduler={"max_num_seqs": MAX_NUM_SEQS},
    )
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(batch_server: Any) -> openai.OpenAI:
    return openai_client(batch_server)


def online(client: openai.OpenAI, line: dict[str, Any]) -> dict[str, Any]:
    """The same body sent to the online endpoint."""
    resp = client.post(line["url"].removeprefix("/v1"), body=line["body"], cast_to=httpx.Response)
    return resp.json()


# ---------------------------------------------------------------------- tests


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_batch_matches_online(client: openai.OpenAI, tmp_path: Path, endpoint: str) -> None:
    make = chat_line if endpoint == "/v1/chat/completions" else completion_line
    lines = [make(f"req-{i}", f"Tell me about number {i}", max_tokens=4 + i) for i in range(6)]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    with open(path, "rb") as f:
        file = client.files.create(file=f, purpose="batch")
    assert (file.object, file.purpose, file.filename, file.bytes) == (
        "file",
        "batch",
        "in.jsonl",
        path.stat().st_size,
    )
    created = client.batches.create(
        input_file_id=file.id, endpoint=endpoint, completion_window="24h", metadata={"job": "t1"}
    )
    assert created.id.startswith("batch_") and created.object == "batch"
    assert created.status == "validating" and created.metadata == {"job": "t1"}
    batch = wait_batch(client, created.id)

    assert batch.status == "completed", batch
    assert batch.errors is None and batch.error_file_id is None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        6,
        6,
        0,
    )
    stamps = [batch.created_at, batch.in_progress_at, batch.finalizing_at, batch.completed_at]
    assert None not in stamps and stamps == sorted(stamps)
    assert batch.expires_at == batch.created_at + 24 * 3600
    output = read_file(client, batch.output_file_id)
    assert [r["custom_id"] for r in output] == [ln["custom_id"] for ln in lines]
    for record, line in zip(output, lines):
        assert set(record) == {"id", "custom_id", "response", "error"}
        assert record["id"].startswith("batch_req_") and record["error"] is None
        response = record["response"]
        assert response["status_code"] == 200 and response["request_id"] == response["body"]["id"]
        assert comparable(response["body"]) == comparable(online(client, line))
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"


def upload_status(server: Any, data: bytes) -> tuple[int, dict[str, Any]]:
    """POST /v1/files (purpose batch) of ``data``; the status and JSON body, whatever they are."""
    with server.client() as http:
        resp = http.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
    return resp.status_code, resp.json()


def test_bad_lines_are_refused_at_upload(batch_server: Any) -> None:
    good = [chat_line("ok-1", "Hi", max_tokens=3), chat_line("ok-2", "Hello", max_tokens=3)]
    bad = [
        "{this is not json",
        {**chat_line("x", "Hi", 3), "custom_id": None},
        chat_line("ok-1", "again", max_tokens=3),
        {**chat_line("get", "Hi", 3), "method": "GET"},
        {**chat_line("no-body", "Hi", 3), "body": "text"},
        {**chat_line("bad-url", "Hi", 3), "url": "/v1/moderations"},
        "[1, 2]",
        "[" * 5000,
    ]
    rows = [good[0], *bad, "", good[1]]
    status, body = upload_status(batch_server, "".join(_row(r) + "\n" for r in rows).encode())
    assert status == 400, body
    error = body["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        "file",
        "invalid_batch_file",
    )
    for expected in (
        "Line 2: not valid JSON",
        "Line 3: 'custom_id' must be a non-empty string",
        "Line 4: 'custom_id' 'ok-1' appears more than once",
        "Line 5: 'method' must be 'POST'",
        "Line 6: 'body' must be a JSON object",
        "Line 7: 'url' must be one of",
        "Line 8: must be a JSON object",
        "Line 9: not valid JSON (nested too deeply)",
    ):
        assert expected in error["message"], (expected, error["message"])
    assert "Line 1:" not in error["message"] and "Line 11:" not in error["message"]


def test_uploads_that_are_not_batch_files_are_refused(batch_server: Any, client: openai.OpenAI) -> None:
    before = {f.id for f in client.files.list()}
    # 60 KB of 'x' (the 99 MB, scaled to this server's limit); not even one line of JSON
    status, body = upload_status(batch_server, b"x" * (MAX_FILE_BYTES - 1024))
    assert status == 400 and body["error"]["code"] == "invalid_batch_file", body
    assert body["error"]["message"].count("Line ") == 1
    # 16 lines of CSV: the first 10 are named, not one per line
    status, body = upload_status(batch_server, "".join(f"{i},hello {i}\n" for i in range(16)).encode())
    assert status == 400 and body["error"]["message"].count("not valid JSON") == 10, body
    assert "Line 10:" in body["error"]["message"] and "Line 11:" not in body["error"]["message"]
    png = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01" + bytes(range(256))
    status, body = upload_status(batch_server, png)
    assert status == 400 and "Line 1 is not UTF-8 text" in body["error"]["message"], body
    lone_id = json.dumps(completion_line("ok", "Hello", max_tokens=2)).replace('"ok"', '"\\udfff"')
    status, body = upload_status(batch_server, lone_id.encode())
    assert status == 400 and "'custom_id' must be valid Unicode text" in body["error"]["message"], body
    assert {f.id for f in client.files.list()} == before  # nothing stored


def _row(row: Any) -> str:
    return row if isinstance(row, str) else json.dumps(row)


def test_bad_lines_go_to_the_error_file(client: openai.OpenAI, tmp_path: Path) -> None:
    """Lines that pass the upload checks but not the batch's: another endpoint, bodies the endpoint refuses."""
    good = [chat_line("ok-1", "Hi", max_tokens=3), chat_line("ok-2", "Hello", max_tokens=3)]
    bad = {
        "url": {**chat_line("wrong-url", "Hi", 3), "url": "/v1/completions"},
        "field": chat_line("bad-temp", "Hi", 3, temperature="hot"),
        "n": chat_line("big-n", "Hi", 3, n=1000),
        "model": chat_line("bad-model", "Hi", 3, model="no-such-model"),
    }
    path = write_jsonl(tmp_path / "in.jsonl", [good[0], *bad.values(), "", good[1]])
    batch = wait_batch(client, submit(client, path, "/v1/chat/completions").id)

    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        6,
        2,
        4,
    )
    assert [r["custom_id"] for r in read_file(client, batch.output_file_id)] == ["ok-1", "ok-2"]
    records = read_file(client, batch.error_file_id)
    assert len(records) == 4
    refused = [(r["custom_id"], r["error"]["code"]) for r in records if r["response"] is None]
    assert refused == [("wrong-url", "mismatched_url")]  # never reached the endpoint
    assert records[0]["error"]["message"].startswith("Line 2: 'url' must be the batch endpoint")
    errors = {r["custom_id"]: r for r in records if r["response"] is not None}
    # Bodies the endpoint refuses carry its error response, as an HTTP request would get it.
    for cid, status, param in (
        ("bad-temp", 400, "temperature"),
        ("big-n", 400, "n"),
        ("bad-model", 404, "model"),
    ):
        response = errors[cid]["response"]
        assert response["status_code"] == status, errors[cid]
        assert response["body"]["error"]["param"] == param and errors[cid]["error"]["message"]


def test_api_errors(client: openai.OpenAI, tmp_path: Path) -> None:
    big = tmp_path / "big.jsonl"
    line = json.dumps(chat_line("x", "y" * 1000, 3))
    big.write_text("\n".join([line] * (MAX_FILE_BYTES // len(line) + 1)))
    with pytest.raises(openai.APIStatusError) as e, open(big, "rb") as f:
        client.files.create(file=f, purpose="batch")
    assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large"
    path = write_jsonl(tmp_path / "in.jsonl", [chat_line("a", "b", 2)])
    with pytest.raises(openai.BadRequestError) as e, open(path, "rb") as f:
        client.files.create(file=f, purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    for call in (
        lambda: client.files.retrieve("file-nope"),
        lambda: client.files.content("file-nope"),
        lambda: client.files.delete("file-nope"),
        lambda: client.batches.retrieve("batch_nope"),
        lambda: client.batches.cancel("batch_nope"),
        lambda: client.batches.create(
            input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["type"] == "invalid_request_error"
    with open(path, "rb") as f:
        file = client.files.create(file=f, purpose="batch")
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id=file.id, endpoint="/v1/moderations", completion_window="24h")
    assert e.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="1h")
    assert e.value.body["param"] == "completion_window"
    assert file.id in [f.id for f in client.files.list()]
    assert client.files.content(file.id).text == path.read_text()
    # Listing batches pages newest first.
    first, second = (submit(client, path, "/v1/chat/completions") for _ in range(2))
    page = client.batches.list(limit=1)
    assert [b.id for b in page.data] == [second.id] and page.has_more
    assert client.batches.list(limit=1, after=second.id).data[0].id == first.id
    for b in (first, second):
        wait_batch(client, b.id)
    assert client.files.delete(file.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file.id)


def test_online_preempts_batch_then_cancel(
    client: openai.OpenAI, batch_server: Any, idle: Callable[..., Any], tmp_path: Path
) -> None:
    lines = [completion_line(f"long-{i}", f"Story {i}:", max_tokens=200, ignore_eos=True) for i in range(32)]
    batch = submit(client, write_jsonl(tmp_path / "in.jsonl", lines), "/v1/completions")
    with batch_server.client() as http:
        num_preemptions = http.get("/v1/admin/stats").json()["num_preemptions"]
        wait_batch(client, batch.id, until=lambda b: b.status == "in_progress")
        # Every engine slot is taken by batch lines: the online request gets one by preempting a line.
        body = {"prompt": "Quick question", "max_tokens": 8, "temperature": 0.0}
        resp = http.post("/v1/completions", json=body)
        assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] == "length"
        during = client.batches.retrieve(batch.id)
        assert during.status == "in_progress"
        assert during.request_counts.completed + during.request_counts.failed < len(lines)
        assert http.get("/v1/admin/stats").json()["num_preemptions"] > num_preemptions

        wait_batch(client, batch.id, until=lambda b: b.request_counts.completed >= 1)
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
        done = wait_batch(client, batch.id)
        assert done.status == "cancelled" and done.cancelled_at is not None and done.completed_at is None
        num_done = done.request_counts.completed
        assert 1 <= num_done < len(lines) and done.request_counts.failed == 0
        output = read_file(client, done.output_file_id)
        assert len(output) == num_done and len({r["custom_id"] for r in output}) == num_done
        assert all(r["response"]["body"]["usage"]["completion_tokens"] == 200 for r in output)
        assert done.error_file_id is None
        idle(http)  # the lines in flight were aborted in the engine
        assert client.batches.cancel(batch.id).status == "cancelled"


def test_cli_submit_and_run_batch(batch_server: Any, model_dir: Path, tmp_path: Path) -> None:
    lines = [chat_line(f"c{i}", f"Say something about {i}", max_tokens=5) for i in range(4)]
    lines.append({**chat_line("bad", "x", 3), "url": "/v1/completions"})
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    url = batch_server.base_url + "/v1"
    submitted = subprocess.run(
        [sys.executable, "-m", "xservice", "batch", "submit", str(path), "--url", url, "--wait", "-o",
         str(tmp_path / "server.jsonl"), "--errors", str(tmp_path / "server-errors.jsonl")],
        capture_output=True, text=True, env=env, timeout=WAIT_TIMEOUT_S,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    batch_id = submitted.stdout.split()[0]
    listed = subprocess.run(
        [sys.executable, "-m", "xservice", "batch", "list", "--url", url],
        capture_output=True,
        text=True,
        env=env,
    )
    assert batch_id in listed.stdout and "completed" in listed.stdout

    s = batch_server.config
    flags = {
        "--model": str(model_dir),
        "--served-model-name": s["model"]["served_model_name"],
        "--max-model-len": s["model"]["max_model_len"],
        "--seed": s["model"]["seed"],
        "--block-size": s["cache"]["block_size"],
        "--num-blocks": s["cache"]["num_blocks"],
        "--max-num-seqs": s["scheduler"]["max_num_seqs"],
        "--max-num-batched-tokens": s["scheduler"]["max_num_batched_tokens"],
        "--device": "cpu",
        "--num-threads": 1,
    }
    out = tmp_path / "local.jsonl"
    cmd = [sys.executable, "-m", "xservice", "run-batch", "-i", str(path), "-o", str(out)]
    cmd += [str(x) for kv in flags.items() for x in kv]
    local = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=WAIT_TIMEOUT_S)
    assert local.returncode == 0, local.stderr

    def load(p: Path) -> list[dict[str, Any]]:
        return [json.loads(x) for x in p.read_text().splitlines()]

    server_records = load(tmp_path / "server.jsonl") + load(tmp_path / "server-errors.jsonl")
    local_records = load(out)  # run-batch writes failed lines into the output unless --errors is given
    assert [r["custom_id"] for r in local_records] == [ln["custom_id"] for ln in lines]
    by_id = {r["custom_id"]: r for r in server_records}
    for record in local_records:
        other = by_id[record["custom_id"]]
        assert set(record) == set(other) and record["id"].startswith("batch_req_")
        if record["response"] is None:
            assert record["error"] == {**other["error"], "message": record["error"]["message"]}
            assert record["error"]["code"] == "mismatched_url"
        else:
            assert record["response"]["status_code"] == 200
            assert comparable(record["response"]["body"]) == comparable(other["response"]["body"])


# ---------------------------------------------------------------------- input validation, downloads


def upload_raw(server: Any, data: bytes, disposition: bytes = b'filename="in.jsonl"') -> dict[str, Any]:
    """POST /v1/files with a hand-written multipart body (``disposition``: the file part's name params)."""
    body = (
        b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--b\r\nContent-Disposition: form-data; name="file"; '
        + disposition
        + b"\r\n\r\n"
        + data
        + b"\r\n--b--\r\n"
    )
    with server.client() as http:
        resp = http.post(
            "/v1/files", content=body, headers={"Content-Type": "multipart/form-data; boundary=b"}
        )
    assert resp.status_code == 200, resp.text
    return resp.json()


def create_batch(client: openai.OpenAI, file_id: str, endpoint: str = "/v1/completions") -> Any:
    return client.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h")


def test_unsafe_values_in_lines_fail_those_lines(client: openai.OpenAI, batch_server: Any) -> None:
    good = json.dumps(completion_line("ok", "Hello", max_tokens=2))
    big = good.replace('"ok"', '"big"').replace('"max_tokens": 2', f'"max_tokens": {2**64}')
    lone = good.replace('"ok"', '"lone"').replace('"Hello"', '"\\ud800"')
    file = upload_raw(batch_server, "\n".join([good, big, lone]).encode())
    batch = wait_batch(client, create_batch(client, file["id"]).id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 2)
    errors = read_file(client, batch.error_file_id)
    by_id = {r["custom_id"]: r for r in errors}
    assert by_id["big"]["response"]["status_code"] == 400
    assert by_id["big"]["response"]["body"]["error"]["param"] == "max_tokens"
    assert by_id["lone"]["response"]["body"]["error"]["param"] == "prompt"


@pytest.mark.parametrize(
    "disposition,header",
    [
        (
            b"filename*=UTF-8''..%2F..%2Fetc%2Fevil%0D%0ASet-Cookie%3A%20x%3D%22y%22.jsonl",
            'attachment; filename="evilSet-Cookie: x=y.jsonl"',
        ),
        (
            'filename="../r\u00e9sum\u00e9\t\\"q\\".jsonl"'.encode(),
            "attachment; filename=\"r_sum_q.jsonl\"; filename*=UTF-8''r%C3%A9sum%C3%A9q.jsonl",
        ),
        (b'filename="..\\\\.."', 'attachment; filename="file"'),
    ],
    ids=["crlf-quotes-path", "non-ascii", "only-dots"],
)
def test_download_name_is_sanitised(batch_server: Any, disposition: bytes, header: str) -> None:
    data = json.dumps(completion_line("a", "Hi", max_tokens=2)).encode() + b"\n"
    file = upload_raw(batch_server, data, disposition)
    with batch_server.client() as http:
        resp = http.get(f"/v1/files/{file['id']}/content")
    assert resp.status_code == 200 and resp.content == data
    assert resp.headers["content-disposition"] == header
    assert resp.headers.get("set-cookie") is None


@pytest.mark.parametrize(
    "url",
    [
        "/v1/files/%ED%A0%80",
        "/v1/batches/%00%0D%0A",
        "/v1/files/%ED%A0%80/content",
        "/v1/batches?after=%ED%A0%80",
    ],
)
def test_odd_path_and_query_params_are_not_server_errors(batch_server: Any, url: str) -> None:
    """Invalid UTF-8 in the URL decodes to U+FFFD (never a lone surrogate): a 404 or an empty page."""
    with batch_server.client() as http:
        resp = http.get(url)
    assert resp.status_code in (200, 404), resp.text
    assert resp.json()


def test_run_batch_refuses_a_binary_file(model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\x00\x01\x02 not text\n")
    cmd = [sys.executable, "-m", "xservice", "run-batch", "-i", str(path), "-o", str(tmp_path / "out.jsonl")]
    out = subprocess.run(cmd + ["--model", str(model_dir)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "not UTF-8 text" in out.stderr and "Traceback" not in out.stderr
