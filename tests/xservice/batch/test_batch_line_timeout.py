"""A batch line past ``batch.line_timeout_s`` is stopped and fails with ``line_timeout``; the batch goes on.

The hang is real: the engine process is SIGSTOPped while the first line runs in it, and SIGCONTed
once that line has failed, so only the first line can have run past its budget.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.xservice.batch.helpers import (
    completion_line,
    openai_client,
    read_file,
    start_batch_server,
    submit,
    wait_batch,
    wait_for,
)
from tests.xservice.batch.helpers import write_jsonl as write_lines


def test_a_line_past_its_budget_fails_and_the_batch_goes_on(
    launch_server, model_dir: Path, tmp_path: Path
) -> None:
    settings = {"max_concurrent_lines": 1, "line_timeout_s": 3.0}
    lines = [completion_line(f"line-{i}", f"Line {i} says", max_tokens=4) for i in range(3)]
    path = write_lines(tmp_path / "in.jsonl", lines)
    server = start_batch_server(launch_server, model_dir, tmp_path / "batch-data", batch=settings)
    try:
        client = openai_client(server)
        with server.client() as http:
            engine_pid = http.get("/v1/admin/stats").json()["engine_pid"]
            os.kill(engine_pid, signal.SIGSTOP)
            try:
                batch_id = submit(client, path, "/v1/completions").id
                wait_for(
                    "the first line timed out",
                    lambda: client.batches.retrieve(batch_id).request_counts.failed,
                )
            finally:
                os.kill(engine_pid, signal.SIGCONT)
            batch = wait_batch(client, batch_id)
            errors = read_file(client, batch.error_file_id)
            output = read_file(client, batch.output_file_id)
            metrics = http.get("/metrics").text
    finally:
        server.stop()
    assert batch.status == "completed", batch
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (3, 2, 1)
    [record] = errors
    assert (record["custom_id"], record["response"]) == ("line-0", None)
    assert record["error"]["code"] == "line_timeout" and "line_timeout_s" in record["error"]["message"]
    assert [r["custom_id"] for r in output] == ["line-1", "line-2"]
    assert all(r["response"]["status_code"] == 200 for r in output)
    assert "xllm_batch_lines_timed_out_total 1.0" in metrics
