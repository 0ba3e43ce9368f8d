"""EPD profiler policy (issue 15 §5), pure: no I/O, numpy only; shared by ``xllm profile epd`` and
the cluster simulator.

HydraInfer (``../shared/papers/hydrainfer-epd-disaggregation.txt``) runs the encode (E), prefill (P)
and decode (D) stages of a vision-language request on instances that hold a subset of them, composed
as E+P+D, EP+D or ED+P, with stage-level batching inside each instance (Algorithm 1), and picks the
composition and the instance counts from a profile of the stages' costs, the workload and the SLOs
(§4.4). Here:

- ``epd_costs.py``: ``StageCosts`` (fitted from measurements by ``fit_stage_costs``), ``EPDWorkload``,
  ``EPDSLO``, and ``budgets`` (Algorithm 1's τ_e / τ_t by binary search over a step-time function);
- ``epd_model.py``: ``choose_strategy``, the analytical goodput model of every strategy and split.
"""

from xservice.policies.epd_costs import (
    EPDSLO,
    Budgets,
    EPDWorkload,
    StageCosts,
    budgets,
    fit_stage_costs,
    max_within,
)
from xservice.policies.epd_model import (
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
