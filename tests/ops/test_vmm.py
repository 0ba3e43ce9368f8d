"""VMM primitives (``ops/platforms``): reserve, create pages, map, unmap, release.

CPU runs everywhere; the CUDA variant needs a GPU (``-m cuda``), the NPU one an Ascend device.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ops.platforms import resolve_platform


def _check_vmm(vmm, device: str) -> None:
    page = max(vmm.granularity, 4096)
    vrange = vmm.reserve(8 * page)
    pages = vmm.create_pages(4, page)
    try:
        view = vmm.tensor(vrange, torch.float32)
        per_page = page // 4
        assert view.numel() == 8 * per_page
        assert torch.count_nonzero(view).item() == 0  # unmapped: zeros, no fault
        vmm.map(vrange, 0, pages, 2)  # page 2 at offset 0
        vmm.map(vrange, 5 * page, pages, 2)  # and again at offset 5 pages: one physical page, two places
        view[:per_page] = 3.0
        assert torch.all(
            view[5 * per_page : 6 * per_page] == 3.0
        )  # written through one, read through the other
        vmm.map(vrange, page, pages, 0, count=2)  # two consecutive pages at once
        view[per_page : 3 * per_page] = 1.0
        vmm.unmap(vrange, 0, page)
        assert torch.count_nonzero(view[:per_page]).item() == 0  # unmapped again: zeros
        assert torch.all(view[5 * per_page : 6 * per_page] == 3.0)  # the page itself kept its bytes
        vmm.map(vrange, 7 * page, pages, 1)
        assert torch.all(view[7 * per_page :] == 1.0)  # page 1, written through offset 2 pages
    finally:
        vmm.release(vrange)
        vmm.free_pages(pages)


def test_cpu_vmm() -> None:
    _check_vmm(resolve_platform("cpu").vmm(), "cpu")


def test_cpu_vmm_refuses_unaligned_sizes() -> None:
    vmm = resolve_platform("cpu").vmm()
    with pytest.raises(ValueError, match="multiple of the page size"):
        vmm.reserve(vmm.granularity + 1)
    with pytest.raises(ValueError, match="multiple of the page size"):
        vmm.create_pages(1, 1000)


def test_cpu_vmm_reports_a_mapping_budget() -> None:
    """On Linux the budget follows ``vm.max_map_count`` and shrinks as this process maps regions."""
    vmm = resolve_platform("cpu").vmm()
    limit = int(Path("/proc/sys/vm/max_map_count").read_text())
    before = vmm.mapping_budget()
    assert before is not None and 1000 < before < limit * 4 // 5 // 2
    page = max(vmm.granularity, 4096)
    vrange = vmm.reserve(64 * page)
    pages = vmm.create_pages(32, page)
    try:
        for i in range(32):  # every other page: 32 separate regions, each splitting the reserved one
            vmm.map(vrange, 2 * i * page, pages, i)
        assert vmm.mapping_budget() <= before - 16  # ~32 less; margin for the process's own maps
    finally:
        vmm.release(vrange)
        vmm.free_pages(pages)


def test_accelerator_vmm_modules_import_without_a_device() -> None:
    import ops.platforms.cuda_vmm  # noqa: F401
    import ops.platforms.npu_vmm  # noqa: F401


@pytest.mark.cuda
def test_cuda_vmm() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _check_vmm(resolve_platform("cuda").vmm(), "cuda")
