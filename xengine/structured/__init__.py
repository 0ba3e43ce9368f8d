"""Structured outputs: grammar backends, compiled-grammar cache, compile executor, per-sequence matchers, bitmasks."""
