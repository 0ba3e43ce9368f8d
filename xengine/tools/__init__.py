"""Offline tools: checkpoint generation for tests, benchmarks and the embedded default model."""
