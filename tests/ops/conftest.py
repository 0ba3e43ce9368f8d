"""Fixtures shared by the op tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(params=[1, 2])
def threads(request):
    """Run the test with 1 and with 2 torch threads (the kernels' threaded paths included)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
