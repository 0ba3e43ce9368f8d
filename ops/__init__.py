"""Operator facades (one module per op family) dispatched per platform through ``ops.registry``.

``ops/platforms`` is the only place that names a device; ``ops/torch_ref`` is the pure-torch
backend used on CPU and as the fallback/test oracle everywhere else.
"""
