"""The ``planaria`` command line."""

from planaria.cli.app import app, main

__all__ = ["app", "main"]
