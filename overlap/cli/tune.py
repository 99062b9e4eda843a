"""What ``overlap tune`` and ``overlap info --probe`` run on every rank (the command line, `overlap.cli`,
parses arguments and starts the ranks).

Problems come from the command line (``--shape``) or from a model description (``--model``):

* ``--shape OP:MxKxN[:DTYPE][:fwd|fwd+bwd]`` with OP ``all_gather_matmul``, ``matmul_reduce_scatter``,
  ``matmul_all_reduce`` (``m x k x n`` as in ``overlap bench``: the per-rank GEMM is ``[W*m, k] @ [k, n]``) or
  ``all_gather_weight_matmul`` (``[m, k] @ [k, W*n]``), or ``moe:TxHxF:EXPERTS:TOPK[:DTYPE][:fwd|fwd+bwd]``
  (``T`` tokens per rank, hidden ``H``, expert ffn ``F``), or ``OP:MxKxN[:DTYPE][:fwd|fwd+bwd]`` with OP
  ``matmul_all_to_all`` or ``all_to_all_matmul`` (sequence parallelism, ``m x k x n`` as in ``overlap bench``:
  ``m`` rows of this rank's sequence shard, the projection ``[k, n]``; the measured calls give each rank one head,
  so ``n``, ``all_to_all_matmul``'s ``k``, must divide by the ranks; no fp8). DTYPE ``float8_e4m3fn`` tunes the op's
  ``fp8="rowwise"`` recipe, ``mxfp8`` its ``fp8="mxfp8"`` one (``k`` a multiple of 32); their plan-file keys
  differ, as the bytes they move do (`overlap.plans.fp8_dtype`), and an op's call looks its own up.
* ``--model hidden=H,ffn=F,tokens=S[,heads=A,kv_heads=B][,experts=E,topk=K][,gated=1][,dtype=D]``: one
  transformer layer with tensor parallelism over the ranks (TP = world size) and sequence parallelism,
  ``S`` tokens per micro-batch: the QKV projection (``all_gather_matmul``, ``S/TP x H x 3H/TP``, or
  ``(A + 2B) H/A / TP`` columns with grouped-query attention), the attention output
  (``matmul_reduce_scatter``, ``S/TP x H/TP x H``), and the MLP: up (``all_gather_matmul``,
  ``S/TP x H x F/TP``, twice the columns when gated) and down (``matmul_reduce_scatter``,
  ``S/TP x F/TP x H``), or with ``experts`` an MoE layer over the same ranks (``moe``, ``S/TP`` tokens
  per rank). Tuned forward and backward (training) unless ``--forward-only``.

The plan file (``--out``) is merged into where it exists (`overlap.plans.planfile.merge_into`): its entries of other
problems are kept, those of the problems tuned now replaced. A file there that is no valid plan file, or one of
another topology, is an error naming it before any tuning (and it is left as it was).
"""

from __future__ import annotations

import dataclasses
import math
import sys

from ..plans.optable import OPS, TRAINING_DTYPES, Problem, ops_of

TP_OPS = ops_of("tp")
DTYPES = TRAINING_DTYPES  # fp8: the op's fp8="rowwise" recipe (float8_e4m3fn) or fp8="mxfp8" (mxfp8)


def _dims(text: str) -> tuple[int, int, int]:
    dims = text.lower().split("x")
    if len(dims) != 3 or not all(d.isdigit() and int(d) > 0 for d in dims):
        raise ValueError(f"{text!r} needs three positive sizes, AxBxC")
    return int(dims[0]), int(dims[1]), int(dims[2])


def parse_shape(text: str, backward_default: bool) -> Problem:
    """One ``--shape`` value (see the module docstring) -> a `Problem`; ValueError with the reason."""
    parts = text.split(":")
    op = parts[0]
    try:
        family = OPS[op].family if op in OPS else None
        if family == "moe":
            if len(parts) < 4:
                raise ValueError(f"{op} needs {op}:TxHxF:EXPERTS:TOPK")
            t, h, f = _dims(parts[1])
            experts, top_k = int(parts[2]), int(parts[3])
            rest = parts[4:]
        elif family in ("tp", "sp"):
            if len(parts) < 2:
                raise ValueError(f"{op} needs {op}:MxKxN")
            t, h, f = _dims(parts[1])
            experts = top_k = 0
            rest = parts[2:]
        else:
            raise ValueError(f"unknown op {op!r}; known: {tuple(OPS)}")
        dtype, backward = "float32", backward_default
        for word in rest:
            if word in DTYPES:
                dtype = word
            elif word in ("fwd", "fwd+bwd"):
                backward = word == "fwd+bwd"
            else:
                raise ValueError(f"{word!r} is neither a dtype {DTYPES} nor fwd / fwd+bwd")
        return Problem(op, t, h, f, dtype, backward, experts, top_k)
    except ValueError as exc:
        raise ValueError(f"--shape {text!r}: {exc}") from None


def parse_model(text: str, tp: int, backward: bool) -> list[Problem]:
    """``--model`` (see the module docstring) at tensor-parallel size `tp` -> the layer's problems."""
    fields: dict[str, str] = {}
    for item in text.split(","):
        if "=" not in item:
            raise ValueError(f"--model {text!r}: {item!r} is not name=value")
        key, value = item.split("=", 1)
        fields[key.strip()] = value.strip()
    known = {"hidden", "ffn", "tokens", "experts", "topk", "gated", "dtype", "heads", "kv_heads"}
    if set(fields) - known:
        raise ValueError(f"--model: unknown fields {sorted(set(fields) - known)}; known: {sorted(known)}")
    try:
        h, ffn, tokens = int(fields["hidden"]), int(fields["ffn"]), int(fields["tokens"])
        experts, top_k = int(fields.get("experts", 0)), int(fields.get("topk", 0))
        gated = fields.get("gated", "0") not in ("0", "false", "no")
        heads = int(fields.get("heads", 0))
        kv_heads = int(fields.get("kv_heads", heads))
    except KeyError as exc:
        raise ValueError(f"--model {text!r}: {exc.args[0]}= is required (hidden, ffn, tokens)") from None
    except ValueError:
        raise ValueError(f"--model {text!r}: sizes must be integers") from None
    dtype = fields.get("dtype", "float32")
    if dtype not in DTYPES:
        raise ValueError(f"--model: dtype must be one of {DTYPES}, got {dtype!r}")
    if experts and not top_k:
        raise ValueError("--model: experts= needs topk=")
    if heads and (h % heads or kv_heads < 1 or heads % kv_heads):
        raise ValueError(f"--model: heads ({heads}) must divide hidden ({h}) and be a multiple of "
                         f"kv_heads ({kv_heads})")
    qkv = (heads + 2 * kv_heads) * (h // heads) if heads else 3 * h  # grouped-query attention where given
    sizes = (("tokens", tokens), ("hidden", h), ("the QKV width", qkv)) + (() if experts else (("ffn", ffn),))
    for what, value in sizes:
        if value % tp:
            raise ValueError(f"--model: {what} ({value}) must divide by the tensor-parallel size {tp} (the ranks)")
    m = tokens // tp
    problems = [Problem("all_gather_matmul", m, h, qkv // tp, dtype, backward),
                Problem("matmul_reduce_scatter", m, h // tp, h, dtype, backward)]
    if experts:
        if experts % tp:
            raise ValueError(f"--model: experts ({experts}) must divide by the expert-parallel size {tp}")
        problems.append(Problem("moe", m, h, ffn, dtype, backward, experts, top_k))
    else:
        problems += [Problem("all_gather_matmul", m, h, (2 if gated else 1) * ffn // tp, dtype, backward),
                     Problem("matmul_reduce_scatter", m, ffn // tp, h, dtype, backward)]
    return list(dict.fromkeys(problems))  # a layer may repeat a shape: tune it once


@dataclasses.dataclass
class TuneConfig:
    shapes: list[str]
    model: str | None
    out: str
    forward_only: bool = False
    measure: int = 3
    repeats: int = 5
    warmup: int = 2
    probe: str = "cached"  # "cached", "refresh", "quick", "none" (the default profile)
    timeout: float | None = None
    routing: str | None = None  # `parse_routing`'s text


def parse_routing(text: str):
    """``--routing``: ``S1,S2,...`` (one share per expert) or ``@FILE`` (a JSON list of shares, or of one list
    of shares per node) -> a tuple (of tuples) of floats; ValueError with the reason."""
    import json

    try:
        if text.startswith("@"):
            with open(text[1:]) as f:
                raw = json.load(f)
        else:
            raw = [float(x) for x in text.split(",")]
        rows = tuple(tuple(float(v) for v in r) if isinstance(r, list) else float(r) for r in raw)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"--routing {text!r}: {exc}; give E comma-separated shares or @FILE (a JSON list of E "
                         "shares, or of E lists of one share per node)") from None
    if not rows or isinstance(raw, dict) or len({isinstance(r, tuple) for r in rows}) > 1 \
            or any(not (math.isfinite(v) and v >= 0) for r in rows for v in (r if isinstance(r, tuple) else (r,))):
        raise ValueError(f"--routing {text!r}: shares must be finite numbers >= 0, one per expert (or one list per "
                         "expert, a share per node)")
    return rows


def problems_of(config: TuneConfig, world_size: int) -> list[Problem]:
    """The problems of `config` on `world_size` ranks; ValueError where one cannot run there (the command
    line calls it before any rank starts, exit 2)."""
    problems = []
    for text in config.shapes:
        problems.append(parse_shape(text, not config.forward_only))
        p = problems[-1]
        if p.spec.family == "moe" and p.experts % world_size:
            raise ValueError(f"--shape {text!r}: {p.experts} experts do not split evenly over {world_size} ranks")
        why = p.spec.split_problem(p, world_size)
        if why:  # (the measured calls give each rank one head of these columns)
            raise ValueError(f"--shape {text!r}: {why}")
    if config.model:
        problems += parse_model(config.model, world_size, not config.forward_only)
    if not problems:
        raise ValueError("nothing to tune: give --shape (one or more) or --model")
    if config.routing is not None:
        routing = parse_routing(config.routing)
        moe = [p for p in problems if p.spec.family == "moe"]
        if not moe:
            raise ValueError("--routing is the MoE problems' routing: give a moe --shape or a --model with experts=")
        for p in moe:
            if len(routing) != p.experts:
                raise ValueError(f"--routing gives {len(routing)} experts' shares, {p.key} has {p.experts}")
    return list(dict.fromkeys(problems))  # a shape given twice (or by the model too) is tuned once


def tune_rank(config: TuneConfig) -> list[str]:
    """On every rank: the profile, the search, the file (rank 0 writes it); returns rank 0's report."""
    import torch.distributed as dist

    from .. import world
    from ..plans import topology_of
    from ..plans.planfile import merge_into
    from ..progress import ProgressBar
    from ..tune.search import tune

    info = world.group_info()
    problems = problems_of(config, info.world_size)
    check_out(config.out, topology_of(info), info.rank == 0, info.global_ranks[0])
    profile = _profile(config.probe, info.rank == 0)
    routing = parse_routing(config.routing) if config.routing is not None else None
    pf, outcomes = tune(problems, profile=profile, measure=config.measure, repeats=config.repeats,
                        warmup=config.warmup, timeout=config.timeout, routing=routing,
                        progress=ProgressBar(info.rank == 0).count)
    lines = report(outcomes, info, profile)
    if routing is not None:
        lines.insert(1, f"MoE routing as given: {config.routing} (normalized per node)")
    error = None
    if info.rank == 0:
        try:  # read again: the file may have changed while tuning
            merged = merge_into(config.out, pf)
        except ValueError as exc:
            error = exc
        else:
            kept = len(set(merged.entries) - set(pf.entries))
            merged.save(config.out)
            lines.append(f"wrote {config.out} ({len(merged.entries)} entries"
                         + (f", {kept} of them kept from the file" if kept else "")
                         + f", topology {merged.topology}); use it with OVERLAP_PLAN={config.out} or "
                         f"plan=\"{config.out}\"")
    dist.barrier()
    if error is not None:
        raise error
    return lines


def predicted_plans(config: TuneConfig, cluster) -> list[str]:
    """``overlap tune --machine``: for every problem of `config` on the described `cluster`
    (`overlap.plans.presets.Cluster`), the cost model's best plan (never one predicted slower than ``reference``,
    which is a candidate; MoE problems under ``config.routing``'s loads, balanced without), merged into the plan
    file ``config.out`` as predicted entries (no measured time) with the cluster's profile; no rank starts. Returns
    the report's lines; ValueError for a problem that does not fit the cluster or a file that cannot be merged
    into, OSError for one that cannot be written."""
    import math

    from ..plans import PlanFile, expected_loads, rank_candidates
    from ..plans.planfile import Entry, merge_into

    topology, profile = cluster.topology, cluster.profile
    problems = problems_of(config, topology.world_size)
    routing = parse_routing(config.routing) if config.routing is not None else None
    pf = PlanFile.new(topology, profile=profile)
    links = tuple(c for c, _ in topology.links)
    lines = [f"predicted for {cluster.about}; {topology.world_size} ranks; nothing was run or measured",
             f"{'problem':<52} {'chosen plan':<34} {'predicted':>10} {'reference':>10} {'speedup':>8}"]
    for p in problems:
        loads = expected_loads(p, topology, routing) if routing is not None and p.spec.family == "moe" else None
        ranked = [(plan, pred) for plan, pred in rank_candidates(p, topology, profile, loads)
                  if math.isfinite(pred.total_s)]
        plan, pred = ranked[0]
        ref = next(pr for pl, pr in ranked if pl.strategy == "reference")
        pf.entries[p.key] = Entry(p, plan, predicted_s=pred.total_s)
        lines.append(f"{p.key:<52} {plan.label(links):<34} {pred.total_s * 1e3:>8.3f}ms {ref.total_s * 1e3:>8.3f}ms "
                     f"{ref.total_s / pred.total_s:>7.2f}x")
    merged = merge_into(config.out, pf)
    kept = len(set(merged.entries) - set(pf.entries))
    merged.save(config.out)
    lines.append(f"wrote {config.out} ({len(merged.entries)} entries" + (f", {kept} of them kept from the file" if kept
                 else "") + f", topology {merged.topology}), predicted: run overlap tune on the cluster to measure; "
                 f"use it with OVERLAP_PLAN={config.out}")
    return lines


def check_out(path: str, topology, reads: bool, src: int) -> None:
    """Raise ValueError on every rank where the plan file at `path` (``--out``) exists and cannot be merged into
    (`overlap.plans.planfile.merge_into`: unreadable, invalid, another topology): rank `src` (global; `reads`
    on it) reads it, the others take its verdict, so every rank stops before any tuning."""
    import torch.distributed as dist

    from ..plans import PlanFile
    from ..plans.planfile import merge_into

    verdict = [""]
    if reads:
        try:
            merge_into(path, PlanFile(topology=topology.signature, world_size=topology.world_size))
        except ValueError as exc:
            verdict[0] = str(exc)
    dist.broadcast_object_list(verdict, src=src)
    if verdict[0]:
        raise ValueError(verdict[0])


def _profile(how: str, verbose: bool):
    from ..tune.probing import probe, probe_cached

    if how == "none":
        return None  # the search then uses the default profile
    progress = (lambda text: print(f"probe: {text}", file=sys.stderr, flush=True)) if verbose else None
    if how == "quick":
        return probe(quick=True, progress=progress)
    return probe_cached(refresh=how == "refresh", progress=progress)


def report(outcomes, info, profile) -> list[str]:
    """The table of chosen plans: predicted against measured time, speedup over reference."""
    lines = [f"tuned on {info.world_size} ranks, {len({*info.nodes})} node(s); times are the slowest rank's "
             "medians; prediction = the cost model with "
             + ("the probed profile" if profile is not None else "the default profile")]
    links = tuple(info.link_classes().values())  # plans are written as overlap bench writes them (`Plan.label`)
    head = f"{'problem':<52} {'chosen plan':<30} {'predicted':>10} {'measured':>10} {'reference':>10} {'speedup':>8}"
    lines += [head, "-" * len(head)]
    for o in outcomes:
        c, r = o.chosen, o.reference
        speedup = r.measured_s / c.measured_s if c.measured_s > 0 else float("nan")
        lines.append(f"{o.problem.key:<52} {c.plan.label(links):<30} {c.predicted_s * 1e3:>8.3f}ms "
                     f"{c.measured_s * 1e3:>8.3f}ms {r.measured_s * 1e3:>8.3f}ms {speedup:>7.2f}x")
        for t in o.trials:
            if t.error:
                lines.append(f"  {t.plan.label(links)}: dropped ({t.error})")
    errors = [abs(t.predicted_s / t.measured_s - 1) for o in outcomes for t in o.trials
              if t.measured_s > 0 and t.predicted_s == t.predicted_s and not t.error]
    if errors:
        errors.sort()
        lines.append(f"model error over {len(errors)} measured plans: median {errors[len(errors) // 2]:.0%}, "
                     f"max {errors[-1]:.0%} (|predicted / measured - 1|)")
    return lines


def probe_rank(refresh: bool, quick: bool) -> list[str]:
    """``overlap info --probe`` on every rank: the cached (or new) profile, formatted on rank 0."""
    from ..tune.cache import cache_path
    from ..tune.fits import format_profile
    from ..tune.probing import probe, probe_cached

    profile = probe(quick=True) if quick else probe_cached(refresh=refresh)
    return [format_profile(profile), "" if quick else f"cached in {cache_path()}"]


__all__ = ["TuneConfig", "parse_model", "parse_routing", "parse_shape", "predicted_plans", "probe_rank", "tune_rank"]
