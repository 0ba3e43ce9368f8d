"""Speculative decoding: decode tok/s with speculation against without it, and the mean accepted length;
prints one JSON.

For each ``--sizes`` (make_tiny's qwen3), method (``--methods``: what is implemented), batch
(``--batches``) and workload, the same prompts run greedily on one engine without speculation and one
with it (``num_speculative_tokens`` ``--k``). Decode tok/s: the output tokens after the first, over the
time a ``1 + --output-len`` token run takes beyond a one-token run (medians of ``--repeats``).

Methods: ``ngram`` (prompt lookup); ``draft_model``, whose draft is the target's own first
``--draft-layers`` layers with its embeddings and head (``benchmarks/spec_checkpoints.py``): a model
with the target's vocabulary at a fraction of its cost; ``mtp``, on make_tiny's deepseek_v3 of the size
with a random MTP layer added (``xengine/tools/mtp_checkpoint.py``); ``eagle`` / ``eagle3``, random heads
for the qwen3 target (``xengine/tools/eagle_checkpoint.py``).

Workloads:

- ``random``: random prompts of ``--prompt-len`` tokens on make_tiny's checkpoint. A random model does
  not repeat itself: the drafts are mostly wrong, and this is what speculation costs when it misses;
- ``repeat``: the "bigram" copy of the checkpoint (``benchmarks/spec_checkpoints.py``: attention
  outputs zeroed, the same shapes and cost per token) on prompts that hold its own greedy continuation:
  a random head, the model's greedy continuation of it (``--output-len`` tokens), the head again. The
  model continues the second head as it did the first, and prompt lookup finds that continuation in
  the prompt: the drafts are mostly right;
- ``oracle`` (the model methods): random prompts; the method's proposer runs as it would (every draft
  forward paid), but what the target verifies is its own greedy continuation: every draft is right.
  Random weights agree with nothing, so this is what a draft that agrees with its target reaches on
  this engine, at its real cost.

    PYTHONPATH=. .venv/bin/python -m benchmarks.offline.spec_decode --num-threads 1
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.checkpoint import cache_root, generated_checkpoint
from benchmarks.machine import describe
from benchmarks.smoke import add_smoke_flag, parse_args
from benchmarks.spec_checkpoints import make_bigram_copy, make_truncated_copy

HEAD_METHODS = ("mtp", "eagle", "eagle3")


def _target(method: str, size: str, workload: str) -> Path:
    """The target checkpoint of a method and workload (``repeat``: its bigram copy)."""
    if method == "mtp":
        from xengine.tools.mtp_checkpoint import add_mtp_layer

        base = cache_root() / f"deepseek_v3-{size}-seed0-mtp"
        if not (base / "model.safetensors").is_file():
            add_mtp_layer(generated_checkpoint("deepseek_v3", size), base)
    else:
        base = generated_checkpoint("qwen3", size)
    if workload != "repeat":
        return base
    target = cache_root() / f"{base.name}-bigram"
    if not (target / "model.safetensors").is_file():
        make_bigram_copy(base, target)
    return target


def _head(method: str, size: str) -> Path:
    """A random EAGLE head for make_tiny's qwen3 of ``size``."""
    from xengine.tools.eagle_checkpoint import make_eagle_head

    target = cache_root() / f"qwen3-{size}-seed0-{method}-head"
    if not (target / "model.safetensors").is_file():
        make_eagle_head(generated_checkpoint("qwen3", size), target, method)
    return target


class _OracleDrafts:
    """The method's proposer runs as it would; the target verifies its own greedy continuation."""

    def __init__(self, inner: Any, continuations: dict[tuple[int, ...], list[int]]) -> None:
        self.inner, self.continuations = inner, continuations

    def prepare(self, reqs: list[Any], ks: list[int]) -> None:
        prepare = getattr(self.inner, "prepare", None)
        if prepare is not None:
            prepare(reqs, ks)

    def propose(self, req: Any, k: int) -> list[int]:
        self.inner.propose(req, k)
        done = len(req.output_token_ids)
        return self.continuations[tuple(req.prompt_token_ids)][done : done + k]

    def release(self, seq_id: str) -> None:
        self.inner.release(seq_id)


def _draft(model_dir: Path, layers: int) -> Path:
    """The target's first ``layers`` layers: the draft model of ``draft_model``."""
    target = model_dir.parent / f"{model_dir.name}-first{layers}"
    if not (target / "model.safetensors").is_file():
        make_truncated_copy(model_dir, target, layers)
    return target


def _prompts(llm: Any, workload: str, batch: int, args: argparse.Namespace) -> list[list[int]]:
    from xengine.api.messages import SamplingParams

    rng = random.Random(batch)
    vocab = llm.engine.vocab_size
    heads = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
    if workload == "random":
        return heads
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len + 8, ignore_eos=True)
    chains = llm.generate(heads, params, use_tqdm=False)
    return [h + list(c.outputs[0].token_ids) + h for h, c in zip(heads, chains)]


def _decode_tok_s(llm: Any, prompts: list[list[int]], args: argparse.Namespace) -> float:
    from xengine.api.messages import SamplingParams

    def run(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        llm.engine.reset_prefix_cache()
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    run(2)  # warm-up
    first = statistics.median(run(1) for _ in range(args.repeats))
    total = statistics.median(run(1 + args.output_len) for _ in range(args.repeats))
    return len(prompts) * args.output_len / max(total - first, 1e-9)


def _measure(
    plain: Any, model_dir: Path, size: str, workload: str, method: str, args: argparse.Namespace
) -> dict[str, Any]:
    """One method on one target: per batch, decode tok/s with and without speculation."""
    from xengine.api.messages import SamplingParams
    from xengine.llm import LLM

    spec_cfg: dict[str, Any] = {"method": method, "num_speculative_tokens": args.k}
    if method == "draft_model":
        spec_cfg["model"] = str(_draft(model_dir, args.draft_layers))
    elif method in ("eagle", "eagle3"):
        spec_cfg["model"] = str(_head(method, size))
    out: dict[str, Any] = {}
    with LLM(
        str(model_dir), num_threads=args.num_threads, block_size=16, speculative_config=spec_cfg
    ) as spec:
        drafter = spec.engine.scheduler.drafter
        inner = drafter.proposer
        for batch in args.batches:
            print(f"{size} {workload} {method} batch {batch}", file=sys.stderr)
            prompts = _prompts(plain, "random" if workload == "oracle" else workload, batch, args)
            if workload == "oracle":
                greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len + 1, ignore_eos=True)
                outs = plain.generate(prompts, greedy, use_tqdm=False)
                conts = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)}
                drafter.proposer = _OracleDrafts(inner, conts)
            base = _decode_tok_s(plain, prompts, args)
            stats = drafter.stats
            stats.__init__()  # count the measured runs only
            fast = _decode_tok_s(spec, prompts, args)
            drafter.proposer = inner
            out[str(batch)] = {
                "target": model_dir.name,
                "decode_tok_s": round(fast, 1),
                "decode_tok_s_no_spec": round(base, 1),
                "speedup": round(fast / base, 3),
                "mean_accepted_length": round(stats.mean_accepted_length, 3),
                "acceptance_rate": round(stats.acceptance_rate, 3),
                "acceptance_per_pos": [round(x, 3) for x in stats.acceptance_per_pos()],
            }
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    p.add_argument("--methods", nargs="+", default=["ngram", "draft_model", "mtp", "eagle", "eagle3"])
    p.add_argument("--draft-layers", type=int, default=1, help="draft_model: the target's first N layers")
    p.add_argument("--workloads", nargs="+", default=["random", "repeat", "oracle"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    add_smoke_flag(p)
    args = parse_args(
        p,
        argv,
        {
            "sizes": ["tiny"],
            "batches": [2],
            "output_len": 8,
            "repeats": 1,
            "prompt_len": 8,
            "methods": ["ngram", "mtp", "eagle3"],
            "workloads": ["repeat", "oracle"],
        },  # fmt: skip
    )
    from xengine.llm import LLM

    results: dict[str, Any] = {}
    for size in args.sizes:
        for workload in args.workloads:
            methods = [m for m in args.methods if not (workload == "oracle" and m == "ngram")]
            for model_dir in dict.fromkeys(_target(m, size, workload) for m in methods):
                # one target at a time, each engine shut down after its runs (their KV pools add up)
                with LLM(str(model_dir), num_threads=args.num_threads, block_size=16) as plain:
                    for method in (m for m in methods if _target(m, size, workload) == model_dir):
                        entry = _measure(plain, model_dir, size, workload, method, args)
                        results.setdefault(size, {}).setdefault(workload, {})[method] = entry
                        gc.collect()
                gc.collect()
    out = {"machine": describe(args.num_threads), "config": vars(args), "results": results}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
