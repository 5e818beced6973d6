"""Health checks: the interface (``api``), the built-in host check and the isolating runner."""
