"""OpenAI Files API (batch input and output files): upload, list, retrieve, delete, content.

An upload is refused before it is stored when it passes a quota (409, ``xservice/batch/quota.py``)
or, for ``purpose=batch``, when a line is not a batch request line (400 naming the first lines).
"""

from __future__ import annotations

import asyncio
import re
import unicodedata
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse

from xservice.batch.lines import check_upload
from xservice.batch.multipart import FormField, parse_form
from xservice.batch.quota import caller_id, check_quota
from xservice.batch.service import BatchService, found_or_404, get_batch_service, list_page
from xservice.http.errors import InvalidRequestError, NotFoundError, RequestTooLargeError

router = APIRouter()

PURPOSES = ("batch",)
# The form is parsed by hand (no python-multipart), so its schema is declared here for /openapi.json.
UPLOAD_FORM = {
    "type": "object",
    "required": ["file", "purpose"],
    "properties": {
        "file": {"type": "string", "format": "binary", "description": "The JSONL file."},
        "purpose": {"type": "string", "enum": list(PURPOSES)},
    },
}


@router.post(
    "/v1/files",
    openapi_extra={
        "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": UPLOAD_FORM}}}
    },
)
async def create_file(request: Request, batch: BatchService = Depends(get_batch_service)) -> dict[str, Any]:
    body = await request.body()
    content_type = request.headers.get("content-type", "")
    # an upload may be ~100 MB: parsing and checking it (copies, scans) happens off the event loop
    upload, purpose = await asyncio.to_thread(_read_upload, body, content_type, batch.config.max_file_bytes)
    del body
    store, quota = batch.store, batch.quota
    owner = caller_id(request.headers.get("authorization"), bool(batch.ctx.config.service.api_key))
    check_quota(quota, store.file_usage(), store.file_usage(owner), len(upload.data))  # cheap, early
    problems = await asyncio.to_thread(check_upload, upload.data)
    if problems:
        raise InvalidRequestError(
            "Not a batch input file (JSONL, one request per line): " + " ".join(problems),
            param="file",
            code="invalid_batch_file",
        )
    return await asyncio.to_thread(store.add_file, upload.data, upload.filename, purpose, owner, quota)


def _read_upload(body: bytes, content_type: str, max_file_bytes: int) -> tuple[FormField, str]:
    """The uploaded file and its purpose, or the 4xx saying what is wrong with the form."""
    form = parse_form(body, content_type)
    upload = form.get("file")
    if upload is None or upload.filename is None:
        raise InvalidRequestError("Missing the 'file' field (a file upload).", param="file")
    purpose = form["purpose"].data.decode("utf-8", "replace") if "purpose" in form else None
    if purpose not in PURPOSES:
        raise InvalidRequestError(
            f"'purpose' must be one of {list(PURPOSES)}, got {purpose!r}.", param="purpose"
        )
    if len(upload.data) > max_file_bytes:
        raise RequestTooLargeError(
            f"File of {len(upload.data)} bytes exceeds the limit of {max_file_bytes} bytes."
        )
    if _BLANK.fullmatch(upload.data):
        raise InvalidRequestError("The file is empty.", param="file")
    return upload, purpose


_BLANK = re.compile(rb"\s*")  # what bytes.strip() removes (ASCII whitespace), without copying


@router.get("/v1/files")
async def list_files(purpose: str | None = None, batch: BatchService = Depends(get_batch_service)) -> Any:
    data = batch.store.list_files(purpose)
    return list_page(data, False)


def _file(batch: BatchService, file_id: str) -> dict[str, Any]:
    return found_or_404(batch.store.get_file(file_id), "file", "file_id", file_id)


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, batch: BatchService = Depends(get_batch_service)) -> dict[str, Any]:
    return _file(batch, file_id)


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, batch: BatchService = Depends(get_batch_service)) -> dict[str, Any]:
    if not batch.store.delete_file(file_id):
        raise NotFoundError(f"No such file: '{file_id}'.", param="file_id")
    return {"id": file_id, "object": "file", "deleted": True}


@router.get(
    "/v1/files/{file_id}/content",
    response_class=FileResponse,
    responses={
        200: {"content": {"application/jsonl": {"schema": {"type": "string"}}}, "description": "The file."}
    },
)
async def file_content(file_id: str, batch: BatchService = Depends(get_batch_service)) -> FileResponse:
    obj = _file(batch, file_id)
    disposition = content_disposition(obj["filename"])
    return FileResponse(
        batch.store.file_path(file_id),
        media_type="application/jsonl",
        headers={"Content-Disposition": disposition},
    )


def content_disposition(filename: str) -> str:
    """An ``attachment`` header for a user-chosen name: no path, quotes or control characters.

    Non-ASCII names go in RFC 6266 ``filename*=UTF-8''...`` with an ASCII ``filename=`` fallback.
    """
    name = re.split(r"[/\\]", filename)[-1]
    name = "".join(ch for ch in name if ch != '"' and unicodedata.category(ch) not in ("Cc", "Cf", "Cs"))
    name = name.strip(" .") or "file"
    fallback = "".join(ch if ch.isascii() else "_" for ch in name)
    if fallback == name:
        return f'attachment; filename="{name}"'
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(name, safe='')}"
