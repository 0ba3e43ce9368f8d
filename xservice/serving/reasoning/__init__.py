"""Reasoning parsers: a thinking model's ``<think>...</think>`` text split out of the content."""
