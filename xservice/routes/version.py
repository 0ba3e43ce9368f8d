"""``GET /version``: the server's version, from the installed package's metadata (as vLLM's route)."""

from __future__ import annotations

from functools import cache
from importlib import metadata

from fastapi import APIRouter

router = APIRouter()

UNKNOWN = "0+unknown"  # running from a source tree that was never installed


@cache
def package_version() -> str:
    try:
        return metadata.version("xllm")
    except metadata.PackageNotFoundError:
        return UNKNOWN


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": package_version()}
