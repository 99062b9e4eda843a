"""The GPU tests (virtual ranks on one device; on the CPU under the Triton interpreter) and the GPU check
(`python3 -m tests.gpu.check` from the repository's root: docs/gpu-check.md)."""
