"""Built-in health checks and the runner that isolates them."""
