"""Checkpoint storage targets: the interface (``api``) and the built-in local filesystem."""
