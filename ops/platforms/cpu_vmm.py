"""CPU VMM: physical pages are a ``memfd``; mapping is ``mmap(MAP_FIXED | MAP_SHARED)`` into a range
reserved with an anonymous read-only ``MAP_NORESERVE`` mapping, so unmapped parts read the kernel's
shared zero page (no memory, never a fault) and memory follows the pages actually touched.

libc is reached through ``ctypes`` (which releases the GIL around each call). Writing to an unmapped
part of a range faults: callers write only through mapped pages.

Lifetimes: a reserved range is unmapped, and a page pool's memfd closed, when ``release`` /
``free_pages`` is called or, failing that, once nothing refers to them any more (neither the
``VirtualRange`` / ``PhysicalPages`` nor a tensor made by ``tensor``, which keeps its range alive).
An engine dropped without an explicit close so gives back its mappings: without this, each one
left behind counted against ``vm.max_map_count`` for the rest of the process.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref

import torch

from ops.platforms.vmm import BaseVMM, PhysicalPages, VirtualRange

_PROT_READ, _PROT_WRITE = mmap.PROT_READ, mmap.PROT_WRITE
_MAP_SHARED, _MAP_PRIVATE = mmap.MAP_SHARED, mmap.MAP_PRIVATE
_MAP_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", 0x20)
_MAP_FIXED = 0x10
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


class CpuVMM(BaseVMM):
    def __init__(self) -> None:
        self._libc = _libc()
        self._page = mmap.PAGESIZE

    @property
    def granularity(self) -> int:
        return self._page

    def _mmap(self, addr: int | None, size: int, prot: int, flags: int, fd: int, offset: int) -> int:
        out = self._libc.mmap(addr, size, prot, flags, fd, offset)
        if out is None or out == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
        return out

    def _check(self, *sizes: int) -> None:
        for s in sizes:
            if s % self._page:
                raise ValueError(f"{s} is not a multiple of the page size {self._page}")

    def reserve(self, size: int) -> VirtualRange:
        self._check(size)
        flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE
        vrange = VirtualRange(self._mmap(None, size, _PROT_READ, flags, -1, 0), size)
        vrange.extra["release"] = weakref.finalize(vrange, _munmap, self._libc, vrange.addr, size)
        return vrange

    def create_pages(self, num_pages: int, page_bytes: int) -> PhysicalPages:
        self._check(page_bytes)
        fd = os.memfd_create("xllm-kv", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, num_pages * page_bytes)  # sparse: memory is taken page by page on first touch
        except OSError:
            os.close(fd)
            raise
        pages = PhysicalPages(num_pages, page_bytes, fd)
        pages.extra["free"] = weakref.finalize(pages, os.close, fd)  # mappings keep the memory alive
        return pages

    def map(
        self, vrange: VirtualRange, offset: int, pages: PhysicalPages, first: int, count: int = 1
    ) -> None:
        size = count * pages.page_bytes
        self._bounds(vrange, offset, size)
        if not (0 <= first and first + count <= pages.num_pages):
            raise ValueError(f"pages {first}..{first + count - 1} outside 0..{pages.num_pages - 1}")
        flags = _MAP_SHARED | _MAP_FIXED
        self._mmap(
            vrange.addr + offset,
            size,
            _PROT_READ | _PROT_WRITE,
            flags,
            pages.handle,
            first * pages.page_bytes,
        )

    def unmap(self, vrange: VirtualRange, offset: int, size: int) -> None:
        self._bounds(vrange, offset, size)
        flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE
        self._mmap(vrange.addr + offset, size, _PROT_READ, flags, -1, 0)

    def release(self, vrange: VirtualRange) -> None:
        vrange.extra["release"]()  # once: a later collection of ``vrange`` does nothing

    def free_pages(self, pages: PhysicalPages) -> None:
        pages.extra["free"]()

    def mapping_budget(self) -> int | None:
        """Regions left under ``vm.max_map_count`` (each mapped region can split a reserved one in
        two), keeping a fifth of the limit for everything else the process maps."""
        try:
            with open("/proc/sys/vm/max_map_count") as f:
                limit = int(f.read())
            with open("/proc/self/maps") as f:
                in_use = sum(1 for _ in f)
        except (OSError, ValueError):
            return None
        return max(0, (limit * 4 // 5 - in_use) // 2)

    def tensor(self, vrange: VirtualRange, dtype: torch.dtype) -> torch.Tensor:
        buf = (ctypes.c_char * vrange.size).from_address(vrange.addr)
        buf._xllm_range = vrange  # the range outlives every tensor over it (see the module docstring)
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype)

    def _bounds(self, vrange: VirtualRange, offset: int, size: int) -> None:
        self._check(offset, size)
        if not (0 <= offset and offset + size <= vrange.size):
            raise ValueError(f"[{offset}, {offset + size}) outside the reserved range of {vrange.size} bytes")


def _munmap(libc: ctypes.CDLL, addr: int, size: int) -> None:
    if libc.munmap(addr, size) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"munmap failed: {os.strerror(err)}")
