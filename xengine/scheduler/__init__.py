"""Scheduler: one token budget per step; emits a plain ``SchedulePlan``."""
