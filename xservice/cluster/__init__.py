"""Cluster mode: metadata store, instance registry, launchers and the instance pool (torch-free)."""
