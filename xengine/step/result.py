"""What one ``Engine.step`` call did: a loop's ``StepResult``, and the ``StepTiming`` callers read.

Benchmarks and the cluster agent's performance samples read ``Engine.last_step_timing``; the loop
that ran the call knows what ran, the engine knows how long the whole call took.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xengine.scheduler.plan import SchedulePlan, StepSample


@dataclass
class StepTiming:
    total_s: float  # whole step: schedule + inputs + forward + sample + update
    forward_s: float  # model forward + logits only
    num_seqs: int
    num_tokens: int
    host_s: float | None = None  # overlap: engine-thread time of the step, waiting excluded
    # of the same plan as ``num_seqs`` (``SchedulePlan.token_counts``): KV tokens attended, prefill tokens
    context_tokens: int = 0
    prefill_tokens: int = 0
    # the non-empty steps whose outputs were applied in this call (normal: this one, ``step_s`` =
    # ``total_s``; overlap: the step that was in flight, and a sync plan's own, ``step_s`` measured
    # from the previous completion while busy: ``OverlapLoop._result``)
    completed: list[StepSample] = field(default_factory=list)
    # the sampler's part of the step (normal loop): device work, counted apart from the host's
    sample_s: float = 0.0
    # host phases of the step, in seconds (the normal loop): "schedule", "prepare" (inputs and sampling
    # rows), "update" (the outputs applied to the requests), "outputs" (their deltas collected)
    phases: dict[str, float] = field(default_factory=dict)


@dataclass
class StepResult:
    """What a step loop did in one call."""

    plan: SchedulePlan  # the plan of this call (normal: the part that ran); empty: nothing ran
    executed: bool = False  # a step ran (or went to the worker): counted in ``Engine.num_steps``
    forward_s: float = 0.0  # forward + logits time of the steps applied in this call
    counts: tuple[int, int] = (0, 0)  # ``plan.token_counts()``, taken before ``update``
    host_s: float | None = None  # overlap: engine-thread time, waiting excluded
    completed: list[StepSample] | None = None  # steps applied; None: ``plan``, timed by the whole call
    sample_s: float = 0.0  # the sampler's time of the steps applied in this call
    phases: dict[str, float] = field(default_factory=dict)  # ``StepTiming.phases`` the loop timed

    def timing(self, total_s: float, outputs_s: float = 0.0) -> StepTiming:
        """The ``StepTiming`` of a call that took ``total_s``, ``outputs_s`` of it collecting deltas."""
        plan, completed = self.plan, self.completed
        if completed is None:
            completed = [StepSample(len(plan.seqs), *self.counts, total_s)] if plan.seqs else []
        return StepTiming(
            total_s, self.forward_s, len(plan.seqs), plan.num_batched_tokens, self.host_s,
            *self.counts, completed, self.sample_s, self.phases | {"outputs": outputs_s},
        )  # fmt: skip
