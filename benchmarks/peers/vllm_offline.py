"""vLLM offline throughput (``LLM.generate``) on given token-id prompts; run with the peer venv's python.

Standalone (imports only vllm and the stdlib): the offline benchmark calls it as a subprocess.
vLLM logs to stdout, so the result JSON goes to ``--out``. By default float32 and eager, as we run;
``--default-mode``: vLLM's own dtype (bfloat16 for a float32 checkpoint on a CPU with bf16) and its
compiled mode, as its users run it. The result says which dtype and compilation mode ran.

    .venv-vllm/bin/python vllm_offline.py --model DIR --prompts prompts.json --max-tokens 64 --out r.json
"""

from __future__ import annotations

import argparse
import json
import time


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF-format model folder")
    p.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    p.add_argument("--max-tokens", type=int, required=True, help="output tokens per prompt (ignore_eos)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--out", required=True, help="where to write the result JSON")
    p.add_argument("--repeats", type=int, default=1, help="timed runs; the median one is reported")
    p.add_argument(
        "--default-mode",
        action="store_true",
        help="vLLM's own dtype and compiled mode instead of float32 and --enforce-eager",
    )
    p.add_argument(
        "--eager-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the dtype of the eager run (without --default-mode)",
    )
    return p


def ran_as(llm: object) -> dict:
    """The dtype, eager flag and compilation mode the engine resolved (vLLM chooses them itself in
    its default mode)."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    if config is None:
        return {}
    compilation = config.compilation_config
    mode = getattr(compilation, "mode", None)
    return {
        "dtype": str(config.model_config.dtype),
        "enforce_eager": bool(config.model_config.enforce_eager),
        "compilation_mode": getattr(mode, "name", str(mode)),
        "compile_backend": getattr(compilation, "backend", None),
    }


def main(argv: list[str] | None = None) -> int:
    """Load the model, warm up, time ``--repeats`` runs of ``generate`` over all prompts, write the
    median run's JSON result (each run's rate in ``output_tok_s_runs``). Every run starts with an empty
    prefix cache (vLLM caches prefixes by default): a repeat prefills its prompts again."""
    args = build_parser().parse_args(argv)
    from vllm import LLM, SamplingParams

    with open(args.prompts) as f:
        prompts = [{"prompt_token_ids": ids} for ids in json.load(f)]
    t0 = time.perf_counter()
    mode = {} if args.default_mode else {"dtype": args.eager_dtype, "enforce_eager": True}
    llm = LLM(
        model=args.model,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=0,
        **mode,
    )
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    runs = []
    for _ in range(max(1, args.repeats)):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        runs.append((elapsed, sum(len(c.token_ids) for o in outputs for c in o.outputs)))
    elapsed, num_out = sorted(runs)[len(runs) // 2]  # the median run
    num_in = sum(len(p["prompt_token_ids"]) for p in prompts)
    result = {
        "elapsed_s": elapsed,
        "load_s": load_s,
        "num_requests": len(prompts),
        "num_output_tokens": num_out,
        "output_tok_s": num_out / elapsed,
        "total_tok_s": (num_in + num_out) / elapsed,
        "repeats": len(runs),
        "output_tok_s_runs": [n / e for e, n in runs],
        **ran_as(llm),
    }
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
