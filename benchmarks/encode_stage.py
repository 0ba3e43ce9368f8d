"""Stage-level batching (HydraInfer's Algorithm 1) vs inline FCFS encoding: the TPOT of ongoing
decodes while a burst of image requests arrives, one engine, side by side in one run.

``PYTHONPATH=. .venv/bin/python -m benchmarks.encode_stage [--model DIR] [--decodes 16] [--burst 12]
[--images 4] [--image-px 448] [--budget 256] [--max-encode-images 2] [--tpot-slo-ms 15] [--threads 2]``
prints one JSON object (``docs/multimodal.md``).

Per policy (``stage``: encodes only in steps without a prefill chunk, within ``--max-encode-images``;
``stage+overlap``: the same with encodes on a second thread beside the decodes; ``inline``: a prefill
step encodes every image its chunk needs) the same trace runs on a fresh engine with the same token
budget: ``--decodes`` text requests start decoding, then ``--burst`` requests of ``--images`` images
each arrive at once. Reported: per step that carried decodes, its wall time (what each decoding
stream waits for its next token: TPOT) as p50 / p99 / max and the share within ``--tpot-slo-ms``; the
mean TTFT of the image requests (in steps' wall time from the burst); the total time. Default model:
the tiny Qwen2-VL (generated).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.epd_ttft import image_url, tiny_vl  # noqa: E402
from benchmarks.smoke import add_smoke_flag, parse_args  # noqa: E402

POLICIES = {
    "inline": dict(encode_scheduling="inline"),
    "stage": dict(encode_scheduling="stage", encode_overlap="off"),
    "stage+overlap": dict(encode_scheduling="stage", encode_overlap="on"),
}


def run_policy(model: str, policy: str, args: argparse.Namespace) -> dict:
    import torch

    from xengine.api.messages import AddRequest, SamplingParams
    from xengine.llm import LLM

    torch.manual_seed(0)
    llm = LLM(
        model,
        max_num_batched_tokens=args.budget,
        max_encode_images=args.max_encode_images,
        max_num_seqs=args.decodes + args.burst,
        enable_prefix_caching=False,
        **POLICIES[policy],
    )
    engine, tok = llm.engine, llm.tokenizer
    decode_params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for i in range(args.decodes):
        ids = tok.encode(f"Story number {i}: once upon a time", add_special_tokens=False)
        engine.add_request(AddRequest(req_id=f"d{i}", prompt_token_ids=ids, params=decode_params))
    while engine.get_stats().num_waiting or any(r.num_computed_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # steady decoding
        engine.step()
    burst_params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for j in range(args.burst):
        parts = [{"type": "image_url", "image_url": {"url": image_url(args.image_px, 100 * j + k)}}
                 for k in range(args.images)]  # fmt: skip
        conv = [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe them."}]}]
        prompt = llm._images.build(tok, conv)  # noqa: SLF001 - the offline API's own preprocessing
        engine.add_request(
            AddRequest(
                req_id=f"i{j}", prompt_token_ids=prompt.token_ids, params=burst_params, images=prompt.images
            )
        )
    t0 = time.perf_counter()
    decode_steps: list[float] = []
    ttft: dict[str, float] = {}
    while len(ttft) < args.burst:
        ts = time.perf_counter()
        deltas = engine.step()
        dt = time.perf_counter() - ts
        if any(d.req_id.startswith("d") for d in deltas):
            decode_steps.append(dt)
        for d in deltas:
            if d.req_id.startswith("i") and d.new_token_ids and d.req_id not in ttft:
                ttft[d.req_id] = time.perf_counter() - t0
    total = time.perf_counter() - t0
    engine.abort_requests([f"d{i}" for i in range(args.decodes)])
    while engine.has_unfinished_requests():
        engine.step()
    steps_ms = sorted(x * 1000 for x in decode_steps)
    slo = args.tpot_slo_ms
    return {
        "policy": policy,
        "decode_steps": len(steps_ms),
        "tpot_p50_ms": round(statistics.median(steps_ms), 2),
        "tpot_p99_ms": round(steps_ms[min(len(steps_ms) - 1, int(0.99 * len(steps_ms)))], 2),
        "tpot_max_ms": round(steps_ms[-1], 2),
        "tpot_slo_attainment": round(sum(x <= slo for x in steps_ms) / len(steps_ms), 3),
        "image_ttft_mean_ms": round(1000 * statistics.mean(ttft.values()), 1),
        "burst_total_s": round(total, 3),
        "encode_steps": engine.get_stats().num_encode_steps,
        "image_encodes": engine.get_stats().num_image_encodes,
    }


SMOKE = dict(decodes=2, burst=1, images=1, image_px=56, threads=1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--decodes", type=int, default=16)
    p.add_argument("--burst", type=int, default=12)
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--image-px", type=int, default=448)
    p.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens (τ_t) of every policy")
    p.add_argument("--max-encode-images", type=int, default=2, help="τ_e of the stage policies")
    p.add_argument("--tpot-slo-ms", type=float, default=15.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--policies", default=",".join(POLICIES))
    add_smoke_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv, SMOKE)
    import torch

    torch.set_num_threads(args.threads)
    model = args.model or tiny_vl()
    rows = [run_policy(model, name, args) for name in args.policies.split(",")]
    print(json.dumps({"threads": args.threads, "config": vars(args), "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
