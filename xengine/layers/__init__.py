"""Reusable model building blocks (torch modules over the ``ops`` facades)."""
