"""planaria's benchmarks: each module is a script (``python benchmarks/NAME.py``, or
``python -m benchmarks.NAME`` from the repository root) whose last line printed is its figures.

What the scripts share lives in :mod:`benchmarks.harness`; a script imports that (and its own
helper modules) through this package, never another benchmark, so that no module is loaded
twice and the imports form no circle (tests/unit/test_import_graph.py checks it). A script run by
its path puts the repository root on ``sys.path`` first, which is what makes the package
importable without installing it.
"""
