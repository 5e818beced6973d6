"""The ``planaria`` command line."""

from planaria.cli.app import app
from planaria.cli.entry import main

__all__ = ["app", "main"]
