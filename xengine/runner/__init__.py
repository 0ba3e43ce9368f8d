"""Model runner: ``SchedulePlan`` -> forward batch -> model -> sampler -> ``StepOutput``."""
