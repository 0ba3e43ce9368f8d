"""Hugging Face ``transformers`` generate throughput: batched, left-padded, greedy, fixed output length."""

from __future__ import annotations

import gc
import time

import torch


def _left_pad(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, p in enumerate(batch):
        ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p) :] = 1
    return ids, mask


def _generate(model: torch.nn.Module, batch: list[list[int]], new_tokens: int, pad_id: int) -> int:
    """Greedy-generate exactly ``new_tokens`` per prompt; return the number of generated tokens."""
    ids, mask = _left_pad(batch, pad_id)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=pad_id,
    )
    return (out.shape[1] - ids.shape[1]) * out.shape[0]


def hf_throughput(
    model_dir: str,
    prompts: list[list[int]],
    output_len: int,
    batch_size: int,
    dtype: torch.dtype = torch.float32,
    repeats: int = 1,
) -> dict:
    """Output tok/s of ``model.generate`` over ``prompts`` in batches of ``batch_size`` (in ``dtype``):
    the median of ``repeats`` timed runs, each run's rate in ``output_tok_s_runs``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    pad_id = model.generation_config.pad_token_id
    pad_id = 0 if pad_id is None else int(pad_id if isinstance(pad_id, int) else pad_id[0])
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    with torch.inference_mode():
        _generate(model, prompts[:2], 2, pad_id)  # warm-up
        runs = []
        for _ in range(max(1, repeats)):
            start = time.perf_counter()
            num_out = sum(_generate(model, batch, output_len, pad_id) for batch in batches)
            runs.append((time.perf_counter() - start, num_out))
    elapsed, num_out = sorted(runs)[len(runs) // 2]  # the median run
    del model
    gc.collect()
    return {
        "dtype": str(dtype).replace("torch.", ""),
        "elapsed_s": elapsed,
        "batch_size": batch_size,
        "num_output_tokens": num_out,
        "output_tok_s": num_out / elapsed,
        "repeats": len(runs),
        "output_tok_s_runs": [n / e for e, n in runs],
    }
