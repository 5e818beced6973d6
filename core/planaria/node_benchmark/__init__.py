"""Node benchmarks (the pre-flight node check): the interface (``api``), the built-in CPU benchmark
and the child process that runs one."""
