"""Ascend NPU VMM through ``ctypes`` on ``libascendcl`` (loaded lazily: importing this module needs no CANN).

``aclrtReserveMemAddress`` reserves a range, ``aclrtMallocPhysical`` creates one physical page per
call, ``aclrtMapMem`` maps it, ``aclrtUnmapMem`` / ``aclrtFreePhysical`` / ``aclrtReleaseMemAddress``
undo them. As on CUDA, a shared zero page is mapped wherever nothing else is, so reads never fault.

Status: written against the CANN ``aclrt`` VMM API; not yet run on an NPU. ``tensor()`` needs a way to
wrap raw NPU memory as a torch tensor (``torch_npu``), which this module does not provide yet.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from ops.platforms.vmm import BaseVMM, PhysicalPages, VirtualRange

_ACL_MEM_ALLOCATION_TYPE_PINNED = 0
_ACL_HBM_MEM_HUGE = 4
_ACL_MEM_LOCATION_TYPE_DEVICE = 1
_ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class _Location(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint32), ("type", ctypes.c_int)]


class _PhysicalMemProp(ctypes.Structure):
    _fields_ = [
        ("handleType", ctypes.c_int),
        ("allocationType", ctypes.c_int),
        ("memAttr", ctypes.c_int),
        ("location", _Location),
        ("reserve", ctypes.c_uint64),
    ]


def _acl() -> Any:
    try:
        return ctypes.CDLL("libascendcl.so")
    except OSError as e:
        raise RuntimeError("xTensor on NPU needs CANN's libascendcl.so on the library path") from e


class NpuVMM(BaseVMM):
    def __init__(self, device_index: int = 0) -> None:
        self._acl = _acl()
        prop = _PhysicalMemProp()
        prop.allocationType = _ACL_MEM_ALLOCATION_TYPE_PINNED
        prop.memAttr = _ACL_HBM_MEM_HUGE
        prop.location.id = device_index
        prop.location.type = _ACL_MEM_LOCATION_TYPE_DEVICE
        self._prop = prop
        gran = ctypes.c_size_t()
        self._call(
            "aclrtMemGetAllocationGranularity",
            ctypes.byref(prop),
            _ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM,
            ctypes.byref(gran),
        )
        self._granularity = int(gran.value)
        self._zero: ctypes.c_void_p | None = None
        self._mapped: dict[int, int] = {}  # mapped address -> size (aclrtUnmapMem takes the start only)

    def _call(self, name: str, *args: Any) -> None:
        ret = getattr(self._acl, name)(*args)
        if ret != 0:
            raise RuntimeError(f"{name} failed with ACL error {ret}")

    @property
    def granularity(self) -> int:
        return self._granularity

    def _new_page(self, size: int) -> ctypes.c_void_p:
        handle = ctypes.c_void_p()
        self._call(
            "aclrtMallocPhysical", ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(self._prop), 0
        )
        return handle

    def _map_one(self, addr: int, size: int, handle: ctypes.c_void_p) -> None:
        if addr in self._mapped:
            self._call("aclrtUnmapMem", ctypes.c_void_p(addr))
        self._call("aclrtMapMem", ctypes.c_void_p(addr), ctypes.c_size_t(size), ctypes.c_size_t(0), handle, 0)
        self._mapped[addr] = size

    def reserve(self, size: int) -> VirtualRange:
        ptr = ctypes.c_void_p()
        self._call("aclrtReserveMemAddress", ctypes.byref(ptr), ctypes.c_size_t(size), 0, None, 0)
        vrange = VirtualRange(int(ptr.value or 0), size)
        self.unmap(vrange, 0, size)
        return vrange

    def create_pages(self, num_pages: int, page_bytes: int) -> PhysicalPages:
        if page_bytes % self._granularity:
            raise ValueError(
                f"page size {page_bytes} is not a multiple of the granularity {self._granularity}"
            )
        return PhysicalPages(num_pages, page_bytes, [self._new_page(page_bytes) for _ in range(num_pages)])

    def map(
        self, vrange: VirtualRange, offset: int, pages: PhysicalPages, first: int, count: int = 1
    ) -> None:
        pb = pages.page_bytes
        for i in range(count):
            addr = vrange.addr + offset + i * pb
            for g in range(0, pb, self._granularity):
                if g and addr + g in self._mapped:
                    self._call("aclrtUnmapMem", ctypes.c_void_p(addr + g))
                    del self._mapped[addr + g]
            self._map_one(addr, pb, pages.handle[first + i])

    def unmap(self, vrange: VirtualRange, offset: int, size: int) -> None:
        if self._zero is None:
            self._zero = self._new_page(self._granularity)  # CANN zero-fills new physical memory
        for off in range(offset, offset + size, self._granularity):
            self._map_one(vrange.addr + off, self._granularity, self._zero)

    def release(self, vrange: VirtualRange) -> None:
        for addr in [a for a in self._mapped if vrange.addr <= a < vrange.addr + vrange.size]:
            self._call("aclrtUnmapMem", ctypes.c_void_p(addr))
            del self._mapped[addr]
        self._call("aclrtReleaseMemAddress", ctypes.c_void_p(vrange.addr))

    def free_pages(self, pages: PhysicalPages) -> None:
        for handle in pages.handle:
            self._call("aclrtFreePhysical", handle)

    def tensor(self, vrange: VirtualRange, dtype: torch.dtype) -> torch.Tensor:
        raise RuntimeError(
            "wrapping raw NPU memory as a torch tensor is not implemented yet; use --kv-layout paged on NPU"
        )
