"""Benchmark scripts, run from the repository root as ``python -m benchmarks.<name>``
(``benchmarks/RESULTS.md`` holds their results)."""
