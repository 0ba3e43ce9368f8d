"""OpenAI Batches API: create, list, retrieve, cancel (the work is done by ``xservice.batch``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query

from xservice.batch.lines import ENDPOINTS
from xservice.batch.service import BatchService, found_or_404, get_batch_service, list_page
from xservice.http.errors import InvalidRequestError, NotFoundError
from xservice.protocol.request_model import RequestModel

router = APIRouter()

COMPLETION_WINDOWS = {"24h": 24 * 3600}
MAX_METADATA_KEYS = 16


class CreateBatchRequest(RequestModel):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


@router.post("/v1/batches")
async def create_batch(
    body: CreateBatchRequest, batch: BatchService = Depends(get_batch_service)
) -> dict[str, Any]:
    if body.endpoint not in ENDPOINTS:
        raise InvalidRequestError(
            f"'endpoint' must be one of {sorted(ENDPOINTS)}, got {body.endpoint!r}.", param="endpoint"
        )
    if body.completion_window not in COMPLETION_WINDOWS:
        raise InvalidRequestError(
            f"'completion_window' must be one of {sorted(COMPLETION_WINDOWS)}, got {body.completion_window!r}.",
            param="completion_window",
        )
    if body.metadata is not None and len(body.metadata) > MAX_METADATA_KEYS:
        raise InvalidRequestError(f"At most {MAX_METADATA_KEYS} metadata keys.", param="metadata")
    file = batch.store.get_file(body.input_file_id)
    if file is None:
        raise NotFoundError(f"No such file: '{body.input_file_id}'.", param="input_file_id")
    if file["purpose"] != "batch":
        raise InvalidRequestError(
            f"File '{body.input_file_id}' has purpose {file['purpose']!r}, not 'batch'.",
            param="input_file_id",
        )
    window_s = COMPLETION_WINDOWS[body.completion_window]
    obj = batch.store.create_batch(
        body.input_file_id, body.endpoint, body.completion_window, window_s, body.metadata
    )
    batch.wake()
    return obj


@router.get("/v1/batches")
async def list_batches(
    limit: int = Query(20, ge=1, le=100),
    after: str | None = None,
    batch: BatchService = Depends(get_batch_service),
) -> dict[str, Any]:
    data, has_more = batch.store.list_batches(limit, after)
    return list_page(data, has_more)


def _batch(batch: BatchService, batch_id: str) -> dict[str, Any]:
    return found_or_404(batch.store.get_batch(batch_id), "batch", "batch_id", batch_id)


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, batch: BatchService = Depends(get_batch_service)) -> dict[str, Any]:
    return _batch(batch, batch_id)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, batch: BatchService = Depends(get_batch_service)) -> dict[str, Any]:
    status = _batch(batch, batch_id)["status"]
    if status in ("validating", "in_progress"):
        batch.store.set_status(batch_id, "cancelling", only_from=("validating", "in_progress"))
        batch.wake()
    elif status not in ("cancelling", "cancelled"):
        raise InvalidRequestError(f"Cannot cancel a batch with status '{status}'.", param="batch_id")
    return _batch(batch, batch_id)
