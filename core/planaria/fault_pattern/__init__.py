"""Fault patterns: the record (``api``) and the core's vendor-neutral patterns (``builtin``)."""
