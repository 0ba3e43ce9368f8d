"""Cluster registration protocol: metadata-store key layout (``keys``) and store clients (``store``)."""
