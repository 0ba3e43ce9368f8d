"""Virtual memory management (VMM) primitives behind one small interface: what xTensor is built on.

Reserve a virtual range, create physical pages, map a page at an offset of a range, unmap it,
release the range. A range's unmapped parts read as zeros and never fault (CPU: the kernel's shared
zero page; accelerators: one zero-filled page mapped read-only wherever nothing else is). A physical
page may be mapped at several places at once (prefix sharing): all of them see the same bytes.

Implementations: ``ops/platforms/cpu_vmm.py`` (memfd + ``mmap(MAP_FIXED | MAP_SHARED)``),
``ops/platforms/cuda_vmm.py`` (``cuMemCreate`` / ``cuMemAddressReserve`` / ``cuMemMap``) and
``ops/platforms/npu_vmm.py`` (``aclrtMallocPhysical`` / ``aclrtReserveMemAddress`` /
``aclrtMapMem``). A platform hands out its own through ``Platform.vmm()``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class PhysicalPages:
    """``num_pages`` physical pages of ``page_bytes`` each; ``handle`` is the backend's (a memfd on CPU,
    a list of allocation handles on accelerators)."""

    num_pages: int
    page_bytes: int
    handle: Any
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class VirtualRange:
    """A reserved virtual address range ``[addr, addr + size)``."""

    addr: int
    size: int
    extra: dict[str, Any] = field(default_factory=dict)


class BaseVMM(ABC):
    """One device's VMM calls. Sizes and offsets are multiples of ``granularity``."""

    @property
    @abstractmethod
    def granularity(self) -> int:
        """The smallest page size (bytes) the device can map."""

    @abstractmethod
    def reserve(self, size: int) -> VirtualRange:
        """Reserve ``size`` bytes of virtual addresses; they read as zeros until pages are mapped."""

    @abstractmethod
    def create_pages(self, num_pages: int, page_bytes: int) -> PhysicalPages:
        """Create ``num_pages`` physical pages of ``page_bytes`` (zero-filled on first touch)."""

    @abstractmethod
    def map(
        self, vrange: VirtualRange, offset: int, pages: PhysicalPages, first: int, count: int = 1
    ) -> None:
        """Map pages ``first .. first + count - 1`` at ``vrange.addr + offset``, consecutively (read-write)."""

    @abstractmethod
    def unmap(self, vrange: VirtualRange, offset: int, size: int) -> None:
        """Unmap ``[offset, offset + size)`` of ``vrange``: it reads as zeros again."""

    @abstractmethod
    def release(self, vrange: VirtualRange) -> None:
        """Give the whole range back (its mappings go with it)."""

    @abstractmethod
    def free_pages(self, pages: PhysicalPages) -> None:
        """Free the physical pages (after every range they were mapped into was released)."""

    def mapping_budget(self) -> int | None:
        """How many more mapped regions this process may create (None: no limit worth tracking)."""
        return None

    @abstractmethod
    def tensor(self, vrange: VirtualRange, dtype: torch.dtype) -> torch.Tensor:
        """A flat ``dtype`` tensor over the whole range (no copy; valid until ``release``)."""
