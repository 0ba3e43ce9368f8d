"""Beam search state and item catalogs (constrained decoding for generative recommendation)."""
