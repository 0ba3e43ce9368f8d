"""CUDA VMM through the driver API (``cuda-bindings``, imported lazily: importing this module needs no GPU).

Physical pages are ``cuMemCreate`` allocations (the driver maps a handle only from offset 0, so one
handle per page), ranges come from ``cuMemAddressReserve`` and pages are mapped with ``cuMemMap`` +
``cuMemSetAccess``. Unmapped parts of a range must never fault: at reserve time one zero-filled page is
mapped read-only into every page of the range (as kvcached does), and ``unmap`` puts it back.

Driver calls need a current context on the calling thread, which the runtime (torch) does not set
for driver calls it never made: every public method makes the device's primary context current
first (``cuCtxSetCurrent``, a thread-local pointer swap). Checked on an H100 by ``tests/ops/test_vmm.py``
(``-m cuda``).
"""

from __future__ import annotations

from typing import Any

import torch

from ops.platforms.vmm import BaseVMM, PhysicalPages, VirtualRange


def _driver() -> Any:
    try:
        from cuda.bindings import driver  # cuda-bindings >= 12.6
    except ImportError:
        try:
            from cuda import cuda as driver  # older cuda-python
        except ImportError as e:
            raise RuntimeError(
                "xTensor on CUDA needs the CUDA driver bindings: pip install cuda-bindings"
            ) from e
    return driver


def _ok(result: Any) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return rest[0] if len(rest) == 1 else rest


class _CudaArray:
    """Just enough of ``__cuda_array_interface__`` for ``torch.as_tensor`` to wrap raw device memory."""

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


class CudaVMM(BaseVMM):
    def __init__(self, device_index: int = 0) -> None:
        torch.cuda.init()
        self._cu = _driver()
        self._device = device_index
        cu = self._cu
        # the device's primary context (the one torch uses), made current by ``_current`` on each call
        self._ctx = _ok(cu.cuDevicePrimaryCtxRetain(_ok(cu.cuDeviceGet(device_index))))
        self._current()
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device_index
        self._prop = prop
        flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        self._granularity = int(_ok(cu.cuMemGetAllocationGranularity(prop, flag)))
        self._zero: Any = None  # the shared zero page (created on first reserve)

    @property
    def granularity(self) -> int:
        return self._granularity

    def _current(self) -> None:
        _ok(self._cu.cuCtxSetCurrent(self._ctx))

    def _access(self, ptr: int, size: int, writable: bool) -> None:
        cu = self._cu
        desc = cu.CUmemAccessDesc()
        desc.location = self._prop.location
        desc.flags = (
            cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            if writable
            else cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
        )
        _ok(cu.cuMemSetAccess(ptr, size, [desc], 1))

    def _zero_page(self) -> Any:
        if self._zero is None:
            cu, g = self._cu, self._granularity
            handle = _ok(cu.cuMemCreate(g, self._prop, 0))
            ptr = int(_ok(cu.cuMemAddressReserve(g, 0, 0, 0)))
            _ok(cu.cuMemMap(ptr, g, 0, handle, 0))
            self._access(ptr, g, True)
            _ok(cu.cuMemsetD8(ptr, 0, g))
            _ok(cu.cuMemUnmap(ptr, g))
            _ok(cu.cuMemAddressFree(ptr, g))
            self._zero = handle
        return self._zero

    def reserve(self, size: int) -> VirtualRange:
        self._current()
        if size % self._granularity:
            raise ValueError(f"{size} is not a multiple of the granularity {self._granularity}")
        ptr = int(_ok(self._cu.cuMemAddressReserve(size, self._granularity, 0, 0)))
        vrange = VirtualRange(ptr, size)
        self.unmap(vrange, 0, size)
        return vrange

    def create_pages(self, num_pages: int, page_bytes: int) -> PhysicalPages:
        self._current()
        if page_bytes % self._granularity:
            raise ValueError(
                f"page size {page_bytes} is not a multiple of the granularity {self._granularity}"
            )
        handles = [_ok(self._cu.cuMemCreate(page_bytes, self._prop, 0)) for _ in range(num_pages)]
        return PhysicalPages(num_pages, page_bytes, handles)

    def map(
        self, vrange: VirtualRange, offset: int, pages: PhysicalPages, first: int, count: int = 1
    ) -> None:
        self._current()
        cu, pb = self._cu, pages.page_bytes
        for i in range(count):
            ptr = vrange.addr + offset + i * pb
            for g in range(0, pb, self._granularity):  # take the zero page(s) out first
                _ok(cu.cuMemUnmap(ptr + g, self._granularity))
            _ok(cu.cuMemMap(ptr, pb, 0, pages.handle[first + i], 0))
            self._access(ptr, pb, True)

    def unmap(self, vrange: VirtualRange, offset: int, size: int) -> None:
        self._current()
        cu, g = self._cu, self._granularity
        zero = self._zero_page()
        for off in range(offset, offset + size, g):
            ptr = vrange.addr + off
            cu.cuMemUnmap(ptr, g)  # may hold a page or nothing yet: both fine
            _ok(cu.cuMemMap(ptr, g, 0, zero, 0))
            self._access(ptr, g, False)

    def release(self, vrange: VirtualRange) -> None:
        self._current()
        _ok(self._cu.cuMemUnmap(vrange.addr, vrange.size))
        _ok(self._cu.cuMemAddressFree(vrange.addr, vrange.size))

    def free_pages(self, pages: PhysicalPages) -> None:
        self._current()
        for handle in pages.handle:
            _ok(self._cu.cuMemRelease(handle))

    def tensor(self, vrange: VirtualRange, dtype: torch.dtype) -> torch.Tensor:
        raw = torch.as_tensor(_CudaArray(vrange.addr, vrange.size), device=f"cuda:{self._device}")
        return raw.view(dtype)
