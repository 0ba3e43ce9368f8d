"""The Mamba2 mixer (Nemotron-H's ``M`` blocks): one input projection to the gate ``z``, the
convolved ``x | B | C`` channels and the step ``dt``; a causal depthwise convolution with SiLU; the SSD
scan (``ops/ssd.py``) with a decay ``exp(dt * A)`` per head and ``B`` / ``C`` shared by a group of
heads; a gated RMSNorm taken per group; the output projection.

Each sequence carries two states between steps, kept by the engine (``recurrent_state_shapes``): the
convolution's last ``conv_kernel - 1`` inputs (model dtype) and the SSM state ``[H, P, N]`` (float32).
The convolution and the scan run per sequence through ``xengine/layers/recurrent.py``; the projections,
the step sizes and the norm run on the step's flat token rows.

The step is ``softplus(dt + dt_bias)`` clamped to the config's ``time_step_limit`` in every step, prefill
or decode, as NVIDIA's implementation and transformers' Mamba2 do (transformers' Nemotron-H clamps at
``time_step_min`` on its chunked path and not at all on its one-token path; with the usual steps, far
above ``time_step_min``, all agree).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ops.recurrent import causal_conv1d
from ops.ssd import ssd_scan
from xengine.layers.linear import Linear
from xengine.layers.recurrent import RecurrentMixer, State
from xengine.models.nemotron_h_config import NemotronHConfig

StateSpec = tuple[tuple[int, ...], torch.dtype]


class CausalConv1d(nn.Module):
    """Depthwise causal convolution weights in the checkpoint's ``nn.Conv1d`` layout (``weight``
    ``[C, 1, K]``); ``forward`` continues from the ``K - 1`` inputs before (``state`` ``[B, C, K - 1]``)."""

    def __init__(self, channels: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None

    def forward(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[B, T, C]`` -> ``(silu(conv(x)) [B, T, C], new state)``."""
        return causal_conv1d(x, self.weight[:, 0], self.bias, state, silu=True)


class GatedRMSNorm(nn.Module):
    """``weight * rms_norm(y * silu(z))`` with the statistics taken over groups of ``group_size``
    channels (the SSM output's ``n_groups``), in float32."""

    def __init__(self, hidden_size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = y.float() * F.silu(gate.float())
        groups = h.view(*h.shape[:-1], -1, self.group_size)
        groups = groups * torch.rsqrt(groups.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * groups.view(h.shape)).to(gate.dtype)


class Mamba2Mixer(RecurrentMixer):
    def __init__(self, cfg: NemotronHConfig, layer_idx: int) -> None:
        super().__init__(layer_idx)
        self.num_heads, self.head_dim = cfg.mamba_num_heads, cfg.mamba_head_dim
        self.n_groups, self.state_size = cfg.n_groups, cfg.ssm_state_size
        self.intermediate_size, self.conv_dim = cfg.mamba_intermediate_size, cfg.conv_dim
        self.chunk_size, self.time_step_limit = cfg.chunk_size, cfg.time_step_limit
        self.in_proj = Linear(
            cfg.hidden_size, self.intermediate_size + self.conv_dim + self.num_heads, bias=cfg.use_bias
        )
        self.conv1d = CausalConv1d(self.conv_dim, cfg.conv_kernel, cfg.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.D = nn.Parameter(torch.empty(self.num_heads))
        self.norm = GatedRMSNorm(
            self.intermediate_size, self.intermediate_size // self.n_groups, cfg.norm_eps
        )
        self.out_proj = Linear(self.intermediate_size, cfg.hidden_size, bias=cfg.use_bias)

    def state_shapes(self) -> tuple[StateSpec, StateSpec]:
        """Per sequence: the convolution's inputs ``[conv_dim, K - 1]`` (model dtype) and the SSM
        state ``[H, P, N]`` (float32), in the order ``_scan`` takes them."""
        conv = self.conv1d.weight
        return (
            ((self.conv_dim, conv.shape[-1] - 1), conv.dtype),
            ((self.num_heads, self.head_dim, self.state_size), torch.float32),
        )

    def zero_state(self, batch: int) -> State:
        device = self.conv1d.weight.device
        return tuple(
            torch.zeros((batch, *shape), dtype=dtype, device=device) for shape, dtype in self.state_shapes()
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` rows of the step -> ``[T, hidden]``; the sequences and their states come from
        the forward context (none: the rows are one sequence from a zero state)."""
        gate, xbc, dt = self.in_proj(hidden).split(
            [self.intermediate_size, self.conv_dim, self.num_heads], dim=-1
        )
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.time_step_limit)
        y = self.scan((xbc, dt), (self.intermediate_size,))
        return self.out_proj(self.norm(y, gate))

    def _scan(self, inputs: tuple[torch.Tensor, ...], state: State) -> tuple[torch.Tensor, State]:
        """Equally long segments: ``xbc`` ``[B, T, conv_dim]``, ``dt`` ``[B, T, H]`` -> ``y [B, T, I]``."""
        xbc, dt = inputs
        conv_state, ssm_state = state
        xbc, conv_state = self.conv1d(xbc, conv_state)
        groups = self.n_groups * self.state_size
        x, B, C = xbc.split([self.intermediate_size, groups, groups], dim=-1)
        batch, length = x.shape[:2]
        y, ssm_state = ssd_scan(
            x.reshape(batch, length, self.num_heads, self.head_dim),
            dt,
            -torch.exp(self.A_log.float()),
            B.reshape(batch, length, self.n_groups, self.state_size),
            C.reshape(batch, length, self.n_groups, self.state_size),
            self.D,
            ssm_state,
            self.chunk_size,
        )
        return y.reshape(batch, length, self.intermediate_size), (conv_state, ssm_state)
