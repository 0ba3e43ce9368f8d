"""The modes ``dtype_accuracy`` scores: each one a way to turn a token sequence into logits.

A mode is a factory ``model_dir -> LogitsFn``; ``LogitsFn(token_ids [L] int64) -> [L, vocab] float32``
gives the logits of every position of one teacher-forced, full-sequence forward. ``hf_*`` modes run
``transformers`` on the checkpoint (``hf_float32`` is the reference every mode is scored against);
``xllm_*`` modes run our model as the engine loads it (``xengine.models.loader.load_model``) over a fresh
paged KV cache (``benchmarks.forward_profile.Case``). A new mode (int8, w8a8, int4, ...) is one more
entry in ``MODES``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks.forward_profile import Case

LogitsFn = Callable[[torch.Tensor], torch.Tensor]
REFERENCE = "hf_float32"
BLOCK_SIZE = 16


def hf_logits_fn(model_dir: str, dtype: torch.dtype) -> LogitsFn:
    """Logits of the ``transformers`` model loaded in ``dtype`` (its default attention), as float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()

    def logits(token_ids: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return model(input_ids=token_ids.unsqueeze(0)).logits[0].float()

    return logits


def xllm_logits_fn(model_dir: str, dtype: torch.dtype, quantization: str = "none") -> LogitsFn:
    """Logits of our model loaded in ``dtype`` (and ``quantization``) as the engine loads it: one
    prefill of the whole sequence over a fresh paged KV cache, logits of every position
    (``compute_logits``, float32)."""
    from xengine.models.loader import load_model

    model = load_model(model_dir, dtype, torch.device("cpu"), quantization)
    cases: dict[int, Case] = {}

    def logits(token_ids: torch.Tensor) -> torch.Tensor:
        length = token_ids.shape[0]
        case = cases.get(length)
        if case is None:
            case = cases[length] = Case(model, [length], [length], BLOCK_SIZE)
            case.last = torch.arange(length)
        case.input_ids = token_ids
        with torch.inference_mode():
            return case.run()

    return logits


MODES: dict[str, Callable[[str], LogitsFn]] = {
    REFERENCE: lambda d: hf_logits_fn(d, torch.float32),
    "hf_bfloat16": lambda d: hf_logits_fn(d, torch.bfloat16),
    "xllm_float32": lambda d: xllm_logits_fn(d, torch.float32),
    "xllm_bfloat16": lambda d: xllm_logits_fn(d, torch.bfloat16),
    "xllm_w8a8_float32": lambda d: xllm_logits_fn(d, torch.float32, "w8a8"),
    "xllm_w8a8_bfloat16": lambda d: xllm_logits_fn(d, torch.bfloat16, "w8a8"),
}
DEFAULT_MODES = [name for name in MODES if name != REFERENCE]
