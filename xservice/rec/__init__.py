"""Generative recommendation API: item catalogs and catalog-constrained beam search."""
