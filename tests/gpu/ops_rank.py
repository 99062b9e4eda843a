"""One rank of the ops run on one device (tests/gpu/test_ops_on_one_device.py): every op of the op table x
{``symm``, ``fused``} x {forward, forward and backward}, and the ops that take fp8 twice more in their fp8 recipes
(``fp8="rowwise"``, then ``fp8="mxfp8"``, on bf16 leaves: the packed fp8 rows with their scales, the scaled GEMMs,
the fused kernels' fp8 dot, MX's per k-block), through the
public API, against a float64 oracle computed here from the seed (fp8: of the leaves as the recipe quantizes
them), each call made twice and required to give bitwise the same results.

Started as ``python -m tests.gpu.ops_rank --rank R --world-size W ...``, one process per rank. On a GPU every rank
computes on the same device: the process group is ``cpu:gloo,cuda:nccl`` (one rank: ``nccl``), whose name tells
overlap the group computes on CUDA (`overlap.world.group_device`), while no NCCL communicator is ever created (NCCL
refuses two ranks on one GPU): ``symm`` and ``fused`` make no collective, overlap's own set-up and torch's
symmetric-memory rendezvous go through the group's store, and this module exchanges nothing (each rank checks its
own results; the parent merges them). Symmetric memory across processes on one device needs
``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``, set by the parent. On the CPU (``--device cpu``) the ranks use gloo
and ``fused`` runs under the Triton interpreter.

Results go to ``<out>/rank<R>.jsonl``, one JSON object a line, flushed as they come (a rank that dies leaves what
it had): ``{"kind": "cases", "names": [...]}`` first, then ``{"kind": "setup", ...}`` once the heap exists (the
set-up smoke: the process group, the group's facts, ``overlap.reserve``, i.e. torch's symmetric-memory allocation
and rendezvous and the flag words on GPUs), then one ``{"kind": "case", ...}`` per case from ``--first`` on (up to
``--stop``). The first exception an op raises ends the run of this rank (the group may then be unusable); the parent
then stops its peers and starts fresh ranks at the next case, so one failure costs one case.

Imports overlap, and of the tests only `tolerance` (no pytest).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import time
import traceback
from typing import Any

import torch

from tests.gpu.tolerance import BLOCK_RTOL, FP32_ACCUMULATE, UNIT_ROUNDOFF, compare_bound, dtype_name

STRATEGIES = ("symm", "fused")
#: chunks per link class of every call: more than one, so per-chunk flags, events and copies run
CHUNKS = {"shm": 2, "nvlink": 2, "pcie": 2}
#: MoE against the dense float64 model (docs/design.md, tolerance (c)): rtol, atol (times the largest value > 1)
MOE_TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 3e-2), torch.float16: (2e-2, 3e-2)}
TRACE_CHARS = 3000  # how much of a failing call's traceback a record keeps


@dataclasses.dataclass(frozen=True)
class Case:
    """One check: an op of the table, a `Plan` variant flag (``""`` or e.g. ``one_shot``), a strategy, and
    whether the call runs its backward too (forward-only calls run under ``torch.no_grad``, which takes other
    paths: the MoE combine's CUDA sum kernel); `fp8`: the op's fp8 recipe on bf16 leaves, as the dtype of its
    problem (``float8_e4m3fn``: rowwise, ``mxfp8``: MX), or ``""``."""

    op: str
    variant: str
    strategy: str
    backward: bool
    shape: dict[str, int]
    fp8: str = ""

    @property
    def name(self) -> str:
        """``op-strategy-mode``, e.g. ``matmul_all_reduce.one_shot-fused-fwd+bwd`` (a test id: no dims; fp8:
        ``all_gather_matmul.fp8-fused-fwd``, MX ``all_gather_matmul.mxfp8-fused-fwd``)."""
        recipe = {"": (), "mxfp8": ("mxfp8",)}.get(self.fp8, ("fp8",))
        op = ".".join((self.op, *((self.variant,) if self.variant else ()), *recipe))
        return f"{op}-{self.strategy}-{'fwd+bwd' if self.backward else 'fwd'}"

    @property
    def dims(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.shape.items())


def shapes(family: str, cuda: bool, mx: bool = False) -> dict[str, int]:
    """A `Problem`'s dims per family. GPU: several tiles of the default 128x128 bf16 tiles, dims that are no
    multiple of them (MX: ``k`` a multiple of its blocks of 32, not of the tile), MoE rows of 256 bytes (what the
    dispatch kernel takes); CPU: interpreted, tiny."""
    if family == "moe":
        return ({"m": 80, "k": 128, "n": 96, "experts": 8, "top_k": 2} if cuda
                else {"m": 8, "k": 32, "n": 24, "experts": 4, "top_k": 2})
    return {"m": 72, "k": 160 if mx else 136, "n": 200} if cuda else {"m": 8, "k": 32, "n": 24}


def cases(cuda: bool) -> list[Case]:
    """Every op of the table (and every `Plan` variant it takes) x `STRATEGIES` (those it has: the sequence-parallel
    ops have neither yet) x {fwd, fwd+bwd}, table order; then
    the same of the ops that take fp8, in the rowwise recipe, then in the MX one."""
    from overlap.plans import FP8_DTYPES, OPS

    return [Case(name, variant, strategy, backward, shapes(spec.family, cuda, fp8 == "mxfp8"), fp8)
            for fp8 in ("", *FP8_DTYPES) for name, spec in OPS.items() if spec.fp8 or not fp8
            for variant in ("", *spec.variants) for strategy in STRATEGIES if strategy in spec.strategies
            for backward in (False, True)]


# ==============================================================================================
# One case: inputs from the seed, the float64 oracle, two calls
# ==============================================================================================


def _as64(inputs, magnitude: bool = False):
    """float64 CPU copies of one rank's `OpInputs` (absolute values with `magnitude`); routing as it is."""
    def conv(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        t = t.detach().to("cpu", torch.float64)
        return t.abs() if magnitude else t

    return dataclasses.replace(inputs, leaves=tuple(conv(t) for t in inputs.leaves), grad_out=conv(inputs.grad_out),
                               routing=None if inputs.routing is None else inputs.routing.cpu())


def call_once(work, inputs, group, plan, backward: bool, timeout: float) -> list[torch.Tensor]:
    """One call through the workload's call (`overlap.workloads.Workload.call`: the public ops) on fresh
    leaves: ``[out]``, or ``[out, gradient of every leaf]`` after ``out.backward(grad_out)``."""
    leaves = tuple(t.detach().clone().requires_grad_(backward) for t in inputs.leaves)
    with torch.set_grad_enabled(backward):
        out = work.call(dataclasses.replace(inputs, leaves=leaves), group, plan=plan, timeout=timeout)
        if backward:
            out.backward(inputs.grad_out)
    return [out.detach(), *(t.grad for t in leaves if backward)]


def bound_of(family: str, dtype: torch.dtype, exact: torch.Tensor, terms: torch.Tensor | None,
             depth: int, world_size: int) -> torch.Tensor:
    """Per element, how far a result may be from the float64 `exact` one.

    TP ops are bilinear in their inputs, so `terms` (the oracle on the inputs' absolute values) is the sum
    of the magnitudes of the products an element adds up, and a rounding bound follows: the result rounds
    at most ``world_size + 2`` times (a partial stored, each reduction step, the output) and accumulates in
    fp32 over at most `depth` terms. MoE applies gelu between
    its GEMMs: docs/design.md's tolerance (c), atol times the largest expected magnitude where that exceeds 1."""
    if family == "tp":
        per_term = (world_size + 2) * UNIT_ROUNDOFF[dtype] + 2 * (depth + 2) * FP32_ACCUMULATE
        return per_term * terms * 1.01 + 1e-30
    rtol, atol = MOE_TOL[dtype]
    scale = max(1.0, float(exact.abs().max())) if exact.numel() else 1.0
    return atol * scale + rtol * exact.abs()


def run_case(case: Case, index: int, seed: int, group, device: torch.device, dtype: torch.dtype,
             timeout: float) -> dict[str, Any]:
    """Inputs of every rank from the seed, this rank's float64 oracle, two calls; the case's verdict here."""
    import torch.distributed as dist

    from overlap.plans import OPS, Plan, Problem
    from overlap.workloads import SeededDraw, leaf_dtype, workload

    spec, work = OPS[case.op], workload(case.op)
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    if case.fp8:  # the recipe on bf16 leaves (the workload's fp8 problem): results rounded as bf16's
        dtype = leaf_dtype(torch.float8_e4m3fn)
    problem = Problem(case.op, dtype=case.fp8 or dtype_name(dtype), backward=case.backward,
                      **case.shape)
    draw = SeededDraw((seed * 1_000_003 + index) % 2**62, rank, device, dtype)
    with torch.no_grad():
        every = [work.inputs(problem, W, draw.for_rank(q)) for q in range(W)]
        exact = work.oracle(problem, [_as64(e) for e in every], rank)
        terms = work.oracle(problem, [_as64(e, True) for e in every], rank) if spec.family == "tp" else exact
    plan = Plan(case.strategy, num_chunks=CHUNKS, **({case.variant: True} if case.variant else {}))
    first = call_once(work, every[rank], group, plan, case.backward, timeout)
    second = call_once(work, every[rank], group, plan, case.backward, timeout)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # bounded: every wait the calls enqueued has its deadline
    depth = max(max(t.shape) for t in every[rank].leaves) * W
    problems, parts, worst = [], [], 0.0
    if len(first) != len(exact):
        problems.append(f"{len(first)} results, the oracle has {len(exact)}")
    for got, again, want, mag in zip(first, second, exact, terms):
        bound = bound_of(spec.family, dtype, want.value, mag.value, depth, W)
        ok, max_err, rel = compare_bound(got.cpu(), want.value, bound, BLOCK_RTOL[dtype])
        same = got.shape == again.shape and bool(torch.equal(got, again))
        worst = max(worst, max_err if math.isfinite(max_err) else math.inf)
        parts.append(f"{want.what} {max_err:.1e} (block rel {rel:.1e})")
        if not ok:
            problems.append(f"{want.what} off the float64 oracle: max {max_err:.1e}, block rel {rel:.1e}")
        if not same:
            problems.append(f"{want.what} differs between two identical calls")
    value = "; ".join(problems) if problems else f"max {worst:.1e} from float64, repeat bitwise ({', '.join(parts)})"
    return {"status": "FAIL" if problems else "PASS", "value": value, "max_err": worst if math.isfinite(worst)
            else str(worst)}


# ==============================================================================================
# The rank's run
# ==============================================================================================


class Results:
    """``<out>/rank<R>.jsonl``, one object a line, flushed at once."""

    def __init__(self, path: str):
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's life

    def write(self, kind: str, **fields: Any) -> None:
        self.file.write(json.dumps({"kind": kind, **fields}) + "\n")
        self.file.flush()


def init(rank: int, world_size: int, init_file: str, device: torch.device, timeout: float):
    """The process group: on a GPU ``cpu:gloo,cuda:nccl`` for several ranks (see the module docstring) and
    plain NCCL for one (the fallback shares no failure of the mixed group); gloo on the CPU."""
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "gloo" if device.type != "cuda" else "cpu:gloo,cuda:nccl" if world_size > 1 else "nccl"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))
    return dist.group.WORLD


def setup_smoke(group, device: torch.device, timeout: float) -> str:
    """The group's facts and its heap (``overlap.reserve``: on GPUs torch's symmetric memory and the flag
    words); what they are, in words. Raises whatever they raise."""
    import overlap

    info = overlap.world.group_info(group, timeout)
    if info.device != device:
        raise RuntimeError(f"overlap sees this group compute on {info.device}, not on {device}")
    overlap.reserve(group, 1 << 16, timeout=timeout)
    return f"{info.world_size} rank(s) on {info.device}, backend {info.backend}, links {info.link_classes()}"


def _failure(exc: BaseException) -> dict[str, str]:
    """A record's fields for an exception: its text, and the end of its traceback."""
    return {"value": f"{type(exc).__name__}: {exc}"[:500], "trace": traceback.format_exc()[-TRACE_CHARS:]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one rank of the ops run on one device (tests/gpu)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--init-file", required=True)
    p.add_argument("--device", required=True, help="cuda:N or cpu")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--timeout", type=float, required=True, help="deadline of every wait on a peer, seconds")
    p.add_argument("--out", required=True, help="folder of the rank<R>.jsonl files")
    p.add_argument("--first", type=int, default=0, help="index of the first case to run (the parent restarts the "
                                                           "ranks after the case that ended a run)")
    p.add_argument("--stop", type=int, default=None, help="index of the case to stop before (default: run to the "
                                                          "end)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before overlap imports its kernels
        torch.set_num_threads(1)
    from overlap import world

    out = Results(os.path.join(args.out, f"rank{args.rank}.jsonl"))
    todo = cases(device.type == "cuda")
    out.write("cases", names=[c.name for c in todo])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    code = 0
    try:
        t0 = time.monotonic()
        group = init(args.rank, args.world_size, args.init_file, device, args.timeout)
        what = setup_smoke(group, device, args.timeout)
        out.write("setup", status="PASS", value=f"{what}, {time.monotonic() - t0:.1f} s")
    except Exception as exc:  # noqa: BLE001 - reported; the parent falls back
        traceback.print_exc()
        out.write("setup", status="FAIL", **_failure(exc))
        world.exit_after_teardown(3)
    for i, case in enumerate(todo[:args.stop]):
        if i < args.first:
            continue
        t0 = time.monotonic()
        try:
            result = run_case(case, i, args.seed, group, device, dtype, args.timeout)
        except Exception as exc:  # noqa: BLE001 - the first error ends this run (the parent starts a fresh one)
            traceback.print_exc()
            out.write("case", name=case.name, status="FAIL", error=True, **_failure(exc))
            code = 1
            break
        out.write("case", name=case.name, dims=case.dims, seconds=round(time.monotonic() - t0, 2), **result)
    if code == 0:
        import overlap

        overlap.release(group)
        import torch.distributed as dist

        dist.destroy_process_group()
    world.exit_after_teardown(code)  # (a dead peer could hang the interpreter's teardown)
    return code


if __name__ == "__main__":
    sys.exit(main())
