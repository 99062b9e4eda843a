"""The version of overlap (one place: the package, the command line and the benchmarks' reports read it)."""

__version__ = "0.1.0"
