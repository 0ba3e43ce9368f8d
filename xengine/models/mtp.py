"""Multi-token-prediction (MTP) layers: the draft head some checkpoints ship beside the model
(DeepSeek-V3's ``num_nextn_predict_layers``, Qwen3-Next's ``mtp.*``, MiMo-V2-Flash's ``model.mtp.*``),
math only.

One MTP layer predicts the token after next: at position ``t`` it takes the target's final hidden state
``h_t`` (after the final norm, as HF passes it) and the embedding of the token at ``t + 1``,

    g_t = post_norm(block(eh_proj([enorm(embed(x_{t+1})), hnorm(h_t)])))

and the target's own head turns ``g_t`` into logits for ``x_{t+2}``. ``block`` is one decoder layer of
the target's kind (DeepSeek-V3: MLA attention and a MoE block; Qwen3-Next: gated full attention and a
MoE block; MiMo-V2-Flash: sliding-window attention with sinks and a dense MLP, ``mtp_kv_info`` giving its
KV geometry) with a KV cache of its own.

A checkpoint with ``L`` layers chains them (HF's ``MtpModel``, DeepSeek-V3's design; MiMo ships three):
layer ``i`` reads, at position ``t``, layer ``i - 1``'s output there (the target's hidden state for the
first) and the token at ``t + i + 1`` -- the drafts so far where the known tokens end -- and drafts the
token after it. Each layer keeps KV for every position, so each runs over a sequence's new positions
(``head_proposer.py``). Drafting further than the layers reach runs the last layer one position on,
feeding its output back in.

A model with MTP layers implements ``mtp_block(kv_index)`` (its decoder layer, always the MoE kind) and
``mtp_weight_name(name, num_layers)`` (where a checkpoint tensor goes: ``(layer, name in MtpLayer)``, or
None); ``load_mtp`` builds and loads them as a draft head (``draft_head.py``), which
``xengine/spec/head_proposer.py`` runs.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from xengine.layers.linear import Linear, make_weights_input_major, pack_linears
from xengine.layers.norm import RMSNorm
from xengine.models.base import BaseCausalLM
from xengine.models.draft_head import DraftHeadModel
from xengine.models.info import read_hf_config, text_config
from xengine.models.loader import iterate_weights, safetensors_files
from xengine.models.weights import WeightLoader


class MtpLayer(nn.Module):
    def __init__(self, hidden_size: int, eps: float, block: nn.Module) -> None:
        super().__init__()
        self.enorm = RMSNorm(hidden_size, eps)
        self.hnorm = RMSNorm(hidden_size, eps)
        self.eh_proj = Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block  # forward(positions, hidden, residual) -> (output, residual)
        self.post_norm = RMSNorm(hidden_size, eps)

    def forward(
        self, positions: torch.Tensor, embeds: torch.Tensor, prev_hidden: torch.Tensor
    ) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(prev_hidden)], dim=-1))
        out, residual = self.block(positions, x, None)
        hidden, _ = self.post_norm(out, residual)
        return hidden


class MtpHead(nn.Module):
    """The MTP layers as a draft head (``draft_head.py``): draft step ``depth`` runs layer
    ``min(depth, layers - 1)``; its output (after ``post_norm``) is both the logits' hidden state and the
    next step's."""

    def __init__(self, layers: list[MtpLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.num_depths = len(layers)

    def forward(
        self, positions: torch.Tensor, embeds: torch.Tensor, prev_hidden: torch.Tensor, depth: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.layers[min(depth, len(self.layers) - 1)](positions, embeds, prev_hidden)
        return hidden, hidden


def num_mtp_layers(hf_config: dict) -> int:
    """How many MTP layers a checkpoint's config declares (0: none)."""
    cfg = text_config(hf_config)
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers"):
        value = cfg.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def load_mtp(target: BaseCausalLM, model_dir: str, quantization: str = "none") -> DraftHeadModel:
    """The MTP layers of ``model_dir``'s checkpoint beside ``target`` (loaded from the same folder), in
    the target's dtype and on its device: depth ``i`` of the chain is layer ``i`` (KV cache ``i`` of the
    head's pool). ``ValueError`` when the model or checkpoint has none."""
    declared = num_mtp_layers(read_hf_config(model_dir))
    make_block = getattr(target, "mtp_block", None)
    if make_block is None or declared == 0:
        raise ValueError(
            f"speculative_config.method mtp needs a checkpoint with multi-token-prediction layers "
            f"(DeepSeek-V3 num_nextn_predict_layers, Qwen3-Next / MiMo-V2-Flash mtp.*); {model_dir!r} "
            + ("declares none" if make_block is not None else f"is a {type(target).__name__}, which has none")
        )
    ref = target.lm_head.weight
    cfg = target.config
    with torch.device("meta"):
        head = MtpHead([MtpLayer(cfg.hidden_size, cfg.rms_norm_eps, make_block(i)) for i in range(declared)])
    head = head.to(dtype=ref.dtype).to_empty(device=ref.device)
    make_weights_input_major(head)
    WeightLoader(head).load(_mtp_weights(target, safetensors_files(model_dir), declared))
    after = getattr(target, "mtp_after_load", None)
    for layer in head.layers:
        if after is not None:
            after(layer)
    head.eval()
    head.requires_grad_(False)
    pack_linears(head, quantization)
    return DraftHeadModel(target, head)


def _mtp_weights(
    target: BaseCausalLM, files: list[str], num_layers: int
) -> Iterable[tuple[str, torch.Tensor]]:
    """The MTP layers' tensors, named as in ``MtpHead`` (the target decides the mapping; a tensor its
    mapping gives layer -1 is every layer's: Qwen3-Next's ``mtp.fc`` and norms beside its layers)."""
    seen: set[int] = set()
    for name, tensor in iterate_weights(files):
        where = target.mtp_weight_name(name, num_layers)  # type: ignore[attr-defined]
        if where is None:
            continue
        layers = range(num_layers) if where[0] == -1 else [where[0]]
        seen.update(layers)
        for i in layers:
            yield f"layers.{i}.{where[1]}", tensor
    missing = sorted(set(range(num_layers)) - seen)
    if missing:
        raise ValueError(
            f"the checkpoint declares {num_layers} MTP layers but holds no weights of layer(s) {missing}"
        )
