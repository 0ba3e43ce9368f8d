"""Model FLOPs of a dense decoder's forward, counted from its config (for FLOP/s and roofline figures).

A token costs 2 x (non-embedding parameters + the LM head) FLOPs, and 4 x layers x context x
(heads x head_dim) more in attention (scores and the weighted sum of values).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelDims:
    body: int  # parameters of the layers' linear weights
    head: int  # parameters of the LM head (hidden x vocab)
    layers: int
    q_width: int  # heads x head_dim
    kv_width: int  # KV heads x head_dim of one token's K (the same for V)


@functools.lru_cache(maxsize=16)
def model_dims(model_dir: str) -> ModelDims:
    from xengine.models.info import read_model_info

    info = read_model_info(model_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * info.head_dim
    kv = info.num_kv_heads * info.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    return ModelDims(info.num_layers * per_layer, h * info.vocab_size, info.num_layers, q, kv)


def model_flops_per_token(model_dir: str, context: int) -> float:
    """One decoded token at ``context`` tokens of context (LM head included)."""
    d = model_dims(model_dir)
    return 2 * (d.body + d.head) + 4 * d.layers * context * d.q_width


def prefill_flops(model_dir: str, num_prompts: int, input_len: int) -> float:
    """``num_prompts`` prompts of ``input_len`` tokens: causal attention, the LM head once each."""
    d = model_dims(model_dir)
    one = input_len * 2 * d.body + 2 * d.head + 4 * d.layers * d.q_width * input_len * (input_len + 1) / 2
    return num_prompts * one


def offline_flops(model_dir: str, num_prompts: int, input_len: int, output_len: int) -> float:
    """The offline workload: each prompt's prefill, then ``output_len - 1`` decode steps at growing context."""
    decode = sum(model_flops_per_token(model_dir, input_len + i) for i in range(1, output_len))
    return prefill_flops(model_dir, num_prompts, input_len) + num_prompts * decode
