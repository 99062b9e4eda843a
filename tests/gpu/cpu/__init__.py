"""The GPU half's tests that need no GPU: the GPU check's driver, preflight and device-work order, the kernels
compiled ahead of time, their specialization, the CUDA kernels' PTX. The GPU check does not run these."""
