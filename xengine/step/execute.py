"""Running a plan: interruptible where co-location allows, and one request at a time when it fails.

A forward that raises fails the requests it hits, not the engine: the plan runs again one request
at a time and the requests that raise again end with ``finish_reason`` "error". An engine whose steps
fail for every request ``MAX_CONSECUTIVE_FAILED_STEPS`` times in a row, or whose expert-parallel
group is out of step, raises ``EngineBrokenError``: its process is restarted (``docs/operations.md``).
"""

from __future__ import annotations

import logging

from graph.interrupt import StepInterrupted
from xengine.colocation.interrupter import Interrupter
from xengine.colocation.resume import PausedStep
from xengine.parallel.group import ExpertParallelGroup
from xengine.runner.model_runner import ModelRunner
from xengine.scheduler.plan import ScheduledSeq, SchedulePlan, StepOutput
from xengine.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

# this many steps in a row whose forward failed for every request: the engine itself is broken
MAX_CONSECUTIVE_FAILED_STEPS = 3


class EngineBrokenError(RuntimeError):
    """Step after step failed for every request: restart the engine rather than keep failing."""


class StepExecutor:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        interrupter: Interrupter,
        parallel: ExpertParallelGroup | None,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.interrupter = interrupter
        self.parallel = parallel
        self.num_failed_steps = 0  # consecutive steps whose forward failed for every request

    def execute(self, plan: SchedulePlan, failed_once: bool = False) -> tuple[SchedulePlan, StepOutput]:
        """Run ``plan`` (``failed_once``: it already raised as a whole, on the overlap worker).
        Returns the part of ``plan`` that ran and its output, for ``scheduler.update``. Raises
        ``StepInterrupted`` when an online arrival stopped it."""
        try:
            if failed_once:
                raise RuntimeError("the step failed on the async worker")
            out = self.interrupter.run(plan, lambda: self.runner.execute(plan))
        except StepInterrupted:
            raise
        except Exception as e:  # noqa: BLE001 - isolated below; re-raised if the engine itself is broken
            if self.parallel is not None:  # the workers ran (part of) it: the group is out of step
                if self.parallel.scan(wait_s=1.0) is not None:  # a peer's death shows as a socket error
                    raise EngineBrokenError(self.parallel.failure) from e
                raise EngineBrokenError(f"an expert-parallel step failed: {type(e).__name__}: {e}") from e
            logger.exception("step failed for %d sequence(s); retrying each request alone", len(plan.seqs))
            plan, out, error = self._each_request(plan)
            if plan.is_empty:
                self.num_failed_steps += 1
                if self.num_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
                    raise EngineBrokenError(
                        f"{self.num_failed_steps} steps in a row failed for every request; last error: {error}"
                    ) from None
                return plan, out
        self.num_failed_steps = 0
        return plan, out

    def resume(self, paused: PausedStep) -> StepOutput:
        """Carry a paused step's forward on from where it stopped (``xengine/colocation/resume.py``)."""
        return self.interrupter.run(paused.plan, lambda: self.runner.resume(paused.step, paused.point))

    def _each_request(self, failed: SchedulePlan) -> tuple[SchedulePlan, StepOutput, str]:
        """Re-run ``failed`` one request at a time (all sequences of a request step together).

        Nothing of the failed attempt is kept: ``update`` was not called, so the scheduler still has
        every sequence at its old ``num_computed_tokens``; a re-run rewrites the same KV slots. A
        request that fails alone is ended through the scheduler, which frees its blocks; its KV
        never reaches the prefix cache (only ``update`` inserts blocks). Returns the plan of the
        requests that ran, their output and the last error."""
        by_req: dict[str, list[ScheduledSeq]] = {}
        for s in failed.seqs:
            by_req.setdefault(s.req.req_id, []).append(s)
        ran = SchedulePlan(
            block_tables=failed.block_tables,
            window_block_tables=failed.window_block_tables,
            preempted_seq_ids=failed.preempted_seq_ids,
            state_slots=failed.state_slots,
            state_checkpoints=failed.state_checkpoints,
        )
        out, error = StepOutput(), ""
        # copy-on-write copies run once, with the first request
        copies, window_copies = failed.block_copies, failed.window_block_copies
        state_copies = failed.state_copies  # a slot copy reads a snapshot: idempotent, run once anyway
        for req_id, seqs in by_req.items():
            tables = {s.req.seq_id: failed.block_tables[s.req.seq_id] for s in seqs}
            alone = SchedulePlan(seqs=seqs, block_tables=tables, block_copies=copies)
            if failed.window_block_tables is not None:
                alone.window_block_tables = {
                    s.req.seq_id: failed.window_block_tables[s.req.seq_id] for s in seqs
                }
                alone.window_block_copies = window_copies
            if failed.state_slots is not None:
                alone.state_slots = {s.req.seq_id: failed.state_slots[s.req.seq_id] for s in seqs}
                alone.state_checkpoints = {
                    s.req.seq_id: failed.state_checkpoints[s.req.seq_id]
                    for s in seqs
                    if s.req.seq_id in failed.state_checkpoints
                }
                alone.state_copies = state_copies
            alone.num_batched_tokens = sum(s.num_new_tokens for s in seqs)
            copies, window_copies, state_copies = [], [], []
            try:
                part = self.runner.execute(alone)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                error = f"{type(e).__name__}: {e}"
                logger.error("request %s failed in the model: %s", req_id, error)
                self.scheduler.fail_request(req_id, f"the engine failed while running this request: {error}")
                continue
            ran.seqs.extend(seqs)
            _merge(out, part)
        for job in failed.encodes:  # each request's images alone too
            try:
                self.runner.execute(SchedulePlan(encodes=[job]))
                ran.encodes.append(job)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                error = f"{type(e).__name__}: {e}"
                self.scheduler.fail_request(job.req.req_id, f"the engine failed encoding its images: {error}")
        ran.num_batched_tokens = sum(s.num_new_tokens for s in ran.seqs)
        return ran, out, error


def _merge(out: StepOutput, part: StepOutput) -> None:
    """Add one request's output to the step's."""
    out.sampled.update(part.sampled)
    out.beam_candidates.update(part.beam_candidates)
    out.prompt_logprobs.update(part.prompt_logprobs)
    out.embeddings.update(part.embeddings)
    out.forward_s += part.forward_s
    out.sample_s += part.sample_s
