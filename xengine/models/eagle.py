"""EAGLE draft heads from an HF folder of their own (``speculative_config.model``), math only.

- ``eagle`` (EAGLE-1, and HASS's variant with two extra norms, ``add_para_norm``): one Llama-style layer
  over ``fc([embed(x_{t+1}), h_t])``, where ``h_t`` is the target's final hidden state (after its final
  norm); the layer has no input norm; its output (no final norm) goes to the LM head, and feeds the next
  draft step. Checkpoint names: ``fc.*``, ``layers.0.*`` (no ``input_layernorm``), optional
  ``lm_head.weight`` (else the target's head), ``embedding_layernorm`` / ``hidden_states_layernorm``.
- ``eagle3``: the target's residual stream entering three of its layers (``eagle_aux_hidden_state_layer_ids``
  in the draft's config or its ``eagle_config``; default 2, L/2 and L-3), side by side, through ``fc`` to
  one hidden state; one layer whose attention reads ``[input_layernorm(embed), hidden_norm(h)]`` (twice the
  width) with ``h`` as its residual; a final ``norm``; its own LM head over a reduced vocabulary
  (``d2t``: each draft id's offset to the target's id). The next draft step reads the pre-norm output.
  Checkpoint names: ``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``.

Both use the target's token embedding (a copy in the folder is not read). ``load_eagle`` builds one for a
target as a draft head (``draft_head.py``) with the KV geometry of its layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from xengine.layers.linear import Linear, MergedLinear, make_weights_input_major, pack_linears
from xengine.layers.norm import RMSNorm
from xengine.layers.rotary import RotaryEmbedding
from xengine.models.base import BaseCausalLM
from xengine.models.decoder import DecoderAttention, DecoderMLP
from xengine.models.decoder_config import DecoderConfig, decoder_config_from_hf
from xengine.models.draft_head import DraftHeadModel
from xengine.models.info import ModelInfo, read_hf_config
from xengine.models.loader import iterate_weights, safetensors_files
from xengine.models.weights import WeightLoader

EAGLE_METHODS = ("eagle", "eagle3")


class EagleLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, rotary: RotaryEmbedding, qkv_width: int, eagle3: bool) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(cfg, rotary, None, 0)
        if qkv_width != cfg.hidden_size:  # EAGLE-3: the attention reads embedding and hidden side by side
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            self.self_attn.qkv_proj = MergedLinear(qkv_width, [q, kv, kv], bias=cfg.qkv_bias)
        self.mlp = DecoderMLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if eagle3:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class EagleHead(nn.Module):
    """EAGLE-1 (``para_norms``: HASS's norms of the embedding and the hidden state before ``fc``)."""

    def __init__(self, cfg: DecoderConfig, rotary: RotaryEmbedding, fc_bias: bool, para_norms: bool) -> None:
        super().__init__()
        size = cfg.hidden_size
        self.fc = Linear(2 * size, size, bias=fc_bias)
        self.layers = nn.ModuleList([EagleLayer(cfg, rotary, size, eagle3=False)])
        self.para_norms = para_norms
        if para_norms:
            self.embedding_layernorm = RMSNorm(size, cfg.rms_norm_eps)
            self.hidden_states_layernorm = RMSNorm(size, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, embeds: torch.Tensor, prev_hidden: torch.Tensor, depth: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.para_norms:
            embeds, prev_hidden = self.embedding_layernorm(embeds), self.hidden_states_layernorm(prev_hidden)
        x = self.fc(torch.cat([embeds, prev_hidden], dim=-1))
        layer = self.layers[0]
        attn, residual = layer.post_attention_layernorm(layer.self_attn(positions, x), x)
        out = layer.mlp(attn) + residual
        return out, out


class Eagle3Head(nn.Module):
    def __init__(
        self, cfg: DecoderConfig, rotary: RotaryEmbedding, target_width: int, norm_before_residual: bool
    ) -> None:
        super().__init__()
        size = cfg.hidden_size
        self.fc = Linear(target_width, size, bias=False)
        self.midlayer = EagleLayer(cfg, rotary, 2 * size, eagle3=True)
        self.norm = RMSNorm(size, cfg.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward(
        self, positions: torch.Tensor, embeds: torch.Tensor, prev_hidden: torch.Tensor, depth: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.fc(prev_hidden) if depth == 0 else prev_hidden  # depth 0: the target's layers
        layer = self.midlayer
        normed = layer.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)
        attn, residual = layer.post_attention_layernorm(layer.self_attn(positions, x), residual)
        out, prenorm = self.norm(layer.mlp(attn), residual)
        return out, prenorm


def aux_layer_ids(draft_hf: dict[str, Any], num_target_layers: int) -> list[int]:
    """The target layers whose entering residual stream an EAGLE-3 head reads, in layer order."""
    nested = draft_hf.get("eagle_config") if isinstance(draft_hf.get("eagle_config"), dict) else {}
    ids = draft_hf.get("eagle_aux_hidden_state_layer_ids") or nested.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = [2, num_target_layers // 2, num_target_layers - 3]
    if (
        not isinstance(ids, list)
        or len(set(ids)) != len(ids)
        or not all(isinstance(i, int) and 0 <= i < num_target_layers for i in ids)
    ):
        raise ValueError(
            f"eagle_aux_hidden_state_layer_ids must be distinct layers of the target's "
            f"{num_target_layers}, got {ids!r}"
        )
    return sorted(ids)


def load_eagle(
    target: BaseCausalLM, draft_dir: str, method: str, quantization: str = "none"
) -> tuple[DraftHeadModel, ModelInfo]:
    """The EAGLE head of ``draft_dir`` for ``target`` (its dtype and device) and the KV geometry of its
    layer. ``ValueError`` for a folder that does not fit the target."""
    hf = read_hf_config(draft_dir)
    if int(hf.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"speculative_config.model {draft_dir!r}: EAGLE heads of one layer only")
    cfg = decoder_config_from_hf({**hf, "num_hidden_layers": 1})
    tcfg = target.config
    if cfg.vocab_size != tcfg.vocab_size:
        raise ValueError(
            f"speculative_config.model {draft_dir!r} has a vocabulary of {cfg.vocab_size} ids, the target "
            f"{tcfg.vocab_size}: an EAGLE head must share the target's tokenizer"
        )
    capture = getattr(target.model, "aux_layers", None)
    if method == "eagle3" and capture is None:
        raise ValueError(
            f"eagle3 reads the target's layers, which {type(target).__name__} does not expose yet"
        )
    names = _names(draft_dir)
    rotary = RotaryEmbedding(
        cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, cfg.rope_is_neox
    )
    ref = target.lm_head.weight
    aux: list[int] = []
    with torch.device("meta"):
        if method == "eagle":
            if cfg.hidden_size != tcfg.hidden_size:
                raise ValueError(f"an EAGLE head's hidden_size must be the target's ({tcfg.hidden_size})")
            para = bool(hf.get("add_para_norm")) or "embedding_layernorm.weight" in names
            head: nn.Module = EagleHead(cfg, rotary, "fc.bias" in names, para)
            lm_head = (
                Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if "lm_head.weight" in names else None
            )
        else:
            aux = aux_layer_ids(hf, tcfg.num_layers)
            head = Eagle3Head(cfg, rotary, len(aux) * tcfg.hidden_size, bool(hf.get("norm_before_residual")))
            draft_vocab = int(hf.get("draft_vocab_size") or cfg.vocab_size)
            lm_head = Linear(cfg.hidden_size, draft_vocab, bias=False)
    head = head.to(dtype=ref.dtype).to_empty(device=ref.device)
    make_weights_input_major(head)
    if lm_head is not None:
        lm_head = lm_head.to(dtype=ref.dtype).to_empty(device=ref.device)
    extra: dict[str, torch.Tensor] = {}  # the LM head and d2t, loaded beside the head's layers

    def layer_weights() -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in _head_weights(draft_dir):
            if name in ("lm_head.weight", "d2t"):
                extra[name] = tensor
            elif name not in ("t2d", "embed_tokens.weight"):
                yield name, tensor

    WeightLoader(head).load(layer_weights())
    if lm_head is not None:
        lm_head.weight.data.copy_(extra["lm_head.weight"])
    d2t = extra["d2t"].to(torch.long) if "d2t" in extra else None
    draft_to_target = None
    if method == "eagle3":
        assert lm_head is not None
        ids = torch.arange(lm_head.weight.shape[0])
        draft_to_target = (ids + d2t if d2t is not None else ids).to(ref.device)
        if int(draft_to_target.max()) >= tcfg.vocab_size or int(draft_to_target.min()) < 0:
            raise ValueError(f"{draft_dir!r}: d2t maps draft ids outside the target's vocabulary")
        target.model.aux_layers = frozenset(aux)
    for module in (head, lm_head):
        if module is not None:
            module.eval()
            module.requires_grad_(False)
    pack_linears(head, quantization)
    info = ModelInfo(
        architecture=str((hf.get("architectures") or ["EagleHead"])[0]),
        model_type=method,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=1,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
    )
    return DraftHeadModel(target, head, lm_head, draft_to_target, rotary), info


def _names(draft_dir: str) -> set[str]:
    return {name for name, _ in _head_weights(draft_dir, load=False)}


def _head_weights(draft_dir: str, load: bool = True) -> Iterable[tuple[str, torch.Tensor]]:
    """The folder's tensors, ``model.`` prefixes dropped (some exports carry them)."""
    files = safetensors_files(draft_dir)
    if not load:
        from safetensors import safe_open

        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name.removeprefix("model."), torch.empty(0)
        return
    for name, tensor in iterate_weights(files):
        yield name.removeprefix("model."), tensor
