"""The service's view of the engine's item catalogs (cached; the engine is the source of truth)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Request

from xengine.api.messages import CatalogInfo
from xservice.http.errors import EngineUnavailableError, NotFoundError, from_value_error
from xservice.rec.protocol import CatalogObject

if TYPE_CHECKING:
    from xservice.engine.protocol import EngineBackend


class CatalogNotFoundError(NotFoundError):
    default_code = "catalog_not_found"


class CatalogDirectory:
    """Catalog infos by name; a miss asks the engine before answering 404."""

    def __init__(self) -> None:
        self._infos: dict[str, CatalogInfo] = {}

    async def register(self, client: EngineBackend, name: str, items: list[list[int]]) -> CatalogInfo:
        try:
            info = await client.register_catalog(name, items)
        except ValueError as exc:
            raise from_value_error(exc) from None
        except TimeoutError:
            raise EngineUnavailableError(
                "The engine did not answer the catalog registration in time."
            ) from None
        self._infos[name] = info
        return info

    async def refresh(self, client: EngineBackend) -> list[CatalogInfo]:
        infos = await client.list_catalogs()
        self._infos = {i.name: i for i in infos}
        return infos

    async def get(self, client: EngineBackend, name: str) -> CatalogInfo:
        info = self._infos.get(name)
        if info is None:
            info = {i.name: i for i in await self.refresh(client)}.get(name)
        if info is None:
            raise not_found(name)
        return info

    def forget(self, name: str) -> None:
        self._infos.pop(name, None)


def not_found(name: str) -> CatalogNotFoundError:
    return CatalogNotFoundError(f"The catalog '{name}' does not exist.", param="catalog")


def as_object(info: CatalogInfo) -> CatalogObject:
    return CatalogObject(name=info.name, num_items=info.num_items, item_len=info.item_len)


def get_directory(request: Request) -> CatalogDirectory:
    """FastAPI dependency: the app's catalog directory (created on first use)."""
    directory = getattr(request.app.state, "rec_catalogs", None)
    if directory is None:
        directory = request.app.state.rec_catalogs = CatalogDirectory()
    return directory
