"""Rendezvous rank placement: the interface (``api``) and the core's placements (``builtin``)."""
