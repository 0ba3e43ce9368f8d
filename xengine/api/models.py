"""The choices of ``xllm model make-tiny`` (torch-free, so the CLI can list them)."""

from __future__ import annotations

ARCHS = ("qwen3", "qwen2", "llama", "qwen3_moe", "deepseek_v3", "qwen2_vl", "qwen2_5_vl", "gemma3",
         "mimo_v2_flash", "qwen3_next", "nemotron_h")  # fmt: skip
# hybrid architectures whose tiny / small configs live in ``xengine/tools/tiny_<arch>.py``
HYBRID_ARCHS = ("mimo_v2_flash", "qwen3_next", "nemotron_h")
VL_ARCHS = ("qwen2_vl", "qwen2_5_vl")  # vision-language: a vision tower and an image processor
SIZES = ("tiny", "small")
