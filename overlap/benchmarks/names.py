"""The names of ``overlap bench`` that the command line needs before any rank starts, without torch:
the ops, modes, dtype names and strategy labels, the MoE shapes and presets, and the shape parsers.

The ops, strategies, variants and dtypes are the op table's (`overlap.plans.optable`, `overlap.plans.plan`: they
import no torch), read from it here; `definitions` says what a case is and re-exports these names. So ``overlap
--help`` and argument errors answer without importing torch.

Strategy labels: the strategies of `overlap.Plan` that an op implements (`OpSpec.strategies`: the sequence-parallel
ops have ``reference`` and ``pipelined`` only) and, for ``matmul_all_reduce``, their ``+one_shot`` variants
(`strategy_labels`); a benchmark also runs two rows beside them
(`bench_labels`): ``torch``, the plain torch.distributed collective and ``torch.matmul`` with no code
of this project on the timed path (the baseline of every speedup), and ``auto``, the default strategy.
"""

from __future__ import annotations

import dataclasses

from ..plans.optable import OPS, TRAINING_DTYPES, ops_of
from ..plans.plan import STRATEGIES

#: the tensor-parallel ops (the op table's family ``tp``), the MoE layer (family ``moe``), the sequence-parallel ops
#: (family ``sp``: DeepSpeed-Ulysses attention's projections)
TP_OPS = ops_of("tp")
MOE_OPS = ops_of("moe")
SP_OPS = ops_of("sp")
#: every op ``overlap bench --op`` takes
BENCH_OPS = TP_OPS + MOE_OPS + SP_OPS
#: the ops of a run without ``--op``: the sequence-parallel ones on request (``--op``, or a preset of theirs in
#: ``--shape``): their default cases (Llama-3 8B attention over 32k tokens, scaled) would add ~15 s on 2 CPU ranks to
#: the default run's ~40 s
DEFAULT_OPS = TP_OPS + MOE_OPS

#: ``fwd``: the forward alone; ``fwd+bwd``: forward, then backward of the fresh output
MODES = ("fwd", "fwd+bwd")

#: the dtypes a case may have (the op table's training dtypes); ``float8_e4m3fn``: the op's ``fp8="rowwise"``
#: recipe on bfloat16 leaves, ``mxfp8``: its ``fp8="mxfp8"`` recipe (`definitions`)
DTYPE_NAMES = TRAINING_DTYPES

#: the strategies of `overlap.plans.STRATEGIES` that ``overlap bench`` does not run: ``hierarchical`` runs ``symm``
#: on one node; across nodes the emulated cluster's figures measure it (``python -m bench.emulated_cluster --figures``)
NOT_BENCHED = ("hierarchical",)
#: `overlap.plans.STRATEGIES` that ``overlap bench`` runs
STRATEGY_NAMES = tuple(s for s in STRATEGIES if s not in NOT_BENCHED)

#: per op, the `Plan` flags beyond the strategy that make labels of their own (`OpSpec.variants`)
VARIANT_FLAGS: dict[str, tuple[str, ...]] = {name: spec.variants for name, spec in OPS.items() if spec.variants}

#: the baseline row of every case: plain torch.distributed and torch.matmul (`baseline`)
TORCH = "torch"
#: the row of the default strategy, ``strategy="auto"``
AUTO = "auto"

#: the Triton interpreter runs a GEMM tile by tile in numpy: only tiny shapes finish in time
INTERPRETED_FUSED_MAX_DIM = 128


def variant_labels(op: str) -> dict[str, tuple[str, str]]:
    """``label -> (strategy, flag)`` of `op`'s variant labels (``symm+one_shot`` -> ``(symm, one_shot)``)."""
    return {f"{s}+{v}": (s, v) for v in VARIANT_FLAGS.get(op, ()) for s in _strategies(op) if s != "reference"}


def _strategies(op: str) -> tuple[str, ...]:
    """`STRATEGY_NAMES` that `op` implements (`OpSpec.strategies`): an op without ``symm`` or ``fused`` has no row of
    them (forcing one raises ValueError)."""
    return tuple(s for s in STRATEGY_NAMES if s in OPS[op].strategies) if op in OPS else STRATEGY_NAMES


def strategy_labels(op: str) -> tuple[str, ...]:
    """The strategy labels `op` can be benchmarked under (the strategies it implements), each variant after its
    strategy."""
    variants = variant_labels(op)
    return tuple(label for s in _strategies(op) for label in (s, *(v for v in variants if variants[v][0] == s)))


def all_strategy_labels() -> tuple[str, ...]:
    """Every strategy label of every op, in `STRATEGY_NAMES` order, each variant after its strategy."""
    return tuple(dict.fromkeys(
        label for s in STRATEGY_NAMES for op in BENCH_OPS for label in strategy_labels(op)
        if label == s or variant_labels(op).get(label, ("",))[0] == s))


def bench_labels(op: str) -> tuple[str, ...]:
    """Every row label a case of `op` can have: ``torch``, the strategy labels, ``auto``."""
    return (TORCH, *strategy_labels(op), AUTO)


def all_bench_labels() -> tuple[str, ...]:
    """What ``overlap bench --strategies`` accepts: ``torch``, every strategy label, ``auto``."""
    return (TORCH, *all_strategy_labels(), AUTO)


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """An MoE layer's shape: `tokens` per rank, `hidden`, expert FFN width `ffn`, `experts` in all,
    `top_k` experts per token (``T,H,F,E,K``; `definitions` explains the presets' scaling)."""

    tokens: int
    hidden: int
    ffn: int
    experts: int
    top_k: int

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f.name} must be an int >= 1, got {v!r}")
        if self.top_k > self.experts:
            raise ValueError(
                f"top_k ({self.top_k}) must be at most experts ({self.experts}): a token's experts are distinct"
            )

    @property
    def spec(self) -> str:
        """``"T,H,F,E,K"``, as `parse_moe_shape` reads it."""
        return ",".join(str(v) for v in dataclasses.astuple(self))


#: name -> (shape, what it is); `definitions`' docstring explains the scaling
MOE_PRESETS: dict[str, tuple[MoEShape, str]] = {
    "mixtral": (MoEShape(512, 128, 448, 8, 2), "Mixtral-8x7B (4096, 14336, 8 experts, top-2), hidden and FFN at 1/32"),
    "deepseek-v3": (
        MoEShape(512, 224, 64, 32, 8),
        "DeepSeek-V3 (7168, 2048, 256 routed experts, top-8), hidden and FFN at 1/32, 32 experts",
    ),
    "tiny": (MoEShape(32, 32, 64, 4, 2), f"every dim <= {INTERPRETED_FUSED_MAX_DIM}, for interpreted fused"),
    "mixtral-full": (MoEShape(4096, 4096, 14336, 8, 2), "Mixtral-8x7B at full width, 4096 tokens per rank"),
    "deepseek-v3-full": (
        MoEShape(4096, 7168, 2048, 256, 8),
        "DeepSeek-V3 at full width with its 256 routed experts, 4096 tokens per rank",
    ),
}



def parse_shape(text: str) -> tuple[int, int, int]:
    """``"MxKxN"`` -> ``(m, k, n)``, each a positive int. Raises ValueError otherwise."""
    parts = text.lower().split("x")
    if len(parts) != 3:
        raise ValueError(f"shape must be MxKxN (three positive ints joined by 'x'), got {text!r}")
    try:
        m, k, n = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"shape must be MxKxN (three positive ints joined by 'x'), got {text!r}") from None
    if min(m, k, n) < 1:
        raise ValueError(f"every dim of the shape must be >= 1, got {text!r}")
    return m, k, n


def parse_moe_shape(text: str) -> tuple[MoEShape, str]:
    """A preset name of `MOE_PRESETS` or ``"T,H,F,E,K"`` -> ``(shape, preset name or "")``.
    Raises ValueError otherwise."""
    name = text.strip().lower()
    if name in MOE_PRESETS:
        return MOE_PRESETS[name][0], name
    parts = name.split(",")
    what = (
        f"an MoE shape must be T,H,F,E,K (tokens per rank, hidden, expert FFN, experts, top-k: five positive "
        f"ints joined by ',') or a preset among {', '.join(MOE_PRESETS)}, got {text!r}"
    )
    if len(parts) != 5:
        raise ValueError(what)
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise ValueError(what) from None
    if min(values) < 1:
        raise ValueError(f"every dim of the MoE shape must be >= 1, got {text!r}")
    return MoEShape(*values), ""
