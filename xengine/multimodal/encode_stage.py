"""The encode stage: images are encoded in steps of their own, batched by HydraInfer's stage-level
rules (Algorithm 1 of the HydraInfer paper on EPD disaggregation).

A request with images stays in the encode stage until every image has embeddings; only then may its
prefill be scheduled. Only a step without a prefill chunk takes encodes, in waiting order, up to
``max_encode_images`` images and ``max_encode_tokens`` image tokens (the first image always fits),
so encodes never stretch a prefill step past the TPOT SLO. A request whose images are cached, or
whose prompt the prefix cache holds past its last image, skips the stage; an ``encode_only`` request
(EPD's encode instance) ends with finish_reason "encoded". Under async scheduling a job of the plan
in flight is not scheduled again; a rewound plan's job is picked up one plan later. See
``docs/multimodal.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from memory.kv_cache_manager import KVCacheManager
from xengine.api.config import SchedulerConfig
from xengine.api.multimodal import ImageInput
from xengine.request import Request

ENCODE_SCHEDULING = ("stage", "inline")


@dataclass
class EncodeJob:
    """Images ``first .. first + len(images) - 1`` of ``req`` (offset order) to encode this step."""

    req: Request
    first: int
    images: list[ImageInput]


class EncodeStage:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, has_image: Callable[[str], bool]) -> None:
        self.max_images = config.max_encode_images
        self.max_tokens = config.max_encode_tokens
        self.kv = kv
        self.has_image = has_image  # content hash -> in the instance's embedding cache
        self.num_plans = 0  # plans scheduled so far (a job remembers the plan it rode in)
        self.num_encode_steps = 0  # steps that carried encodes
        self.num_images_scheduled = 0

    def admit(self, req: Request) -> None:
        """A new request: skip the stage when every image is cached already (not for encode-only
        requests: they report "encoded" through a step)."""
        mm = req.mm
        if (
            mm is not None
            and not req.encode_only
            and all(self.has_image(im.content_hash) for im in mm.images)
        ):
            mm.num_encoded = len(mm.images)

    def select(self, waiting: list[Request], has_prefill: bool) -> list[EncodeJob]:
        """This plan's encode jobs (none when it carries a prefill chunk)."""
        plan_index = self.num_plans
        self.num_plans += 1
        if has_prefill:
            return []
        jobs: list[EncodeJob] = []
        num_images = num_tokens = 0
        for req in waiting:
            mm = req.mm
            if mm is None or mm.encoded or mm.encode_plan == plan_index - 1:
                continue  # no images, done, or its job is in the plan still in flight
            job = EncodeJob(req, mm.num_encoded, [])
            for im in mm.images[mm.num_encoded :]:
                if num_images and (num_images >= self.max_images or num_tokens + im.length > self.max_tokens):
                    break
                job.images.append(im)
                num_images += 1
                num_tokens += im.length
            if job.images:
                mm.encode_plan = plan_index
                jobs.append(job)
            if job.first + len(job.images) < len(mm.images):
                break  # the budget is spent
        if jobs:
            self.num_encode_steps += 1
            self.num_images_scheduled += num_images
        return jobs

    def ready(self, req: Request) -> bool:
        """May ``req``'s prefill be scheduled: no images, all encoded, or none needed any more (the
        prefix cache holds its prompt past its last image)? Never for an encode-only request."""
        mm = req.mm
        if mm is None or (mm.encoded and not req.encode_only):
            return True
        if req.encode_only or mm.encode_plan is not None or not self._prefix_covers(req):
            return False
        mm.num_encoded = len(mm.images)
        return True

    def _prefix_covers(self, req: Request) -> bool:
        """The prefix cache holds the prompt past its last image: its prefill needs no embeddings."""
        assert req.mm is not None
        if req.wants_prompt_logprobs:
            return False
        return self.kv.get_computed_prefix(req.cache_token_ids).num_tokens >= req.mm.images_end

    @staticmethod
    def applied(jobs: list[EncodeJob]) -> list[Request]:
        """The step carrying ``jobs`` ran: the encode-only requests it finished."""
        done = []
        for job in jobs:
            mm = job.req.mm
            assert mm is not None
            mm.num_encoded = max(mm.num_encoded, job.first + len(job.images))
            mm.encode_plan = None
            if mm.encoded and job.req.encode_only:
                done.append(job.req)
        return done
