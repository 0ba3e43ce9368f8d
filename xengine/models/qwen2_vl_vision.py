"""The vision towers of Qwen2-VL and Qwen2.5-VL: patches -> image embeddings in the LM's width.

Patch embedding (a 3D convolution whose stride equals its kernel, so one matmul over flattened
patches), transformer blocks with 2D rotary positions (a patch's row and column rotate halves of each
head) and bidirectional attention within each image (Qwen2.5-VL: within windows of merged cells except
on ``fullatt_block_indexes``), then the patch merger (each ``merge x merge`` block of patches -> one
LM token). Qwen2-VL blocks use LayerNorm and a plain MLP; Qwen2.5-VL blocks RMSNorm and a gated MLP.
Runs eagerly (image shapes vary); the runner calls it once per image, not per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ops.rope import rotary_embedding
from xengine.layers.linear import Linear, MergedLinear
from xengine.layers.norm import RMSNorm

Grid = tuple[int, int, int]


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS = {
    "quick_gelu": _quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


@dataclass(frozen=True)
class VisionConfig:
    windowed: bool  # Qwen2.5-VL: window attention, RMSNorm, gated MLP
    depth: int
    dim: int  # width of the blocks
    num_heads: int
    mlp_dim: int
    out_dim: int  # the language model's hidden size
    hidden_act: str
    patch_size: int
    temporal_patch_size: int
    in_channels: int
    merge_size: int
    rope_theta: float
    window_size: int = 0  # pixels
    fullatt_block_indexes: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, v: dict[str, Any], windowed: bool, text_hidden_size: int) -> VisionConfig:
        rope = v.get("rope_parameters") or {}
        if windowed:
            dim, mlp_dim, out_dim = (
                int(v["hidden_size"]),
                int(v["intermediate_size"]),
                int(v["out_hidden_size"]),
            )
        else:
            dim = int(v["embed_dim"])
            mlp_dim, out_dim = int(dim * v.get("mlp_ratio", 4)), int(v.get("hidden_size", text_hidden_size))
        act = v.get("hidden_act", "silu" if windowed else "quick_gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"unsupported vision hidden_act {act!r}; supported: {sorted(_ACTIVATIONS)}")
        return cls(
            windowed=windowed,
            depth=int(v["depth"]),
            dim=dim,
            num_heads=int(v["num_heads"]),
            mlp_dim=mlp_dim,
            out_dim=out_dim,
            hidden_act=act,
            patch_size=int(v.get("patch_size", 14)),
            temporal_patch_size=int(v.get("temporal_patch_size", 2)),
            in_channels=int(v.get("in_channels", 3)),
            merge_size=int(v.get("spatial_merge_size", 2)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            window_size=int(v.get("window_size", 0)),
            fullatt_block_indexes=tuple(v.get("fullatt_block_indexes", ())),
        )


class PatchProjection(nn.Module):
    """The Conv3d patch embedding as a matmul: its weight keeps the checkpoint's conv shape."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.weight = nn.Parameter(torch.empty(cfg.dim, cfg.in_channels, *kernel))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return F.linear(patches.to(self.weight.dtype), self.weight.reshape(self.weight.shape[0], -1))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.proj = PatchProjection(cfg)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.dim // cfg.num_heads
        self.qkv = Linear(cfg.dim, 3 * cfg.dim, bias=True)
        self.proj = Linear(cfg.dim, cfg.dim, bias=True)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], rope: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = rotary_embedding(torch.arange(n, device=x.device), q, k, rope)
        out = torch.empty_like(q)
        for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):  # attention within each segment only
            qs, ks, vs = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            out[start:end] = F.scaled_dot_product_attention(qs, ks, vs)[0].transpose(0, 1)
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    """Qwen2-VL: ``fc2(act(fc1(x)))``."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc1 = Linear(cfg.dim, cfg.mlp_dim, bias=True)
        self.fc2 = Linear(cfg.mlp_dim, cfg.dim, bias=True)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GatedVisionMLP(nn.Module):
    """Qwen2.5-VL: ``down(act(gate(x)) * up(x))``, with biases."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(cfg.dim, [cfg.mlp_dim, cfg.mlp_dim], bias=True)
        self.down_proj = Linear(cfg.mlp_dim, cfg.dim, bias=True)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(self.act(gate) * up)


def _norm(cfg: VisionConfig, dim: int) -> nn.Module:
    return RMSNorm(dim, 1e-6) if cfg.windowed else nn.LayerNorm(dim, eps=1e-6)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1, self.norm2 = _norm(cfg, cfg.dim), _norm(cfg, cfg.dim)
        self.attn = VisionAttention(cfg)
        self.mlp = GatedVisionMLP(cfg) if cfg.windowed else VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, rope)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.merged_dim = cfg.dim * cfg.merge_size**2
        self.ln_q = _norm(cfg, cfg.dim)
        self.mlp = nn.Sequential(
            Linear(self.merged_dim, self.merged_dim, bias=True),
            nn.GELU(),
            Linear(self.merged_dim, cfg.out_dim, bias=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.merged_dim))


class VisionTransformer(nn.Module):
    """``forward(patches [N, patch_dim], grids) -> [N / merge**2, out_dim]``, images in ``grids`` order."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        half = cfg.dim // cfg.num_heads // 2
        # per axis head_dim / 4 frequencies; numpy, as the model is built on the meta device
        self._inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, half, 2, dtype=np.float32) / np.float32(half))

    def forward(self, patches: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        cfg = self.config
        x = self.patch_embed(patches)
        rope = self._rope(grids, x.device)
        full = _frame_seqlens(grids)
        order = None
        if cfg.windowed:  # regroup merge blocks window by window; positions travel with them
            order_np, windows = _window_order(
                grids, cfg.merge_size, cfg.window_size // cfg.merge_size // cfg.patch_size
            )
            order = torch.from_numpy(order_np).to(x.device)
            unit = cfg.merge_size**2
            x = x.view(-1, unit, x.shape[-1])[order].reshape(x.shape)
            rope = rope.view(-1, unit, rope.shape[-1])[order].reshape(rope.shape)
        for i, block in enumerate(self.blocks):
            segments = full if order is None or i in cfg.fullatt_block_indexes else windows
            x = block(x, segments, rope)
        out = self.merger(x)
        if order is not None:
            out = out[torch.argsort(order)]
        return out

    def _rope(self, grids: Sequence[Grid], device: torch.device) -> torch.Tensor:
        """Per patch ``[cos | sin]`` of its (row, column) angles: ``[N, head_dim]`` float32."""
        rows, cols = _patch_coords(grids, self.config.merge_size)
        inv = torch.from_numpy(self._inv_freq.astype(np.float32))
        angles = torch.cat([torch.outer(rows, inv), torch.outer(cols, inv)], dim=-1)
        return torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)


def _patch_coords(grids: Sequence[Grid], merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of every patch, patches in merge-block order (as the preprocessor lays them)."""
    rows, cols = [], []
    for t, h, w in grids:
        r, c = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        r = r.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        c = c.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        rows.append(np.tile(r, t))
        cols.append(np.tile(c, t))
    return (torch.from_numpy(np.concatenate(rows)).float(), torch.from_numpy(np.concatenate(cols)).float())


def _frame_seqlens(grids: Sequence[Grid]) -> list[int]:
    """Cumulative patch counts of every frame of every image (full attention spans one frame)."""
    cu = [0]
    for t, h, w in grids:
        for _ in range(t):
            cu.append(cu[-1] + h * w)
    return cu


def _window_order(grids: Sequence[Grid], merge: int, window: int) -> tuple[np.ndarray, list[int]]:
    """Merge blocks regrouped window by window (``window x window`` blocks, row-major windows, blocks
    row-major inside each), and the cumulative patch counts of the windows."""
    order: list[np.ndarray] = []
    cu = [0]
    base = 0
    unit = merge * merge
    for t, h, w in grids:
        lh, lw = h // merge, w // merge
        index = np.arange(t * lh * lw).reshape(t, lh, lw) + base
        for frame in index:
            for r0 in range(0, lh, window):
                for c0 in range(0, lw, window):
                    cells = frame[r0 : r0 + window, c0 : c0 + window].reshape(-1)
                    order.append(cells)
                    cu.append(cu[-1] + cells.size * unit)
        base += t * lh * lw
    return np.concatenate(order), cu
