"""Triton device code of `overlap`, installed as ``overlap.kernels``.

This folder sits at the repository's top level, beside ``overlap/``, and is not inside it: ``setup.py`` maps it
into the package (``package_dir={"overlap.kernels": "kernels"}``), for a wheel and an editable install alike, so
``import overlap.kernels`` imports this file and a reader looking for the kernels under ``overlap/`` finds them
here.

One kernel file per op that has a fused form, named as the op (`all_gather_matmul`, `matmul_reduce_scatter`, whose
kernels `matmul_all_reduce` runs too, `all_gather_weight_matmul`, `dispatch_grouped_matmul`,
`grouped_matmul_combine`, and sequence parallelism's `matmul_all_to_all` and `all_to_all_matmul`); `flags` holds the device-side waits and releases they share. Kernels take
peer-pointer tables and flag pointers, so the same code runs on GPUs and, interpreted (``TRITON_INTERPRET=1``,
set by `overlap` where no GPU exists), on CPU ranks over POSIX shared memory. Beside each kernel are its host
launcher (``launch_*``: checks the arguments, allocates what belongs to the launch, computes the grid,
launches) and the launch data it reads (the MoE kernels' tile tables); the ops and the GPU check call the
launchers, never a kernel directly. What the launchers share: `host`; where their data sits in a
symmetric-heap slot: `slots`; `compat` adapts the supported Triton versions (applied by `flags`, which every
kernel file imports before it defines a kernel).

Importing this package imports no Triton and defines no kernel: each kernel file does on its own import
(``from overlap.kernels import all_gather_matmul``). `slots` and `host` need no Triton, so the ops that lay
out slots the way the kernels read them (the non-fused ``symm`` paths) import them without it.
"""

from overlap import envs as _envs

_envs.set_triton_interpret()  # where no GPU exists: before any kernel file imports Triton and defines a kernel
