"""vLLM LoRA decode throughput (``LLM.generate`` with one ``LoRARequest`` per prompt), in the peer venv.

Standalone (imports only vllm and the stdlib), and no program of its own: ``benchmarks/lora_decode.py``
runs ``main`` in a subprocess of the peer venv's python, one per case (``RUNNER`` below). vLLM logs to stdout, so the result JSON goes to ``--out``. vLLM runs in its default mode
(its own dtype and compilation mode), as its users run it; the result says which ran.

``--prompts`` is the JSON that ``lora_decode`` writes: ``{"warmup": [ids...], "runs": [{"prefill":
[ids...], "full": [ids...]}, ...]}``. Each run times ``generate`` of its ``prefill`` prompts with one
output token and of its ``full`` prompts (fresh ones, so no prefix-cache hits) with ``--max-tokens``;
decode tok/s = B x (max_tokens - 1) / (t_full - t_prefill). Prompt ``i`` runs under adapter
``i % len(adapters)`` (``--adapters``: PEFT folders; none: the base model with LoRA off).

    .venv-vllm/bin/python -c "$RUNNER" --model DIR --prompts p.json --max-tokens 64 --adapters A B --out r.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

try:
    from benchmarks.peers.decode_timing import time_decode_runs
except ImportError:  # run by the peer venv's python with benchmarks/peers on the path (``RUNNER``)
    from decode_timing import time_decode_runs


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF-format model folder")
    p.add_argument("--prompts", required=True, help="JSON file written by benchmarks/lora_decode.py")
    p.add_argument("--max-tokens", type=int, required=True, help="output tokens per prompt (ignore_eos)")
    p.add_argument("--adapters", nargs="*", default=[], help="PEFT adapter folders; none: LoRA off")
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--out", required=True, help="where to write the result JSON")
    return p


def ran_as(llm: object) -> dict:
    """The dtype, eager flag and compilation mode vLLM resolved in its default mode."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    if config is None:
        return {}
    mode = getattr(config.compilation_config, "mode", None)
    return {
        "dtype": str(config.model_config.dtype),
        "enforce_eager": bool(config.model_config.enforce_eager),
        "compilation_mode": getattr(mode, "name", str(mode)),
    }


def main(argv: list[str] | None = None) -> int:
    """Load the model (LoRA on with ``max_loras`` = the number of adapters), warm up, time each run."""
    args = build_parser().parse_args(argv)
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    with open(args.prompts) as f:
        spec = json.load(f)
    k = len(args.adapters)
    lora = dict(enable_lora=True, max_loras=k, max_lora_rank=args.max_lora_rank) if k else {}
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=0,
        **lora,
    )
    load_s = time.perf_counter() - t0
    adapters = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(args.adapters)]

    def generate(prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        loras = [adapters[i % k] for i in range(len(prompts))] if k else None
        inputs = [{"prompt_token_ids": ids} for ids in prompts]
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False, lora_request=loras)
        return time.perf_counter() - start, sum(len(c.token_ids) for o in outputs for c in o.outputs)

    generate(spec["warmup"], 4)  # every adapter loaded, the compiled graphs built
    runs = time_decode_runs(generate, spec["runs"], args.max_tokens)
    result = {
        "load_s": load_s,
        "num_loras": k,
        "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
        "output_tok_s": statistics.median(r["output_tok_s"] for r in runs),
        "runs": runs,
        **ran_as(llm),
    }
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


# what the peer venv's python runs (``-c RUNNER ARGS...``): this file's ``main`` on ``ARGS``
RUNNER = (
    "import sys; sys.path.insert(0, {peer_dir!r}); import vllm_lora; sys.exit(vllm_lora.main(sys.argv[1:]))"
)
