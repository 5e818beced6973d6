"""``python -m planaria``: the same as the ``planaria`` command."""

from planaria.cli import main

main()
