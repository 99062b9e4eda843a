"""The op table: what decides a plan for each op, for everything that reasons about ops without being one.

One `OpSpec` per op in `OPS`: its family (``tp``, ``moe`` or ``sp``, sequence parallelism), the rows of a rank's
input and output, its FLOPs and the bytes its plain collectives move per link class, which links each strategy chunks
for, its cost (driving the cost model's pipelines) and the strategies it has. The cost model
(`costmodel`), ``strategy="auto"``'s problem (`overlap.ops.tp.entry`, `overlap.ops.moe.entry`), the tuner and
the benchmark cases read this table; none of them switches on op names. What it takes to run an op on made-up
data (inputs, the call, the oracle, the plain collectives, the plain-torch baseline) is its workload, one
layer up (`overlap.workloads`).

Adding an op: its module in ``overlap/ops/<family>/``, its kernel and launcher, one entry here (its functions
beside the others of its family: `tp_ops`, `moe_op`), its workload, the package's exports, its tests and docs.

A `Problem` is one call's shape as the table describes it (the key of plan files).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import moe_op, sp_ops, tp_ops
from .plan import STRATEGIES

if TYPE_CHECKING:
    import torch

FAMILIES = ("tp", "moe", "sp")
#: the dtype name of an MX fp8 call (``fp8="mxfp8"``, or fp8 operands with e8m0 block scales): e4m3 elements, one
#: power-of-two scale byte per `MX_BLOCK` of them along ``k``. Its own name, not ``float8_e4m3fn``'s: it moves other
#: bytes (`wire_sizes`), so plan files key it apart
MX_DTYPE = "mxfp8"
#: the elements along ``k`` that share one MX scale (`overlap.ops.fp8.MX_BLOCK`)
MX_BLOCK = 32
#: bytes per element of every dtype a problem may have, by its name (torch's: `torch_dtype`; `MX_DTYPE`'s elements
#: are e4m3)
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "float8_e4m3fn": 1, MX_DTYPE: 1}
#: the dtypes of training calls, which ``overlap bench`` and ``overlap tune`` take (float64 is the oracles')
TRAINING_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", MX_DTYPE)
#: the fp8 dtypes: a problem in one is an fp8 call (fp8 operands, or the ``fp8=`` recipe on high-precision leaves)
#: whose transfers move what `wire_sizes` (tensor-parallel ops) or `moe_row_bytes` (the MoE dispatch) says:
#: ``float8_e4m3fn`` with one float32 scale per row or tensor (rowwise, tensorwise), `MX_DTYPE` with MX block scales
FP8_DTYPES = ("float8_e4m3fn", MX_DTYPE)
#: the dtype of an fp8 problem's leaves and output (the recipe's convention: its backward runs in it)
FP8_LEAVES = "bfloat16"
#: bytes of a rowwise (or tensorwise: repeated on every row) scale on the wire, and of an MX block's
ROW_SCALE_BYTES = 4
MX_SCALE_BYTES = 1
#: the columns of an MoE token that share one float32 scale at ``block128`` (`overlap.ops.moe.fp8.BLOCK`)
TOKEN_BLOCK = 128


def fp8_dtype(granularity: str) -> str:
    """The dtype name of an fp8 call at `granularity` (``rowwise``, ``tensorwise``, ``mxfp8``: `overlap.ops.fp8`), as
    its `Problem` (and so its plan-file key) has it: `MX_DTYPE` for MX blocks, ``float8_e4m3fn`` otherwise."""
    return MX_DTYPE if granularity == "mxfp8" else "float8_e4m3fn"


def fp8_granularity(dtype: str) -> str:
    """The ``fp8=`` recipe a problem in the fp8 dtype `dtype` runs (``overlap bench`` and ``overlap tune``'s calls):
    ``mxfp8`` for `MX_DTYPE`, ``rowwise`` for ``float8_e4m3fn``. ValueError for another dtype."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_granularity: {dtype!r} is not an fp8 dtype {FP8_DTYPES}")
    return "mxfp8" if dtype == MX_DTYPE else "rowwise"


def gathered_row_bytes(dtype: str, k: int) -> int:
    """Bytes a gather moves per row of ``k`` elements of dtype `dtype` (the op's wire format, its GPU padding to 16
    bytes aside): ``k`` elements, and for fp8 their scales: a float32 per row (rowwise, and tensorwise whose scale is
    written into every row) or one byte per `MX_BLOCK` (MX)."""
    if dtype == MX_DTYPE:
        return k * ITEMSIZE[dtype] + k // MX_BLOCK * MX_SCALE_BYTES
    if dtype in FP8_DTYPES:
        return k * ITEMSIZE[dtype] + ROW_SCALE_BYTES
    return k * ITEMSIZE[dtype]


def dispatch_row_bytes(granularity: str, hidden: int) -> int:
    """Bytes of one token of `hidden` columns as the MoE dispatch packs it in fp8 at `granularity` (``rowwise``,
    ``block128``, ``mxfp8``: `overlap.ops.moe.fp8.RowFormat`'s row on CPU ranks; a GPU pads it to 16 bytes, not
    counted, as `gathered_row_bytes` does not count it): the ``hidden`` e4m3 bytes, then the scales: zeros up to a
    multiple of 4 and one float32 (rowwise) or one per `TOKEN_BLOCK` columns (block128, the last block partial),
    or one e8m0 byte per `MX_BLOCK` (MX, right after the data). ValueError for another granularity."""
    if granularity == "mxfp8":
        return hidden + hidden // MX_BLOCK * MX_SCALE_BYTES
    if granularity not in ("rowwise", "block128"):
        raise ValueError(f"dispatch_row_bytes: granularity must be rowwise, block128 or mxfp8, got {granularity!r}")
    scales = -(-hidden // TOKEN_BLOCK) if granularity == "block128" else 1
    return -(-hidden // 4) * 4 + scales * ROW_SCALE_BYTES


def moe_row_bytes(p: Problem) -> tuple[int, int]:
    """``(dispatched, returned)``: the bytes an MoE problem `p` moves per routed row (a token's copy for one of its
    experts) in the forward dispatch, and in each of its other transfers (the combine, and in a backward the output
    gradient's rows to the experts and the input gradient's back). ``H`` elements of the dtype both, but in an fp8
    dtype the dispatch moves the packed fp8 row (`dispatch_row_bytes` at `fp8_granularity`) and the others the
    leaves' `FP8_LEAVES` (the combine and the backward run in them)."""
    if p.dtype in FP8_DTYPES:
        return dispatch_row_bytes(fp8_granularity(p.dtype), p.k), p.k * ITEMSIZE[FP8_LEAVES]
    return p.k * ITEMSIZE[p.dtype], p.k * ITEMSIZE[p.dtype]


def wire_sizes(p: Problem) -> tuple[float, float, float]:
    """Bytes per element `p`'s transfers move: ``(gathered operand, reduced partial, backward)``. The dtype's size
    for all three, except fp8 (`FP8_DTYPES`): the gathered rows' fp8 bytes with their scales (`gathered_row_bytes`
    over ``k``: ``1 + 4/k`` with a float32 scale per row, ``1 + 1/32`` with MX blocks; a GPU pads rows to 16 bytes,
    not counted), the reductions' float32 partials (4), and the backward in the leaves' `FP8_LEAVES` (2). A gathered
    weight (``all_gather_weight_matmul``) moves its columns as such rows (``k`` long: scales along ``k``). (An MoE
    problem's rows: `moe_row_bytes`.)"""
    if p.dtype in FP8_DTYPES:
        return gathered_row_bytes(p.dtype, p.k) / p.k, 4.0, float(ITEMSIZE[FP8_LEAVES])
    size = float(ITEMSIZE[p.dtype])
    return size, size, size


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One op of the table. The functions take a `Problem` ``p`` and the world size ``W`` where they need it.

    in_rows / out_rows: ``(m, W) -> rows`` of a rank's input and output.
    flops: ``(p, W) -> FLOPs`` of one call on one rank (forward, or forward and backward).
    bytes_per_peer: ``(p, W) -> bytes`` one rank receives from each peer in the op's plain collectives.
    chunked: ``(strategy, backward, topology) -> link classes`` whose chunk counts the strategy reads.
    cost: ``(model, p)``: adds one call to the cost model's schedule (`costmodel.predict`).
    variants: `Plan` flags beyond the strategy that apply (``one_shot``).
    label: a short name for plots.
    out_cols: ``(n, W) -> columns`` of a rank's output (``n``, but ``W * n`` where the gathered operand is
        the weight's columns).
    in_cols: ``(k, W) -> columns`` of a rank's input (``k``, but ``k / W`` where the input holds this rank's heads of
        the whole sequence: ``all_to_all_matmul``).
    strategies: the strategies the op implements (`Plan.STRATEGIES` unless it says otherwise); ``auto``
        never picks another, forcing one raises ValueError, the tuner and the benchmark skip the rest.
    dim_arg: the keyword naming the activation dim the op gathers or scatters (``gather_dim``, ``scatter_dim``;
        empty: dim 0 only); several_weights: whether ``b`` may be a list of weights fed by one transfer.
    fp8: whether the op takes fp8 (the ``fp8=`` recipe, and fp8 operands where it has them): a `Problem` in an fp8
        dtype.
    calls: the calls (each a handshake or its steady-state post) one forward and one backward make: what the
        cost model charges `Profile.call_s` for.
    """

    name: str
    family: str
    label: str
    in_rows: Callable[[int, int], int]
    out_rows: Callable[[int, int], int]
    flops: Callable[..., int]
    bytes_per_peer: Callable[..., float]
    chunked: Callable[..., tuple[str, ...]]
    cost: Callable[..., None]
    variants: tuple[str, ...] = ()
    out_cols: Callable[[int, int], int] = lambda n, W: n
    in_cols: Callable[[int, int], int] = lambda k, W: k
    strategies: tuple[str, ...] = STRATEGIES
    dim_arg: str = ""
    several_weights: bool = False
    fp8: bool = False
    calls: tuple[int, int] = (1, 1)

    def __post_init__(self) -> None:
        assert self.family in FAMILIES and set(self.strategies) <= set(STRATEGIES), self

    def rows_per_rank(self, rows: int, world_size: int) -> int | None:
        """The ``m`` of a call whose input has `rows` rows, None where no ``m`` gives that many."""
        per_m = self.in_rows(1, world_size)
        return rows // per_m if rows >= per_m and rows % per_m == 0 else None

    def comm_bytes(self, p: Problem, world_size: int) -> int:
        """Bytes one rank receives in one call's plain collectives (rounded: fp8's bytes per element are fractions)."""
        return round((world_size - 1) * self.bytes_per_peer(p, world_size))

    def split_problem(self, p: Problem, world_size: int) -> str | None:
        """Why `p`'s columns cannot be cut over `world_size` ranks where the op cuts them (`in_cols` or `out_cols`
        below ``k`` or ``n``: the sequence-parallel ops give each rank whole heads), or None."""
        for what, dim, cols in (("k", p.k, self.in_cols(p.k, world_size)), ("n", p.n, self.out_cols(p.n, world_size))):
            if cols < dim and cols * world_size != dim:
                return f"{what} ({dim}, the heads' columns) does not divide by {world_size} ranks"
        return None

    def bytes_per_link(self, p: Problem, topology) -> dict[str, int]:
        """`comm_bytes` per link class of `topology` (from each peer over the link to it)."""
        per_peer = self.bytes_per_peer(p, topology.world_size)
        return {link: round(count * per_peer) for link, count in topology.links}


def _tp(name: str, label: str, in_rows, out_rows, per_peer_bytes, chunked, cost, variants=(),
        out_cols=lambda n, W: n, strategies=STRATEGIES, dim_arg="", several_weights=False, fp8=True, calls=(1, 2)):
    return OpSpec(
        name, "tp", label, in_rows, out_rows,
        flops=lambda p, W: (3 if p.backward else 1) * 2 * W * p.m * p.k * p.n,
        bytes_per_peer=lambda p, W: per_peer_bytes(p, *wire_sizes(p)), chunked=chunked, cost=cost,
        variants=variants, out_cols=out_cols, strategies=strategies, dim_arg=dim_arg,
        several_weights=several_weights, fp8=fp8, calls=calls)


def _moe_bytes_per_peer(p, W: int) -> float:
    """Uniform routing: ``T*K/W`` rows to and from every peer (the backward twice that), each of `moe_row_bytes`:
    an fp8 dispatch's rows packed, the rest in the leaves' dtype."""
    dispatched, returned = moe_row_bytes(p)
    return p.m * p.top_k / W * (dispatched + (3 if p.backward else 1) * returned)


#: the strategies of the sequence-parallel ops (no ``hierarchical`` yet)
SP_STRATEGIES = ("reference", "pipelined", "symm", "fused")

#: every op, by name
OPS: dict[str, OpSpec] = {s.name: s for s in (
    _tp("all_gather_matmul", "AG+MM", in_rows=lambda m, W: m, out_rows=lambda m, W: W * m,
        per_peer_bytes=lambda p, gather, part, grad: p.m * p.k * gather + (2 * p.m * p.k * grad if p.backward else 0),
        chunked=tp_ops.chunked_all_gather_matmul, cost=tp_ops.cost_all_gather_matmul, dim_arg="gather_dim",
        several_weights=True),
    _tp("matmul_reduce_scatter", "MM+RS", in_rows=lambda m, W: W * m, out_rows=lambda m, W: m,
        per_peer_bytes=lambda p, gather, part, grad: p.m * p.n * part + (p.m * p.n * grad if p.backward else 0),
        chunked=tp_ops.chunked_matmul_reduce_scatter, cost=tp_ops.cost_matmul_reduce_scatter, dim_arg="scatter_dim",
        calls=(1, 1)),  # (its backward: one gather of the output gradient feeding both GEMMs)
    _tp("matmul_all_reduce", "MM+AR", in_rows=lambda m, W: W * m, out_rows=lambda m, W: W * m,
        per_peer_bytes=lambda p, gather, part, grad: 2 * p.m * p.n * part, variants=("one_shot",),
        chunked=tp_ops.chunked_matmul_all_reduce, cost=tp_ops.cost_matmul_all_reduce,
        calls=(1, 0)),  # (its backward communicates nothing)
    # The weight-side gather (FSDP): a [m, k] per rank, b_shard [k, n] (this rank's columns), out [m, W*n]; its
    # backward gathers the weight again and reduce-scatters its gradient (fp8: both in the leaves' dtype).
    _tp("all_gather_weight_matmul", "AG(W)+MM", in_rows=lambda m, W: m, out_rows=lambda m, W: m,
        per_peer_bytes=lambda p, gather, part, grad: p.k * p.n * (gather + (2 * grad if p.backward else 0)),
        out_cols=lambda n, W: W * n,
        chunked=tp_ops.chunked_all_gather_weight_matmul, cost=tp_ops.cost_all_gather_weight_matmul),
    OpSpec("moe", "moe", "moe", in_rows=lambda m, W: m, out_rows=lambda m, W: m,
           flops=lambda p, W: (3 if p.backward else 1) * 4 * p.m * p.top_k * p.k * p.n,
           bytes_per_peer=_moe_bytes_per_peer, chunked=moe_op.chunked, cost=moe_op.cost, fp8=True,
           calls=(2, 2)),  # (dispatch and combine; fp8: the ``fp8=`` of the dispatch, the combine in the leaves')
    # Sequence parallelism (`sp_ops`): the QKV projections then the all-to-all to heads, and the all-to-all back
    # then the output projection; each one's backward is the other's exchange.
    OpSpec("matmul_all_to_all", "sp", "MM+A2A", in_rows=lambda m, W: m, out_rows=lambda m, W: W * m,
           flops=lambda p, W: (3 if p.backward else 1) * 2 * p.m * p.k * p.n,
           bytes_per_peer=lambda p, W: (2 if p.backward else 1) * p.m * p.n / W * ITEMSIZE[p.dtype],
           chunked=sp_ops.chunked, cost=sp_ops.cost_matmul_all_to_all, out_cols=lambda n, W: n // W,
           strategies=SP_STRATEGIES, dim_arg="seq_dim", several_weights=True),
    OpSpec("all_to_all_matmul", "sp", "A2A+MM", in_rows=lambda m, W: W * m, out_rows=lambda m, W: m,
           flops=lambda p, W: (3 if p.backward else 1) * 2 * p.m * p.k * p.n,
           bytes_per_peer=lambda p, W: (2 if p.backward else 1) * p.m * p.k / W * ITEMSIZE[p.dtype],
           chunked=sp_ops.chunked, cost=sp_ops.cost_all_to_all_matmul, in_cols=lambda k, W: k // W,
           strategies=SP_STRATEGIES, dim_arg="seq_dim"),
)}


def op_spec(name: str) -> OpSpec:
    """The table's entry of op `name`; raises ValueError for an op it does not know."""
    if name not in OPS:
        raise ValueError(f"unknown op {name!r}; known: {tuple(OPS)}")
    return OPS[name]


def ops_of(family: str) -> tuple[str, ...]:
    """The names of the ops of `family` (``tp`` or ``moe``), in table order."""
    return tuple(name for name, spec in OPS.items() if spec.family == family)


@dataclasses.dataclass(frozen=True)
class Problem:
    """One call's problem. Tensor-parallel ops: the per-rank ``m x k x n`` (every rank's GEMM is
    ``[W*m, k] @ [k, n]``; `tp_ops`). ``moe``: ``m`` tokens per rank, hidden ``k``, expert FFN ``n``,
    `experts` in all, `top_k` per token (0 for the other ops). `backward`: forward plus backward.
    Raises ValueError for an unknown op or dtype or a count out of range."""

    op: str
    m: int
    k: int
    n: int
    dtype: str = "float32"
    backward: bool = False
    experts: int = 0
    top_k: int = 0

    def __post_init__(self) -> None:
        dims = {f: getattr(self, f) for f in ("m", "k", "n", "experts", "top_k")}
        moe = self.op in OPS and OPS[self.op].family == "moe"
        if self.op not in OPS or self.dtype not in ITEMSIZE or not isinstance(self.backward, bool) \
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in dims.values()) \
                or min(self.m, self.k, self.n) < 1 \
                or (not 1 <= self.top_k <= self.experts if moe else self.top_k or self.experts) \
                or (self.dtype in FP8_DTYPES and not OPS[self.op].fp8):
            raise ValueError(f"Problem: op in {tuple(OPS)}, dtype in {tuple(ITEMSIZE)} (fp8 only for "
                             f"{tuple(n for n, s in OPS.items() if s.fp8)}), m, k, n ints >= 1, "
                             f"backward a bool, experts >= top_k >= 1 for moe: got {self}")
        if self.dtype == MX_DTYPE and self.k % MX_BLOCK:
            raise ValueError(f"Problem: {MX_DTYPE} scales blocks of {MX_BLOCK} along k, which is {self.k}: it must be "
                             f"a multiple of {MX_BLOCK} (got {self})")

    @property
    def spec(self) -> OpSpec:
        return OPS[self.op]

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def key(self) -> str:
        """Canonical text, e.g. ``matmul_all_reduce:64x1024x512:bfloat16:fwd`` (plan files' entry key)."""
        moe = f":experts={self.experts}:top_k={self.top_k}" if self.spec.family == "moe" else ""
        return f"{self.op}:{self.m}x{self.k}x{self.n}:{self.dtype}:{'fwd+bwd' if self.backward else 'fwd'}{moe}"


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name of `ITEMSIZE` (``"bfloat16"`` -> ``torch.bfloat16``; `MX_DTYPE` -> its
    elements', ``torch.float8_e4m3fn``); KeyError for another. The table itself imports no torch, so the command
    line reads it before torch loads."""
    import torch

    if name not in ITEMSIZE:
        raise KeyError(name)
    return torch.float8_e4m3fn if name == MX_DTYPE else getattr(torch, name)
