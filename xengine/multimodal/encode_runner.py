"""Runs a step's encode jobs (``encode_stage.py``) on the device side: before the language model's
forward, or beside it on a second thread (``execution.encode_overlap``), as HydraInfer runs the vision
and language models of one batch on two streams. On CPU both threads share the cores, so overlap pays
only where the two forwards leave cores idle; ``benchmarks/encode_stage.py`` measures it."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from xengine.multimodal.encode_stage import EncodeJob
from xengine.multimodal.image_cache import ImageEmbeddingCache


class EncodeRunner:
    def __init__(self, images: ImageEmbeddingCache, overlap: bool) -> None:
        self.images = images
        self.overlap = overlap
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="xllm-encode") if overlap else None

    def start(self, jobs: list[EncodeJob], with_forward: bool) -> Future[None] | None:
        """Encode ``jobs``: now, or (overlap, with a language-model forward to hide behind) on the
        encode thread; ``wait`` on what this returns before the step ends."""
        work = [(job.req.seq_id, job.images) for job in jobs]
        if not work:
            return None
        if self._pool is None or not with_forward:
            self._encode(work)
            return None
        return self._pool.submit(self._encode, work)

    @staticmethod
    def wait(pending: Future[None] | None) -> None:
        if pending is not None:
            pending.result()

    def _encode(self, work: list[tuple[str, list]]) -> None:
        with torch.inference_mode():
            self.images.encode_for(work)
