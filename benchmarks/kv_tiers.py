"""KV tiers behind the prefix cache: a multi-turn chat whose working set is ~10x the KV pool, served with
no tiers, with L2 (host), with L2 + disk, and with the Mooncake Store shared by two instances; and the
TTFT of one long prompt loaded from the store (L3) against computing it. Prints one JSON document.

Each of ``--conversations`` chats runs ``--turns`` turns; a turn's prompt is the whole history (earlier
prompts and answers) plus ``--turn-tokens`` new tokens, answered with ``--output-len`` greedy tokens.
Turns go round-robin over the chats, one request at a time (TTFT is the engine's own: add to first
token). The KV pool (``--pool-blocks``, default a tenth of the working set) cannot keep the chats, so
without tiers most of each history is recomputed. With the store, turns alternate between two
instances: every turn's history was computed on the other one. ``token_hit_rate`` = prompt tokens
found cached / prompt tokens; ``identical_outputs``: every configuration's tokens equal the no-tier run's.
``l3_vs_recompute``: a ``--long-prompt``-token prompt on a fresh instance computed, then on another
fresh instance loaded from the store (its first instance wrote it through).

    PYTHONPATH=. .venv/bin/python -m benchmarks.kv_tiers            # small model, 2 threads

See ``docs/kv_tiers.md`` and ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.checkpoint import generated_checkpoint
from benchmarks.machine import describe
from benchmarks.smoke import add_smoke_flag, parse_args

BLOCK_SIZE = 16


def progress(msg: str) -> None:
    print(f"[kv_tiers] {msg}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_store(memory_gb: float) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "xengine.process.kv_store_server", "--port", str(port)]
    cmd += ["--metrics-port", str(_free_port()), "--memory-gb", str(memory_gb)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError("the KV store server did not start")
    return proc, json.loads(line)["store_master"]


def serve_one(llm: Any, req_id: str, prompt: list[int], output_len: int) -> tuple[float, list[int]]:
    """One request alone: (TTFT seconds, generated tokens)."""
    from xengine.api.messages import AddRequest, SamplingParams

    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    eng.add_request(AddRequest(req_id=req_id, prompt_token_ids=prompt, params=params))
    ttft, tokens = None, []
    while True:
        for d in eng.step():
            if d.req_id != req_id:
                continue
            if d.error:
                raise RuntimeError(f"{req_id} failed: {d.error}")
            if d.new_token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            tokens += d.new_token_ids
            if d.finish_reason is not None:
                return ttft or 0.0, tokens


def settle(llm: Any) -> None:
    tiers = llm.engine.tiers
    while tiers is not None and tiers.busy:
        tiers.poll(False, {})


def chat(llms: list[Any], args: argparse.Namespace, tag: str) -> dict[str, Any]:
    rng = random.Random(args.seed)
    histories: list[list[int]] = [[] for _ in range(args.conversations)]
    before = [llm.engine.get_stats() for llm in llms]
    ttfts, outputs = [], []
    for turn in range(args.turns):
        for c in range(args.conversations):
            prompt = histories[c] + [rng.randrange(3, args.vocab) for _ in range(args.turn_tokens)]
            llm = llms[(c + turn) % len(llms)]
            ttft, tokens = serve_one(llm, f"{tag}-{turn}-{c}", prompt, args.output_len)
            ttfts.append(ttft)
            outputs.append(tokens)
            histories[c] = prompt + tokens
        progress(f"{tag}: turn {turn + 1}/{args.turns} done")
    for llm in llms:
        settle(llm)
    after = [llm.engine.get_stats() for llm in llms]
    queries = sum(a.prefix_cache_queries - b.prefix_cache_queries for a, b in zip(after, before))
    hits = sum(a.prefix_cache_hits - b.prefix_cache_hits for a, b in zip(after, before))
    qs = statistics.quantiles(ttfts, n=10) if len(ttfts) > 1 else ttfts * 9
    tiers = [msg.kv_tiers for msg in after if msg.kv_tiers is not None]
    return {
        "token_hit_rate": hits / max(queries, 1),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p90_s": qs[8],
        "num_requests": len(ttfts),
        "tiers": [{t.name: {"hits": t.hits, "writes": t.writes} for t in msg.tiers} for msg in tiers],
        "_outputs": outputs,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="qwen3")
    p.add_argument("--size", default="small")
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn-tokens", type=int, default=192)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--pool-blocks", type=int, default=None, help="KV pool blocks (default: working set / 10)")
    p.add_argument("--long-prompt", type=int, default=4000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    add_smoke_flag(p)
    args = parse_args(
        p, argv, dict(size="tiny", conversations=3, turns=2, turn_tokens=48, output_len=4, long_prompt=256)
    )
    from xengine.llm import LLM

    model = str(generated_checkpoint(args.arch, args.size))
    hf = json.loads((Path(model) / "config.json").read_text())
    args.vocab = hf["vocab_size"]
    final_ctx = args.turns * (args.turn_tokens + args.output_len)
    working_blocks = args.conversations * final_ctx // BLOCK_SIZE
    pool = args.pool_blocks or max(final_ctx // BLOCK_SIZE + 4, working_blocks // 10)
    max_len = min(max(final_ctx, args.long_prompt) + 64, hf["max_position_embeddings"])
    base = dict(
        block_size=BLOCK_SIZE,
        num_blocks=pool,
        max_model_len=max_len,
        num_threads=args.threads,
        dtype="float32",
    )
    tmp = Path(tempfile.mkdtemp(prefix="xllm-kv-tiers-"))
    store_proc, master = start_store(memory_gb=1.0)
    host_gb = 0.5
    configs: dict[str, list[dict[str, Any]]] = {
        "none": [{}],
        "l2": [dict(host_memory_gb=host_gb)],
        "l2+disk": [dict(host_memory_gb=host_gb, disk_path=str(tmp / "arena"), disk_gb=1.0)],
        "store_2_instances": [dict(store_master=master), dict(store_master=master)],
    }
    out: dict[str, Any] = {"configs": {}}
    try:
        for name, instances in configs.items():
            llms = [LLM(model, **base, **extra) for extra in instances]
            try:
                out["configs"][name] = chat(llms, args, name)
            finally:
                for llm in llms:
                    llm.shutdown()
        ref = out["configs"]["none"]["_outputs"]
        out["identical_outputs"] = all(c.pop("_outputs") == ref for c in list(out["configs"].values())[1:])
        out["configs"]["none"].pop("_outputs", None)
        # one long prompt: computed on a fresh instance, then loaded from the store on another
        long_kw = {**base, "num_blocks": args.long_prompt // BLOCK_SIZE + 8, "store_master": master}
        prompt = [random.Random(1).randrange(3, args.vocab) for _ in range(args.long_prompt)]
        first = LLM(model, **long_kw)
        recompute_s, want = serve_one(first, "long-0", prompt, 4)
        settle(first)
        first.shutdown()
        second = LLM(model, **long_kw)
        l3_s, got = serve_one(second, "long-1", prompt, 4)
        loaded = second.engine.get_stats().kv_tiers.num_loaded_blocks
        second.shutdown()
        out["l3_vs_recompute"] = {
            "prompt_tokens": args.long_prompt,
            "kv_bytes": loaded * _record_bytes(model),
            "recompute_ttft_s": recompute_s,
            "l3_ttft_s": l3_s,
            "loaded_blocks": loaded,
            "identical_outputs": got == want,
        }
        out["l3_vs_recompute_ttft_ratio"] = recompute_s / l3_s if l3_s else 0.0
    finally:
        store_proc.send_signal(signal.SIGTERM)
        store_proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    out.update(
        model=f"{args.arch}-{args.size}",
        pool_blocks=pool,
        working_set_blocks=working_blocks,
        settings={k: v for k, v in vars(args).items() if k != "vocab"},
        machine=describe(args.threads),
    )
    print(json.dumps(out, indent=2))
    return 0


def _record_bytes(model: str) -> int:
    """Bytes of one block record of ``model`` in float32 (every layer's K and V)."""
    from xengine.models.info import read_model_info

    info = read_model_info(model)
    return 2 * info.num_layers * BLOCK_SIZE * info.num_kv_heads * info.head_dim * 4


if __name__ == "__main__":
    sys.exit(main())
