"""Leaf helpers every layer of the package may use (they import nothing else from ``inflight``)."""
