"""Why an engine could not serve a request: the errors every engine backend raises (``protocol.py``).

The HTTP layer maps them to 503s and the cluster pool migrates requests on them (``docs/operations.md``).
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine process is gone; the request cannot complete."""


class EngineRequestLostError(EngineDeadError):
    """The engine is alive but stopped serving this request unasked (an abort nobody requested, or
    an output stream lost); like a dead engine, the request can migrate or fail with an error."""


class EngineStartupError(RuntimeError):
    """The engine process failed to become ready (the message carries its stderr tail)."""
