"""The old home of the health-check runner and the built-in host check, now in
:mod:`planaria.health` (``runner``, ``host``): ``planaria.checks.runner`` and
``planaria.checks.host`` are kept for plugins written against them."""
