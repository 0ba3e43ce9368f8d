"""Our engine's offline throughput through the ``LLM`` API (``xengine.llm``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineArgs:
    """The ``LLM(...)`` keyword arguments every xllm measurement shares."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    num_blocks: int | None = None
    num_threads: int | None = None
    kv_layout: str = "auto"
    graph_mode: str = "auto"
    async_scheduling: bool = False

    def make_llm(self, model_dir: str, **overrides: Any) -> Any:
        """Build ``xengine.llm.LLM`` on ``model_dir`` in float32 with these arguments."""
        from xengine.llm import LLM

        kwargs = dict(
            dtype="float32",
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            num_blocks=self.num_blocks,
            num_threads=self.num_threads,
            kv_layout=self.kv_layout,
            graph_mode=self.graph_mode,
            async_scheduling=self.async_scheduling,
        )
        return LLM(model=model_dir, **(kwargs | overrides))


def greedy(max_tokens: int) -> Any:
    """Greedy sampling of exactly ``max_tokens`` tokens (EOS ignored)."""
    from xengine.api.messages import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def xllm_throughput(llm: Any, prompts: list[list[int]], output_len: int, repeats: int = 1) -> dict:
    """Output tok/s of ``llm.generate`` over all prompts (after a short warm-up): the median of
    ``repeats`` timed runs, each run's rate in ``output_tok_s_runs``. Every run starts with an empty
    prefix cache: a repeat prefills its prompts as the first run did, not from the cache."""
    llm.generate(prompts[:2], greedy(4), use_tqdm=False)
    num_in = sum(len(p) for p in prompts)
    runs = []
    for _ in range(max(1, repeats)):
        llm.engine.reset_prefix_cache()
        steps_before = llm.engine.num_steps
        start = time.perf_counter()
        outputs = llm.generate(prompts, greedy(output_len), use_tqdm=False)
        elapsed = time.perf_counter() - start
        num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        runs.append((elapsed, num_out, llm.engine.num_steps - steps_before))
    elapsed, num_out, num_steps = sorted(runs)[len(runs) // 2]  # the median run
    return {
        "elapsed_s": elapsed,
        "num_output_tokens": num_out,
        "output_tok_s": num_out / elapsed,
        "total_tok_s": (num_in + num_out) / elapsed,
        "num_steps": num_steps,
        "repeats": len(runs),
        "output_tok_s_runs": [n / e for e, n, _ in runs],
    }
