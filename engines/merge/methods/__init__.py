"""Merge methods, one per module, listed in `registry.METHODS`."""
