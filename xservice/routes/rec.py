"""``/v1/rec/catalogs`` (register, list) and ``/v1/rec/generate`` (generative recommendation)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from xservice.rec.catalogs import CatalogDirectory, as_object, get_directory
from xservice.rec.protocol import (
    CatalogCreateRequest,
    CatalogList,
    CatalogObject,
    RecGenerateRequest,
    RecGenerateResponse,
)
from xservice.rec.serving import rec_generate
from xservice.routes.body_route import BodyRoute
from xservice.routes.error_responses import GENERATION_ERRORS, errors
from xservice.serving.context import ServingContext, get_ctx

router = APIRouter(route_class=BodyRoute)


@router.post("/v1/rec/catalogs", response_model=CatalogObject, responses=errors(503))
async def create_catalog(
    body: CatalogCreateRequest,
    ctx: ServingContext = Depends(get_ctx),
    directory: CatalogDirectory = Depends(get_directory),
) -> CatalogObject:
    ctx.check_engine()
    return as_object(await directory.register(ctx.engine_client, body.name, body.items))


@router.get("/v1/rec/catalogs", response_model=CatalogList, responses=errors(503))
async def list_catalogs(
    ctx: ServingContext = Depends(get_ctx), directory: CatalogDirectory = Depends(get_directory)
) -> CatalogList:
    ctx.check_engine()
    return CatalogList(data=[as_object(i) for i in await directory.refresh(ctx.engine_client)])


@router.post("/v1/rec/generate", response_model=RecGenerateResponse, responses=errors(*GENERATION_ERRORS))
async def generate(
    body: RecGenerateRequest,
    request: Request,
    ctx: ServingContext = Depends(get_ctx),
    directory: CatalogDirectory = Depends(get_directory),
) -> RecGenerateResponse:
    return await rec_generate(ctx, directory, body, request)
