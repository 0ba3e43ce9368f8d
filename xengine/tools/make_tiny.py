"""Generate small seeded-random checkpoints of real architectures (tests, benchmarks, default model).

``tiny`` (about 1.1-1.9M parameters, 2048-token vocabulary) is for tests; ``small`` (about 56M
parameters, 32000-token vocabulary) is for benchmarks and the embedded default model. Weights are
float32, written by ``transformers`` as safetensors, with a byte-level BPE tokenizer trained here.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from xengine.api.models import ARCHS, HYBRID_ARCHS, SIZES, VL_ARCHS
from xengine.api.paths import default_model_dir

# Shapes per size. Tiny ties embeddings for the Qwen archs (like the small real Qwens) and unties
# them for llama, so both loader paths are exercised; small is untied for every arch.
_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    ),
    "small": dict(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    ),
}
# qwen3_moe: enough experts for load balancing to mean something, a dense first layer (mlp_only_layers)
# so both feed-forward kinds are exercised, experts small enough to keep the parameter budget of the size.
_MOE: dict[str, dict[str, Any]] = {
    "tiny": dict(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=32),
    "small": dict(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=48),
}
# deepseek_v3: MLA (q and kv low-rank), 32 routed experts in 4 groups (top-2 groups, top-4 experts), one
# shared expert, a dense first layer (first_k_dense_replace). kv_lora_rank + qk_rope_head_dim is 64 / 256,
# so a 16-token block of the latent cache is whole 4 KiB pages (xTensor) in float32 and bfloat16.
_DEEPSEEK: dict[str, dict[str, Any]] = {
    "tiny": dict(
        q_lora_rank=64, kv_lora_rank=48, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        n_routed_experts=32, moe_intermediate_size=32,
    ),
    "small": dict(
        q_lora_rank=256, kv_lora_rank=192, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
        n_routed_experts=32, moe_intermediate_size=44,
    ),
}  # fmt: skip
_DEEPSEEK_COMMON = dict(
    num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
    routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True, num_nextn_predict_layers=0,
)  # fmt: skip
# qwen2_vl / qwen2_5_vl: a small vision tower (14-pixel patches, 2x2 merge) in front of the language model
# of the size; M-RoPE sections split head_dim / 2 as Qwen's 16/24/24 of 64.
_VISION: dict[str, dict[str, Any]] = {
    "tiny": dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2),
    "small": dict(depth=4, embed_dim=128, num_heads=4, mlp_ratio=2),
}
_MROPE_SECTION = {"tiny": [4, 6, 6], "small": [8, 12, 12]}
# preprocessor_config.json: images resized to between 56x56 and 224x224 pixels (4 to 64 image tokens)
IMAGE_MIN_PIXELS = 56 * 56
IMAGE_MAX_PIXELS = 28 * 28 * 64
# gemma3: a global (full-attention) layer every 4th (tiny) / 6th (small) layer, the rest sliding windows
# shorter than the prompts the tests send; per-type RoPE with linear scaling on the global layers (Gemma
# 3's 4B+ checkpoints).
_GEMMA3 = {"tiny": dict(window=32, every=4), "small": dict(window=128, every=6)}
_VOCAB = {"tiny": 2048, "small": 32000}
_CORPUS_CHARS = {"tiny": 400_000, "small": 12_000_000}
INITIALIZER_RANGE = 0.2
MAX_POSITION_EMBEDDINGS = 4096


def tie_embeddings(arch: str, size: str) -> bool:
    """Whether the generated checkpoint ties ``lm_head`` to the input embeddings."""
    # gemma3 unties too: its embeddings are scaled by sqrt(hidden_size), and a tied random head then
    # mostly echoes the input token
    return size == "tiny" and arch not in ("llama", "gemma3")


def build_config(arch: str, size: str, vocab_size: int | None = None, eos_token_id: int = 2) -> Any:
    """The ``transformers`` config of one (arch, size); ``vocab_size`` defaults to the target size."""
    import torch
    from transformers import DeepseekV3Config, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if arch not in ARCHS or size not in SIZES:
        raise ValueError(f"arch must be one of {ARCHS} and size one of {SIZES}, got {arch!r}, {size!r}")
    kw: dict[str, Any] = dict(_SHAPES[size])
    kw.update(
        vocab_size=vocab_size or _VOCAB[size],
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        initializer_range=INITIALIZER_RANGE,
        tie_word_embeddings=tie_embeddings(arch, size),
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=None,
        rms_norm_eps=1e-6,
    )
    if arch in VL_ARCHS:
        config = _vl_config(arch, size, kw)
    elif arch == "qwen3":
        config = Qwen3Config(**kw)
    elif arch == "qwen3_moe":
        moe = dict(_MOE[size], norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0])
        config = Qwen3MoeConfig(**kw, **moe)
    elif arch == "deepseek_v3":
        kw.pop("head_dim")  # MLA: qk_nope_head_dim + qk_rope_head_dim per query head
        kw["num_key_value_heads"] = kw["num_attention_heads"]  # as DeepSeek's configs: no GQA grouping
        config = DeepseekV3Config(**kw, **_DEEPSEEK[size], **_DEEPSEEK_COMMON)
    elif arch == "gemma3":
        config = _gemma3_config(size, kw)
    elif arch in HYBRID_ARCHS:
        config = _hybrid_module(arch).tiny_config(size, kw)
    elif arch == "qwen2":
        kw.pop("head_dim")  # Qwen2 derives it: hidden_size / num_attention_heads
        config = Qwen2Config(**kw)
    else:
        llama3 = dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=1024,
        )
        config = LlamaConfig(**kw, rope_scaling=llama3, rope_theta=500000.0)
    config.dtype = torch.float32
    return config


def _gemma3_config(size: str, kw: dict[str, Any]) -> Any:
    """Gemma 3 text: sliding-window layers with one global layer in ``every``, per-type RoPE."""
    from transformers import Gemma3TextConfig

    shape = _GEMMA3[size]
    types = [
        "full_attention" if (i + 1) % shape["every"] == 0 else "sliding_attention"
        for i in range(kw["num_hidden_layers"])
    ]
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    }
    return Gemma3TextConfig(**kw, sliding_window=shape["window"], layer_types=types, rope_parameters=rope)


def _hybrid_module(arch: str) -> Any:
    """``xengine/tools/tiny_<arch>.py``: ``tiny_config(size, kw)`` and ``randomise(model, seed)``."""
    import importlib

    return importlib.import_module(f"xengine.tools.tiny_{arch}")


def _vl_config(arch: str, size: str, kw: dict[str, Any]) -> Any:
    """Qwen2-VL / Qwen2.5-VL: the size's language model (Qwen2 shapes) and a small vision tower; the
    vision special tokens are the last four ids of the vocabulary (``bpe.VISION_TOKENS``)."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    kw = dict(kw)
    kw.pop("head_dim")  # hidden_size / num_attention_heads, as Qwen2
    tie = kw.pop("tie_word_embeddings")
    kw["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 1000000.0,
        "mrope_section": _MROPE_SECTION[size],
    }
    vocab = kw["vocab_size"]
    vision_start, vision_end, image_pad, video_pad = range(vocab - 4, vocab)
    v = _VISION[size]
    common = dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, num_heads=v["num_heads"])
    common.update(depth=v["depth"], initializer_range=INITIALIZER_RANGE)
    if arch == "qwen2_vl":
        vision = dict(
            common, embed_dim=v["embed_dim"], hidden_size=kw["hidden_size"], mlp_ratio=v["mlp_ratio"]
        )
        cls = Qwen2VLConfig
    else:  # window attention on all but the last block; 56-pixel windows: 2x2 merged cells
        vision = dict(
            common, hidden_size=v["embed_dim"], intermediate_size=v["embed_dim"] * v["mlp_ratio"],
            out_hidden_size=kw["hidden_size"], window_size=56, fullatt_block_indexes=[v["depth"] - 1],
        )  # fmt: skip
        cls = Qwen2_5_VLConfig
    return cls(
        text_config=kw,
        vision_config=vision,
        image_token_id=image_pad,
        video_token_id=video_pad,
        vision_start_token_id=vision_start,
        vision_end_token_id=vision_end,
        tie_word_embeddings=tie,
    )


def _model_class(config: Any) -> Any:
    """The HF class that builds ``config``'s model (vision-language models are not causal-LM autos)."""
    from transformers import (
        AutoModelForCausalLM,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
    )

    by_type = {"qwen2_vl": Qwen2VLForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration}
    cls = by_type.get(config.model_type)
    return cls if cls is not None else AutoModelForCausalLM


def count_params(config: Any) -> int:
    """Parameter count of ``config``'s model, built on the meta device (no weights materialised)."""
    import torch
    from transformers import AutoModelForCausalLM

    cls = _model_class(config)
    with torch.device("meta"):
        model = cls.from_config(config) if cls is AutoModelForCausalLM else cls(config)
    return sum(p.numel() for p in model.parameters())  # tied weights are yielded once


def make_tiny(arch: str, size: str, out: str | Path, seed: int = 0, progress: bool = True) -> Path:
    """Write a seeded random ``arch`` checkpoint of ``size`` with its tokenizer into ``out``."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, GenerationConfig

    from xengine.tools.bpe import VISION_TOKENS, VL_CHATML_TEMPLATE, save_tokenizer, train_bpe

    out = Path(out)
    bar = tqdm(total=3, desc=f"make-tiny {arch}/{size}", file=sys.stderr, disable=not progress)
    bar.set_postfix_str("training tokenizer")
    tok = train_bpe(_VOCAB[size], _CORPUS_CHARS[size], seed)
    vl = arch in VL_ARCHS
    if vl:
        info = save_tokenizer(tok, out, extra_special=VISION_TOKENS, chat_template=VL_CHATML_TEMPLATE)
        _save_image_processor(out)
    else:
        info = save_tokenizer(tok, out)
    bar.update()

    bar.set_postfix_str("initialising weights")
    config = build_config(arch, size, vocab_size=info.vocab_size, eos_token_id=info.im_end_id)
    torch.manual_seed(seed)
    cls = _model_class(config)
    if cls is AutoModelForCausalLM:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        model = cls(config).to(torch.float32)
    _randomise_router_biases(model, seed)
    randomise_gemma_norms(model, seed)
    if arch in HYBRID_ARCHS:  # parameters HF initialises to constants (norms, decays) made random
        _hybrid_module(arch).randomise(model, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=None,
        eos_token_id=[info.im_end_id, info.endoftext_id],
        pad_token_id=info.endoftext_id,
    )
    num_params = sum(p.numel() for p in model.parameters())
    bar.update()

    bar.set_postfix_str("saving")
    _save_quietly(model, out, quiet=not progress)
    bar.update()
    bar.close()
    if progress:
        print(f"wrote {arch}/{size} to {out}: {num_params / 1e6:.2f}M parameters", file=sys.stderr)
    return out


def _save_image_processor(out: Path) -> None:
    """``preprocessor_config.json`` of Qwen2-VL's image processor (CLIP mean/std, bicubic resize to
    multiples of 28 pixels) and ``processor_config.json``, so ``AutoProcessor`` loads the folder."""
    import json

    config = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "do_resize": True,
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_convert_rgb": True,
        "min_pixels": IMAGE_MIN_PIXELS,
        "max_pixels": IMAGE_MAX_PIXELS,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "processor_config.json").write_text(
        json.dumps({"processor_class": "Qwen2VLProcessor"}, indent=2) + "\n"
    )


def _randomise_router_biases(model: Any, seed: int) -> None:
    """DeepSeek-V3 routers start with a zero ``e_score_correction_bias``; give them seeded values so the
    bias-corrected expert choice is exercised (real checkpoints carry learned biases)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.05)


def randomise_gemma_norms(model: Any, seed: int) -> None:
    """Gemma's RMSNorms scale by ``1 + weight`` and start at zero; seeded offsets make that scaling (and
    each norm) matter, as in trained checkpoints."""
    import torch

    if getattr(model.config, "model_type", "") != "gemma3_text":
        return
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)


def _save_quietly(model: Any, out: Path, quiet: bool) -> None:
    """``save_pretrained`` as safetensors, without transformers' own progress bar when ``quiet``."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def ensure_default_model(progress: bool = True) -> Path:
    """Return the default model folder, generating it (qwen3 / small / seed 0) on first use.

    The build goes to a temporary folder next to the target and is renamed into place only when
    complete, so an interrupted build is never reused.
    """
    target = default_model_dir()
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        make_tiny("qwen3", "small", tmp, seed=0, progress=progress)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    """CLI: ``xllm model make-tiny --arch ARCH --size SIZE --out DIR [--seed N]``."""
    parser = argparse.ArgumentParser(prog="xllm model make-tiny", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=ARCHS, default="qwen3", help="model architecture")
    parser.add_argument("--size", choices=SIZES, default="tiny", help="tiny (~1M params) or small (~56M)")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the tokenizer corpus")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    args = parser.parse_args(argv)
    make_tiny(args.arch, args.size, args.out, seed=args.seed, progress=not args.quiet)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
