"""What the tests share and are not tests themselves: harnesses, oracles, rank tasks, tool look-ups.

Imported as ``tests.support.<module>``: ``tests`` is a package (as are its folders of tests), so pytest puts the
repository's root on the module search path (``pythonpath = ["."]`` in pyproject.toml does too), and the spawned
ranks of a pool inherit that path, so a task defined here pickles by its module's name (``tests.support.<module>``
or ``tests.<family>.test_<name>``) and imports on every rank. A subprocess runs ``python -m tests....`` from the
root (``scripts.run_module``).

* `harness`: the multi-rank CPU harness: `RankPool` (a reusable pool of spawned gloo ranks, built on
  `overlap.pool.RankPool`, running ``fn(rank, world_size, *args)``), `run_isolated`, `RankError`, and the
  deadline margins every timing assertion uses (`FALLBACK_TIMEOUT_S`, `LATE_S`, `raised_by_deadline`).
* `tp_oracle`: the tensor-parallel ops' inputs, float64 oracles (forward and backward), tolerances,
  comparisons and error capture (`expect_error`).
* `weight_oracle`: ``all_gather_weight_matmul``'s float64 oracle (the weight-side gather) and its checks.
* `memory`: `peak_allocated`, the peak CPU memory a function allocates on the calling thread (torch's profiler).
* `moe_oracle`: the MoE ops' dense float64 oracle and the rank tasks that check every strategy against it.
* `failure_tasks`: the rank side of `tests/comm/test_failures.py`: the world layout, the injected kills and stalls,
  what each rank records.
* `cuda_tools`: where ``cuobjdump`` is (on PATH or in Triton's wheel), for the tests that read SASS.
* `launch_specs`: what the kernels' launchers would compile on an sm_90 GPU, without one: `recording()`
  replaces every kernel by a recorder of Triton's specialization key and compile inputs.
* `ptx_flow`: which branches of a PTX kernel can take different warps past different barriers (a wait loop
  left on a per-thread clock or load), read from the text.
* `scripts`: running the project's scripts (``run_script``) and modules (``run_module``: ``python -m``) as
  subprocesses with a clean environment and a timeout.
* `aot_compile`: a script, run by `test_kernels_aot.py` in its own process (``python -m tests.support.aot_compile``,
  ``TRITON_INTERPRET=0``) that compiles the Triton kernels for sm_90 and prints what their PTX shows as JSON; never
  imported.
"""
