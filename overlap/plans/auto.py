"""``strategy="auto"``: the plan of a call, and the checks of a forced one.

`resolve_auto` is a pure function of the call signature (op, shapes, dtype) and of the group's topology, so
every rank computes the same plan without communicating; the plan's text is part of the
call signature, so ranks that somehow disagree raise on every rank instead of hanging.

The cost model (`overlap.plans.costmodel`: `predict`, `candidates`, `rank_candidates`; machine
constants in `Profile`, `default_profile`) scores every plan that can run on a `Topology` for a
`Problem`; `overlap tune` searches with it and writes plan files (`overlap.plans.planfile`).

Default heuristic (`resolve_auto`, where no plan file covers a call):

* one rank: ``reference`` (there is nothing to communicate);
* a tensor-parallel call on a group that spans nodes: the cost model's best plan under the default profile of
  the device (``hierarchical``, ``pipelined`` or ``reference``, chunked per link class); other calls across
  nodes: ``pipelined``, 2 chunks per network transfer;
* CPU ranks of one node: ``symm`` (shared-memory copies beat gloo's loopback TCP); interpreted
  ``fused`` is never chosen;
* GPU ranks of one node: ``fused`` for fp16/bf16 with at least 128 rows per rank, else ``symm``;
  ``pipelined`` (with a warning, once) where GPU symmetric memory is unavailable (``overlap._C``
  built without CUDA, or a torch without ``_symmetric_memory``);
* ops with the ``one_shot`` variant (`OpSpec.variants`: ``matmul_all_reduce``): one-shot (every rank
  sums every rank's whole partial) for outputs up to `ONE_SHOT_MAX_BYTES` or fewer than
  ``2 * world_size`` rows, else two-shot (reduce-scatter, then all-gather);
* then, for a tensor-parallel call on one node: ``reference`` (the plain collectives) where the cost model with
  the default profile of the device predicts it faster than that plan, i.e. where the plan's fixed per-call cost
  (`Profile.call_s`) is more than its overlap saves (`_plain_is_cheaper`). With the default CPU profile (measured
  on a 2-core VM: gloo's collectives cost more per call than shared-memory flags) that never happens; the default
  GPU profile is the preset of the ranks' GPU (`overlap.plans.presets`, by its device name; ``h100-sxm`` for a GPU
  without a preset), with which decode-sized calls and small messages take ``reference``: a chunked GEMM of a few
  rows rereads its weight, and the per-call costs (guessed until a GPU runs the probe) outweigh what overlap hides.
  `described_plan` applies the same rules to a described cluster (``overlap predict``, ``overlap tune --machine``)
  with its profile, and its check to every op family (at run time an MoE call's check comes from a plan file).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from collections.abc import Mapping

from .. import envs
from ..errors import warn_once
from ..world import GroupInfo
from .costmodel import default_profile, predict, rank_candidates, topology_of
from .migration import check_migrate, nodes_of
from .optable import FP8_DTYPES, FP8_LEAVES, ITEMSIZE, OPS, Problem
from .plan import STRATEGIES, Plan
from .planfile import PlanFile, load_cached

log = logging.getLogger("overlap")

def as_plan(strategy: str, plan) -> Plan | None:
    """Normalize the ``strategy=``/``plan=`` arguments of an op; None means 'resolve auto' (with
    ``plan=`` a plan file, see `plan_source`).

    Raises TypeError/ValueError for a bad pair, among them ``plan="symm"``: a string is a plan file's path, and a
    strategy's name where no such file exists is a mistake for ``strategy="symm"`` or ``plan=Plan("symm")``."""
    if isinstance(plan, str) and _names_a_strategy(plan) and not os.path.exists(plan):
        raise ValueError(f"plan={plan!r} names a strategy, but plan= takes a plan file (a path or "
                         f"overlap.plans.PlanFile) or an overlap.Plan: pass strategy={plan.split('+')[0]!r}, or "
                         f"plan=overlap.Plan({plan.split('+')[0]!r}"
                         + (", one_shot=True)" if plan.endswith("+one_shot") else ")"))
    if plan is not None and plan_source(plan) is None:
        if isinstance(plan, Mapping):
            plan = Plan(**plan)
        if not isinstance(plan, Plan):
            raise TypeError("plan must be an overlap.Plan, a dict of its fields, a plan file (path or "
                            f"overlap.plans.PlanFile) or None, got {type(plan).__name__}")
        if strategy not in ("auto", plan.strategy):
            raise ValueError(f"strategy={strategy!r} contradicts plan.strategy={plan.strategy!r}")
        return plan
    if not isinstance(strategy, str):
        raise TypeError(f"strategy must be a str, got {type(strategy).__name__}")
    if plan is not None and strategy != "auto":
        raise ValueError(f"strategy={strategy!r} contradicts plan= a plan file (which is for strategy='auto')")
    if strategy == "auto":
        return None
    return _named_plan(strategy)


def _names_a_strategy(text: str) -> bool:
    """Whether `text` is a strategy's name (or ``auto``), as ``strategy=`` takes it, or a variant's label
    (``symm+one_shot``)."""
    name, _, variant = text.strip().partition("+")
    return name in ("auto", *STRATEGIES) and variant in ("", "one_shot")


@functools.lru_cache(maxsize=64)
def _named_plan(strategy: str) -> Plan:
    """``Plan(strategy)``, made once per name (plans are immutable; an unknown name raises every time)."""
    return Plan(strategy)


def plan_source(plan):
    """The plan file named by an op's ``plan=`` argument (a path or a `PlanFile`), else None."""
    if isinstance(plan, (str, os.PathLike, PlanFile)):
        return plan
    return None


def env_plan_file() -> PlanFile | None:
    """The plan file OVERLAP_PLAN names (`envs.plan_path`), loaded (`load_cached`: read again once rewritten), or
    None where the variable is unset. Raises one ValueError naming the variable, the file and what is wrong where
    it cannot be read or is no valid plan file (the command line checks it so before any rank starts)."""
    path = envs.plan_path()
    if path is None:
        return None
    try:
        return load_cached(path)
    except ValueError as exc:
        raise ValueError(f"OVERLAP_PLAN={os.environ['OVERLAP_PLAN']!r}: {exc} (or unset OVERLAP_PLAN)") from None


_LOGGED: set[str] = set()


#: ``matmul_all_reduce`` outputs up to this size take the one-shot variant under ``auto``
ONE_SHOT_MAX_BYTES = 256 * 1024


def resolve_auto(op: str, signature: str, info: GroupInfo, rows_per_rank: int | None, dtype_name: str,
                 out_bytes: int = 0, problem: Problem | None = None, plan_file=None) -> Plan:
    """The plan of an ``auto`` call, identical on every rank by construction (the same file and the same
    call give the same plan; ranks that load different files raise `OverlapMismatchError` in the
    call's handshake, as the plan is part of its signature):

    1. a plan file (`plan_file`, an op's ``plan=`` path or `PlanFile`, else ``OVERLAP_PLAN``): its entry
       for `problem` (``reference`` where the tuned plan was measured slower than reference), else the
       cost model's best plan with the file's machine profile. A file tuned on another topology raises
       ValueError. MoE calls, whose token counts differ between ranks, take the entry of their layer tuned
       at the most tokens, whatever this rank's count, and the heuristic where the file has no such entry;
    2. the default heuristic of this module's docstring. `rows_per_rank` None (MoE: not the same on every
       rank) leaves out the thresholds on rows: ``fused`` for 16-bit dtypes on GPU ranks of one node.
    """
    source = plan_file if plan_file is not None else envs.plan_path()
    if source is not None and problem is not None and info.world_size > 1:
        if plan_file is None:
            source = env_plan_file()
        plan, how = _from_plan_file(source, problem, info)
        if plan is not None:
            _log_once(op, signature, plan, how)
            return plan
    if not info.single_node and info.world_size > 1 and problem is not None and problem.spec.family != "moe":
        plan = _across_nodes(problem, info)
        _log_once(op, signature, plan, "cost model with the default profile")
        return plan
    symm = info.device.type != "cuda" or gpu_symmetric_memory()
    if info.single_node and info.world_size > 1 and not symm:
        warn_once("overlap: GPU symmetric memory is unavailable (overlap._C built without CUDA, or torch "
                  "lacks _symmetric_memory); 'auto' falls back to 'pipelined'", log=True)
    plan = heuristic_plan(op, info.world_size, info.single_node, info.device.type, rows_per_rank, dtype_name,
                          out_bytes, symm)
    how = "default heuristic"
    if plan.strategy != "reference" and problem is not None and problem.spec.family != "moe" \
            and _plain_is_cheaper(problem, _topology(info), plan, gpu_name(info.device)):
        plan, how = Plan("reference"), "cost model: the protocol costs more than the overlap saves"
    _log_once(op, signature, plan, how)
    return plan


def heuristic_plan(op: str, world_size: int, single_node: bool, device_type: str, rows: int | None,
                   dtype_name: str, out_bytes: int = 0, symm_available: bool = True) -> Plan:
    """The default heuristic of this module's docstring, before the cost model's check: a pure function of the call
    (`rows`: its input rows, None for MoE; `out_bytes`: its output's) and of the group (``pipelined`` across nodes,
    where the caller has not asked the model; ``pipelined`` on GPUs without symmetric memory)."""
    if world_size == 1:
        plan = Plan("reference")
    elif not single_node or (device_type == "cuda" and not symm_available):
        plan = Plan("pipelined")
    elif device_type == "cuda" and dtype_name in ("float16", "bfloat16") and (rows or 128) >= 128:
        plan = Plan("fused")
    else:
        plan = Plan("symm")
    if op in OPS and plan.strategy not in OPS[op].strategies:  # an op without fused or symm: the next it has
        plan = Plan(next(s for s in ("symm", "pipelined", "reference") if s in OPS[op].strategies))
    if _takes_one_shot(op) and plan.strategy != "reference":
        one_shot = out_bytes <= ONE_SHOT_MAX_BYTES or (rows or 0) < 2 * world_size
        plan = dataclasses.replace(plan, one_shot=one_shot)
    return plan


def described_plan(problem: Problem, topology, profile) -> tuple[Plan, str]:
    """``auto``'s plan for `problem` on a described cluster (`overlap.plans.presets.cluster`: `topology` and its
    `profile`), without a plan file, and how it was chosen: the runtime's rules (a tensor-parallel call across
    nodes: the model's best plan; else `heuristic_plan`), then, for every op family, ``reference`` where the model
    predicts the plain collectives faster than that plan. So it is never a plan the model predicts slower than
    unfused. (At run time the last check covers the tensor-parallel ops: an MoE call's token count differs between
    ranks; a plan file from ``overlap tune --machine`` carries the checked choice to them.)"""
    spec, W = problem.spec, topology.world_size
    if topology.num_nodes > 1 and W > 1 and spec.family != "moe":
        return best_plan(problem, topology, profile) or Plan("pipelined"), "cost model: the best plan across nodes"
    rows = spec.in_rows(problem.m, W) if spec.family != "moe" else None
    out_size = ITEMSIZE[FP8_LEAVES if problem.dtype in FP8_DTYPES else problem.dtype]
    out_bytes = spec.out_rows(problem.m, W) * spec.out_cols(problem.n, W) * out_size
    plan = heuristic_plan(problem.op, W, topology.num_nodes == 1, topology.device, rows, problem.dtype, out_bytes)
    if plan.strategy != "reference" and plain_is_faster(problem, topology, plan, profile):
        return Plan("reference"), "cost model: the plain collectives are faster than the default heuristic's plan"
    return plan, "default heuristic"


def best_plan(problem: Problem, topology, profile) -> Plan | None:
    """The cost model's fastest plan for `problem` that runs on `topology` (`rank_candidates`), None where none
    does."""
    return next((p for p, pred in rank_candidates(problem, topology, profile) if math.isfinite(pred.total_s)), None)


def plain_is_faster(problem: Problem, topology, plan: Plan, profile) -> bool:
    """Whether the cost model with `profile` predicts the plain collectives (``reference``) faster than `plan` for
    `problem` (False where the profile does not describe the call: a dtype or link class it lacks)."""
    try:
        plain = predict(problem, Plan("reference"), topology, profile).total_s
        chosen = predict(problem, plan, topology, profile).total_s
    except ValueError:
        return False
    return plain < chosen


@functools.lru_cache(maxsize=64)
def _topology(info: GroupInfo):
    """`topology_of` a group's facts, once per group (every call of auto asks)."""
    return topology_of(info)


@functools.lru_cache(maxsize=16)
def gpu_name(device) -> str:
    """What ``torch.cuda.get_device_name`` calls `device` (a `torch.device`), empty for a CPU or where CUDA cannot
    say: the default profile of GPU ranks is that GPU's preset (`default_profile`)."""
    if device.type != "cuda":
        return ""
    import torch

    try:
        return torch.cuda.get_device_name(device)
    except (RuntimeError, AssertionError, ValueError):  # (no driver, or torch without CUDA)
        return ""


@functools.lru_cache(maxsize=1024)
def _plain_is_cheaper(problem: Problem, topology, plan: Plan, name: str = "") -> bool:
    """Whether the cost model, with the default profile of the group's device (`name`: its GPU, whose preset it is
    where there is one), predicts the plain collectives (``reference``) faster than `plan` for `problem`: a call so
    small that the overlapped plan's fixed per-call cost (`Profile.call_s`) is more than its overlap saves. The same
    on every rank of one GPU type (a pure function of the call, the topology and the GPU); cached per call shape."""
    return plain_is_faster(problem, topology, plan, default_profile(topology.device, name))


def _across_nodes(problem: Problem, info: GroupInfo) -> Plan:
    """A TP or sequence-parallel call on a group that spans nodes, without a plan file: the cost model's best plan
    (``hierarchical``, ``pipelined`` or ``reference``, chunked per link) under `default_profile` of the group's
    device."""
    profile = default_profile(info.device.type, gpu_name(info.device))
    return best_plan(problem, topology_of(info), profile) or Plan("pipelined")


def _from_plan_file(source, problem: Problem, info: GroupInfo) -> tuple[Plan | None, str]:
    pf = source if isinstance(source, PlanFile) else load_cached(source)
    topology = topology_of(info)
    pf.check_topology(topology)
    if problem.spec.family == "moe":
        # Token counts differ between ranks, so every rank must pick by what they share: the entry of
        # the same layer (hidden, ffn, experts, top-k, dtype, mode) tuned at the most tokens. No entry:
        # the heuristic (the model would need this rank's own count).
        same = [e for e in pf.entries.values() if dataclasses.replace(e.problem, m=problem.m) == problem]
        if not same:
            _warn_missing(pf, problem, info, "the default heuristic")
            return None, ""
        return pf.lookup(max(same, key=lambda e: e.problem.m).problem), f"plan file {pf.path or ''}".rstrip()
    plan = pf.lookup(problem)
    if plan is not None:
        return plan, f"plan file {pf.path or ''}".rstrip()
    if pf.profile is not None:
        best = best_plan(problem, topology, pf.profile)
        if best is not None:
            _warn_missing(pf, problem, info, "the cost model with the file's machine profile")
            return best, "cost model with the plan file's profile"
    _warn_missing(pf, problem, info, "the default heuristic")
    return None, ""


_MISSING: set[tuple[str, str]] = set()


def _warn_missing(pf: PlanFile, problem: Problem, info: GroupInfo, instead: str) -> None:
    """Say once per plan file and shape (on the group's first rank, at warning level) that the file has no entry
    for the call: otherwise the fallback looks like the tuned plan at work."""
    key = (pf.path or str(id(pf)), problem.key)
    if info.rank != 0 or key in _MISSING:
        return
    _MISSING.add(key)
    what = "the layer (hidden, ffn, experts, top-k, dtype, mode) of " if problem.spec.family == "moe" else ""
    log.warning("overlap.%s: plan file %s has no entry for %s%s; auto uses %s instead (overlap tune adds it)",
                problem.op, pf.path or "(given in memory)", what, problem.key, instead)


def _log_once(op: str, signature: str, plan: Plan, how: str) -> None:
    key = f"{op}|{signature}|{plan.describe()}|{how}"  # once per call signature and choice
    if key not in _LOGGED:
        if len(_LOGGED) >= 4096:  # bounded: every distinct shape is a new signature
            _LOGGED.clear()
        _LOGGED.add(key)
        log.info("overlap.%s: auto chose %s for %s (%s)", op, plan.describe(), signature, how)


def _takes_one_shot(op: str) -> bool:
    return op in OPS and "one_shot" in OPS[op].variants


def gpu_symmetric_memory() -> bool:
    """Whether `symm`/`fused` can run on GPUs here: `_C`'s CUDA half and torch's symmetric memory."""
    try:
        import torch.distributed._symmetric_memory  # noqa: F401

        from .. import signals
    except ImportError:
        return False
    return bool(signals.has_cuda)


def fit_plan(op: str, plan: Plan, info: GroupInfo, num_experts: int | None = None) -> Plan:
    """The plan a call runs on this group: `plan`, except that ``hierarchical`` on a group of one node runs as
    ``symm`` (one code path, so the same GEMMs in the same order: bitwise ``symm``'s numbers, forward and
    backward, and its steady state). Raises ValueError where a forced strategy cannot run on this group, or
    a flag does not apply.

    ``plan.migrate`` (`overlap.plans.migration.check_migrate`): only the MoE grouped-matmul ops, on a group
    spanning nodes, node indices below the group's node count; with `num_experts` (the MoE ops pass their
    ``num_experts``) also each expert below it and never to the node that holds the expert."""
    if plan.one_shot and not _takes_one_shot(op):
        takers = ", ".join(name for name in OPS if _takes_one_shot(name))
        raise ValueError(f"overlap.{op}: plan.one_shot applies only to {takers}, got {plan.label()}")
    if op in OPS and plan.strategy not in OPS[op].strategies:
        raise ValueError(f"overlap.{op}: strategy {plan.strategy!r} is not implemented for this op; it has "
                         f"{OPS[op].strategies} and 'auto'")
    if plan.strategy in ("symm", "fused") and not info.single_node:
        raise ValueError(
            f"overlap.{op}: strategy {plan.strategy!r} needs the ranks of one node, but this group spans "
            f"nodes {info.node_names}; use 'hierarchical', 'pipelined' or 'auto'"
        )
    if plan.strategy == "hierarchical" and not info.single_node:
        if info.device.type != "cpu":
            raise ValueError(f"overlap.{op}: strategy 'hierarchical' across nodes runs on CPU ranks only in this "
                             f"version; this group computes on {info.device}: use 'pipelined' or 'auto'")
        sizes = {name: info.nodes.count(name) for name in info.node_names}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"overlap.{op}: strategy 'hierarchical' needs the same number of ranks on every "
                             f"node; this group has {sizes}: use 'pipelined' or 'auto'")
    if plan.migrate:
        check_migrate(op, plan.migrate, nodes_of(info), num_experts)
    if plan.strategy == "hierarchical" and info.single_node:
        return dataclasses.replace(plan, strategy="symm")
    return plan
