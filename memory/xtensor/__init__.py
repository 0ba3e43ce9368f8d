"""xTensor: virtually contiguous, physically paged KV memory (see ``layout.py``)."""

from memory.xtensor.layout import XTensorKVLayout
from memory.xtensor.pages import PageState, XTensorStats

__all__ = ["PageState", "XTensorKVLayout", "XTensorStats"]
