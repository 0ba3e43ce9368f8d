"""Recurrent hybrid models (Qwen3-Next, Nemotron-H) on the engine; prints one JSON.

For each model (make_tiny's ``--size`` checkpoints of ``--archs``):

- ``memory``: attention KV bytes per token (theory: 2 x KV heads x head dim x element bytes x
  attention layers) next to what the engine allocated, and recurrent state bytes per sequence (theory
  from the config: the causal-conv window and the SSM / delta-rule state of every recurrent layer)
  next to the engine's state pool slot, which holds it whatever the sequence's length;
- ``multi_turn_prefix_hits``: the chat trace of ``benchmarks/offline/multi_turn.py``: the token hit
  rate with snapshot-safe hits, beside a full-attention model's (make_tiny's qwen3 of the same size)
  on the same trace, and their ratio;
- ``speed``: prefill tok/s (a ``--prompt-len`` prompt, one output token) and decode tok/s (the
  ``--output-len`` tokens after it, batch ``--batch``) of the engine against HF ``generate`` on the
  same weights (fp32, the same thread count), medians of ``--repeats`` runs.

    PYTHONPATH=. .venv/bin/python -m benchmarks.offline.recurrent_models --num-threads 1
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.checkpoint import generated_checkpoint
from benchmarks.machine import describe
from benchmarks.offline.multi_turn import run_chat_trace, trace_max_len
from benchmarks.smoke import add_smoke_flag, parse_args


def _llm(model_dir: Path, threads: int, **kw: Any) -> Any:
    from xengine.llm import LLM

    return LLM(str(model_dir), num_threads=threads, block_size=16, **kw)


def state_theory(hf: dict[str, Any]) -> dict[str, int]:
    """Bytes of one sequence's recurrent state from the config (conv state in fp32 checkpoints' dtype,
    SSM / delta-rule state in fp32), and the numbers of recurrent and attention layers."""
    t = hf.get("model_type")
    if t == "qwen3_next":
        types = hf.get("layer_types") or []
        layers = sum(1 for x in types if x == "linear_attention")
        attention = sum(1 for x in types if x == "full_attention")
        key_dim = hf["linear_num_key_heads"] * hf["linear_key_head_dim"]
        value_dim = hf["linear_num_value_heads"] * hf["linear_value_head_dim"]
        conv = (2 * key_dim + value_dim) * (hf["linear_conv_kernel_dim"] - 1)
        ssm = hf["linear_num_value_heads"] * hf["linear_key_head_dim"] * hf["linear_value_head_dim"]
    elif t == "nemotron_h":
        # transformers 5 writes layers_block_type (Mamba2 layers as "linear_attention"); older: the pattern
        kinds = hf.get("layers_block_type") or list(hf.get("hybrid_override_pattern") or "")
        layers = sum(1 for k in kinds if k in ("mamba", "linear_attention", "M"))
        attention = sum(1 for k in kinds if k in ("attention", "full_attention", "*"))
        inner = hf["mamba_num_heads"] * hf["mamba_head_dim"]
        conv = (inner + 2 * hf["n_groups"] * hf["ssm_state_size"]) * (hf["conv_kernel"] - 1)
        ssm = hf["mamba_num_heads"] * hf["mamba_head_dim"] * hf["ssm_state_size"]
    else:
        raise ValueError(f"no state theory for model_type {t!r}")
    return {
        "recurrent_layers": layers,
        "attention_layers": attention,
        "per_sequence": layers * (conv + ssm) * 4,
    }


def memory_section(model_dir: Path, threads: int) -> dict[str, Any]:
    hf = json.loads((model_dir / "config.json").read_text())
    llm = _llm(model_dir, threads, num_blocks=64, max_model_len=1024)
    engine = llm.engine
    spec, states = engine.kv_setup.spec, engine.state_setup
    assert states is not None
    elem = torch.empty((), dtype=engine.dtype).element_size()
    theory = state_theory(hf)
    attention_layers = theory["attention_layers"]
    stats = states.stats()
    return {
        "layers": {"attention": attention_layers, "recurrent": theory["recurrent_layers"]},
        "theory": {
            "attention_kv_per_token": 2 * spec.num_kv_heads * spec.head_dim * elem * attention_layers,
            "recurrent_state_per_sequence": theory["per_sequence"],
        },
        "engine": {
            "attention_kv_per_token": spec.bytes_per_block // spec.block_size,
            "recurrent_state_per_sequence": stats.bytes_per_slot,
            "state_slots": stats.num_seq_slots,
            "snapshot_slots": stats.num_snapshot_slots,
        },
    }


def multi_turn_section(model_dir: Path, baseline: Path, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"chats": args.chats, "turns": args.turns}
    for name, path in (("model", model_dir), ("full_attention_baseline", baseline)):
        llm = _llm(
            path, args.num_threads, max_num_batched_tokens=args.chunk, max_num_seqs=args.chats,
            max_model_len=trace_max_len(args), state_snapshot_interval=args.snapshot_interval,
        )  # fmt: skip
        out[name] = run_chat_trace(llm, args)
        print(f"[multi-turn] {name}: {out[name]}", file=sys.stderr)
        del llm
        gc.collect()
    base = out["full_attention_baseline"]["hit_rate"]
    out["hit_rate_ratio"] = out["model"]["hit_rate"] / base if base else None
    return out


def _time(fn: Any, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def speed_section(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Prefill and decode tok/s, engine against HF ``generate`` (greedy, fp32, same threads)."""
    from transformers import AutoModelForCausalLM

    from xengine.api.messages import SamplingParams

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 2000, (args.prompt_len,), generator=gen).tolist() for _ in range(args.batch)]
    llm = _llm(model_dir, args.num_threads, max_num_batched_tokens=max(2048, args.prompt_len * args.batch),
               enable_prefix_caching=False)  # fmt: skip

    def ours(n: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)

    ours(2)  # warm-up
    xllm_prefill = _time(lambda: ours(1), args.repeats)
    xllm_total = _time(lambda: ours(1 + args.output_len), args.repeats)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)

    def theirs(n: int) -> None:
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=0)  # fmt: skip

    theirs(2)
    hf_prefill = _time(lambda: theirs(1), args.repeats)
    hf_total = _time(lambda: theirs(1 + args.output_len), args.repeats)
    tokens_in, tokens_out = args.prompt_len * args.batch, args.output_len * args.batch

    def rates(prefill: float, total: float) -> dict[str, float]:
        return {"prefill_tok_s": tokens_in / prefill, "decode_tok_s": tokens_out / max(total - prefill, 1e-9)}

    ours_r, hf_r = rates(xllm_prefill, xllm_total), rates(hf_prefill, hf_total)
    return {
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "batch": args.batch,
        "xllm": ours_r,
        "hf_generate": hf_r,
        "ratio": {k: ours_r[k] / hf_r[k] for k in ours_r},
    }


SMOKE = dict(chats=2, turns=2, system_len=32, user_len=8, answer_len=4, prompt_len=32, output_len=4,
             batch=1, repeats=1, snapshot_interval=16)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--archs", nargs="+", default=["qwen3_next", "nemotron_h"])
    p.add_argument("--size", default="tiny", choices=["tiny", "small"])
    p.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens of the trace runs")
    p.add_argument("--chats", type=int, default=16, help="multi-turn: conversations")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--answer-len", type=int, default=48)
    p.add_argument("--snapshot-interval", type=int, default=64, help="cache.state_snapshot_interval")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--sections",
        nargs="+",
        default=["memory", "multi_turn", "speed"],
        choices=["memory", "multi_turn", "speed"],
    )
    add_smoke_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv, SMOKE)
    torch.set_num_threads(args.num_threads)
    baseline = generated_checkpoint("qwen3", args.size)
    report: dict[str, Any] = {"machine": describe(args.num_threads), "config": vars(args), "models": {}}
    for arch in args.archs:
        path = generated_checkpoint(arch, args.size)
        print(f"[{arch}] {path}", file=sys.stderr)
        sections = {
            "memory": ("memory", lambda p: memory_section(p, args.num_threads)),
            "multi_turn": ("multi_turn_prefix_hits", lambda p: multi_turn_section(p, baseline, args)),
            "speed": ("speed", lambda p: speed_section(p, args)),
        }
        report["models"][arch] = {sections[k][0]: sections[k][1](path) for k in args.sections}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
