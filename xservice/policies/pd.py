"""PD pairing: pick a (prefill, decode) pair for a request from snapshots (no I/O, deterministic).

- prefill: the least-loaded ``prefill`` instance (load, then KV usage, then name). Prefill time
  dominates there, and the decode side is where the prompt's KV has to live.
- decode: ``cache_aware`` over the ``decode`` instances: a decode instance already holding the
  prompt's leading blocks transfers fewer of them; ties to the lower load, then the name.

``None`` for a side that has no candidate: the caller then runs the request without PD (no
prefill instance: the whole request on a decode instance; no decode instance: on a prefill one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from xservice.policies.routing import CacheAwarePolicy, InstanceSnapshot, LeastLoadPolicy, RouteRequest

PREFILL_ROLE = "prefill"
DECODE_ROLE = "decode"


@dataclass(frozen=True)
class PDPair:
    prefill: str | None
    decode: str | None


class PDPolicy:
    name = "pd"

    def __init__(self, match_weight: float = 2.0) -> None:
        self._prefill = LeastLoadPolicy()
        self._decode = CacheAwarePolicy(match_weight)

    def select_prefill(self, candidates: Sequence[InstanceSnapshot]) -> str | None:
        prefills = [c for c in candidates if c.role == PREFILL_ROLE]
        return self._prefill.select(RouteRequest(), prefills) if prefills else None

    def select_decode(self, request: RouteRequest, candidates: Sequence[InstanceSnapshot]) -> str | None:
        decodes = [c for c in candidates if c.role == DECODE_ROLE]
        return self._decode.select(request, decodes) if decodes else None

    def select(self, request: RouteRequest, candidates: Sequence[InstanceSnapshot]) -> PDPair:
        return PDPair(self.select_prefill(candidates), self.select_decode(request, candidates))
