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

from xengine.api.models import ARCHS, SIZES
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
_VOCAB = {"tiny": 2048, "small": 32000}
_CORPUS_CHARS = {"tiny": 400_000, "small": 12_000_000}
INITIALIZER_RANGE = 0.2
MAX_POSITION_EMBEDDINGS = 4096


def tie_embeddings(arch: str, size: str) -> bool:
    """Whether the generated checkpoint ties ``lm_head`` to the input embeddings."""
    return size == "tiny" and arch != "llama"


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
    if arch == "qwen3":
        config = Qwen3Config(**kw)
    elif arch == "qwen3_moe":
        moe = dict(_MOE[size], norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0])
        config = Qwen3MoeConfig(**kw, **moe)
    elif arch == "deepseek_v3":
        kw.pop("head_dim")  # MLA: qk_nope_head_dim + qk_rope_head_dim per query head
        kw["num_key_value_heads"] = kw["num_attention_heads"]  # as DeepSeek's configs: no GQA grouping
        config = DeepseekV3Config(**kw, **_DEEPSEEK[size], **_DEEPSEEK_COMMON)
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


def count_params(config: Any) -> int:
    """Parameter count of ``config``'s model, built on the meta device (no weights materialised)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # tied weights are yielded once


def make_tiny(arch: str, size: str, out: str | Path, seed: int = 0, progress: bool = True) -> Path:
    """Write a seeded random ``arch`` checkpoint of ``size`` with its tokenizer into ``out``."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, GenerationConfig

    from xengine.tools.bpe import save_tokenizer, train_bpe

    out = Path(out)
    bar = tqdm(total=3, desc=f"make-tiny {arch}/{size}", file=sys.stderr, disable=not progress)
    bar.set_postfix_str("training tokenizer")
    tok = train_bpe(_VOCAB[size], _CORPUS_CHARS[size], seed)
    info = save_tokenizer(tok, out)
    bar.update()

    bar.set_postfix_str("initialising weights")
    config = build_config(arch, size, vocab_size=info.vocab_size, eos_token_id=info.im_end_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise_router_biases(model, seed)
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


def _randomise_router_biases(model: Any, seed: int) -> None:
    """DeepSeek-V3 routers start with a zero ``e_score_correction_bias``; give them seeded values so the
    bias-corrected expert choice is exercised (real checkpoints carry learned biases)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.05)


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
