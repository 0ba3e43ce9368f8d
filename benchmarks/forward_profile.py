"""Where the time of one model forward goes: per-component breakdown of a decode step and a prefill.

The model is loaded as the engine loads it (``xengine.models.loader.load_model``) with its own paged KV
caches; no engine, scheduler or sampler runs. For each case (decode at ``--batch-sizes`` with
``--context`` tokens of context each, and prefills of ``--prefills`` shapes ``NUMxLEN``: NUM prompts of
LEN tokens in one step) the JSON holds:

- ``forward_ms``: median of ``--steps`` un-instrumented forwards (+ logits of the last tokens);
- ``components_ms``: the same forward timed per component (projections, attention, rope, norms,
  activation, lm_head, ...) with timers around each call; ``other`` is what no timer covered;
- ``top_ops``: the aten ops with the most self CPU time under ``torch.profiler``, per forward.

    PYTHONPATH=. .venv/bin/python -m benchmarks.forward_profile --size small --num-threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch

from benchmarks.checkpoint import add_checkpoint_args, resolve_checkpoint
from benchmarks.smoke import add_smoke_flag, parse_args

_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
_NORMS = ("q_norm", "k_norm", "input_layernorm", "post_attention_layernorm", "norm")


class Case:
    """One forward's inputs over a fresh paged KV cache: ``query_lens[b]`` new tokens per sequence."""

    def __init__(self, model: Any, query_lens: list[int], seq_lens: list[int], block_size: int) -> None:
        cfg = model.config
        per_seq = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(per_seq) + 1
        shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        dtype = next(model.parameters()).dtype
        self.kv_caches = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]
        # Interleave the sequences' blocks (block 0 of each, then block 1, ...), as decoding in lockstep
        # from a shared pool would; block 0 stays unused like the pool's padding block.
        tables: list[list[int]] = [[] for _ in per_seq]
        order = sorted((i, b) for b, n in enumerate(per_seq) for i in range(n))
        for block, (_, b) in enumerate(order, start=1):
            tables[b].append(block)
        self.meta_args = (query_lens, seq_lens, tables, block_size)
        gen = torch.Generator().manual_seed(0)
        num_tokens = sum(query_lens)
        self.input_ids = torch.randint(0, cfg.vocab_size, (num_tokens,), generator=gen)
        self.positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
        self.last = torch.tensor([sum(query_lens[: b + 1]) - 1 for b in range(len(query_lens))])
        self.model = model
        # Fill the context with finite K/V, as the steps before this one would have.
        for cache in self.kv_caches:
            cache.normal_(generator=gen)

    def run(self) -> torch.Tensor:
        """One step: fresh metadata (as the runner builds per step), forward, logits of last tokens."""
        from ops.attention import build_attention_metadata

        meta = build_attention_metadata(*self.meta_args)
        hidden = self.model(self.input_ids, self.positions, self.kv_caches, meta)
        return self.model.compute_logits(hidden[self.last])


def median_ms(fn: Callable[[], Any], steps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


@contextlib.contextmanager
def component_timers(model: Any, totals: dict[str, float]) -> Iterator[None]:
    """Accumulate wall time per component into ``totals`` while the context is open."""
    import xengine.models.decoder as decoder

    handles, started = [], {}

    def pre(name: str) -> Callable[..., None]:
        def hook(module: Any, args: Any) -> None:
            started[id(module)] = time.perf_counter()

        return hook

    def post(name: str) -> Callable[..., None]:
        def hook(module: Any, args: Any, out: Any) -> None:
            totals[name] += time.perf_counter() - started.pop(id(module))

        return hook

    for path, module in model.named_modules():
        leaf = path.rsplit(".", 1)[-1]
        name = leaf if leaf in _LINEARS else "rms_norm" if leaf in _NORMS else None
        name = "embedding" if leaf == "embed_tokens" else name
        if name is not None:
            handles += [module.register_forward_pre_hook(pre(name)), module.register_forward_hook(post(name))]

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - t0

        return wrapper

    saved = {name: getattr(decoder, name) for name in ("unified_attention", "silu_and_mul")}
    rotary = model.model.rotary
    rotary_call = type(rotary).__call__
    for name, fn in saved.items():
        setattr(decoder, name, timed(name, fn))
    type(rotary).__call__ = timed("rope", rotary_call)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(decoder, name, fn)
        type(rotary).__call__ = rotary_call
        for h in handles:
            h.remove()


def components_ms(case: Case, steps: int) -> dict[str, float]:
    """Mean time per step of each component over ``steps`` instrumented steps."""
    totals: dict[str, float] = defaultdict(float)
    case.run()
    with component_timers(case.model, totals):
        t0 = time.perf_counter()
        for _ in range(steps):
            case.run()
        wall = time.perf_counter() - t0
    out = {k: v / steps * 1e3 for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
    out["other"] = wall / steps * 1e3 - sum(out.values())
    out["total"] = wall / steps * 1e3
    return {k: round(v, 3) for k, v in out.items()}


def top_ops(case: Case, steps: int, limit: int) -> list[dict[str, Any]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            case.run()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:limit]
    return [
        {
            "op": e.key,
            "self_ms": round(e.self_cpu_time_total / 1e3 / steps, 3),
            "calls": e.count // steps,
        }
        for e in rows
    ]


def profile_case(case: Case, steps: int, limit: int) -> dict[str, Any]:
    return {
        "forward_ms": round(median_ms(case.run, steps), 3),
        "components_ms": components_ms(case, steps),
        "top_ops": top_ops(case, max(1, steps // 4), limit),
    }


SMOKE = dict(batch_sizes=[1], context=16, prefills=["1x16"], steps=1, prefill_steps=1, top_ops=2)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(p)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=160, help="context tokens of each decoding sequence")
    p.add_argument("--prefills", nargs="*", default=["1x2048", "16x128"], help="prefill steps NUMxLEN")
    p.add_argument("--steps", type=int, default=20, help="timed forwards per decode case")
    p.add_argument("--prefill-steps", type=int, default=5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads; 0 keeps the default")
    p.add_argument("--top-ops", type=int, default=8, help="aten ops listed per case")
    add_smoke_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv, SMOKE)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    from xengine.models.loader import load_model

    model_dir = resolve_checkpoint(args)
    model = load_model(model_dir, getattr(torch, args.dtype), torch.device("cpu"))
    report: dict[str, Any] = {
        "model": model_dir,
        "config": {k: v for k, v in vars(args).items() if k != "model"},
        "host": {"torch": torch.__version__, "torch_threads": torch.get_num_threads()},
    }
    with torch.inference_mode():
        for b in args.batch_sizes:
            print(f"[decode B={b}]", file=sys.stderr)
            case = Case(model, [1] * b, [args.context] * b, args.block_size)
            report[f"decode_b{b}"] = profile_case(case, args.steps, args.top_ops)
            del case
        for shape in args.prefills:
            print(f"[prefill {shape}]", file=sys.stderr)
            num, length = (int(x) for x in shape.split("x"))
            case = Case(model, [length] * num, [length] * num, args.block_size)
            report[f"prefill_{shape}"] = profile_case(case, args.prefill_steps, args.top_ops)
            del case
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
