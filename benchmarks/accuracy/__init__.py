"""Helpers of ``benchmarks/dtype_accuracy.py``: the reduced-precision modes it runs (``modes.py``) and how
their logits are scored against HF float32's (``metrics.py``)."""
