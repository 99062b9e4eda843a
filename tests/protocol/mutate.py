"""Mutation testing of the synchronization protocol: plant each bug of `MUTATIONS` in a copy of the sources, run the
tests that should catch it there, and report caught or missed. Every mutation must be caught.

Usage (from the repository's root, with overlap installed: ``_C`` is copied, not rebuilt)::

    python -m tests.protocol.mutate            # every mutation (a few minutes)
    python -m tests.protocol.mutate -k relaxed # the mutations whose name contains "relaxed"
    python -m tests.protocol.mutate --list     # the mutations and the tests each runs
    python -m tests.protocol.mutate --full     # also the model checker's larger configurations

The planted bugs are the ones the model checker finds in the protocol (`tests.protocol.spec.MUTATIONS`), here in the
code: the Triton kernels (`kernels/flags.py`), the C++ and CUDA sources (`csrc/`), and the CPU ranks' Python path
(`overlap/symm/call.py`). The C++ mutations are caught by the sequence tests, which read the sources (the CPU tests
would need ``_C`` rebuilt). Run it before changing the protocol; the list and its last result are in
docs/testing.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEQUENCES = "tests/protocol/test_sequences.py"
AOT = "tests/gpu/cpu/test_kernels_aot.py"


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str  # replaced everywhere in the file (it must be there)
    new: str
    tests: tuple[str, ...]  # pytest arguments that must fail with the mutation in place
    then: tuple[tuple[str, str], ...] = ()  # more (old, new) replacements in the same file

    def apply(self, text: str) -> str | None:
        """`text` mutated, or None where one of the texts to replace is not there."""
        for old, new in ((self.old, self.new), *self.then):
            if old not in text:
                return None
            text = text.replace(old, new)
        return text


MUTATIONS = [
    Mutation("Triton: the flag's release made relaxed", "kernels/flags.py",
             'tl.atomic_xchg(flag_ptr, epoch, sem="release", scope="sys")',
             'tl.atomic_xchg(flag_ptr, epoch, sem="relaxed", scope="sys")', (SEQUENCES,)),
    Mutation("Triton: the flag's acquire made relaxed", "kernels/flags.py",
             'tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")',
             'tl.atomic_add(flag_ptr, 0, sem="relaxed", scope="sys")', (SEQUENCES,)),
    Mutation("Triton: the flag's scope narrowed to the GPU", "kernels/flags.py",
             'tl.atomic_xchg(flag_ptr, epoch, sem="release", scope="sys")',
             'tl.atomic_xchg(flag_ptr, epoch, sem="release", scope="gpu")', (SEQUENCES,)),
    Mutation("Triton: the count made relaxed", "kernels/flags.py",
             'tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="sys")',
             'tl.atomic_add(counter_ptr, 1, sem="relaxed", scope="sys")', (SEQUENCES,)),
    Mutation("Triton: the barrier before the count removed", "kernels/flags.py",
             "    tl.debug_barrier()\n    seen = ", "    seen = ", (SEQUENCES, AOT)),
    Mutation("Triton: the last-tile test off by one", "kernels/flags.py",
             "if seen == target - 1:", "if seen == target - 2:",
             (SEQUENCES, "tests/gpu/test_reduce_scatter_kernels.py")),
    Mutation("Triton: the data written after the flag", "kernels/matmul_reduce_scatter.py",
             "        tl.store(out_ptrs, acc.to(a_ptr.dtype.element_ty), mask=mask)\n", "        pass\n",
             (SEQUENCES, "tests/gpu/test_reduce_scatter_kernels.py"),
             then=(("own_flags + d * FLAG_STRIDE + chunk, epoch)\n",
                    "own_flags + d * FLAG_STRIDE + chunk, epoch)\n"
                    "    if not A_SCALE:\n        tl.store(out_ptrs, acc.to(a_ptr.dtype.element_ty), mask=mask)\n"),)),
    Mutation("Triton: an interpreted wait without its deadline (the abort word)", "kernels/flags.py",
             "while ((ready - epoch) < 0) & (aborted == 0):", "while (ready - epoch) < 0:",
             ("tests/gpu/test_all_gather_kernels.py", "-k", "gives_up", "--timeout", "60")),
    Mutation("Triton: the epoch comparison off by one", "kernels/flags.py",
             "stop = ((ready - epoch) >= 0)", "stop = ((ready - epoch) >= -1)", (SEQUENCES,)),
    Mutation("Triton: an interpreted wait taking the previous call's flag", "kernels/flags.py",
             "while ((ready - epoch) < 0) & (aborted == 0):", "while ((ready - epoch) < -1) & (aborted == 0):",
             (SEQUENCES, "tests/gpu/test_all_gather_kernels.py", "-k", "flagged_first or decides_on_values")),
    Mutation("C++: the host flag store made relaxed", "csrc/include/overlap/signal.h",
             "__atomic_store_n(addr, value, __ATOMIC_RELEASE)", "__atomic_store_n(addr, value, __ATOMIC_RELAXED)",
             (SEQUENCES,)),
    Mutation("C++: the host flag load made relaxed", "csrc/include/overlap/signal.h",
             "__atomic_load_n(addr, __ATOMIC_ACQUIRE)", "__atomic_load_n(addr, __ATOMIC_RELAXED)", (SEQUENCES,)),
    Mutation("C++: the epoch comparison off by one", "csrc/include/overlap/signal.h",
             "static_cast<uint32_t>(value)) >= 0;", "static_cast<uint32_t>(value)) >= -1;", (SEQUENCES,)),
    Mutation("CUDA: the device flag store made relaxed", "csrc/include/overlap/cuda_signal.cuh",
             '"st.release.sys.global.b32', '"st.relaxed.sys.global.b32', (SEQUENCES,)),
    Mutation("CUDA: the device flag load's scope narrowed to the GPU", "csrc/include/overlap/cuda_signal.cuh",
             '"ld.acquire.sys.global.b32', '"ld.acquire.gpu.global.b32', (SEQUENCES,)),
    Mutation("CUDA: the barrier before the dispatch's count removed", "csrc/include/overlap/moe_a2a.cuh",
             "  __threadfence_system();\n  __syncthreads();\n  if (threadIdx.x == 0) {",
             "  __threadfence_system();\n  if (threadIdx.x == 0) {", (SEQUENCES,)),
    Mutation("CUDA: the dispatch's last-CTA test off by one", "csrc/include/overlap/moe_a2a.cuh",
             "== ctas - 1)", "== ctas - 2)", (SEQUENCES,)),
    Mutation("C++: the watchdog releases before it reports", "csrc/watchdog.cpp",
             "      set_if_zero(e.err, 1);\n      set_if_zero(e.abort, e.peer + 1);\n      raise_to(e.word, e.value);",
             "      raise_to(e.word, e.value);\n      set_if_zero(e.err, 1);\n      set_if_zero(e.abort, e.peer + 1);",
             (SEQUENCES,)),
    Mutation("C++: the watchdog's raise made relaxed", "csrc/watchdog.cpp",
             "!__atomic_compare_exchange_n(addr, &seen, value, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)",
             "!__atomic_compare_exchange_n(addr, &seen, value, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)",
             (SEQUENCES,)),
    Mutation("Python: a CPU rank publishes the previous epoch", "overlap/symm/call.py",
             "        else:\n            signals().signal_store(addr, self.word)\n\n    def wait_ready",
             "        else:\n            signals().signal_store(addr, self.word - 1)\n\n    def wait_ready",
             ("tests/comm/test_symm_protocol.py", "-k", "reserve_and_release")),
    Mutation("Python: a CPU rank's done word never written", "overlap/symm/call.py",
             "            else:\n                signals().signal_store(addr, self.word)\n",
             "            else:\n                pass\n",
             (SEQUENCES, "tests/comm/test_symm_protocol.py", "-k", "reserve_and_release or cpu_ranks")),
    Mutation("Python: a CPU rank's slot-free wait skipped", "overlap/symm/call.py",
             "        if prev <= 0 or not self.uses_heap:\n            return\n",
             "        if True:\n            return\n", (SEQUENCES,)),
    Mutation("Python: the epochs' re-base leaving the flags", "overlap/symm/heap.py",
             "        self._ctrl_np[self.rank][SLOT_BASE:CTRL_WORDS] = 0\n", "",
             ("tests/comm/test_symm_protocol.py", "-k", "rebase")),
]


def copy_tree(dest: Path) -> None:
    """The checkout's tracked files and the built extension into `dest`; ``overlap/kernels`` linked to ``kernels``
    there (the install maps one onto the other), so the copy imports its own kernels."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    for built in (ROOT / "overlap").glob("_C*.so"):
        shutil.copy2(built, dest / "overlap" / built.name)
    (dest / "overlap" / "kernels").symlink_to("../kernels")


def run_tests(tree: Path, tests: tuple[str, ...], timeout: float) -> tuple[bool, str]:
    """Whether the tests pass in `tree` (the copy first on the path), and the end of their output."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OVERLAP_TIMEOUT_S": "10"}
    env.pop("TRITON_INTERPRET", None)
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=",
                               *tests], cwd=tree, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:.0f} s"
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    if proc.returncode == 5:  # pytest selected nothing: the mutation's test list is wrong, nothing was checked
        return True, "no test selected: " + " ".join(tests)
    return proc.returncode == 0, "\n".join(lines[-3:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.protocol.mutate", description=__doc__.split("\n\n")[0])
    p.add_argument("-k", dest="keyword", default="", help="only the mutations whose name contains this")
    p.add_argument("--list", action="store_true", help="print the mutations and their tests, run nothing")
    p.add_argument("--full", action="store_true", help="also check the model's larger configurations")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run of the tests (default 600)")
    args = p.parse_args(argv)
    chosen = [m for m in MUTATIONS if args.keyword.lower() in m.name.lower()]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.path}; pytest {' '.join(m.tests)}")
        return 0
    missed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="overlap-mutate-") as tmp:
        tree = Path(tmp) / "tree"
        copy_tree(tree)
        ok, tail = run_tests(tree, (SEQUENCES, "tests/protocol/test_model.py"), args.timeout)
        if not ok:
            print(f"the unmutated copy fails its tests, nothing to compare with:\n{tail}")
            return 2
        if args.full:
            from tests.protocol import model, test_model

            for config in test_model.FULL:
                print(model.check(config).summary(), flush=True)
        for i, m in enumerate(chosen, 1):
            target = tree / m.path
            original = target.read_text()
            mutated = m.apply(original)
            if mutated is None:
                print(f"[{i}/{len(chosen)}] {m.name}: NOT APPLIED ({m.path} no longer has its text)")
                missed.append(m.name)
                continue
            target.write_text(mutated)
            began = time.monotonic()
            try:
                passed, tail = run_tests(tree, m.tests, args.timeout)
            finally:
                target.write_text(original)
            verdict = "MISSED" if passed else "caught"
            print(f"[{i}/{len(chosen)}] {m.name}: {verdict} ({time.monotonic() - began:.0f} s) by "
                  f"{' '.join(m.tests)}" + (f"\n    {tail.splitlines()[-1]}" if tail else ""), flush=True)
            if passed:
                missed.append(m.name)
    print(f"{len(chosen) - len(missed)} of {len(chosen)} mutations caught" +
          (f"; missed: {'; '.join(missed)}" if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
