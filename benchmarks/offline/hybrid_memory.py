"""Hybrid KV memory (``cache.hybrid_kv``): sliding-window layers in a pool of their own; prints one JSON.

Models: the tiny Gemma 3 of ``make_tiny`` (one global layer to three sliding ones, window 32) and a
MiMo-shaped one generated here (Gemma 3 layers, one global to five sliding, window 128: MiMo-V2.5's
ratio and window), and make_tiny's MiMo-V2-Flash (its sliding layers hold twice the KV heads: each
pool has its own page size; only the bytes and window-use sections, as one uniform pool cannot hold
it). For each:

- ``kv_bytes_per_token``: per kind, the theory (2 x KV heads x head dim x element bytes x layers of
  the kind) next to what the engine allocated (its pools' specs); sliding-window bytes are held for at
  most the window per sequence, full-attention bytes for every token;
- ``capacity``: ``--capacity-prompts`` prompts of ``--capacity-len`` tokens (one prompt a step) in a
  ``--budget-mib`` KV budget, each generating more tokens than all prompts take to prefill, run to the
  end with the window pool and without (every layer full-length KV); the most sequences running at
  once in each, and their ratio;
- ``window_use``: one ``--long-prompt``-token prompt generating ``--long-output`` tokens: the most
  window-pool blocks the sequence held while decoding, beside the bound (window / block + 2);
- ``decode_vs_context``: ``--decode-batch`` sequences decoding at each context length, median decode
  step time and tok/s, for the model and for the same weights with every layer global (the control).
  The sliding layers read only the window, so their share of the step stays flat past it; the global
  layers' grows with the context;
- ``multi_turn_prefix_hits``: a multi-turn chat trace (``--chats`` conversations, ``--turns`` turns,
  each prompt the conversation so far): the prefix-cache token hit rate with window-safe hits and
  with every layer full-length (the full-attention model's rate), and their ratio.

    PYTHONPATH=. .venv/bin/python -m benchmarks.offline.hybrid_memory --num-threads 1
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.checkpoint import cache_root, generated_checkpoint
from benchmarks.machine import describe
from benchmarks.offline.multi_turn import run_chat_trace, trace_max_len
from benchmarks.smoke import add_smoke_flag, parse_args

MIMO_SHAPE = dict(
    hidden_size=128, intermediate_size=384, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, sliding_window=128, vocab_size=2048,
)  # fmt: skip


def mimo_shaped_checkpoint(tokenizer_from: Path) -> Path:
    """A Gemma 3 checkpoint with MiMo-V2.5's layer ratio and window (generated once into the cache)."""
    out = cache_root() / "gemma3-mimo-shape-seed0"
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from xengine.tools.make_tiny import randomise_gemma_norms

    n = MIMO_SHAPE["num_hidden_layers"]
    config = Gemma3TextConfig(
        **MIMO_SHAPE,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)],
        max_position_embeddings=16384,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=None,
        pad_token_id=None,
        eos_token_id=json.loads((tokenizer_from / "config.json").read_text())["eos_token_id"],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomise_gemma_norms(model, 0)
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in tokenizer_from.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, tmp / f.name)
    tmp.rename(out)
    return out


def _llm(model_dir: Path, hybrid: str, threads: int, **kw: Any) -> Any:
    from xengine.llm import LLM

    return LLM(str(model_dir), hybrid_kv=hybrid, num_threads=threads, block_size=16, **kw)


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 2000, (length,), generator=gen).tolist() for _ in range(n)]


def bytes_section(model_dir: Path, threads: int) -> dict[str, Any]:
    from xengine.kv_setup import kv_cache_heads

    llm = _llm(model_dir, "on", threads, num_blocks=64, max_model_len=1024)
    setup, cfg = llm.engine.kv_setup, llm.engine.model.config
    elem = torch.empty((), dtype=llm.engine.dtype).element_size()
    (full_heads, full_dim), (window_heads, window_dim) = kv_cache_heads(llm.engine.model_info)
    num_window = sum(1 for w in cfg.sliding_windows if w)
    num_full = len(cfg.sliding_windows) - num_window
    window = max(w for w in cfg.sliding_windows if w)
    full_per_layer, window_per_layer = 2 * full_heads * full_dim * elem, 2 * window_heads * window_dim * elem
    return {
        "window": window,
        "layers": {"full_attention": num_full, "sliding_window": num_window},
        "kv_heads": {"full_attention": [full_heads, full_dim], "sliding_window": [window_heads, window_dim]},
        "theory": {
            "full_attention_per_token": full_per_layer * num_full,
            "sliding_window_per_token": window_per_layer * num_window,
            "sliding_window_per_sequence_max": window_per_layer * num_window * window,
        },
        "engine": {
            "full_attention_per_token": setup.spec.bytes_per_block // setup.spec.block_size,
            "sliding_window_per_token": setup.window_spec.bytes_per_block // setup.window_spec.block_size,
        },
    }


def _peak_running(llm: Any, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    from xengine.api.messages import AddRequest, SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(AddRequest(req_id=f"cap-{i}", prompt_token_ids=p, params=params))
    peak = steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        peak = max(peak, len(engine.scheduler.running))
    stats = engine.get_stats()
    return {"peak_running": peak, "steps": steps, "preemptions": stats.num_preemptions}


def capacity_section(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    prompts = _prompts(args.capacity_prompts, args.capacity_len, seed=1)
    kw = dict(
        max_num_seqs=args.capacity_prompts,
        max_num_batched_tokens=args.capacity_chunk,
        mixed_prefill_tokens=0,  # a whole prompt a step even beside decodes: all admitted in time
        max_model_len=args.capacity_len + args.capacity_output,
        kv_cache_memory_gb=args.budget_mib / 1024,
        enable_prefix_caching=False,
    )
    out: dict[str, Any] = {"budget_mib": args.budget_mib, "prompt_len": args.capacity_len}
    for mode in ("on", "off"):
        llm = _llm(model_dir, mode, args.num_threads, **kw)
        print(f"[capacity] hybrid_kv {mode}", file=sys.stderr)
        out[f"hybrid_{mode}"] = _peak_running(llm, prompts, args.capacity_output)
        del llm
        gc.collect()
    off = out["hybrid_off"]["peak_running"]
    out["ratio"] = out["hybrid_on"]["peak_running"] / off if off else None
    # layer-tokens one sequence holds: every layer full-length, against global layers full-length and
    # sliding ones the window plus two blocks (the window pool also keeps one step's chunk, once)
    cfg = json.loads((model_dir / "config.json").read_text())
    types, window = cfg["layer_types"], cfg["sliding_window"]
    length = args.capacity_len + args.capacity_output
    hybrid = types.count("full_attention") * length + types.count("sliding_attention") * (window - 1 + 32)
    out["theory_ratio"] = len(types) * length / hybrid
    return out


def window_use_section(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from xengine.api.messages import AddRequest, SamplingParams

    max_len = args.long_prompt + args.long_output + 8
    llm = _llm(model_dir, "on", args.num_threads, max_num_batched_tokens=args.chunk, max_model_len=max_len)
    engine = llm.engine
    window = engine.kv.window
    params = SamplingParams(temperature=0.0, max_tokens=args.long_output, ignore_eos=True)
    prompt = _prompts(1, args.long_prompt, seed=2)[0]
    engine.add_request(AddRequest(req_id="long", prompt_token_ids=prompt, params=params))
    peak_prefill = peak_decode = 0
    while engine.has_unfinished_requests():
        engine.step()
        seq = engine.scheduler.seqs.get("long")
        if seq is None or "long" not in window.tables:
            continue
        held = window.num_held("long")
        if seq.num_computed_tokens > args.long_prompt:
            peak_decode = max(peak_decode, held)
        else:
            peak_prefill = max(peak_prefill, held)
    bs = window.block_size
    return {
        "prompt_len": args.long_prompt,
        "output_len": args.long_output,
        "block_size": bs,
        "peak_blocks_decoding": peak_decode,
        "peak_blocks_prefilling": peak_prefill,
        "bound_decoding": -(-(window.window - 1) // bs) + 2,
        "bound_prefilling": window.blocks_needed_per_sequence(args.chunk),
        "full_length_blocks": -(-(args.long_prompt + args.long_output) // bs),
    }


def all_global_copy(model_dir: Path) -> Path:
    """The same weights with every layer global (full attention): the control of ``decode_section``."""
    out = model_dir.with_name(model_dir.name + "-all-global")
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.name != "config.json":
            (tmp / f.name).symlink_to(f.resolve())
    config = json.loads((model_dir / "config.json").read_text())
    config["layer_types"] = ["full_attention"] * len(config["layer_types"])
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(out)
    return out


def decode_section(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Median decode step of ``--decode-batch`` sequences at each context, for the model (its sliding
    layers read only the window; their KV in the window pool) and for the same weights with every
    layer global (the control: every layer's reads grow with the context)."""
    from xengine.api.messages import AddRequest, SamplingParams

    out: dict[str, Any] = {"batch": args.decode_batch, "steps": args.decode_steps}
    for name, path in (("sliding", model_dir), ("all_global", all_global_copy(model_dir))):
        llm = _llm(
            path, "auto", args.num_threads, max_num_batched_tokens=max(args.chunk, args.decode_batch),
            max_model_len=max(args.contexts) + args.decode_steps + 4 + -(-args.decode_batch * max(args.contexts) // args.chunk),
            enable_prefix_caching=False,
        )  # fmt: skip
        engine = llm.engine
        rows = {}
        for ctx in [args.contexts[0], *args.contexts]:  # the first once more: a warm-up, not reported
            # the first sequences decode while the last ones prefill: enough tokens that every one is
            # still decoding for ``decode_steps`` steps once all have prefilled
            prefill_steps = -(-args.decode_batch * ctx // args.chunk) + 2
            params = SamplingParams(
                temperature=0.0, max_tokens=args.decode_steps + prefill_steps, ignore_eos=True
            )
            for i, p in enumerate(_prompts(args.decode_batch, ctx, seed=ctx)):
                engine.add_request(AddRequest(req_id=f"d{name}{ctx}-{i}", prompt_token_ids=p, params=params))
            times = []
            while engine.has_unfinished_requests():
                engine.step()
                t = engine.last_step_timing
                if t is not None and t.num_seqs == args.decode_batch and t.num_tokens == args.decode_batch:
                    times.append(t.total_s)
            step = statistics.median(times[2:] or times)
            rows[str(ctx)] = {"step_ms": step * 1e3, "tok_s": args.decode_batch / step}
            print(f"[decode] {name} context {ctx}: {step * 1e3:.2f} ms", file=sys.stderr)
        out[name] = rows
        del llm, engine
        gc.collect()
    return out


def multi_turn_section(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The chat trace of ``benchmarks/offline/multi_turn.py``: prefix-cache token hit rate with the
    window pool (window-safe hits) and without it (every layer full-length: the full-attention
    model's rate)."""
    out: dict[str, Any] = {"chats": args.chats, "turns": args.turns}
    for mode in ("on", "off"):
        llm = _llm(
            model_dir, mode, args.num_threads, max_num_batched_tokens=args.chunk, max_num_seqs=args.chats,
            max_model_len=trace_max_len(args), kv_cache_memory_gb=args.multi_turn_budget_mib / 1024,
        )  # fmt: skip
        out[f"hybrid_{mode}"] = run_chat_trace(llm, args)
        print(f"[multi-turn] hybrid_kv {mode}: {out[f'hybrid_{mode}']}", file=sys.stderr)
        del llm
        gc.collect()
    off = out["hybrid_off"]["hit_rate"]
    out["hit_rate_ratio"] = out["hybrid_on"]["hit_rate"] / off if off else None
    return out


SMOKE = dict(
    capacity_prompts=4, capacity_len=96, capacity_output=4, capacity_chunk=128, budget_mib=2.0, long_prompt=64, long_output=40,
    contexts=[16, 64], decode_batch=2, decode_steps=4, chunk=64, mimo=False, chats=2, turns=2, system_len=32,
    user_len=8, answer_len=4,
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--budget-mib", type=float, default=64.0, help="KV budget of the capacity runs")
    p.add_argument("--capacity-prompts", type=int, default=32)
    p.add_argument("--capacity-len", type=int, default=3900, help="prompt tokens (+ output: a 4k sequence)")
    p.add_argument(
        "--capacity-output",
        type=int,
        default=128,
        help="output tokens: more than the prefill steps of all prompts, so the admitted ones are all running",
    )
    p.add_argument(
        "--capacity-chunk", type=int, default=4096, help="max_num_batched_tokens of the capacity runs"
    )
    p.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    p.add_argument("--long-prompt", type=int, default=1024)
    p.add_argument("--long-output", type=int, default=1024)
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024, 2048, 3500])
    p.add_argument("--decode-batch", type=int, default=16)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--chats", type=int, default=16, help="multi-turn: conversations")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--answer-len", type=int, default=48)
    p.add_argument("--multi-turn-budget-mib", type=float, default=32.0)
    p.add_argument(
        "--mimo", action=argparse.BooleanOptionalAction, default=True, help="the MiMo-shaped model too"
    )
    p.add_argument(
        "--sections",
        nargs="+",
        default=["bytes", "capacity", "window_use", "decode", "multi_turn"],
        choices=["bytes", "capacity", "window_use", "decode", "multi_turn"],
    )
    add_smoke_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv, SMOKE)
    torch.set_num_threads(args.num_threads)
    gemma3 = generated_checkpoint("gemma3", "tiny")
    models = {"gemma3_tiny": gemma3}
    if args.mimo:
        models["mimo_shaped"] = mimo_shaped_checkpoint(gemma3)
        models["mimo_v2_flash_tiny"] = generated_checkpoint("mimo_v2_flash", "tiny")
    report: dict[str, Any] = {"machine": describe(args.num_threads), "config": vars(args), "models": {}}
    for name, path in models.items():
        print(f"[{name}] {path}", file=sys.stderr)
        sections = {
            "bytes": ("kv_bytes_per_token", lambda p: bytes_section(p, args.num_threads)),
            "capacity": ("capacity", lambda p: capacity_section(p, args)),
            "window_use": ("window_use", lambda p: window_use_section(p, args)),
            "decode": ("decode_vs_context", lambda p: decode_section(p, args)),
            "multi_turn": ("multi_turn_prefix_hits", lambda p: multi_turn_section(p, args)),
        }
        # MiMo-V2-Flash's kinds differ in KV heads: one uniform pool cannot hold it (no hybrid_kv off runs)
        wanted = [k for k in args.sections if name != "mimo_v2_flash_tiny" or k in ("bytes", "window_use")]
        report["models"][name] = {sections[k][0]: sections[k][1](path) for k in wanted}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
