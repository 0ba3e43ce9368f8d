"""Prefix caches behind one ABC (``BasePrefixCache``): radix tree now, SWA/Mamba-aware later."""

from memory.prefix_cache.base import BasePrefixCache, PrefixMatch
from memory.prefix_cache.radix import RadixPrefixCache

__all__ = ["BasePrefixCache", "PrefixMatch", "RadixPrefixCache"]
