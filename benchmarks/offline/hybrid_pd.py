"""PD transfer of hybrid models: bytes moved per layer kind next to the theory; prints one JSON.

For each of make_tiny's hybrid checkpoints (``--archs``), two in-process engines (prefill and decode,
Mooncake over TCP on loopback): the prefill engine computes each ``--lengths`` prompt and its first
token and exports it, the decode engine imports it and generates the rest. Printed per prompt:

- what moved, per kind (``KVImportResult``): full-attention blocks, sliding-window blocks, recurrent
  state bytes, and their sum;
- the theory: the exported blocks' full-attention KV, plus only the window blocks a query after them
  reads (``window / block_size``-ish, whatever the prompt's length), plus one state snapshot;
- ``uniform_bytes``: what a transfer of every layer's KV for the same blocks would be (the model
  served with full-length KV in every layer), and ``uniform_over_moved``;
- ``tokens_equal``: the PD tokens equal one colocated engine's.

    PYTHONPATH=. .venv/bin/python -m benchmarks.offline.hybrid_pd
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from benchmarks.checkpoint import generated_checkpoint
from benchmarks.machine import describe
from benchmarks.smoke import add_smoke_flag, parse_args

BS = 16


def _engine(model: Any, **kw: Any) -> Any:
    from xengine.engine import Engine
    from xengine.llm import engine_config

    return Engine(engine_config(str(model), block_size=BS, num_blocks=512, max_model_len=4096, seed=0, **kw))


def _generate(engine: Any, req_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    from xengine.api.messages import AddRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(AddRequest(req_id=req_id, prompt_token_ids=prompt, params=params))
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for d in engine.step() for t in d.new_token_ids]
    return tokens


def _layer_bytes_per_block(tensors: list[torch.Tensor]) -> int:
    """K and V of one block in every given layer tensor ``[2, num_blocks, ...]``."""
    return sum(2 * t[0, 0].nbytes for t in tensors)


def run_arch(arch: str, args: argparse.Namespace) -> dict[str, Any]:
    model = generated_checkpoint(arch, "tiny")
    kw = {"state_snapshot_interval": args.snapshot_interval}
    prefill, decode, colocated = _engine(model, **kw), _engine(model, **kw), _engine(model, **kw)
    transfer = decode.kv_transfer
    full_per_block = _layer_bytes_per_block(transfer.kv_caches)
    window_per_block = _layer_bytes_per_block(transfer.window.caches) if transfer.window else 0
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i, length in enumerate(args.lengths):
        prompt = torch.randint(3, 2000, (length,), generator=gen).tolist()
        first = _generate(prefill, f"p{i}", prompt, 1)
        source = prefill.kv_export(f"x{i}", prompt)
        result = decode.kv_import(source, prompt, pin_id=f"d{i}")
        prefill.kv_release(f"x{i}")
        tokens = first + _generate(decode, f"d{i}", prompt + first, args.output_len - 1)
        k = len(source.block_ids)
        window_blocks = len(source.window.block_ids) if source.window is not None else 0
        state = decode.get_stats().state_pool
        theory = {
            "full_attention": k * full_per_block,
            "sliding_window": window_blocks * window_per_block,
            "recurrent_state": state.bytes_per_slot if state is not None and k else 0,
        }
        moved = {
            "full_attention": result.num_bytes - result.num_window_bytes - result.num_state_bytes,
            "sliding_window": result.num_window_bytes,
            "recurrent_state": result.num_state_bytes,
        }
        # every layer full-length: the window layers' blocks for the whole prefix (a recurrent layer has
        # no KV: its state is the same either way)
        uniform = k * (full_per_block + window_per_block) + theory["recurrent_state"]
        rows.append(
            {
                "prompt_len": length,
                "exported_blocks": k,
                "window_blocks": window_blocks,
                "moved": {**moved, "total": result.num_bytes},
                "theory": {**theory, "total": sum(theory.values())},
                "uniform_bytes": uniform,
                "uniform_over_moved": uniform / result.num_bytes if result.num_bytes else None,
                "tokens_equal": tokens == _generate(colocated, f"c{i}", prompt, args.output_len),
            }
        )
        print(f"[{arch}] {rows[-1]}", file=sys.stderr)
    return {"block_size": BS, "prompts": rows}


SMOKE = dict(archs=["gemma3", "qwen3_next"], lengths=[40], output_len=2, snapshot_interval=16)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", nargs="+", default=["gemma3", "mimo_v2_flash", "qwen3_next", "nemotron_h"])
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 3000])
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--snapshot-interval", type=int, default=64, help="cache.state_snapshot_interval")
    add_smoke_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv, SMOKE)
    report: dict[str, Any] = {
        "machine": describe(torch.get_num_threads()),
        "config": vars(args),
        "models": {},
    }
    for arch in args.archs:
        report["models"][arch] = run_arch(arch, args)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
