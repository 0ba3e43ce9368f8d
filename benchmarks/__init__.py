"""Benchmark programs: each prints one JSON document to stdout (progress goes to stderr)."""
