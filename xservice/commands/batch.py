"""``xllm batch submit|status|list|cancel`` (against a server) and ``xllm run-batch`` (no server).

Both read OpenAI batch input files (one ``{"custom_id", "method", "url", "body"}`` per line) and
write OpenAI batch output lines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from xservice.commands import common as cli

DEFAULT_URL = "http://127.0.0.1:8000/v1"
DEFAULT_ENDPOINT = "/v1/chat/completions"
POLL_INTERVAL_S = 1.0
FINAL_STATUSES = ("completed", "failed", "expired", "cancelled")


def infer_endpoint(path: Path) -> str:
    """The ``url`` of the first line of ``path`` if it names a supported endpoint."""
    from xservice.batch.lines import ENDPOINTS

    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    url = json.loads(raw).get("url")
                except (ValueError, AttributeError):
                    break
                return url if url in ENDPOINTS else DEFAULT_ENDPOINT
    return DEFAULT_ENDPOINT


def _input_file(name: str) -> Path:
    path = Path(name)
    if not path.is_file():
        raise cli.CliError(f"input file not found: {name}")
    return path


# ---------------------------------------------------------------------- xllm batch ...


def register_batch(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "batch",
        help="submit and manage batch jobs on a running server",
        description="OpenAI Batches API client: upload a JSONL file, create a batch, follow it.",
    )
    commands = p.add_subparsers(title="batch commands", metavar="COMMAND")

    def add(name: str, help_text: str, run: Any) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--url", default=DEFAULT_URL, help="server base URL (default: %(default)s)")
        sub.add_argument("--api-key", default=None, help="API key, if the server requires one")
        sub.set_defaults(run=run)
        return sub

    submit = add("submit", "upload a JSONL file and create a batch", run_submit)
    submit.add_argument("input", help="batch input file (JSONL)")
    submit.add_argument(
        "--endpoint", default=None, help="/v1/chat/completions or /v1/completions (default: the lines' url)"
    )
    submit.add_argument("--wait", action="store_true", help="follow the batch and download its output")
    submit.add_argument("-o", "--output", default=None, help="output file (default: <input>.output.jsonl)")
    submit.add_argument("--errors", default=None, help="error file (default: <output>.errors.jsonl)")
    status = add("status", "show a batch", run_status)
    status.add_argument("batch_id")
    listing = add("list", "list recent batches", run_list)
    listing.add_argument("--limit", type=int, default=20, help="most batches shown (default: %(default)s)")
    cancel = add("cancel", "cancel a batch", run_cancel)
    cancel.add_argument("batch_id")
    p.set_defaults(run=lambda _args: (p.print_help(sys.stderr), cli.EXIT_USAGE)[1])


def _http(args: argparse.Namespace) -> Any:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return httpx.Client(
        base_url=args.url.rstrip("/") + "/", headers=headers, timeout=httpx.Timeout(600.0, connect=5.0)
    )


def _call(http: Any, method: str, path: str, **kw: Any) -> Any:
    import httpx

    try:
        resp = http.request(method, path, **kw)
    except httpx.HTTPError as e:
        raise cli.CliError(f"cannot reach {http.base_url} ({e}); start 'xllm serve' or pass --url") from e
    if resp.status_code != 200:
        raise cli.CliError(f"{method} {path} answered {resp.status_code}: {_error_message(resp.text)}")
    return resp


def _error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text.strip()[:200]


def run_submit(args: argparse.Namespace) -> int:
    path = _input_file(args.input)
    endpoint = args.endpoint or infer_endpoint(path)
    with _http(args) as http:
        with open(path, "rb") as f:
            upload = _call(http, "POST", "files", files={"file": (path.name, f)}, data={"purpose": "batch"})
        file_id = upload.json()["id"]
        body = {"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h"}
        batch = _call(http, "POST", "batches", json=body).json()
        print(f"{batch['id']} {batch['status']} (input {file_id}, {endpoint})", flush=True)
        if not args.wait:
            return 0
        batch = _follow(http, batch)
        output = Path(args.output) if args.output else path.with_suffix(".output.jsonl")
        errors = Path(args.errors) if args.errors else output.with_suffix(".errors.jsonl")
        for file_id, target in ((batch["output_file_id"], output), (batch["error_file_id"], errors)):
            if file_id:
                target.write_bytes(_call(http, "GET", f"files/{file_id}/content").content)
                print(f"wrote {target}")
    counts = batch["request_counts"]
    print(f"{batch['id']} {batch['status']}: {counts['completed']} completed, {counts['failed']} failed")
    return 0 if batch["status"] == "completed" else 1


def _follow(http: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """Poll until the batch is final, with a progress bar."""
    from tqdm import tqdm

    with tqdm(total=0, unit="line", desc=batch["id"][:18], file=sys.stderr) as bar:
        while True:
            counts = batch["request_counts"]
            bar.total = counts["total"]
            bar.n = counts["completed"] + counts["failed"]
            bar.set_postfix(status=batch["status"], failed=counts["failed"], refresh=False)
            bar.refresh()
            if batch["status"] in FINAL_STATUSES:
                return batch
            time.sleep(POLL_INTERVAL_S)
            batch = _call(http, "GET", f"batches/{batch['id']}").json()


def run_status(args: argparse.Namespace) -> int:
    with _http(args) as http:
        print(json.dumps(_call(http, "GET", f"batches/{args.batch_id}").json(), indent=2))
    return 0


def run_list(args: argparse.Namespace) -> int:
    with _http(args) as http:
        page = _call(http, "GET", "batches", params={"limit": args.limit}).json()
    for b in page["data"]:
        c = b["request_counts"]
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(b["created_at"]))
        done = f"{c['completed'] + c['failed']}/{c['total']}"
        print(f"{b['id']}  {b['status']:<11}  {done:>11}  {b['endpoint']:<21}  {created}")
    return 0


def run_cancel(args: argparse.Namespace) -> int:
    with _http(args) as http:
        batch = _call(http, "POST", f"batches/{args.batch_id}/cancel").json()
    print(f"{batch['id']} {batch['status']}")
    return 0


# ---------------------------------------------------------------------- xllm run-batch


def register_run_batch(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run-batch",
        help="run a batch input file through a local engine (no server)",
        description="Run an OpenAI batch input file through a local engine and write OpenAI batch output "
        "lines (in input order). Engine flags are those of 'xllm serve'.",
    )
    p.add_argument("-i", "--input", required=True, help="batch input file (JSONL)")
    p.add_argument("-o", "--output", required=True, help="output file (JSONL)")
    p.add_argument("--errors", default=None, help="write failed lines here (default: into --output)")
    p.add_argument(
        "--endpoint", default=None, help="/v1/chat/completions or /v1/completions (default: lines' url)"
    )
    p.add_argument("--config", metavar="FILE", help="YAML config file (sections: service, model, ...).")
    cli.add_config_flags(p)
    p.set_defaults(run=run_run_batch)


def run_run_batch(args: argparse.Namespace) -> int:
    cfg = cli.resolve_model(cli.load_cli_config(args))
    path = _input_file(args.input)
    endpoint = args.endpoint or infer_endpoint(path)
    records = asyncio.run(_run_file(cfg, path, endpoint))
    from xservice.batch.lines import is_error_record

    errors_path = Path(args.errors) if args.errors else None
    num_failed = 0
    with open(args.output, "w") as out:
        err = open(errors_path, "w") if errors_path else out
        try:
            for record in records:
                failed = is_error_record(record)
                num_failed += failed
                (err if failed else out).write(json.dumps(record) + "\n")
        finally:
            if err is not out:
                err.close()
    print(f"wrote {args.output}: {len(records) - num_failed} completed, {num_failed} failed", file=sys.stderr)
    return 0


async def _run_file(cfg: Any, path: Path, endpoint: str) -> list[dict[str, Any]]:
    from tqdm import tqdm

    from xservice.batch.lines import InputFileError, parse_lines
    from xservice.engine.data_parallel import start_engine_client
    from xservice.engine.errors import EngineStartupError
    from xservice.http.metrics import ServiceMetrics
    from xservice.serving.context import ServingContext

    try:
        with open(path, "rb") as f:
            lines = list(parse_lines(f, endpoint))
    except InputFileError as e:
        raise cli.CliError(f"{path}: {e}") from None
    tokenizer = cli.load_tokenizer(cfg.model.model)
    print(f"xllm: starting the engine for {cfg.model.model}", file=sys.stderr, flush=True)
    try:
        client = await start_engine_client(cfg.engine, cfg.service.engine_startup_timeout_s)
    except EngineStartupError as e:
        raise cli.CliError(f"the engine did not start: {str(e).splitlines()[0]}") from e
    try:
        ctx = ServingContext(engine_client=client, tokenizer=tokenizer, config=cfg, metrics=ServiceMetrics())
        slots = asyncio.Semaphore(cfg.batch.max_concurrent_lines)
        with tqdm(total=len(lines), unit="line", desc="run-batch", file=sys.stderr) as bar:

            async def one(line: Any) -> dict[str, Any]:
                record = line.result or await _run_one(ctx, endpoint, line, slots)
                bar.update()
                return record

            return list(await asyncio.gather(*(one(line) for line in lines)))
    finally:
        await client.close()


async def _run_one(ctx: Any, endpoint: str, line: Any, slots: asyncio.Semaphore) -> dict[str, Any]:
    from xservice.batch.lines import RetryLater, run_line

    async with slots:
        while True:
            try:
                return await run_line(ctx, endpoint, line.custom_id, line.body)
            except RetryLater as exc:
                if not ctx.engine_client.is_alive:
                    raise cli.CliError(f"the engine stopped: {exc}") from None
                await asyncio.sleep(0.5)
