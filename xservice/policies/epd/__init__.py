"""EPD policies, pure (no I/O, numpy only): which encode / prefill / decode split serves a workload best,
with what budgets, and where each request's images go. Shared by ``xllm profile epd``, cluster
serving (``xservice/cluster/epd/``) and the cluster simulator; see ``docs/multimodal.md``.

The model follows HydraInfer's EPD disaggregation (E+P+D, EP+D, ED+P; stage-level batching with
Algorithm 1's budgets; the composition and instance counts chosen from a profile, the workload and
the SLOs):

- ``costs.py``: ``StageCosts`` (fitted from measurements by ``fit_stage_costs``), ``EPDWorkload``,
  ``EPDSLO``, and ``budgets`` (Algorithm 1's τ_e / τ_t by binary search over a step-time function);
- ``model.py``: ``choose_strategy``, the analytical goodput model of every strategy and split;
- ``assign.py``: a chosen strategy as each instance's role and engine budgets;
- ``placement.py``: which instance encodes a request's images and which prefills it.
"""

from xservice.policies.epd.costs import (
    EPDSLO,
    Budgets,
    EPDWorkload,
    StageCosts,
    budgets,
    fit_stage_costs,
    max_within,
)
from xservice.policies.epd.model import (
    STRATEGIES,
    EPDChoice,
    StrategyResult,
    choose_strategy,
    evaluate,
    splits,
)

__all__ = [
    "EPDSLO",
    "STRATEGIES",
    "Budgets",
    "EPDChoice",
    "EPDWorkload",
    "StageCosts",
    "StrategyResult",
    "budgets",
    "choose_strategy",
    "evaluate",
    "fit_stage_costs",
    "max_within",
    "splits",
]
