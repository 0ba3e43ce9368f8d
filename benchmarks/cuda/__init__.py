"""Benchmarks that need a CUDA device (each prints a JSON saying so without one)."""
