#!/usr/bin/env python3
"""The GPU check of overlap: one short run that proves and times its GPU paths (docs/design.md, tier 4).

Usage::

    python3 bench/gpu_check.py                        # one GPU: virtual ranks, checks, then timings
    python3 bench/gpu_check.py --only b.racing f.rs   # rerun some sections (a group, a name, a name prefix)
    python3 bench/gpu_check.py --list                 # the groups and their sections
    torchrun --nproc-per-node 8 bench/gpu_check.py    # several GPUs: every op x strategy over NCCL
    python3 bench/gpu_check.py --cpu-smoke            # CPU, Triton interpreter, tiny sizes (CI)

It installs overlap first (``pip install --no-build-isolation --no-deps -e <repo>``, which builds
``overlap._C`` with this machine's nvcc, ``MAX_JOBS`` = its cores) when ``overlap._C`` does not import, then
re-executes itself. ``--time-limit`` (default 480 s) counts from the start, the install included: the install
gets what is left less 30 s, and at the limit (less a margin) the run stops itself, records what ran and exits.

A run always leaves a record: ``--out DIR`` (default ``gpu_check_out/``, under ``$OUT`` where that is set) holds
``gpu_check.json`` (rewritten after every section: results, sections, the one running) and ``gpu_check.log``
(everything printed, tracebacks included). The output ends with a summary: each FAIL with the ``--only`` that
reruns it, the SKIPs by reason, headline figures and the count line. Exit status: 0 all selected sections ran
and passed, 1 a FAIL, 2 the install or the command line failed, 3 some sections did not run (time limit).

Before torch is imported this sets ``CUDA_DEVICE_MAX_CONNECTIONS=32`` (logged with the value it replaced):
streams then get hardware queues of their own, so a waiting stream cannot sit in front of the producer it waits
for (the checks also issue every producer before its waiters, see `gpu_check_virtual`).

One GPU: NCCL refuses two ranks of one communicator on one GPU, so W *virtual ranks* live in one process
(``gpu_check_virtual``), each with its own stream, its own symmetric buffer (a plain device tensor) and its own
int32 flag word; one address space, so the peer-pointer table is an int64 tensor of the buffers' ``data_ptr()``.
The kernels are launched through the launchers the ops call (``overlap.kernels``), MoE tile tables from the ops'
own builders (``overlap.ops.moe.layout``). The sections come in groups (`gpu_check_groups.GROUPS`), each group in
a process of its own (`gpu_check_runner`: a crash or a sticky CUDA error in one cannot poison the next), every
correctness group before any timing group:

* ``ag`` (``gpu_check_tp_ag``): the fused all-gather GEMM (``kernels/all_gather_matmul.py``) against
  ``torch.cat(shards) @ b`` in float64, outputs NaN-poisoned: a. ordered (flags set before the consumers launch),
  b. racing (flags published later from another stream), c. a flag never set (the kernel's bounded wait fires);
  a.weight-ordered: the weight-side kernel (``kernels/all_gather_weight_matmul.py``, ``all_gather_weight_matmul``'s
  fused) against ``a @ torch.cat(shards).T``, its shards flagged before the consumers launch.
* ``streams``: d. ``overlap.signals``' bounded flag-wait kernel and stream-ordered wait/write, e. the ``symm``
  pipeline (side-stream bounded waits and copies, per-chunk events, per-chunk GEMMs).
* ``rs`` (``gpu_check_tp_rs``): f. the fused reduce-scatter kernels (``kernels/matmul_reduce_scatter.py``) in the
  layouts of ``matmul_reduce_scatter`` and two-shot and one-shot ``matmul_all_reduce``, against float64 sums:
  ordered (two calls back to back), racing, a source that never signals.
* ``moe`` (``gpu_check_moe``): g. the fused MoE kernels (``kernels/dispatch_grouped_matmul.py``,
  ``kernels/grouped_matmul_combine.py``) with the MoE ops' slot layout and a host-built routing: the dispatch
  grouped GEMM that waits per block (ordered, racing, a block never flagged) and the combine grouped GEMM that
  stores into the sources' regions (ordered twice, racing).
* ``a2a``: h. ``overlap.signals``' MoE all-to-all kernels (GPU only).
* ``ops`` (``gpu_check_ops``): i. the ops themselves through their public API, every op of the op table x
  {symm, fused} x {fwd, fwd+bwd}, in two rank processes sharing the device (a one-rank fallback), against the
  table's float64 oracle, each call twice and bitwise equal; ``ops1``: the same under
  ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (every stream of a rank in one hardware queue).
* ``queues``, ``queues1`` (``gpu_check_streams``): j. under 32 and 1 hardware queues: a wait on a registered host
  word behind its publish, the host watchdog releasing a wait nobody publishes, a wait that passes while a
  kernel holds every SM.
* ``time_ag``, ``time_rs``, ``time_moe``: device copy bandwidth and the cost of a stream-ordered signal; the fused
  kernels against cuBLAS / ``torch.mm`` (+ ``torch.sum``, ``torch._grouped_mm``) on 8192^3, Llama-3-70B TP=8,
  Mixtral-8x7B and DeepSeek-V3 EP=8 shapes.

Several GPUs (torchrun, WORLD_SIZE > 1; one process per rank, no groups): every strategy of every op in
`build_ops` against ``reference`` and float64, forward and backward, then the timings of each strategy and of
torch's own ``symm_mem.fused_all_gather_matmul`` where it exists; ``--only`` takes section-name prefixes there.

Nothing waits unbounded: kernels spin with a timeout, stream-ordered waits are polled from the host with a
deadline and released by a watchdog write, and the run has its deadline.

Modules, by concept (imports go one way, from this entry point down; ``tests/test_gpu_check.py`` checks it):
``gpu_check_common`` (the log, `Report`, tolerances, timing, shapes; torch only), ``gpu_check_report`` (the JSON
record, the table, the summary), ``gpu_check_groups`` (the registry of groups, listing, ``--only``, one group in
a process), ``gpu_check_runner`` (the group processes), ``gpu_check_virtual`` (virtual ranks: streams, gates,
bounded drains; checks d), ``gpu_check_tp_group``, ``gpu_check_tp_ag``, ``gpu_check_tp_rs``,
``gpu_check_moe_group``, ``gpu_check_moe_dispatch``, ``gpu_check_moe_combine``, ``gpu_check_moe_a2a``,
``gpu_check_moe_timing``, ``gpu_check_moe`` (the MoE entries), ``gpu_check_dist`` (several GPUs under torchrun).
"""

from __future__ import annotations

import os
import sys
import time

T0 = time.time()  # --time-limit counts from here: before torch is imported (kept across the re-exec)

# Before torch is imported (CUDA reads it when it creates the context): one hardware queue per stream, up to 32.
# A group's process keeps what the runner set for it (a group may run under another count on purpose).
CONNECTIONS = "32"
CONNECTIONS_BEFORE = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
TORCH_FIRST = "torch" in sys.modules  # imported before this script could set it (then the setting is too late)
if "--group" not in sys.argv:
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = CONNECTIONS

import argparse  # noqa: E402
import contextlib  # noqa: E402
import fcntl  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from gpu_check_common import Report, log, log_text, set_log_file  # noqa: E402
from gpu_check_report import DOC_NAME, LOG_NAME, new_doc, report_sink, save_doc, summary, table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
INSTALL_RESERVE_S = 30.0  # what the install leaves of --time-limit: enough to write the record and exit


# ==============================================================================================
# Command line and self-install
# ==============================================================================================


def default_out() -> str:
    return os.path.join(os.environ["OUT"], "gpu_check_out") if os.environ.get("OUT") else "gpu_check_out"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--install", action="store_true", help="(re)install overlap first, even if overlap._C imports")
    p.add_argument("--no-install", action="store_true", help="never install, even if overlap._C does not import")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run the virtual-rank checks on CPU under the Triton interpreter at tiny sizes")
    p.add_argument("--out", default=default_out(),
                   help="where the record (gpu_check.json) and the log (gpu_check.log) go, rewritten after every "
                        "section (default gpu_check_out/, under $OUT where set)")
    p.add_argument("--json", default=None, help="also write the record here")
    p.add_argument("--time-limit", type=float, default=480.0,
                   help="seconds from the start, the install included; at the limit the run records what it has "
                        "and exits (default 480)")
    p.add_argument("--only", nargs="+", default=[], metavar="SECTION",
                   help="run only these: group names, section names, or prefixes of section names (--list)")
    p.add_argument("--list", action="store_true", help="print the groups and their sections, run nothing")
    p.add_argument("--seed", type=int, default=None, help="seed of the random inputs (default: from the clock)")
    p.add_argument("--started-at", type=float, default=None, help=argparse.SUPPRESS)  # kept across the re-exec
    p.add_argument("--group", default=None, help=argparse.SUPPRESS)  # run one group here (the runner's processes)
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


def machine_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def install_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The install's environment: ``MAX_JOBS`` = this machine's cores unless the caller set it, and what the
    preflight found the build needs (``CUDACXX`` where CMake would not find nvcc)."""
    env = {**os.environ, **(extra or {})}
    env.setdefault("MAX_JOBS", str(machine_cores()))
    return env


def install_deadline(started: float, time_limit: float) -> float:
    """Wall time by which the install must be done: the run's deadline less INSTALL_RESERVE_S."""
    return started + time_limit - min(INSTALL_RESERVE_S, 0.25 * time_limit)


def ensure_installed(args: argparse.Namespace, log_file) -> str | None:
    """Install overlap (editable, building _C here) if needed, then re-exec this script; else return None.
    Returns what went wrong where the install failed or ran out of time.

    Under torchrun only local rank 0 installs; the other local ranks wait for its marker file (one
    written after they started: a marker left by an earlier run with the same run id does not count).
    """
    from gpu_check_preflight import preflight
    from gpu_check_runner import run_teed

    if args.no_install:
        return None
    why = "--install given" if args.install else project_problem()
    if why is None:
        return None
    started = args.started_at
    checked = preflight(dict(os.environ), gpu=not args.cpu_smoke and torch.cuda.is_available(), root=ROOT)
    for fact in checked.facts:
        log(f"preflight: {fact}", started)
    if checked.problems:
        return "the install cannot work here: " + "; ".join(checked.problems)
    until = install_deadline(started, args.time_limit)
    build = ROOT / "build"
    build.mkdir(exist_ok=True)
    run_id = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'single')}-{os.environ.get('MASTER_PORT', os.getpid())}"
    marker = build / f".gpu_check_install-{run_id}"
    several = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        cmd = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-e", str(ROOT)]
        env = install_env(checked.env)
        log(f"installing overlap ({why}), MAX_JOBS={env['MAX_JOBS']}, at most {until - time.time():.0f} s: "
            f"{' '.join(cmd)}", started)
        with open(build / ".gpu_check_install.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two runs on one checkout build one at a time
            code = run_teed(cmd, env, until, log_file, cwd=str(ROOT))
        if several:
            marker.write_text("ok" if code == 0 else "failed")
        if code != 0:
            return ("the install ran out of time" if code is None else f"the install failed (exit {code})") + \
                "; rerun with --no-install to check what is there"
    else:
        while not (marker.exists() and marker.stat().st_mtime >= started - 60):
            if time.time() > until:
                return "local rank 0 did not finish installing overlap in time"
            time.sleep(1.0)
        if marker.read_text() != "ok":
            return "local rank 0 failed to install overlap"
    argv = [a for a in sys.argv[1:] if a != "--install"]
    if "--started-at" not in argv:
        argv += ["--started-at", repr(started)]
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, sys.argv[0], *argv, "--no-install"])
    return None  # not reached


# ==============================================================================================
# Main
# ==============================================================================================


def finish(doc: dict, args: argparse.Namespace, code: int) -> int:
    """The table of every result, then the summary (the last lines of the output); returns `code`."""
    log_text("\n" + table(doc["results"]) + "\n\n" + summary(doc, args.out), sys.stdout)
    return code


def run_torchrun(args: argparse.Namespace, doc: dict, paths: list[str]) -> int:
    """Several GPUs under torchrun: this rank's sections in this process (gpu_check_dist)."""
    from gpu_check_dist import run_distributed

    from overlap import world

    rank = int(os.environ.get("RANK", "0"))
    rep = Report(args, rank=rank)
    torch.manual_seed(args.seed + rank)
    if rank == 0:
        rep.sink = report_sink(doc, paths)
    rep.arm_deadline()
    d = run_distributed(rep, args.cpu_smoke)
    doc["complete"] = not any("time-limit" in r.value for r in rep.results if r.status != "PASS")
    if rank == 0:
        rep.sink(rep)
        finish(doc, args, 0)
    code = 1 if rep.failed else 0 if doc["complete"] else 3
    if rep.stuck or d.broken:
        os._exit(code)  # a stuck device or peer could hang the interpreter's teardown
    with contextlib.suppress(Exception):
        d.dist.barrier()  # no rank tears down while a peer is still in a collective
        d.dist.destroy_process_group()
    world.exit_after_teardown(code)  # (see its docstring: a rare abort in the interpreter's teardown)
    return code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before overlap imports its kernels
    if args.group:  # one group in this process, for the runner
        from gpu_check_groups import run_group

        code = run_group(args)
        sys.stdout.flush()
        os._exit(code)  # no interpreter teardown: it could wait on a device a section left stuck
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank = int(os.environ.get("RANK", "0")) if distributed else 0
    fresh = args.started_at is None  # not the re-exec after the install
    started = args.started_at = args.started_at or T0
    if args.list:  # no record, no log
        from gpu_check_groups import list_sections, ordered_groups, print_listing

        problem = ensure_installed(args, None)
        if problem is not None:
            log(problem, started)
            return 2
        print_listing({g.name: list_sections(g, not args.cpu_smoke, args) for g in ordered_groups()})
        return 0
    if rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    log_file = set_log_file(Path(args.out) / LOG_NAME, append=not fresh) if rank == 0 else None
    if rank == 0 and fresh:
        log(f"CUDA_DEVICE_MAX_CONNECTIONS={CONNECTIONS} set before torch was imported (it was "
            f"{CONNECTIONS_BEFORE if CONNECTIONS_BEFORE is not None else 'unset'})"
            + ("; WARNING: torch was imported earlier, the setting may come too late" if TORCH_FIRST else ""), started)
    problem = ensure_installed(args, log_file)  # may re-exec this script
    if problem is None and not args.cpu_smoke:
        problem = project_problem()  # after the install too: a GPU with a _C that lacks CUDA is one clear FAIL
    args.seed = args.seed if args.seed is not None else int(time.time()) % (1 << 31)
    mode = ("cpu-smoke" if args.cpu_smoke else "gpu") + ("-distributed" if distributed else "")
    doc = new_doc(mode, args.seed, args.time_limit, started)
    paths = [os.path.join(args.out, DOC_NAME)] + ([args.json] if args.json else [])
    if problem is not None:
        log(problem, started)
        doc["results"].append({"name": "install", "status": "FAIL", "value": problem, "tflops": None,
                               "ratio": None, "data": {}, "section": None})
        if rank == 0:
            save_doc(doc, paths)
            finish(doc, args, 2)
        return 2
    if rank == 0:
        log(f"mode {mode}, seed {args.seed}, torch {torch.__version__}, --out {args.out}", started)
    if distributed:
        return run_torchrun(args, doc, paths)
    why_not = None
    if not args.cpu_smoke and not torch.cuda.is_available():
        why_not = "no CUDA device (use --cpu-smoke for the CPU checks)"
    elif not args.cpu_smoke and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        why_not = "TRITON_INTERPRET is set: the kernels would run interpreted, unset it"
    if why_not is not None:
        doc["results"].append({"name": "gpu", "status": "FAIL", "value": why_not, "tflops": None, "ratio": None,
                               "data": {}, "section": None})
        save_doc(doc, paths)
        return finish(doc, args, 1)
    from gpu_check_runner import Runner

    code = Runner(args, doc, log_file).run()
    return finish(doc, args, code)


if __name__ == "__main__":
    sys.exit(main())
