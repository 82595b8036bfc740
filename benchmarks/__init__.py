"""The series' benchmark suites (a regular package, so that the pinned tree's own
``benchmarks`` package on PYTHONPATH cannot shadow it)."""
