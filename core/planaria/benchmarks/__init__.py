"""The built-in node benchmarks (registered through the ``planaria`` entry-point group)."""
