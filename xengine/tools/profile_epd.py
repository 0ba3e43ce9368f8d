"""Engine-side half of ``xllm profile epd``: loads the model once, in this process, and times real stage
costs on request. The torch-free CLI (``xservice/commands/profile.py``) drives it over JSON lines on
stdin / stdout (one request, one answer; logs go to stderr) and does the fitting, the binary search
and the strategy choice with the pure policy (``xservice/policies/epd/``).

``python -m xengine.tools.profile_epd --model DIR --image-size WxH [--threads T]``; requests:

- ``{"op": "info"}``: model, threads, the image's tokens and patches, bytes per embedding / KV token;
- ``{"op": "encode", "images": k}``: the vision encoder (``encode_images``) over a batch of k images;
- ``{"op": "prefill", "tokens": t}``: an engine step prefilling a t-token prompt, nothing else;
- ``{"op": "decode", "batch": B, "context": C}``: an engine step of B decodes (C-token prompts);
- ``{"op": "step_encode", "batch": B, "context": C, "images": k}``: a step of B decodes and k image
  encodes (encode-only requests through the encode stage: the engine's real step);
- ``{"op": "step_prefill", "batch": B, "context": C, "tokens": t}``: B decodes and a t-token chunk;
- ``{"op": "bandwidth"}``: bytes/s over a loopback TCP socket (what local instances move data over).

Every timing is the median of ``repeats`` (default 3) after one warm-up, in seconds.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import io
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from xengine.api.chat_images import ChatImageBuilder
from xengine.api.config import EngineConfig
from xengine.api.messages import AddRequest, SamplingParams
from xengine.api.multimodal import ImageInput
from xengine.llm import LLM

BANDWIDTH_BYTES = 64 * 1024 * 1024


class StageBench:
    """One engine (synchronous steps, no prefix cache) and the probes that time its stages.

    ``image_size`` None: a text model, timed without image probes (``profile_engine.py``);
    ``timed``: the ``StepTiming`` field a probe reports (``total_s``: the whole engine step;
    ``forward_s``: the model forward and logits, what a device does)."""

    def __init__(
        self,
        model_dir: str,
        image_size: tuple[int, int] | None,
        num_threads: int | None,
        seed: int = 0,
        timed: str = "total_s",
        **engine: Any,
    ) -> None:
        fields: dict[str, Any] = {
            "num_threads": num_threads, "async_scheduling": False, "enable_prefix_caching": False,
            "max_num_seqs": 256, "max_num_batched_tokens": 1 << 16,
            "encode_scheduling": "stage", "max_encode_images": 1024, "max_encode_tokens": 1 << 24,
            **engine,
        }  # fmt: skip
        builder = ChatImageBuilder.from_dir(model_dir) if image_size is not None else None
        if builder is None and image_size is not None:
            raise ValueError(
                f"{model_dir} is not a vision-language model (no image processor / image_token_id)"
            )
        self.builder = builder
        self.timed = timed
        self.llm = LLM(model_dir, **_known_fields(fields))
        self.engine = self.llm.engine
        self.image_size = image_size
        self.rng = np.random.default_rng(seed)
        self.vocab = self.engine.vocab_size
        self.max_model_len = self.engine.max_model_len
        self._decodes: list[str] = []
        self._decode_shape = (0, 0)
        self._ids = 0
        if builder is None:
            self.encode_mode = "none"
            return
        probe = self._image_request()
        self.image: ImageInput = probe.images[0]
        stage = getattr(self.engine.scheduler, "encode_stage", None)
        self.encode_mode = "engine" if stage is not None and hasattr(AddRequest, "__struct_fields__") and (
            "encode_only" in AddRequest.__struct_fields__
        ) else "composed"  # fmt: skip

    # ------------------------------------------------------------------ requests
    def _next_id(self, kind: str) -> str:
        self._ids += 1
        return f"profile-{kind}-{self._ids}"

    def _tokens(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(0, max(1, self.vocab - 8), n)]  # clear of special ids

    def _image_request(self) -> Any:
        """A one-image chat prompt with a fresh random image (a new content hash: no cache hit)."""
        from PIL import Image

        assert self.builder is not None
        w, h = self.image_size
        pixels = self.rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
        return self.builder.build(self.llm.tokenizer, messages)

    def _add(self, req_id: str, ids: list[int], params: SamplingParams, **kw: Any) -> None:
        self.engine.add_request(AddRequest(req_id=req_id, prompt_token_ids=ids, params=params, **kw))

    def _step(self) -> float:
        self.engine.step()
        timing = self.engine.last_step_timing
        assert timing is not None
        return float(getattr(timing, self.timed))

    def clear(self) -> None:
        """Abort everything running (the decodes) and step until the engine is empty."""
        if self._decodes:
            self.engine.abort_requests(self._decodes)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        self._decodes, self._decode_shape = [], (0, 0)

    def ensure_decodes(self, batch: int, context: int) -> None:
        """``batch`` requests past their prefill, decoding on ``context``-token prompts."""
        if self._decode_shape == (batch, context) and self._running_decodes() == batch:
            return
        self.clear()
        if batch == 0:
            return
        if context + 64 >= self.max_model_len:
            raise ValueError(
                f"context {context} leaves no room to decode (max_model_len {self.max_model_len})"
            )
        params = SamplingParams(temperature=0.0, max_tokens=self.max_model_len - context - 1, ignore_eos=True)
        self._decodes = [self._next_id("decode") for _ in range(batch)]
        for req_id in self._decodes:
            self._add(req_id, self._tokens(context), params)
        started: set[str] = set()
        while len(started) < batch:  # prefill them all (chunked under the budget)
            started.update(d.req_id for d in self.engine.step() if d.new_token_ids)
        self._decode_shape = (batch, context)
        self._step()  # one plain decode step: warm

    def _running_decodes(self) -> int:
        groups = self.engine.scheduler.groups
        return sum(1 for r in self._decodes if r in groups)

    # ------------------------------------------------------------------ probes
    def encode(self, images: int, repeats: int) -> float:
        """The vision encoder alone over a batch of ``images`` images of the configured size."""
        im = self.image
        one = torch.frombuffer(bytearray(im.pixel_values), dtype=torch.float32).view(*im.shape)
        device = self.engine.platform.torch_device()
        patches = one.repeat(images, 1).to(device)
        grids = [tuple(im.grid_thw)] * images
        model = self.engine.model

        def run() -> float:
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.encode_images(patches, grids)
            self.engine.platform.synchronize()
            return time.perf_counter() - t0

        return _median(run, repeats)

    def prefill(self, tokens: int, repeats: int) -> float:
        """An engine step that prefills one ``tokens``-token prompt, alone."""
        self.clear()
        return self.step_prefill(0, 0, tokens, repeats)

    def decode(self, batch: int, context: int, repeats: int) -> float:
        self.ensure_decodes(batch, context)
        return _median(lambda: self._checked_step(batch, 0), repeats)

    def step_prefill(self, batch: int, context: int, tokens: int, repeats: int) -> float:
        """A step of ``batch`` decodes plus a ``tokens``-token prefill chunk (its whole prompt)."""
        self.ensure_decodes(batch, context)

        def run() -> float:
            req_id = self._next_id("prefill")
            self._add(
                req_id, self._tokens(tokens), SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            )
            s = self._checked_step(batch + 1, tokens)
            if req_id in self.engine.scheduler.groups:
                self.engine.abort_requests([req_id])
                self.engine.step()
            return s

        return _median(run, repeats)

    def step_encode(self, batch: int, context: int, images: int, repeats: int) -> float:
        """A step of ``batch`` decodes plus ``images`` image encodes. Through the engine's encode stage
        (encode-only requests) when it has one; else the decode step plus the encoder, timed apart."""
        self.ensure_decodes(batch, context)
        if self.encode_mode != "engine":
            return self.encode(images, repeats) + (self.decode(batch, context, repeats) if batch else 0.0)

        def run() -> float:
            ids = []
            for _ in range(images):
                prompt = self._image_request()
                req_id = self._next_id("encode")
                self._add(
                    req_id,
                    prompt.token_ids,
                    SamplingParams(max_tokens=0),
                    images=prompt.images,
                    encode_only=True,
                )
                ids.append(req_id)
            before = self.engine.get_stats().num_image_encodes
            s = self._step()
            done = self.engine.get_stats().num_image_encodes - before
            if done != images:
                raise RuntimeError(f"the step encoded {done} images, not {images}")
            leftover = [r for r in ids if r in self.engine.scheduler.groups]
            if leftover:
                self.engine.abort_requests(leftover)
            return s

        return _median(run, repeats)

    def _checked_step(self, num_seqs: int, prefill_tokens: int) -> float:
        s = self._step()
        timing = self.engine.last_step_timing
        if timing.num_seqs != num_seqs or timing.prefill_tokens != prefill_tokens:
            raise RuntimeError(
                f"the step ran {timing.num_seqs} sequences / {timing.prefill_tokens} prefill tokens, "
                f"expected {num_seqs} / {prefill_tokens} (raise max_num_batched_tokens / KV memory?)"
            )
        return s

    def info(self) -> dict[str, Any]:
        im, e = self.image, self.engine
        model = e.model
        hidden = model.model.embed_tokens.weight.shape[1]
        return {
            "model": e.info.model_name,
            "device": e.info.device,
            "num_threads": torch.get_num_threads(),
            "dtype": str(e.dtype).removeprefix("torch."),
            "max_model_len": e.max_model_len,
            "max_num_seqs": e.scheduler.config.max_num_seqs,
            "kv_cache_tokens": e.info.num_total_blocks * e.info.block_size,
            "image_size": list(self.image_size),
            "image_tokens_per_image": im.length,
            "patches_per_image": int(im.shape[0]),
            "embed_bytes_per_token": hidden * model.model.embed_tokens.weight.element_size(),
            "kv_bytes_per_token": e.info.kv_bytes_per_token,
            "encode_mode": self.encode_mode,
            "encode_overlap": bool(getattr(getattr(e.runner, "encoder", None), "overlap", False)),
        }


def _known_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """The engine config fields of ``fields`` this engine has (the encode stage's may be absent)."""
    defaults = EngineConfig()
    names = {
        f.name
        for sec in dataclasses.fields(EngineConfig)
        for f in dataclasses.fields(getattr(defaults, sec.name))
    }
    return {k: v for k, v in fields.items() if k in names and v is not None}


def _median(run: Callable[[], float], repeats: int) -> float:
    run()  # warm-up
    return statistics.median(run() for _ in range(max(1, repeats)))


def loopback_bandwidth(num_bytes: int = BANDWIDTH_BYTES) -> float:
    """Bytes/s of one TCP stream over 127.0.0.1 (instances of one machine move data over it)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    payload = os.urandom(1 << 20)

    def send() -> None:
        with socket.create_connection(("127.0.0.1", port)) as c:
            for _ in range(num_bytes // len(payload)):
                c.sendall(payload)

    sender = threading.Thread(target=send, daemon=True)
    conn = None
    try:
        sender.start()
        conn, _ = server.accept()
        t0, got = time.perf_counter(), 0
        while got < num_bytes:
            chunk = conn.recv(1 << 20)
            if not chunk:
                break
            got += len(chunk)
        return got / (time.perf_counter() - t0)
    finally:
        if conn is not None:
            conn.close()
        server.close()
        sender.join(5)


def serve(bench: StageBench, inp: Any, out: Any) -> None:
    """Answer JSON-line requests until ``quit`` or end of input."""
    for line in inp:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            op, repeats = req.get("op"), int(req.get("repeats", 3))
            if op == "quit":
                break
            if op == "info":
                result: Any = bench.info()
            elif op == "encode":
                result = bench.encode(int(req["images"]), repeats)
            elif op == "prefill":
                result = bench.prefill(int(req["tokens"]), repeats)
            elif op == "decode":
                result = bench.decode(int(req["batch"]), int(req["context"]), repeats)
            elif op == "step_encode":
                result = bench.step_encode(
                    int(req["batch"]), int(req["context"]), int(req["images"]), repeats
                )
            elif op == "step_prefill":
                result = bench.step_prefill(
                    int(req["batch"]), int(req["context"]), int(req["tokens"]), repeats
                )
            elif op == "bandwidth":
                result = loopback_bandwidth()
            else:
                raise ValueError(f"unknown op {op!r}")
            out.write(json.dumps({"ok": True, "result": result}) + "\n")
        except (ValueError, RuntimeError, KeyError, TypeError) as e:
            out.write(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        out.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m xengine.tools.profile_epd", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", required=True)
    p.add_argument("--image-size", required=True, help="WxH of the workload's images")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    w, _, h = args.image_size.partition("x")
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")  # the protocol; anything else printed goes to stderr
    sys.stdout = sys.stderr
    try:
        bench = StageBench(args.model, (int(w), int(h)), args.threads, args.seed)
    except (ValueError, OSError) as e:
        out.write(json.dumps({"ok": False, "error": f"cannot load the model: {e}"}) + "\n")
        out.flush()
        return 1
    out.write(json.dumps({"ok": True, "result": "ready"}) + "\n")
    out.flush()
    serve(bench, sys.stdin, out)
    bench.clear()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
