"""Qwen3-Next's gated DeltaNet token mixer (HF ``Qwen3NextGatedDeltaNet``): linear attention with a
fixed-size state per sequence.

Per token: ``in_proj_qkvz`` gives q, k, v and the output gate z, ``in_proj_ba`` the write strength
``beta = sigmoid(b)`` and the decay ``g = -exp(A_log) * softplus(a + dt_bias)``. Checkpoints lay both
projections out grouped by key head (``[q | k | v_group | z_group]`` and ``[b_group | a_group]`` per key
head); the layer regroups them per kind. q|k|v then go through a depthwise causal convolution (SiLU)
and the gated delta rule (``ops/gated_delta.py``), both carrying state across steps; the output is
RMS-normalised per value head, gated by ``silu(z)`` and projected back. The two recurrent steps run
per sequence through ``xengine/layers/recurrent.py``; everything else runs on the step's flat rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ops.gated_delta import gated_delta_rule
from ops.recurrent import causal_conv1d
from xengine.layers.linear import Linear
from xengine.layers.recurrent import RecurrentMixer, State
from xengine.models.qwen3_next_config import Qwen3NextConfig


class RMSNormGated(nn.Module):
    """``weight * rms_norm(x) * silu(gate)`` over the last dim (HF ``Qwen3NextRMSNormGated``: a plain
    weight, not the ``1 + weight`` of Qwen3-Next's other norms; statistics and gate in float32)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class DepthwiseConv(nn.Module):
    """Holds the checkpoint's ``conv1d.weight`` (``[channels, 1, kernel]``, no bias) for ``causal_conv1d``."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))


class GatedDeltaNet(RecurrentMixer):
    """The linear-attention mixer of layer ``layer_idx``; ``forward(positions, x)`` like attention."""

    def __init__(self, cfg: Qwen3NextConfig, layer_idx: int) -> None:
        super().__init__(layer_idx)
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        hidden = cfg.hidden_size
        self.in_proj_qkvz = Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = Linear(hidden, 2 * self.num_v_heads, bias=False)
        self.conv1d = DepthwiseConv(self.conv_dim, self.kernel)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = RMSNormGated(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, hidden, bias=False)

    def state_shapes(self, dtype: torch.dtype) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """Per sequence: the conv state (the last ``kernel - 1`` q|k|v inputs, model dtype) and the delta
        rule state (float32), in the order the scan takes them."""
        return (
            ((self.conv_dim, self.kernel - 1), dtype),
            ((self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32),
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv, z, b, a = self._project(x)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out = self.scan((qkv, g, beta), (self.num_v_heads, self.head_v_dim))
        out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(num_tokens, self.value_dim))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q|k|v [N, conv_dim], z [N, Hv, Dv], b [N, Hv], a [N, Hv])`` from the per-key-head layout."""
        n, hk, group = x.shape[0], self.num_k_heads, self.num_v_heads // self.num_k_heads
        dk, vg = self.head_k_dim, group * self.head_v_dim
        q, k, v, z = self.in_proj_qkvz(x).view(n, hk, -1).split([dk, dk, vg, vg], dim=-1)
        b, a = self.in_proj_ba(x).view(n, hk, -1).split([group, group], dim=-1)
        qkv = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        z = z.reshape(n, self.num_v_heads, self.head_v_dim)
        return qkv, z, b.reshape(n, self.num_v_heads), a.reshape(n, self.num_v_heads)

    def _scan(self, inputs: tuple[torch.Tensor, ...], state: State) -> tuple[torch.Tensor, State]:
        """Conv and delta rule over ``[B, T, ...]`` segments from ``state``; output ``[B, T, Hv, Dv]``."""
        qkv, g, beta = inputs
        conv_state, rule_state = state
        bsz, length = qkv.shape[:2]
        qkv, conv_state = causal_conv1d(qkv, self.conv1d.weight.squeeze(1), None, conv_state, silu=True)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(bsz, length, self.num_k_heads, self.head_k_dim)
        k = k.reshape(bsz, length, self.num_k_heads, self.head_k_dim)
        v = v.reshape(bsz, length, self.num_v_heads, self.head_v_dim)
        out, rule_state = gated_delta_rule(q, k, v, g, beta, rule_state, use_qk_l2norm=True)
        return out, (conv_state, rule_state)

    def zero_state(self, batch: int) -> State:
        weight = self.out_proj.weight
        return tuple(
            torch.zeros((batch, *shape), dtype=dtype, device=weight.device)
            for shape, dtype in self.state_shapes(weight.dtype)
        )
