"""compressed-tensors checkpoints (llm-compressor's format, which vLLM also loads).

One config group targeting ``Linear``; its ``weights`` / ``input_activations`` decide the scheme:
- "w8a8": ``int-quantized``, int8 weights symmetric per channel, int8 activations per token, dynamic;
- "int8" (W8A16): the same weights, no activations; ``int-quantized`` (``weight`` int8) or
  ``pack-quantized`` (``weight_packed`` int32 ``[out, in / 4]``, four values + 128 per word);
- "int4": ``pack-quantized``, per group or channel, symmetric or not: ``weight_packed`` int32
  ``[out, in / 8]`` (eight values + 8 per word along the input), ``weight_scale [out, groups]``,
  ``weight_zero_point`` int32 ``[out / 8, groups]`` (zero points + 8, packed along the output) when
  asymmetric, ``weight_shape``;
- "fp8": ``float-quantized``, e4m3 weights per channel and activations per token, dynamic
  (``FP8_DYNAMIC``): ``weight`` float8_e4m3fn and ``weight_scale [out, 1]``.
Values are stored signed; canonical int4 values are the stored unsigned ones (+ 8), so
``(q - zero) * scale`` is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from xengine.models.quant_formats.canonical import QuantizedWeight
from xengine.models.quant_formats.checkpoint import CheckpointQuantization
from xengine.models.quant_formats.layers import LayerInfo, assemble, refuse
from xengine.models.quant_formats.packing import pack_int32, unpack_int32

_INT8_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
_INT_TOKENS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
_FP8_WEIGHTS = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
_FP8_TOKENS = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
_INT4_WEIGHTS = {"num_bits": 4, "type": "int", "strategy": ("group", "channel")}
# scheme -> (formats, weights, input_activations (None: none))
SPECS: dict[str, tuple[tuple[str, ...], dict[str, Any], dict[str, Any] | None]] = {
    "w8a8": (("int-quantized",), _INT8_WEIGHTS, _INT_TOKENS),
    "int8": (("int-quantized", "pack-quantized"), _INT8_WEIGHTS, None),
    "int4": (("pack-quantized",), _INT4_WEIGHTS, None),
    "fp8": (("float-quantized",), _FP8_WEIGHTS, _FP8_TOKENS),
}
_SUPPORTED = "W8A8 int8, W8A16 int8, W4A16 int4 and FP8_DYNAMIC compressed-tensors checkpoints"


def parse(qc: dict[str, Any]) -> CheckpointQuantization:
    """The quantization of a compressed-tensors ``quantization_config``; ``ValueError`` naming the
    first field xllm does not support."""
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qc.get(key):
            raise refuse(key, qc[key], _SUPPORTED)
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise refuse("config_groups", list(groups), "one config group")
    ((group_name, group),) = groups.items()
    where = f"config_groups.{group_name}"
    if group.get("targets") != ["Linear"]:
        raise refuse(f"{where}.targets", group.get("targets"), "targets ['Linear']")
    if group.get("output_activations"):
        raise refuse(f"{where}.output_activations", group["output_activations"], "none")
    weights = group.get("weights") or {}
    scheme = _scheme(weights, group.get("input_activations"), where)
    formats, weight_spec, act_spec = SPECS[scheme]
    fmt = group.get("format") or qc.get("format")
    if fmt not in formats:
        raise refuse("format", fmt, f"{scheme} as {' or '.join(formats)}")
    _match(weight_spec, weights, f"{where}.weights")
    if weights.get("dynamic"):
        raise refuse(f"{where}.weights.dynamic", True, "static weights")
    if weights.get("actorder") == "group":
        raise refuse(f"{where}.weights.actorder", "group", "groups in input order (actorder null or weight)")
    acts = group.get("input_activations")
    if act_spec is None and acts:
        raise refuse(f"{where}.input_activations", acts, f"{scheme} weight-only (none)")
    if act_spec is not None:
        _match(act_spec, acts or {}, f"{where}.input_activations")
    group_size = _group_size(weights, where) if scheme == "int4" else -1
    symmetric = bool(weights.get("symmetric", True))
    if not symmetric and scheme != "int4":
        raise refuse(f"{where}.weights.symmetric", False, f"symmetric {scheme} weights")
    return CheckpointQuantization(
        scheme, "compressed-tensors", fmt, group_size, symmetric, tuple(qc.get("ignore") or ())
    )


def _scheme(weights: dict[str, Any], acts: dict[str, Any] | None, where: str) -> str:
    kind = (weights.get("type"), weights.get("num_bits"))
    if kind == ("int", 8):
        return "w8a8" if acts else "int8"
    if kind == ("int", 4):
        return "int4"
    if kind == ("float", 8):
        return "fp8"
    raise refuse(f"{where}.weights.num_bits/type", f"{kind[1]}-bit {kind[0]}", "int8, int4 or fp8 weights")


def _match(spec: dict[str, Any], got: dict[str, Any], where: str) -> None:
    for key, expected in spec.items():
        allowed = expected if isinstance(expected, tuple) else (expected,)
        if got.get(key) not in allowed:
            raise refuse(f"{where}.{key}", got.get(key), " or ".join(map(repr, allowed)))


def _group_size(weights: dict[str, Any], where: str) -> int:
    if weights.get("strategy") == "channel":
        return -1
    size = weights.get("group_size")
    if not isinstance(size, int) or size <= 0:
        raise refuse(f"{where}.weights.group_size", size, "a positive group size")
    return size


def convert(
    weights: Iterable[tuple[str, torch.Tensor]], quant: CheckpointQuantization, layers: dict[str, LayerInfo]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each quantized layer in the canonical form."""
    if quant.layout == "pack-quantized":
        parts = ("weight_packed", "weight_scale") + (() if quant.symmetric else ("weight_zero_point",))
        checks = {"weight_shape": _check_shape, "weight_g_idx": _refuse_g_idx}
        if quant.symmetric:
            checks["weight_zero_point"] = lambda *_: None  # symmetric: zero points are 0 by definition

        def build(layer: str, got: dict[str, torch.Tensor], info: LayerInfo) -> QuantizedWeight:
            return _unpack(got, info, quant)

        return assemble(weights, layers, quant.scheme, parts, build, checks)

    def build_plain(layer: str, got: dict[str, torch.Tensor], info: LayerInfo) -> QuantizedWeight:
        return QuantizedWeight(got["weight"], got["weight_scale"].reshape(-1).float())

    checks = {"weight_zero_point": _check_zero}  # symmetric int-quantized: stored zeros only
    return assemble(weights, layers, quant.scheme, ("weight", "weight_scale"), build_plain, checks)


def _unpack(got: dict[str, torch.Tensor], info: LayerInfo, quant: CheckpointQuantization) -> QuantizedWeight:
    out, inp = info.out_features, info.in_features
    bits = 4 if quant.scheme == "int4" else 8
    q = unpack_int32(got["weight_packed"], bits, dim=1)[:, :inp]
    if quant.scheme == "int8":
        return QuantizedWeight((q - 128).to(torch.int8), got["weight_scale"].reshape(-1).float())
    scale = got["weight_scale"].float()
    if scale.dim() == 1:
        scale = scale[:, None]
    if quant.symmetric:
        zero = torch.full_like(scale, 8.0)
    else:
        zero = unpack_int32(got["weight_zero_point"], 4, dim=0)[:out].float()
    return QuantizedWeight(q.to(torch.uint8), scale, zero)


def _check_shape(name: str, tensor: torch.Tensor, info: LayerInfo) -> None:
    if tensor.tolist() != [info.out_features, info.in_features]:
        raise ValueError(
            f"{name} is {tensor.tolist()}, the model has [{info.out_features}, {info.in_features}]"
        )


def _refuse_g_idx(name: str, tensor: torch.Tensor, info: LayerInfo) -> None:
    raise ValueError(f"{name}: activation-ordered groups (g_idx) are not supported")


def _check_zero(name: str, tensor: torch.Tensor, info: LayerInfo) -> None:
    if tensor.any():
        raise ValueError(f"{name}: non-zero zero points in a symmetric scheme")


def pack_layer(layer: str, quantized: QuantizedWeight, scheme: str) -> dict[str, torch.Tensor]:
    """The tensors a compressed-tensors checkpoint stores for one layer in ``scheme``."""
    if scheme in ("w8a8", "fp8"):
        return {f"{layer}.weight": quantized.q, f"{layer}.weight_scale": quantized.scale[:, None]}
    out, inp = quantized.q.shape
    shape = {f"{layer}.weight_shape": torch.tensor([out, inp], dtype=torch.int64)}
    if scheme == "int8":
        packed = pack_int32(quantized.q.to(torch.int32) + 128, 8, dim=1)
        return {f"{layer}.weight_packed": packed, f"{layer}.weight_scale": quantized.scale[:, None], **shape}
    return {
        f"{layer}.weight_packed": pack_int32(quantized.q, 4, dim=1),
        f"{layer}.weight_scale": quantized.scale,
        f"{layer}.weight_zero_point": pack_int32(quantized.zero.to(torch.int32), 4, dim=0),
        **shape,
    }


def write_config(scheme: str, group_size: int, ignore: list[str]) -> dict[str, Any]:
    """The ``quantization_config`` of the checkpoint ``pack_layer`` writes (what ``parse`` accepts)."""
    formats, weights, acts = SPECS[scheme]
    weights = {**weights, "dynamic": False, "group_size": None, "observer": "minmax"}
    if scheme == "int4":
        weights |= {"symmetric": False, "strategy": "group", "group_size": group_size}
        if group_size == -1:
            weights |= {"strategy": "channel", "group_size": None}
    fmt = "pack-quantized" if scheme in ("int8", "int4") else formats[0]
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": acts,
                "output_activations": None,
                "format": fmt,
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
    }
