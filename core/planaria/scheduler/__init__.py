"""Schedulers: the interface (``api``) and the built-in local scheduler."""
