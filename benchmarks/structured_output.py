"""What structured outputs cost the engine; prints one JSON document.

- ``decode``: per batch size B (1, 8, 32), the median engine step time over steady decode steps of B
  unconstrained sequences, then of B sequences all constrained by one grammar (each its own matcher),
  and the difference: bitmask fill (llguidance, on the thread that samples) + applying it + accepting
  the tokens. Two grammars bracket the mask's cost: inside a long JSON string (most ids allowed, and
  a length to track) and in a long array of enums (few ids allowed). ``host_ms`` is the step less its
  forward (schedule, inputs, sampling, masks); ``overhead_ms`` / ``overhead_pct`` compare host times
  (the mask work happens outside the forward), so they do not move with the forward's noise on a
  shared machine; ``step_overhead_pct`` is the plain ratio of step medians.
- ``compile``: per grammar, the engine's compile (``GrammarCompiler.submit`` -> result) cold (a spec
  never seen) and cached (the same spec again), and the one-off backend setup (tokenizer tables).

    PYTHONPATH=. .venv/bin/python -m benchmarks.structured_output --size small --num-threads 1
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from typing import Any

from benchmarks.checkpoint import add_checkpoint_args, resolve_checkpoint
from benchmarks.offline.prompts import prompt_id_pool, random_token_prompts
from benchmarks.offline.step_efficiency import _decode_timings
from benchmarks.smoke import add_smoke_flag, parse_args
from benchmarks.structured_backends import CASES

_ids = itertools.count()
# Grammars that keep every row constrained for the whole measurement (ignore_eos: past their end only
# eos is allowed, still a masked row).
DECODE_GRAMMARS: dict[str, dict[str, Any]] = {
    "json_long_string": {
        "type": "object",
        "properties": {"text": {"type": "string", "minLength": 2000, "maxLength": 2000}},
        "required": ["text"],
        "additionalProperties": False,
    },
    "json_enum_array": {
        "type": "array",
        "items": {"enum": ["alpha", "beta", "gamma", "delta"]},
        "minItems": 500,
        "maxItems": 500,
    },
}


def _params(num_tokens: int, schema: dict[str, Any] | None) -> Any:
    from xengine.api.messages import SamplingParams, StructuredOutputsParams

    so = None
    if schema is not None:
        so = StructuredOutputsParams(json=json.dumps(schema), disable_any_whitespace=True)
    return SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True, structured_outputs=so)


def _step_ms(engine: Any, prompts: list[list[int]], schema: dict[str, Any] | None, num_steps: int) -> dict:
    from xengine.api.messages import AddRequest

    num_warmup = 4
    for ids in prompts:
        params = _params(num_warmup + num_steps + 2, schema)
        engine.add_request(AddRequest(req_id=f"so-{next(_ids)}", prompt_token_ids=ids, params=params))
    timings = _decode_timings(engine, len(prompts), num_warmup, num_steps)
    if not timings:
        return {"error": "no pure-decode steps"}
    return {
        "step_ms": round(statistics.median(t.total_s for t in timings) * 1e3, 3),
        "forward_ms": round(statistics.median(t.forward_s for t in timings) * 1e3, 3),
        "host_ms": round(statistics.median(t.total_s - t.forward_s for t in timings) * 1e3, 3),
    }


def decode_overhead(
    engine: Any, pool: list[int], batch_sizes: list[int], num_steps: int, input_len: int
) -> dict:
    out: dict[str, Any] = {}
    for b in batch_sizes:
        prompts = random_token_prompts(pool, b, input_len, seed=b)
        row: dict[str, Any] = {"unconstrained": _step_ms(engine, prompts, None, num_steps)}
        base = row["unconstrained"]
        for name, schema in DECODE_GRAMMARS.items():
            r = _step_ms(engine, prompts, schema, num_steps)
            if "step_ms" in base and "step_ms" in r:
                r["overhead_ms"] = round(r["host_ms"] - base["host_ms"], 3)
                r["overhead_pct"] = round(100 * r["overhead_ms"] / base["step_ms"], 1)
                r["step_overhead_pct"] = round(100 * (r["step_ms"] / base["step_ms"] - 1), 1)
            row[name] = r
        out[f"B={b}"] = row
        print(f"B={b}: {row}", file=sys.stderr)
    return out


def compile_times(engine: Any, reps: int) -> dict:
    from xengine.api.grammar import grammar_spec
    from xengine.api.messages import StructuredOutputsParams

    compiler = engine.structured.compiler
    t0 = time.perf_counter()
    compiler.backend()
    out: dict[str, Any] = {"backend_setup_ms": round((time.perf_counter() - t0) * 1e3, 3), "cases": {}}
    for name, (kind, source, _) in CASES.items():
        cold, cached = [], []
        for i in range(reps):
            if kind == "json":  # a fresh spec each time: never in the cache
                source_i = json.dumps({**json.loads(source), "title": f"run-{name}-{i}-{time.time_ns()}"})
                so = StructuredOutputsParams(json=source_i, disable_any_whitespace=True)
            elif kind == "json_object":
                so = StructuredOutputsParams(
                    json=json.dumps({"type": "object", "title": f"r{i}-{time.time_ns()}"})
                )
            elif kind == "choice":
                so = StructuredOutputsParams(choice=[*json.loads(source), f"other-{i}-{time.time_ns()}"])
            elif kind == "regex":
                so = StructuredOutputsParams(regex=f"{source}|x{i}y{time.time_ns()}")
            else:
                so = StructuredOutputsParams(grammar=f"{source}# {i} {time.time_ns()}\n")
            spec = grammar_spec(so)
            t1 = time.perf_counter()
            compiler.submit(spec).result()
            cold.append(time.perf_counter() - t1)
            t1 = time.perf_counter()
            compiler.submit(spec).result()
            cached.append(time.perf_counter() - t1)
        out["cases"][name] = {
            "cold_ms": round(statistics.median(cold) * 1e3, 3),
            "cached_ms": round(statistics.median(cached) * 1e3, 4),
        }
    return out


SMOKE = dict(batch_sizes=[1], num_steps=2, input_len=8, compile_reps=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_args(p)
    p.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads of the engine")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--num-steps", type=int, default=24, help="decode steps measured per configuration")
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--compile-reps", type=int, default=5)
    p.add_argument("--async-scheduling", choices=["on", "off"], default="off")
    add_smoke_flag(p)
    args = parse_args(p, argv, SMOKE)
    from xengine.engine import Engine
    from xengine.llm import engine_config

    model_dir = resolve_checkpoint(args)
    engine = Engine(
        engine_config(
            model_dir,
            num_threads=args.num_threads,
            max_model_len=2048,
            max_num_seqs=max(args.batch_sizes),
            async_scheduling=args.async_scheduling,
        )
    )
    report = {
        "model": model_dir,
        "vocab_size": engine.vocab_size,
        "num_threads": args.num_threads,
        "async_scheduling": args.async_scheduling,
        "backend": "llguidance",
        "compile": compile_times(engine, args.compile_reps),
        "decode": decode_overhead(
            engine, prompt_id_pool(model_dir), args.batch_sizes, args.num_steps, args.input_len
        ),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
