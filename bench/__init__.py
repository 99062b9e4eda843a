"""Benchmarks and scripts, run from the repository's root (`python -m bench.emulated_cluster`,
`python bench/soak.py`) and the pytest-benchmark wrappers (`pytest bench/ --benchmark-only`)."""
