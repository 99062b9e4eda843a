#!/usr/bin/env python3
"""The GPU check of overlap: one short run that proves and times its GPU paths (docs/design.md, tier 4).

Usage::

    python3 bench/gpu_check.py                        # one GPU: virtual ranks, checks, timings
    torchrun --nproc-per-node 8 bench/gpu_check.py    # several GPUs: every op x strategy over NCCL
    python3 bench/gpu_check.py --cpu-smoke            # CPU, Triton interpreter, tiny sizes (CI)

It installs overlap first (``pip install --no-build-isolation --no-deps -e <repo>``, which builds
``overlap._C`` with this machine's nvcc) when ``overlap._C`` does not import, then re-executes itself.

One GPU: NCCL refuses two ranks of one communicator on one GPU, so W *virtual ranks* live in this
process (``gpu_check_virtual``), each with its own stream, its own symmetric buffer (a plain device tensor)
and its own int32 flag word; one address space, so the peer-pointer table is an int64 tensor of the
buffers' ``data_ptr()``. The kernels are launched with those tables through the launchers the ops call
(``overlap.kernels``), MoE tile tables from the ops' own builders (``overlap.ops.moe_layout``).
First (``gpu_check_tp_ag``) the fused all-gather GEMM (``kernels/ag_matmul.py``). Checks (against
``torch.cat(shards) @ b`` in float64, outputs NaN-poisoned before every run): a. ordered (flags set before
the consumers launch), b. racing (consumers first, flags published later from another stream), c. a flag
never set (the kernel's bounded wait fires), d. ``overlap.signals``' bounded flag-wait kernel and
stream-ordered wait/write, e. the ``symm`` pipeline (side-stream waits and copies, per-chunk events,
per-chunk GEMMs). Then timings: the fused kernel against cuBLAS on the gathered tensor (8192^3 and
Llama-3-70B TP=8 shapes), the cost of a stream-ordered signal, and device-to-device copy bandwidth.
Then (``gpu_check_tp_rs``) f. the fused reduce-scatter kernels (``kernels/mm_rs.py``: a GEMM whose
tiles store into the owners' buffers and count per chunk, a reduction that waits per chunk) in the
layouts of ``matmul_reduce_scatter``, two-shot and one-shot ``matmul_all_reduce``, against float64
sums: ordered (two calls back to back), racing (reductions spin first), a source that never signals
(the reduction's bounded wait fires); timings of rank 0's scatter + reduction against ``torch.mm``
plus ``torch.sum`` (Llama-3-70B TP=8 row-parallel shapes, W=8 virtual ranks).
Then (``gpu_check_moe``) g. the fused MoE kernels (``kernels/moe.py``) with the MoE ops' slot layout
(a header of counts, one region per source, a flag per (peer, expert group)) and a host-built routing
(uneven top-k loads and token counts, an expert nobody picks, expert groups of two experts): the
dispatch direction's grouped GEMM that waits per block (ordered, racing copies flagged later from
another stream, a block never flagged) and the combine direction's grouped GEMM that stores into the
sources' regions and releases a flag per block (ordered twice on the same slots, racing against the
sources' bounded waits; flags at the epoch, counters back at 0); rows bitwise, GEMMs against float64;
h. (GPU) ``overlap.signals``' MoE all-to-all kernels. Timings: both grouped GEMMs against one
``torch.mm`` per expert (and ``torch._grouped_mm``) on Mixtral-8x7B and DeepSeek-V3 EP=8 shapes, 4096
tokens per rank.

Several GPUs (torchrun, WORLD_SIZE > 1): every strategy of every op in `build_ops`
(``all_gather_matmul``, ``matmul_reduce_scatter``, ``matmul_all_reduce`` two-shot and one-shot, the MoE
``dispatch``, ``dispatch`` + ``combine``, ``dispatch_grouped_matmul`` and it + ``grouped_matmul_combine``)
against ``reference`` and float64, forward and backward, then timings of each strategy and of
torch's own ``symm_mem.fused_all_gather_matmul`` where it exists.

Nothing waits unbounded: kernels spin with a timeout, stream-ordered waits are polled from the host
with a deadline and released by a watchdog write, and ``--time-limit`` is checked between sections.
Output: progress lines, a table printed last, JSON (``--json``); exit status 1 if a check FAILs.

Modules, by concept (imports go one way, from this entry point down; ``tests/test_gpu_check.py`` checks it):
``gpu_check_common`` (the report, tolerances, timing, benchmark shapes; torch only), ``gpu_check_virtual``
(virtual ranks on one device: streams, stream-ordered flags, bounded drains; checks d), ``gpu_check_tp_group``
(the virtual TP ranks and their heap layouts), ``gpu_check_tp_ag`` (a-c, e), ``gpu_check_tp_rs`` (f),
``gpu_check_moe_group`` (the virtual MoE ranks), ``gpu_check_moe_dispatch`` and ``gpu_check_moe_combine`` (g),
``gpu_check_moe_a2a`` (h), ``gpu_check_moe_timing``, ``gpu_check_moe`` (the MoE sections in order),
``gpu_check_dist`` (several GPUs under torchrun).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from gpu_check_common import STARTED, Report, log

ROOT = Path(__file__).resolve().parents[1]


# ==============================================================================================
# Command line and self-install
# ==============================================================================================


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--install", action="store_true", help="(re)install overlap first, even if overlap._C imports")
    p.add_argument("--no-install", action="store_true", help="never install, even if overlap._C does not import")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run the virtual-rank checks on CPU under the Triton interpreter at tiny sizes")
    p.add_argument("--json", default=None, help="where to write the results (default $OUT/gpu_check.json or "
                                                "./gpu_check.json)")
    p.add_argument("--time-limit", type=float, default=420.0,
                   help="seconds from the start; sections that would start later are skipped (default 420)")
    p.add_argument("--only", default="", help="comma-separated substrings: run only sections whose name has one")
    p.add_argument("--seed", type=int, default=None, help="seed of the random inputs (default: from the clock)")
    p.add_argument("--started-at", type=float, default=None, help=argparse.SUPPRESS)  # kept across the re-exec
    return p.parse_args(argv)


def project_problem() -> str | None:
    """None if overlap._C imports and suits this machine, else what is wrong."""
    try:
        from overlap import signals  # overlap._C's exports: raises ImportError where it is not built
    except ImportError as exc:
        return f"overlap._C does not import ({exc})"
    if torch.cuda.is_available() and not signals.has_cuda:
        return "overlap._C was built without its CUDA half, on a machine with a GPU"
    return None


def ensure_installed(args: argparse.Namespace) -> None:
    """Install overlap (editable, building _C here) if needed, then re-exec this script; else return.

    Under torchrun only local rank 0 installs; the other local ranks wait for its marker file (one
    written after they started: a marker left by an earlier run with the same run id does not count).
    """
    if args.no_install:
        return
    why = "--install given" if args.install else project_problem()
    if why is None:
        return
    build = ROOT / "build"
    build.mkdir(exist_ok=True)
    run_id = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'single')}-{os.environ.get('MASTER_PORT', os.getpid())}"
    marker = build / f".gpu_check_install-{run_id}"
    several = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        cmd = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-e", str(ROOT)]
        log(f"installing overlap ({why}): {' '.join(cmd)}")
        with open(build / ".gpu_check_install.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two runs on one checkout build one at a time
            done = subprocess.run(cmd, cwd=ROOT, timeout=900)
        if several:
            marker.write_text("ok" if done.returncode == 0 else "failed")
        if done.returncode != 0:
            log(f"install failed (exit {done.returncode}); rerun with --no-install to check what is there")
            raise SystemExit(2)
    else:
        deadline = time.monotonic() + 900
        while not (marker.exists() and marker.stat().st_mtime >= STARTED - 60):
            if time.monotonic() > deadline:
                raise SystemExit("gpu_check: local rank 0 did not finish installing overlap within 900 s")
            time.sleep(1.0)
        if marker.read_text() != "ok":
            raise SystemExit("gpu_check: local rank 0 failed to install overlap")
    argv = [a for a in sys.argv[1:] if a != "--install"]
    if args.started_at is None:
        argv += ["--started-at", str(STARTED)]
    os.execv(sys.executable, [sys.executable, sys.argv[0], *argv, "--no-install"])


# ==============================================================================================
# Main
# ==============================================================================================


def run_one_device(rep: Report, dev) -> None:
    """Every section of one process on `dev` (a `gpu_check_virtual.Device`: a GPU, or the CPU under the
    interpreter), in order: the all-gather GEMM kernel with the signal primitives, the scatter and reduction
    kernels, the MoE kernels."""
    from gpu_check_moe import run_moe_virtual
    from gpu_check_ops import run_ops
    from gpu_check_tp_ag import run_all_gather_virtual
    from gpu_check_tp_rs import run_reduce_scatter_virtual

    run_all_gather_virtual(rep, dev)
    run_reduce_scatter_virtual(rep, dev)
    run_moe_virtual(rep, dev)
    run_ops(rep, dev.device)  # the ops themselves, in rank processes sharing the device (gpu_check_ops)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before overlap imports its kernels
    ensure_installed(args)  # may re-exec this script
    # overlap, and the sibling modules that import it, only now: after the self-install, with TRITON_INTERPRET set
    from gpu_check_dist import run_distributed
    from gpu_check_virtual import Device

    from overlap import signals, world

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    mode = "cpu-smoke" if args.cpu_smoke else "gpu"
    if distributed:
        mode += "-distributed"
    seed = args.seed if args.seed is not None else int(time.time()) % (1 << 31)
    rep = Report(args, rank=int(os.environ.get("RANK", "0")) if distributed else 0)
    torch.manual_seed(seed + int(os.environ.get("RANK", "0")))
    rep.log(f"mode {mode}, seed {seed}, torch {torch.__version__}, overlap._C has_cuda={signals.has_cuda}")
    d = None
    if distributed:
        d = run_distributed(rep, args.cpu_smoke)
    elif args.cpu_smoke:
        dev = Device(torch.device("cpu"), rep)
        run_one_device(rep, dev)
    elif not torch.cuda.is_available():
        rep.add("gpu", "FAIL", "no CUDA device (use --cpu-smoke for the CPU checks)")
    else:
        rep.log(f"GPU {torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs")
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            rep.add("gpu", "FAIL", "TRITON_INTERPRET is set: the kernels would run interpreted, unset it")
        else:
            dev = Device(torch.device("cuda", torch.cuda.current_device()), rep)
            run_one_device(rep, dev)
    if rep.rank == 0:
        out_dir = os.environ.get("OUT")
        path = args.json or (os.path.join(out_dir, "gpu_check.json") if out_dir else "gpu_check.json")
        rep.write_json(path, mode, seed)
        print(f"\nresults written to {path}\n" + rep.table(), flush=True)
    code = 1 if rep.failed else 0
    if rep.stuck or (d is not None and d.broken):
        os._exit(code)  # a stuck device or peer could hang the interpreter's teardown
    if d is not None:
        with contextlib.suppress(Exception):
            d.dist.barrier()  # no rank tears down while a peer is still in a collective
            d.dist.destroy_process_group()
        world.exit_after_teardown(code)  # (see its docstring: a rare abort in the interpreter's teardown)
    return code


if __name__ == "__main__":
    sys.exit(main())
