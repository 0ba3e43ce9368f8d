"""Linear layers that stack several checkpoint projections into one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graph.lora_op import apply_lora
from ops.linear import pack_linear, packed_linear
from xengine.layers.checkpoint_tensor import materialize, narrow


class Linear(nn.Linear):
    """``nn.Linear`` whose weight the platform may pack once for a faster GEMM (``ops/linear.py``).

    ``pack()`` after the weights are loaded; later changes to ``weight`` need another ``pack()``.
    ``float_output`` (set before ``pack()``, e.g. on an LM head): the caller wants float32 out, which a
    backend may produce straight from its accumulators."""

    _packed: int | None = None
    _packed_owner: object = None  # keeps the backend's packed weight alive while this layer is
    float_output: bool = False
    # LoRA (``xengine/lora/slots.py``): every adapter slot's A ``[slots, rank, in]`` and scaled B
    # ``[slots, out, rank]``, buffers set when the engine serves adapters; None: no LoRA here
    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None

    def pack(self, quantization: str = "none") -> bool:
        """Pack the weight for the platform's kernel; False where the platform has none.
        ``quantization`` ("none", "w8a8", "int8", "int4", "fp8") quantizes it; ``ValueError`` where
        that cannot run. A quantized checkpoint's loader sets ``weight_scale`` (and ``weight_zero``)
        on the layer: ``weight`` then holds its quantized values, packed as they are."""
        scale = getattr(self, "weight_scale", None)
        zero = getattr(self, "weight_zero", None)
        packed = pack_linear(self.weight, self.fused_bias(), self.float_output, quantization, scale, zero)
        self._packed, self._packed_owner = (None, None) if packed is None else packed
        return self._packed is not None

    def fused_bias(self) -> torch.Tensor | None:
        """The bias the GEMM adds (a row-parallel layer adds its own after the all-reduce)."""
        return self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (
            F.linear(x, self.weight, self.fused_bias())
            if self._packed is None
            else packed_linear(x, self._packed)
        )
        if self.lora_a is not None:
            y = apply_lora(x, y, self.lora_a, self.lora_b)
        return y


def pack_linears(model: nn.Module, quantization: str = "none") -> int:
    """Pack every ``Linear`` of ``model`` the platform can; returns how many were packed. With
    ``quantization`` every one is quantized but the float-output ones (the LM head keeps the model's
    dtype, as quantized checkpoints usually do)."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear):
            count += module.pack("none" if module.float_output else quantization)
    return count


class MergedLinear(Linear):
    """Projections with the same input stacked along the output dim (e.g. q|k|v, gate|up).

    Checkpoints store each projection separately; ``load_shard`` copies one into its row range.
    Column-parallel (tensor parallel): ``output_sizes`` are this rank's rows of each projection and
    ``source_starts`` where they begin in the checkpoint's tensor, read without reading the rest.
    """

    def __init__(
        self, in_features: int, output_sizes: list[int], bias: bool, source_starts: list[int] | None = None
    ) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        self.source_starts = source_starts

    @property
    def num_shards(self) -> int:
        return len(self.output_sizes)

    def load_shard(self, shard: int, param_name: str, tensor: torch.Tensor) -> None:
        """Copy checkpoint tensor ``tensor`` into rows of shard ``shard`` of ``weight`` or ``bias``."""
        param = getattr(self, param_name)
        if param is None:
            raise ValueError(f"checkpoint has a {param_name} for a projection built without one")
        start, size = self.offsets[shard], self.output_sizes[shard]
        if self.source_starts is not None:
            tensor = narrow(tensor, 0, self.source_starts[shard], size)
        tensor = materialize(tensor)
        expected = (size, *param.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"shard {shard} {param_name}: expected shape {expected}, got {tuple(tensor.shape)}"
            )
        with torch.no_grad():
            param[start : start + size].copy_(tensor)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Split an output of this layer back into its projections."""
        return out.split(self.output_sizes, dim=-1)


def make_weights_input_major(model: nn.Module, keep: tuple[torch.Tensor, ...] = ()) -> None:
    """Re-allocate every float32 ``nn.Linear`` weight of ``model`` input-major: same ``[out, in]`` shape,
    stored as the transpose of a contiguous ``[in, out]`` matrix. Contents are discarded, so call it
    before loading weights. Weights in ``keep`` (e.g. an LM head tied to the embedding, whose row
    lookups want the row-major layout) are left as they are.

    ``F.linear`` then multiplies by a contiguous ``[in, out]`` matrix, which MKL's sgemm runs up to
    twice as fast for the few-row inputs of decode steps (large batches: same speed). Half-precision
    CPU matmuls measured no better, so those weights keep the row-major layout.
    """
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) and w.dtype == torch.float32 and not any(w is t for t in keep):
            w.data = torch.empty_strided(w.shape, (1, w.shape[0]), dtype=w.dtype, device=w.device)
