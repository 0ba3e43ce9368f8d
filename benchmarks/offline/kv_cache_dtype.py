"""8-bit KV cache (``--kv-cache-dtype int8|fp8``) against float32 / bfloat16 KV; prints one JSON.

- ``pool``: tokens the KV pool that ``--pool-gb`` buys holds, counted from the allocated tensors
  (``build_kv``, the engine's own call) for float32, bfloat16, int8 and fp8 KV, and the ratios.
- ``decode``: the ``--decode-size`` checkpoint with bfloat16 weights (its RoPE scaled linearly by 2,
  so contexts up to 8192 tokens are in range); B sequences whose first ``context`` tokens are already
  in the cache (random K/V written straight into their blocks, quantized
  for an 8-bit cache: no prefill), then ``--steps`` greedy decode steps; median step and forward time
  per KV dtype (bf16 = ``auto``, int8, fp8) and the 8-bit speedups.
- ``accuracy``: float32 weights, per checkpoint and 8-bit format: teacher-forced next-token agreement
  and mean KL(float32 KV || 8-bit KV) over sequences decoded one token at a time, and greedy generation
  through the engine compared token by token with the float32 KV's (near-ties of a random checkpoint
  flip on any rounding; the teacher-forced numbers are the measure).

    PYTHONPATH=. .venv/bin/python -m benchmarks.offline.kv_cache_dtype --num-threads 1
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.checkpoint import cache_root, generated_checkpoint
from benchmarks.machine import describe
from benchmarks.smoke import add_smoke_flag, parse_args

KV_DTYPES = ("auto", "int8", "fp8")
POOL_CASES = (("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "int8"), ("bfloat16", "fp8"))


def pool_section(model_dir: str, pool_gb: float) -> dict[str, Any]:
    """Tokens and bytes of the allocated pool for each KV element type, from one ``pool_gb``."""
    from ops.platforms import resolve_platform
    from xengine.api.config import CacheConfig, SchedulerConfig
    from xengine.kv_setup import build_kv
    from xengine.models.info import read_model_info

    info = read_model_info(model_dir)
    out: dict[str, Any] = {"pool_gb": pool_gb}
    for dtype, kv_dtype in POOL_CASES:
        cache = CacheConfig(kv_cache_memory_gb=pool_gb, kv_cache_dtype=kv_dtype, kv_layout="paged")
        # max_num_seqs high enough that memory, not the worst case of the sequences, sizes the pool
        kv = build_kv(cache, SchedulerConfig(max_num_seqs=1 << 20), info, getattr(torch, dtype),
                      resolve_platform("cpu"), info.max_position_embeddings)  # fmt: skip
        first = kv.kv_caches[0]
        tokens = first.shape[1] * first.shape[2]
        num_bytes = sum(t.nbytes for t in kv.kv_caches)
        out[kv.spec.cache_dtype_name] = {
            "tokens": tokens,
            "pool_bytes": num_bytes,
            "bytes_per_token": num_bytes // tokens,
            "tensor_dtype": str(first.dtype).replace("torch.", ""),
        }
        del kv
    for base in ("float32", "bfloat16"):
        for fmt in ("int8", "fp8"):
            out[f"{fmt}_over_{base}"] = round(out[fmt]["tokens"] / out[base]["tokens"], 3)
    return out


def long_context_checkpoint(model_dir: str, factor: float = 2.0) -> str:
    """A sibling of ``model_dir`` whose RoPE is scaled linearly by ``factor`` (``factor`` times the
    positions), the weights linked, not copied; made once under the benchmark cache."""
    source = Path(model_dir)
    target = cache_root() / f"{source.name}-rope{factor:g}x"
    if not (target / "config.json").is_file():
        target.mkdir(parents=True, exist_ok=True)
        for f in source.iterdir():
            if f.name != "config.json" and not (target / f.name).exists():
                (target / f.name).symlink_to(f.resolve())
        config = json.loads((source / "config.json").read_text())
        config["rope_parameters"] = {**config["rope_parameters"], "rope_type": "linear", "factor": factor}
        (target / "config.json.tmp").write_text(json.dumps(config, indent=2))
        (target / "config.json.tmp").replace(target / "config.json")
    return str(target)


def _engine(model_dir: str, kv_dtype: str, dtype: str, batch: int, max_len: int, num_threads: int):
    from xengine.engine import Engine
    from xengine.llm import engine_config

    config = engine_config(
        model_dir, dtype=dtype, kv_cache_dtype=kv_dtype, kv_layout="paged", block_size=16,
        num_blocks=batch * (-(-max_len // 16) + 2) + 1, max_model_len=max_len, max_num_seqs=max(batch, 1),
        max_num_batched_tokens=max(2048, batch), num_threads=num_threads,
    )  # fmt: skip
    return Engine(config)


def _inject(engine: Any, batch: int, context: int, max_tokens: int, seed: int) -> None:
    """Add ``batch`` requests whose first ``context - 1`` tokens count as computed, their K/V random
    (quantized row by row for an 8-bit cache, as the store would write them)."""
    from ops.kv_quant import kv_format, quantize
    from xengine.api.messages import AddRequest, SamplingParams
    from xengine.request import RequestStatus

    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(3, engine.vocab_size, (context,), generator=gen).tolist()
        engine.add_request(AddRequest(req_id=f"r{i}", prompt_token_ids=prompt, params=params))
    sched, kv, caches = engine.scheduler, engine.kv, engine.runner.kv_caches
    for req in list(sched.waiting):
        assert kv.allocate_slots(req.seq_id, context)
        blocks = torch.tensor(kv.block_tables[req.seq_id][: -(-context // kv.block_size)])
        for cache in caches:
            shape = cache[:, blocks].shape
            fmt = kv_format(cache)
            if fmt is None:
                cache[:, blocks] = torch.randn(shape, generator=gen, dtype=cache.dtype)
            else:
                cache[:, blocks] = quantize(torch.randn(*shape[:-1], shape[-1] - 4, generator=gen), fmt)
        req.num_computed_tokens = context - 1  # the last prompt token is computed by the first step
        req.admitted_once = True
        req.status = RequestStatus.RUNNING
        sched.running.append(req)
    sched.waiting.clear()


def decode_case(model_dir: str, kv_dtype: str, batch: int, context: int, args: argparse.Namespace) -> dict:
    steps = args.warmup + args.steps
    engine = _engine(model_dir, kv_dtype, "bfloat16", batch, context + steps + 8, args.num_threads)
    try:
        _inject(engine, batch, context, steps + 2, args.seed)
        total, forward = [], []
        for _ in range(steps):
            engine.step()
            total.append(engine.last_step_timing.total_s)
            forward.append(engine.last_step_timing.forward_s)
        step = statistics.median(total[args.warmup :])
        spec = engine.kv_setup.spec
        return {
            "step_ms": round(step * 1e3, 3),
            "forward_ms": round(statistics.median(forward[args.warmup :]) * 1e3, 3),
            "output_tok_s": round(batch / step, 1),
            "kv_bytes_read_per_step": batch * context * spec.bytes_per_block // spec.block_size,
        }
    finally:
        del engine
        gc.collect()


def decode_section(model_dir: str, args: argparse.Namespace) -> list[dict]:
    rows = []
    for context in args.contexts:
        for batch in args.batch_sizes:
            row: dict[str, Any] = {"batch": batch, "context": context}
            for kv_dtype in KV_DTYPES:
                print(f"[decode] kv {kv_dtype} B={batch} context={context}", file=sys.stderr)
                row["bfloat16" if kv_dtype == "auto" else kv_dtype] = decode_case(
                    model_dir, kv_dtype, batch, context, args
                )
            for fmt in ("int8", "fp8"):
                row[f"{fmt}_speedup"] = round(row["bfloat16"]["step_ms"] / row[fmt]["step_ms"], 3)
            rows.append(row)
    return rows


def teacher_forced_logits(model: Any, ids: torch.Tensor, prompt_len: int, kv_dtype: str) -> torch.Tensor:
    """Logits ``[B, L - 1 - prompt_len, V]`` of decoding ``ids`` ([B, L]) one token at a time after a
    ``prompt_len`` prefill, each step fed the true next token, over a fresh paged cache."""
    from memory.kv_layout import KVCacheSpec, PagedKVLayout
    from ops.attention import build_attention_metadata

    cfg, (batch, length), block_size = model.config, ids.shape, 16
    per_seq = -(-length // block_size)
    dtype = next(model.parameters()).dtype
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, dtype, kv_dtype)
    caches = PagedKVLayout().allocate(spec, batch * per_seq + 1, torch.device("cpu"))
    tables = [[1 + b * per_seq + j for j in range(per_seq)] for b in range(batch)]
    logits = []
    with torch.inference_mode():
        meta = build_attention_metadata([prompt_len] * batch, [prompt_len] * batch, tables, block_size)
        model(ids[:, :prompt_len].reshape(-1), torch.arange(prompt_len).repeat(batch), caches, meta)
        for t in range(prompt_len, length - 1):
            meta = build_attention_metadata([1] * batch, [t + 1] * batch, tables, block_size)
            logits.append(
                model.compute_logits(model(ids[:, t], torch.full((batch,), t), caches, meta)).float()
            )
    return torch.stack(logits, 1)


def _greedy(model_dir: str, kv_dtype: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from xengine.api.messages import SamplingParams
    from xengine.llm import LLM

    llm = LLM(model=model_dir, dtype="float32", kv_cache_dtype=kv_dtype, kv_layout="paged", seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def accuracy_section(model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    from xengine.models.loader import load_model

    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (args.tf_seqs, args.tf_len), generator=gen)
    full = teacher_forced_logits(model, ids, args.tf_prompt, "auto")
    top2 = full.topk(2, -1).values
    clear = top2[..., 0] - top2[..., 1] > args.margin
    prompts = torch.randint(3, vocab, (args.greedy_prompts, args.greedy_prompt_len), generator=gen).tolist()
    greedy_full = _greedy(model_dir, "auto", prompts, args.greedy_tokens)
    out: dict[str, Any] = {"positions": full.shape[0] * full.shape[1], "clear_positions": int(clear.sum())}
    for fmt in ("int8", "fp8"):
        logits = teacher_forced_logits(model, ids, args.tf_prompt, fmt)
        agree = logits.argmax(-1) == full.argmax(-1)
        p = full.log_softmax(-1)
        kl = (p.exp() * (p - logits.log_softmax(-1))).sum(-1)
        tokens = _greedy(model_dir, fmt, prompts, args.greedy_tokens)
        first_diff = [
            next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
            for x, y in zip(tokens, greedy_full)
        ]
        out[fmt] = {
            "teacher_forced_agreement": round(agree.float().mean().item(), 4),
            f"agreement_margin_over_{args.margin}": round(agree[clear].float().mean().item(), 4),
            "mean_kl": round(kl.mean().item(), 6),
            "max_kl": round(kl.max().item(), 4),
            "max_abs_logit_diff": round((logits - full).abs().max().item(), 4),
            "greedy_sequences_identical": sum(x == y for x, y in zip(tokens, greedy_full)),
            "greedy_sequences": len(prompts),
            "greedy_mean_tokens_before_divergence": round(statistics.mean(first_diff), 2),
        }  # fmt: skip
    return out


SMOKE = dict(
    pool_gb=0.01, decode_size="tiny", accuracy_sizes=["tiny"], batch_sizes=[1], contexts=[64], steps=1,
    warmup=1, tf_seqs=2, tf_len=24, tf_prompt=8, greedy_prompts=2, greedy_tokens=4,
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="qwen3")
    p.add_argument("--pool-gb", type=float, default=1.0, help="kv_cache_memory_gb of the pool section")
    p.add_argument("--decode-size", default="small", choices=["tiny", "small"])
    p.add_argument("--accuracy-sizes", nargs="*", default=["tiny", "small"], choices=["tiny", "small"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--contexts", type=int, nargs="+", default=[4000, 8000])  # RoPE x2: 8192 positions
    p.add_argument("--steps", type=int, default=20, help="decode steps measured (median)")
    p.add_argument("--warmup", type=int, default=3, help="decode steps run before measuring")
    p.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads of the engine")
    p.add_argument("--tf-seqs", type=int, default=8, help="teacher-forced sequences")
    p.add_argument("--tf-len", type=int, default=288, help="tokens per teacher-forced sequence")
    p.add_argument("--tf-prompt", type=int, default=32, help="of those, prefilled before decoding")
    p.add_argument("--margin", type=float, default=1.0, help="top-1 lead over top-2 of a clear position")
    p.add_argument("--greedy-prompts", type=int, default=16)
    p.add_argument("--greedy-prompt-len", type=int, default=64)
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    add_smoke_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv, SMOKE)
    torch.set_num_threads(args.num_threads)
    decode_dir = long_context_checkpoint(str(generated_checkpoint(args.arch, args.decode_size)))
    report: dict[str, Any] = {
        "config": vars(args),
        "machine": describe(args.num_threads),
        "pool": pool_section(decode_dir, args.pool_gb),
        "decode": {"size": args.decode_size, "weights": "bfloat16", "rows": decode_section(decode_dir, args)},
        "accuracy": {},
    }
    for size in args.accuracy_sizes:
        print(f"[accuracy] {size}", file=sys.stderr)
        report["accuracy"][size] = accuracy_section(str(generated_checkpoint(args.arch, size)), args)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
