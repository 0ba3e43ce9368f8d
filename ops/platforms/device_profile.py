"""A device profile: how long one engine step of a model takes on a device, as JSON.

The emulated platform (``emulated.py``) makes each step take the time its profile predicts; the cluster
simulator reads the same profiles. A profile is measured on this machine by ``xllm profile engine``
(``xengine/tools/profile_engine.py``) or written from published numbers. Its step-time model:

    step_s = base_ms + tokens_ms(T) + attention_ns * sum(q * (s - q)) + seq_us * sequences

- ``tokens_ms``: a piecewise-linear curve of ``[tokens, ms]`` points over the step's new tokens ``T``
  (the GEMMs, and a fresh prompt's attention over itself: flat while the step is memory-bound, growing
  once compute-bound), extended past its last point along its last segment;
- ``attention_ns``: per pair of a new token and a context token computed before the step (``q`` new
  tokens ending a context of ``s``): a decode reads its ``s - 1`` cached tokens, a prefill chunk its
  prompt's earlier chunks;
- ``seq_us``: per sequence of the step (its metadata, sampling).

Beside the step time: ``kv_bytes_per_token`` and ``transfer_gbps`` (what moving a prompt's KV between
instances costs), for planners; the emulated instance moves real (small) KV blocks instead; and
``kv_capacity_tokens``, the tokens of KV the device holds (an emulated instance's pool).

    {"name": "h20-qwen3-8b", "device": "NVIDIA H20", "model": "Qwen3-8B",
     "base_ms": 6.0, "tokens_ms": [[1, 0.0], [256, 1.0], [8192, 120.0]],
     "attention_ns": 0.02, "seq_us": 5.0, "kv_bytes_per_token": 147456, "transfer_gbps": 50.0}
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    base_ms: float
    tokens_ms: list[tuple[float, float]]  # [tokens, ms], tokens increasing
    attention_ns: float = 0.0
    seq_us: float = 0.0
    kv_bytes_per_token: int = 0
    transfer_gbps: float = 0.0
    kv_capacity_tokens: int = 65536  # the KV pool an emulated instance gets when cache.num_blocks is unset
    device: str = ""
    model: str = ""
    measured: dict[str, Any] = field(default_factory=dict)  # how it was measured (free-form)

    def __post_init__(self) -> None:
        points = [tuple(map(float, p)) for p in self.tokens_ms]
        if not points or any(len(p) != 2 for p in points):
            raise ValueError("device profile: tokens_ms must be a non-empty list of [tokens, ms] points")
        if any(b[0] <= a[0] for a, b in zip(points, points[1:])):
            raise ValueError("device profile: tokens_ms points must have increasing token counts")
        values = [
            self.base_ms,
            self.attention_ns,
            self.seq_us,
            self.transfer_gbps,
            *(v for p in points for v in p),
        ]
        if any(not math.isfinite(v) or v < 0 for v in values) or self.kv_bytes_per_token < 0:
            raise ValueError("device profile: times, sizes and bandwidths must be finite and >= 0")
        if self.kv_capacity_tokens < 1:
            raise ValueError("device profile: kv_capacity_tokens must be >= 1")
        object.__setattr__(self, "tokens_ms", points)

    def tokens_cost_ms(self, tokens: float) -> float:
        """``tokens_ms`` at ``tokens`` (linear between points, along the end segments outside them)."""
        pts = self.tokens_ms
        if len(pts) == 1:
            return pts[0][1] * tokens / pts[0][0] if pts[0][0] else pts[0][1]
        i = 1
        while i < len(pts) - 1 and tokens > pts[i][0]:
            i += 1
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return max(0.0, y0 + (y1 - y0) * (tokens - x0) / (x1 - x0))

    def step_seconds(self, query_lens: list[int], seq_lens: list[int]) -> float:
        """The predicted time of a step whose sequence ``b`` computes ``query_lens[b]`` new tokens ending a
        context of ``seq_lens[b]`` tokens."""
        tokens = sum(query_lens)
        if tokens == 0:
            return 0.0
        pairs = sum(q * max(s - q, 0) for q, s in zip(query_lens, seq_lens))
        ms = self.base_ms + self.tokens_cost_ms(tokens) + self.seq_us * len(query_lens) / 1000
        return ms / 1000 + self.attention_ns * pairs * 1e-9

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


def load_profile(path: str | Path) -> DeviceProfile:
    """The profile in ``path``; ``ValueError`` naming the file and the problem."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read device profile {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"device profile {path} must hold a JSON object")
    known = set(DeviceProfile.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"device profile {path}: unknown field(s) {unknown}; known: {sorted(known)}")
    try:
        return DeviceProfile(**data)
    except TypeError as e:  # a required field missing
        raise ValueError(f"device profile {path}: {e}") from e
    except ValueError as e:
        raise ValueError(f"{e} ({path})") from e
