"""Serving load generator pieces: prompts, streaming client, arrival process, metrics."""
