"""How a tensor-parallel op is entered: its checks, plan and signature (`prepare` of a `TpCall`), and the custom-op
schema, public call and autograd plumbing the four ops share (`tp_call`, `tp_context`, `tp_save`, `tp_backward`).

Every TP op takes ``(a, b, group, strategy, plan, timeout)``; `matmul_all_reduce` has the custom-op signature
`TP_SCHEMA` (the operands, the call's arguments as text, whether a backward will run, the fp8 arguments
`FP8_SCHEMA`; two outputs, the result and the key of the call context its backward reuses), `matmul_reduce_scatter`
that with its ``scatter_dim`` after ``b``, `all_gather_weight_matmul` that with a pre-quantized shard and the recipe
in place of the fp8 operands' scales, and `all_gather_matmul` one of its own (a list of weights, its
``gather_dim``, the gathered input as an output). Each has a backward custom op of its own (taking the fp8
recipe) computing the input gradients in the forward's call context.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from ... import world
from ...plans import Plan, Problem, fp8_dtype, op_spec
from ...plans.auto import as_plan, fit_plan, plan_source, resolve_auto
from .. import fp8 as fp8s
from .. import library
from ..context import FLOAT_DTYPES, CallContext, autocast_inputs, describe, preamble
from ..fp8 import Fp8Args
from ..fp8_recipe import check_recipe, recipe_of, text_of
from ..fused import check_fused_available
from .rows import normalize_dim

# ----------------------------------------------------------------------------------------------
# Checks, plan and signature
# ----------------------------------------------------------------------------------------------


def check_matmul_operands(op: str, a: Any, b: Any, device: torch.device) -> None:
    """Checks shared by the TP ops: ``a`` is ``[..., k]``, ``b`` is ``[k, n]``, same float dtype/device."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError(f"overlap.{op}: a and b must be tensors, got {type(a).__name__} and {type(b).__name__}")
    if not (fp8s.is_fp8(a) or fp8s.is_fp8(b)):  # (fp8 operands' dtypes: `check_fp8`)
        if a.dtype != b.dtype:
            raise TypeError(f"overlap.{op}: a and b must have one dtype outside autocast, got {a.dtype} and "
                            f"{b.dtype}")
        if a.dtype not in FLOAT_DTYPES:
            raise TypeError(f"overlap.{op}: dtype must be one of {FLOAT_DTYPES}, got {a.dtype}")
    if a.dim() < 2:
        raise ValueError(f"overlap.{op}: a must be [..., k] with at least 2 dims (dim 0 is gathered or scattered), "
                         f"got {describe(a)}")
    if b.dim() != 2:
        raise ValueError(f"overlap.{op}: b must be [k, n] (pass a weight w[n, k] as w.t()), got {describe(b)}")
    if a.shape[-1] != b.shape[0]:
        raise ValueError(f"overlap.{op}: inner dims differ: a is {describe(a)} (k={a.shape[-1]}), "
                         f"b is {describe(b)} (k={b.shape[0]})")
    if a.numel() == 0 or b.numel() == 0:
        raise ValueError(f"overlap.{op}: empty operands are not supported: a is {describe(a)}, b is {describe(b)}")
    if a.device != b.device:
        raise ValueError(f"overlap.{op}: a is on {a.device}, b on {b.device}")
    if a.device.type != device.type or (device.type == "cuda" and a.device.index != device.index):
        raise ValueError(f"overlap.{op}: this rank's group computes on {device} but the inputs are on {a.device}")


def check_fp8(op: str, a: torch.Tensor, bs: list[torch.Tensor], scaled: Fp8Args | None) -> str:
    """The fp8 checks of a call (`overlap.ops.fp8`): fp8 operands with their scales and ``out_dtype``, or the
    ``fp8=`` recipe on high-precision operands, or neither. Returns what the call's signature adds."""
    scaled = scaled if scaled is not None else Fp8Args()
    a_scale, b_scales, out_dtype = scaled.a_scale, list(scaled.b_scales), scaled.out_dtype
    if fp8s.is_fp8(a) or any(fp8s.is_fp8(b) for b in bs):
        check_recipe(op, scaled.recipe, a)
        a_kind, b_kinds = fp8s.check_scales(op, a, bs, a_scale, b_scales, out_dtype)
        return f", scales={a_kind}/{'+'.join(b_kinds)}, out={str(out_dtype).removeprefix('torch.')}"
    fp8s.check_no_scales(op, a, a_scale, b_scales or None, out_dtype)
    recipe = check_recipe(op, scaled.recipe, a)
    if recipe is not None and recipe.granularity == "mxfp8" and a.shape[-1] % fp8s.MX_BLOCK:
        raise ValueError(f"overlap.{op}: fp8='mxfp8' quantizes blocks of {fp8s.MX_BLOCK} along k, which is "
                         f"{a.shape[-1]}: it must be a multiple of {fp8s.MX_BLOCK}")
    return f", fp8={recipe.text}" if recipe else ""


def fp8_args(a_scale: Any, b_scale: Any, out_dtype: Any, fp8: Any) -> Fp8Args | None:
    """An op's fp8 arguments as its custom op takes them (`Fp8Args`), None where one is of a type it does not
    take (the caller then lets the op's checks raise)."""
    b_scales = _listed(b_scale)
    fp8 = text_of(fp8)
    ok = ((a_scale is None or isinstance(a_scale, torch.Tensor)) and library.tensors(*b_scales)
          and (out_dtype is None or isinstance(out_dtype, torch.dtype)) and (fp8 is None or isinstance(fp8, str)))
    return Fp8Args(a_scale, tuple(b_scales), out_dtype, fp8 or "") if ok else None


def _listed(b_scale: Any) -> list:
    return list(b_scale) if isinstance(b_scale, (list, tuple)) else ([] if b_scale is None else [b_scale])


def wire_dtype(a: torch.Tensor, scaled: Fp8Args | None) -> torch.dtype:
    """The dtype a call's operands move and multiply in: fp8 for fp8 operands and the recipe."""
    return fp8s.OPERAND_DTYPE if fp8s.is_fp8(a) or (scaled is not None and scaled.recipe) else a.dtype


def key_dtype(a: torch.Tensor, scaled: Fp8Args | None) -> str:
    """The dtype name of a call's plan-file key (`overlap.plans.Problem.dtype`): ``mxfp8`` for MX scales or the MX
    recipe (`overlap.plans.fp8_dtype`: an MX call moves other bytes than a rowwise one), else `wire_dtype`'s."""
    if scaled is not None and (fp8s.is_mx_scale(scaled.a_scale)
                               or (scaled.recipe and recipe_of("", scaled.recipe).granularity == "mxfp8")):
        return fp8_dtype("mxfp8")
    return str(wire_dtype(a, scaled)).removeprefix("torch.")


def out_dtype_of(a: torch.Tensor, scaled: Fp8Args | None) -> torch.dtype:
    """The dtype of a call's result: `a`'s, but fp8 operands' ``out_dtype`` (default bfloat16)."""
    if fp8s.is_fp8(a):
        out = scaled.out_dtype if scaled is not None else None
        return out if out is not None else torch.bfloat16
    return a.dtype


@dataclasses.dataclass(frozen=True)
class TpCall:
    """One call of a TP op as its preamble takes it, operands aside: the op, the caller's `group`, `strategy`, `plan`
    and `timeout` (as given: the preamble checks them), the op's own `check` of its operands (``check(a, b,
    info)``, raising ValueError/TypeError), its gathered or scattered `dim` with the argument's name `dim_name`
    (``gather_dim``, ``scatter_dim``; None: the op has none), and whether `b` may be a list of weights (`multi`:
    `overlap.all_gather_matmul` feeding several GEMMs)."""

    op: str
    group: Any = None
    strategy: Any = "auto"
    plan: Any = None
    timeout: Any = None
    check: Callable[[torch.Tensor, torch.Tensor, world.GroupInfo], None] | None = None
    dim: Any = 0
    dim_name: str | None = None
    multi: bool = False


def prepare(call: TpCall, a: Any, b: Any, scaled: Fp8Args | None = None, needs_grad: bool | None = None,
            cast: bool = True) -> tuple[torch.Tensor, Any, CallContext]:
    """The TP ops' preamble: checks, autocast (unless `cast` is False: the custom op's caller cast them),
    plan and signature. Returns ``(a, b, context)``. `needs_grad`: whether the call's backward will run (plan
    files keep forward and forward+backward plans apart); None: read from grad mode and the inputs.

    `b` may be a list of weights where ``call.multi`` (one ``k`` and dtype, any ``n``; returned as a list);
    ``call.dim`` is checked (`overlap.ops.tp.rows.normalize_dim`) and, past dim 0, part of the signature.
    `scaled`: the call's fp8 arguments (`fp8_args`; `check_fp8`)."""
    op, dim_name, plan = call.op, call.dim_name, call.plan

    def decide(cc: CallContext) -> tuple[Plan, str, tuple[torch.Tensor, Any]]:
        info = cc.info
        many = isinstance(b, (list, tuple))
        weights = list(b) if many else [b]
        if many and not call.multi:
            raise TypeError(f"overlap.{op}: b must be a tensor, got a {type(b).__name__} (only all_gather_matmul "
                            "takes a list of weights)")
        if not weights:
            raise ValueError(f"overlap.{op}: b is an empty list; pass one weight or a list of weights")
        a2, *bs = autocast_inputs(a, *weights) if cast else (a, *weights)
        for w in bs:
            check_matmul_operands(op, a2, w, info.device)
        b2 = bs[0]
        d = normalize_dim(op, dim_name, call.dim, a2.shape) if dim_name is not None else 0
        fp8_sig = check_fp8(op, a2, bs, scaled)
        if call.check is not None:
            call.check(a2, b2, info)
        chosen = as_plan(call.strategy, plan)
        n = sum(w.shape[1] for w in bs)
        shape_sig = f"a={describe(a2)}, " + (f"bs={[tuple(w.shape) for w in bs]}" if many else f"b={tuple(b2.shape)}")
        if d:
            shape_sig += f", {dim_name}={d}"
        shape_sig += fp8_sig
        wire = wire_dtype(a2, scaled)
        if chosen is None:
            rows = math.prod(a2.shape[:-1])
            dtype = key_dtype(a2, scaled)
            out_bytes = rows * n * out_dtype_of(a2, scaled).itemsize
            chosen = resolve_auto(op, shape_sig, info, rows, dtype, out_bytes=out_bytes,
                                  problem=tp_problem(op, rows, a2, b2, info.world_size, needs_grad, n, dtype),
                                  plan_file=plan_source(plan))
        chosen = fit_plan(op, chosen, info)
        if chosen.strategy == "fused":
            check_fused_available(op, wire)
        return chosen, f"{op}({shape_sig}, plan={chosen.describe()}, ring={info.slowest_link})", (a2, bs if many
                                                                                                     else b2)

    cc, (a, b) = preamble(op, call.group, call.timeout, decide)
    return a, b, cc


def tp_problem(op: str, rows: int, a: torch.Tensor, b: torch.Tensor, world_size: int,
               needs_grad: bool | None = None, n: int | None = None,
               dtype: torch.dtype | str | None = None) -> Problem | None:
    """The `overlap.plans.Problem` of a TP call (plan files are keyed by it), None where it has none. `n`: the
    columns of every weight together (one gather feeding several GEMMs moves the bytes of one); `dtype`: the
    operands' on the wire (default `a`'s: fp8 for the fp8 recipe)."""
    m = op_spec(op).rows_per_rank(rows, world_size)
    if m is None:
        return None
    backward = needs_grad if needs_grad is not None else (
        torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))
    try:
        return Problem(op, m, a.shape[-1], b.shape[1] if n is None else n,
                       str(a.dtype if dtype is None else dtype).removeprefix("torch."), backward)
    except ValueError:  # a call the model does not describe: no plan file entry can match it
        return None




# ----------------------------------------------------------------------------------------------
# The custom ops: the signature they share, forward and backward
# ----------------------------------------------------------------------------------------------

FP8_SCHEMA = "Tensor? a_scale, Tensor? b_scale, ScalarType? out_dtype, str fp8"
"""The fp8 arguments the activation-side TP ops' custom ops take last (`Fp8Args`; one weight, one ``b_scale``)."""
TP_SCHEMA = ("(Tensor a, Tensor b, str group, str strategy, str plan, float? timeout, bool needs_grad, "
             f"{FP8_SCHEMA}) -> (Tensor, Tensor)")


def call_args(call: TpCall, a: Any, weights: list,
              fp8: tuple = (None, None, None, None)) -> tuple[tuple, Fp8Args]:
    """The call's arguments as a TP custom op takes them: ``(group, strategy, plan, timeout)`` and the fp8 ones
    (`fp8` = ``(a_scale, b_scale, out_dtype, fp8)`` as `Fp8Args`), or, where one is of a type the op does not
    take, this rank's error raised through the op's checks (which tell the peers)."""
    args = library.call_args(call.group, call.strategy, call.plan, call.timeout)
    scaled = fp8_args(*fp8)
    if scaled is not None and isinstance(a, torch.Tensor) and any(s.device != a.device for s in scaled.scales):
        scaled = None  # (a scale on another device, e.g. meta, would send the custom op to another kernel)
    dim_ok = call.dim_name is None or (isinstance(call.dim, int) and not isinstance(call.dim, bool))
    if args is None or scaled is None or not weights or not library.tensors(a, *weights) or not dim_ok:
        b = weights if len(weights) != 1 else weights[0]
        raw = Fp8Args(fp8[0], tuple(_listed(fp8[1])), fp8[2], fp8[3])
        prepare(call, a, b, scaled=raw if scaled is None else scaled)  # raises, peers told
        raise TypeError(f"overlap.{call.op}: unsupported arguments")  # pragma: no cover - prepare raised
    return args, scaled


def tp_call(packet: Any, call: TpCall, a: Any, b: Any, fp8: tuple | None = None) -> torch.Tensor:
    """A TP op's public function: its arguments as the custom op takes them (autocast applied here, where
    torch.compile traces it), then the custom op (``call.dim`` after ``b`` where the op has a ``dim_name``; the fp8
    arguments, `fp8` = ``(a_scale, b_scale, out_dtype, fp8)``, last where the op takes them: `TP_SCHEMA`).
    Arguments of the wrong types raise through the op's checks (which tell the peers) instead."""
    if isinstance(b, (list, tuple)):  # (one weight only: the op's check says so, on every rank)
        prepare(call, a, b)
    args, scaled = call_args(call, a, [b], fp8=fp8 or (None, None, None, None))
    a, b = autocast_inputs(a, b)
    extra = () if call.dim_name is None else (call.dim,)
    if fp8 is None:
        return packet(a, b, *extra, *args, library.needs_grad(a, b))[0]
    b_scales = scaled.b_scales
    b_scale = b_scales[0] if len(b_scales) == 1 else None
    if len(b_scales) > 1:  # (one weight: the op's check says so, on every rank)
        prepare(call, a, b, scaled=scaled)
    return packet(a, b, *extra, *args, library.needs_grad(a, b), scaled.a_scale, b_scale, scaled.out_dtype,
                  scaled.recipe)[0]


def tp_context(call: TpCall, a: torch.Tensor, b: Any, needs_grad: bool, scaled: Fp8Args | None = None):
    """Inside a TP custom op, whose `call` names its group and plan as text: the call context (checks, plan,
    signature) of the public call."""
    call = dataclasses.replace(call, group=library.group_of(call.group), plan=library.plan_of(call.plan))
    return prepare(call, a, b, scaled=scaled, needs_grad=needs_grad, cast=False)[2]


def tp_save(ctx: Any, inputs: tuple, output: Any) -> None:
    """`setup_context` of the TP ops: the operands and the forward's call context."""
    a, b, *rest = inputs
    ctx.save_for_backward(a, b, output[1])
    ctx.rest = len(rest)


def tp_backward(backward_packet: Any) -> Callable:
    """The autograd backward of a TP op whose gradients a ``<op>_backward`` custom op computes (with
    ``ctx.extra``, where `setup_context` set it, as its last arguments)."""

    def backward(ctx: Any, grad: torch.Tensor, _grad_context: Any):
        a, b, context = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_a, grad_b = backward_packet(grad, a, b, context, need_a, need_b, *getattr(ctx, "extra", ()))
        return (grad_a if need_a else None, grad_b if need_b else None) + (None,) * ctx.rest

    return backward


def tp_backward_fake(grad, a, b, context, need_a, need_b, *_extra):
    """The fake of every ``<op>_backward``: the gradients have the operands' shapes (0 elements: not asked)."""
    return (a.new_empty(a.shape if need_a else (0,)), b.new_empty(b.shape if need_b else (0,)))


