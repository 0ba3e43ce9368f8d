"""Offline throughput pieces: checkpoints, prompts, and one measurement per runner."""
