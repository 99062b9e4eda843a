"""The test suite (docs/testing.md): one package per family of tests, shared helpers in `tests.support`."""
