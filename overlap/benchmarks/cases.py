"""The benchmark cases: which cases a run benchmarks, one definition used by ``overlap bench`` and
by the ``bench/`` scripts. What a case is (the ops, modes, dtypes and strategy labels, `Case` and
`MoECase`, `MOE_PRESETS`, the shape parsers) is `definitions`', re-exported here: the rest of the
project imports cases from this module. `BenchConfig` is what one run measures.

Presets from real models (`models`): ``llama3-8b`` and ``llama3-70b`` (scaled for CPU ranks; the
real sizes with ``-full``) expand, for ``W`` ranks, to the four projections of one Llama-3 layer at
tensor-parallel size ``W`` with sequence parallelism: ``qkv`` and ``mlp-up`` for
``all_gather_matmul``, ``attn-out`` and ``mlp-down`` for ``matmul_reduce_scatter`` and
``matmul_all_reduce`` (`preset_cases`). Such a case carries its preset, layer and ``tp``, shown in
its name (``all_gather_matmul llama3-8b/mlp-up:512x256x896 float32 fwd``); it runs only on ``tp``
ranks.

Default CPU cases (2 gloo ranks on a 2-core machine, one torch thread per rank): for each
tensor-parallel op the ``llama3-8b`` projections it has (two per op; ``all_gather_weight_matmul``: four) and one
tiny shape, three batch-first projections (`_BATCH_FIRST`: torchtitan's layout, q/k/v and gate/up as separate
weights fed by one gather), and the three CPU presets of `MOE_PRESETS`, each forward and forward+backward; and
small calls of the three tensor-parallel ops, where a plain collective and ``torch.matmul`` are hardest to beat: a
decode step of ``llama3-8b-decode`` and ``llama3-70b-decode`` (forward) and a short prompt of
``llama3-8b-prefill`` (both modes); 64 cases. The Llama-3 8B projections
at 1/16 width in fp32 keep the real layer's balance of compute and communication per projection
(`models` explains the scale): attention's are communication-heavy, ``mlp-up`` compute-heavy,
``mlp-down`` in between, as on GPUs; a call takes milliseconds to tens of milliseconds, far above
timer and barrier noise (~0.1 ms). The same 3 warm-up calls and 10 repeats as always, so that the
whole default ``overlap bench`` stays within about a minute including rank start-up. The tiny
shape of each op, 32x64x64 (moe: ``tiny``), has every dim <= `INTERPRETED_FUSED_MAX_DIM`, for the
interpreted ``fused`` kernels, whose timings are labelled and left out of the summaries: an
interpreted call costs ~0.1 s even there (moe: ~0.3-0.6 s), and the runner times it in at most 3
repeats (`timing.INTERPRETED_ITERS`). On other numbers of ranks the Llama-3 preset applies where
its heads, FFN width and tokens divide by the ranks (2, 4, 8); elsewhere it is left out with a
note. GPU defaults: ``llama3-8b-full`` and ``llama3-70b-full`` in bf16, and one generic shape.
Suites (`SUITES`, `suite_cases`) name subsets of the defaults for the pytest-benchmark wrappers
in ``bench/``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..plans.optable import MX_BLOCK, MX_DTYPE
from .definitions import (
    AUTO,
    BENCH_OPS,
    DEFAULT_OPS,
    DTYPES,
    FP8_DTYPES,
    FP8_OPS,
    INTERPRETED_FUSED_MAX_DIM,
    MODES,
    MOE_OPS,
    MOE_PRESETS,
    OPS,
    SP_OPS,
    TORCH,
    VARIANTS,
    AnyCase,
    Case,
    MoECase,
    MoEShape,
    SpCase,
    all_bench_labels,
    all_strategy_labels,
    bench_labels,
    label_plan,
    parse_moe_shape,
    parse_shape,
    strategy_labels,
)
from .models import SP_PRESETS, TP_PRESETS, layer_split, sp_problem, sp_problems, tp_problem, tp_problems

__all__ = [
    # defined here
    "SUITES",
    "BenchConfig",
    "default_cases",
    "dtype_problem",
    "preset_cases",
    "sp_preset_cases",
    "suite_cases",
    # `definitions`'
    "AUTO",
    "BENCH_OPS",
    "DEFAULT_OPS",
    "TORCH",
    "all_bench_labels",
    "bench_labels",
    "DTYPES",
    "INTERPRETED_FUSED_MAX_DIM",
    "MODES",
    "MOE_OPS",
    "MOE_PRESETS",
    "OPS",
    "SP_OPS",
    "VARIANTS",
    "AnyCase",
    "Case",
    "MoECase",
    "MoEShape",
    "SpCase",
    "all_strategy_labels",
    "label_plan",
    "parse_moe_shape",
    "parse_shape",
    "strategy_labels",
]


#: the tensor-parallel ops of the small-call presets (decode, short prefill): no weight gather (FSDP)
_TP_ONLY = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")

# Per device type, for every tensor-parallel op: (a `models.TP_PRESETS` name or ``(m, k, n)``, dtype, modes, the
# ops it is a case of).
_DEFAULTS: dict[str, list[tuple[str | tuple[int, int, int], str, tuple[str, ...], tuple[str, ...]]]] = {
    "cpu": [
        ("llama3-8b", "float32", MODES, OPS),  # Llama-3 8B's four projections, scaled for CPU ranks (`models`)
        ((32, 64, 64), "float32", MODES, OPS),  # small enough for interpreted fused
        # small calls: a decode step (8 rows per rank on 2 ranks), a short prompt (64 rows per rank)
        ("llama3-8b-decode", "float32", ("fwd",), _TP_ONLY),
        ("llama3-70b-decode", "float32", ("fwd",), _TP_ONLY),
        ("llama3-8b-prefill", "float32", MODES, _TP_ONLY),
    ],
    # Not yet measured on a GPU. The generic shape runs on any number of GPUs, the presets where
    # heads, FFN and tokens divide by it.
    "cuda": [
        ("llama3-8b-full", "bfloat16", MODES, OPS),
        ("llama3-70b-full", "bfloat16", MODES, OPS),
        ((1024, 8192, 8192), "bfloat16", ("fwd",), OPS),
        ("llama3-8b-full-decode", "bfloat16", ("fwd",), _TP_ONLY),
        ("llama3-70b-full-decode", "bfloat16", ("fwd",), _TP_ONLY),
    ],
}

# Batch-first cases per device type: (preset, layer, op, batch, several weights?, dtype, modes): torchtitan's
# layout ([b, s, h], the sequence on dim 1) with its separate q/k/v and gate/up weights (`layouts`).
_BATCH_FIRST: dict[str, list[tuple[str, str, str, int, bool, str, tuple[str, ...]]]] = {
    "cpu": [("llama3-8b", "qkv", "all_gather_matmul", 2, True, "float32", MODES),
            ("llama3-8b", "mlp-up", "all_gather_matmul", 2, True, "float32", MODES),
            ("llama3-8b", "attn-out", "matmul_reduce_scatter", 2, False, "float32", MODES)],
    # Not yet measured on a GPU.
    "cuda": [("llama3-8b-full", "qkv", "all_gather_matmul", 2, True, "bfloat16", MODES),
             ("llama3-8b-full", "mlp-up", "all_gather_matmul", 2, True, "bfloat16", MODES),
             ("llama3-8b-full", "attn-out", "matmul_reduce_scatter", 2, False, "bfloat16", MODES)],
}

# (preset, dtype, modes) per device type for op "moe"
_MOE_DEFAULTS: dict[str, list[tuple[str, str, tuple[str, ...]]]] = {
    "cpu": [("mixtral", "float32", MODES), ("deepseek-v3", "float32", MODES), ("tiny", "float32", MODES)],
    # Not yet measured on a GPU.
    "cuda": [("mixtral-full", "bfloat16", MODES), ("deepseek-v3-full", "bfloat16", MODES)],
}

# (preset, dtype, modes) per device type for the sequence-parallel ops (`models.SP_PRESETS`): each preset's ``qkv``
# layer for ``matmul_all_to_all``, its ``attn-out`` for ``all_to_all_matmul``
_SP_DEFAULTS: dict[str, list[tuple[str, str, tuple[str, ...]]]] = {
    "cpu": [("llama3-8b-32k", "float32", MODES)],
    # Not yet measured on a GPU (nor has the family run on one).
    "cuda": [("llama3-8b-32k-full", "bfloat16", MODES), ("llama3-8b-128k-full", "bfloat16", ("fwd",))],
}


def _check_selection(ops: tuple[str, ...], modes: Sequence[str]) -> None:
    unknown = [o for o in ops if o not in BENCH_OPS]
    if unknown:
        raise ValueError(f"unknown ops {unknown}; known: {BENCH_OPS}")
    bad_modes = [m for m in modes if m not in MODES]
    if bad_modes:
        raise ValueError(f"unknown modes {bad_modes}; known: {MODES}")


def dtype_problem(dtype: str | None, k: int, what: str = "k") -> str | None:
    """Why a case whose GEMMs reduce over ``k`` (`what`: its name in the reason; an MoE layer's hidden size)
    cannot run in `dtype`, or None: ``mxfp8`` scales blocks of 32 along ``k``."""
    if dtype == MX_DTYPE and k % MX_BLOCK:
        return f"{MX_DTYPE} needs {what} a multiple of {MX_BLOCK}, got {k}"
    return None


def preset_cases(
    preset: str,
    op: str | Sequence[str] = OPS,
    world_size: int = 2,
    dtype: str = "float32",
    modes: Sequence[str] = MODES,
    left_out: list[str] | None = None,
) -> list[Case]:
    """The cases of the `models.TP_PRESETS` layer `preset` at tensor-parallel size `world_size`, for
    the tensor-parallel ops among `op` (others are ignored), grouped by op, then layer (`models.LAYERS`
    order), then mode. Raises ValueError for an unknown preset, op or mode, or a layer that does not
    split over `world_size` ranks (`models.tp_problem`); a layer that `dtype` cannot run (`dtype_problem`) raises
    too, or, given `left_out`, is left out with the reason appended to it."""
    ops = (op,) if isinstance(op, str) else tuple(op)
    _check_selection(ops, modes)
    if preset not in TP_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {tuple(TP_PRESETS)}")
    cases = []
    for o in ops:
        for layer, layer_op, dims in tp_problems(TP_PRESETS[preset][0], world_size):
            if layer_op != o:
                continue
            if why := dtype_problem(dtype, dims[1]):
                why = f"{o} {preset}/{layer}: {why}"
                if left_out is None:
                    raise ValueError(why)
                if why not in left_out:
                    left_out.append(why)
                continue
            cases += [Case.of(o, *dims, dtype, backward=mode == "fwd+bwd", preset=preset, layer=layer,
                              tp=world_size) for mode in MODES if mode in modes]
    return cases


def sp_preset_cases(
    preset: str,
    op: str | Sequence[str] = SP_OPS,
    world_size: int = 2,
    dtype: str = "float32",
    modes: Sequence[str] = MODES,
) -> list[SpCase]:
    """The cases of the `models.SP_PRESETS` attention `preset` at sequence-parallel size `world_size`, for the
    sequence-parallel ops among `op` (others are ignored), grouped by op, then mode. Raises ValueError for an unknown
    preset, op or mode, or a layer that does not split over `world_size` ranks (`models.sp_problem`)."""
    ops = (op,) if isinstance(op, str) else tuple(op)
    _check_selection(ops, modes)
    if preset not in SP_PRESETS:
        raise ValueError(f"unknown sequence-parallel preset {preset!r}; known: {tuple(SP_PRESETS)}")
    problems = sp_problems(SP_PRESETS[preset][0], world_size)
    return [SpCase.of(o, *dims, dtype, backward=mode == "fwd+bwd", preset=preset, layer=layer, sp=world_size)
            for o in ops for layer, layer_op, dims in problems if layer_op == o for mode in MODES if mode in modes]


def default_cases(
    op: str | Sequence[str] = DEFAULT_OPS,
    device_type: str = "cpu",
    dtype: str | None = None,
    modes: Sequence[str] = MODES,
    world_size: int = 2,
    left_out: list[str] | None = None,
) -> list[AnyCase]:
    """The default cases of `op` (one name or several, of `BENCH_OPS`; default `DEFAULT_OPS`) for `world_size` ranks on
    `device_type` (``"cpu"`` or ``"cuda"``), in the given `modes` (see `MODES`), grouped by op, then
    shape (a preset's layers in order), then mode.

    `dtype` (a name of `DTYPES`) replaces every case's own dtype when given (an fp8 dtype: `FP8_OPS` only, the
    tensor-parallel ones sequence-first, the other ops' reason appended to `left_out`; ``mxfp8``: shapes whose ``k``
    (MoE: hidden size) divides by 32, the others' reason appended). A preset whose layer
    does not split over `world_size` ranks is left out, and the reason appended to `left_out`
    (MoE presets whose experts do not split are returned: `MoECase.world_problem` says why).
    Raises ValueError for an unknown op, device type, dtype or mode.
    """
    ops = (op,) if isinstance(op, str) else tuple(op)
    _check_selection(ops, modes)
    if device_type not in _DEFAULTS:
        raise ValueError(f"no default case for device type {device_type!r}; known: {tuple(_DEFAULTS)}")
    cases: list[AnyCase] = []
    for o in ops:
        if dtype in FP8_DTYPES and o not in FP8_OPS:
            why = f"{o}: no {dtype} cases (the fp8 recipe is benchmarked for {', '.join(FP8_OPS)})"
            if left_out is not None and why not in left_out:
                left_out.append(why)
            continue
        if o in MOE_OPS:
            for preset, dt, case_modes in _MOE_DEFAULTS[device_type]:
                dims = MOE_PRESETS[preset][0]
                if why := dtype_problem(dtype or dt, dims.hidden, "the hidden size"):
                    why = f"{o} {preset}: {why}"
                    if left_out is not None and why not in left_out:
                        left_out.append(why)
                    continue
                cases += [MoECase.of(dims, dtype or dt, backward=mode == "fwd+bwd", preset=preset)
                          for mode in MODES if mode in case_modes and mode in modes]
            continue
        if o in SP_OPS:
            for preset, dt, case_modes in _SP_DEFAULTS[device_type]:
                if why := sp_problem(SP_PRESETS[preset][0], world_size):
                    if left_out is not None and f"{preset}: {why}" not in left_out:
                        left_out.append(f"{preset}: {why}")
                    continue
                cases += sp_preset_cases(preset, o, world_size, dtype or dt,
                                         [mode for mode in MODES if mode in case_modes and mode in modes])
            continue
        for shape, dt, case_modes, case_ops in _DEFAULTS[device_type]:
            selected = [mode for mode in MODES if mode in case_modes and mode in modes]
            if o not in case_ops:
                continue
            if not isinstance(shape, str):
                if why := dtype_problem(dtype or dt, shape[1]):
                    why = f"{o} {'x'.join(map(str, shape))}: {why}"
                    if left_out is not None and why not in left_out:
                        left_out.append(why)
                    continue
                cases += [Case.of(o, *shape, dtype or dt, backward=mode == "fwd+bwd") for mode in selected]
            elif why := tp_problem(TP_PRESETS[shape][0], world_size):
                if left_out is not None and f"{shape}: {why}" not in left_out:
                    left_out.append(f"{shape}: {why}")
            else:
                cases += preset_cases(shape, o, world_size, dtype or dt, selected,
                                      [] if left_out is None else left_out)
        if dtype not in FP8_DTYPES:  # (fp8 cases are sequence-first with one weight)
            cases += _batch_first_cases(o, device_type, dtype, modes, world_size)
    return list(dict.fromkeys(cases))  # a dtype override can make two cases equal


def _batch_first_cases(op: str, device_type: str, dtype: str | None, modes: Sequence[str],
                       world_size: int) -> list[Case]:
    """The `_BATCH_FIRST` cases of `op` that apply to `world_size` ranks (those that do not: left out, as the
    presets' own cases are, with the reason `default_cases` notes)."""
    cases = []
    for preset, layer, o, batch, several, dt, case_modes in _BATCH_FIRST[device_type]:
        model = TP_PRESETS[preset][0]
        if o != op or tp_problem(model, world_size):
            continue
        dims = next(d for name, layer_op, d in tp_problems(model, world_size) if (name, layer_op) == (layer, o))
        if dims[0] % batch:
            continue
        split = layer_split(model, layer, world_size) if several else ()
        cases += [Case.of(o, *dims, dtype or dt, backward=mode == "fwd+bwd", preset=preset, layer=layer,
                       tp=world_size, batch=batch, split=split)
                  for mode in MODES if mode in case_modes and mode in modes]
    return cases


#: named selections of the default cases (`suite_cases`), for the pytest-benchmark wrappers in bench/
SUITES: dict[str, str] = {
    "quick": "the default cases, forward only, without those sized for interpreted fused",
    "default": "the default cases, as overlap bench runs them",
    "tiny": "the default cases sized for interpreted fused, forward only (seconds: a smoke test)",
}


def suite_cases(
    name: str, device_type: str = "cpu", world_size: int = 2, left_out: list[str] | None = None
) -> list[AnyCase]:
    """The cases of suite `name` (`SUITES`) of every op in `DEFAULT_OPS` (see `default_cases`).
    Raises ValueError for an unknown suite."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; known: {tuple(SUITES)}")
    modes = MODES if name == "default" else ("fwd",)
    cases = default_cases(DEFAULT_OPS, device_type, None, modes, world_size, left_out)
    if name == "quick":
        return [c for c in cases if not c.fits_interpreted_fused]
    if name == "tiny":
        return [c for c in cases if c.fits_interpreted_fused]
    return cases


# ----------------------------------------------------------------------------------------------
# What one run measures
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What `runner.run` measures. `strategies` always gets ``torch`` (the baseline of the speedups: plain
    torch, `baseline`) and ``reference`` (the correctness baseline) put first; ``auto`` is the default strategy.

    Without `cases`, the default cases (`default_cases`) of `ops` in `modes` run; given
    cases must be of those ops and modes. Each strategy label runs for the ops it applies to
    (``symm+one_shot``: ``matmul_all_reduce`` only) and must apply to at least one of them.
    Raises ValueError for anything unknown or inconsistent.
    """

    ops: tuple[str, ...] = DEFAULT_OPS
    modes: tuple[str, ...] = MODES
    cases: tuple[AnyCase, ...] = ()  # empty: the default cases of `ops` x `modes` for the ranks' device type
    dtype: str | None = None  # overrides the dtype of the default cases
    strategies: tuple[str, ...] = all_bench_labels()
    warmup: int = 3
    iters: int = 10
    timeout: float | None = None  # per-call deadline of the ops (None: OVERLAP_TIMEOUT_S)
    json_path: str | None = None  # rank 0 writes the results there
    seed: int | None = None  # None: rank 0 draws one
    progress: bool = True  # progress lines on rank 0's stderr
    wide: bool = False  # the table one line per row, about 200 columns (default: 120, `report.Table`); not in the JSON
    profile: bool = False  # after the timings, each label's host time per stage (`timing.profile_case`)

    def __post_init__(self) -> None:
        for name, known in (("ops", BENCH_OPS), ("modes", MODES)):
            values = tuple(dict.fromkeys(getattr(self, name)))
            unknown = [v for v in values if v not in known]
            if not values or unknown:
                raise ValueError(f"{name} must be a non-empty selection of {known}, got {getattr(self, name)!r}")
            object.__setattr__(self, name, values)
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)} or None, got {self.dtype!r}")
        wrong = [c.name for c in self.cases if c.op not in self.ops or c.mode not in self.modes]
        if wrong:
            raise ValueError(f"cases {wrong} are not of ops {self.ops} in modes {self.modes}")
        ops = {c.op for c in self.cases} or set(self.ops)
        known = all_bench_labels()
        unknown = [s for s in self.strategies if s not in known]
        if unknown:
            raise ValueError(f"unknown strategies {unknown}; known: {known}")
        idle = [s for s in self.strategies if not any(s in bench_labels(op) for op in ops)]
        if idle:
            raise ValueError(f"strategies {idle} apply to none of the ops benchmarked ({', '.join(sorted(ops))})")
        strategies = (TORCH, "reference", *dict.fromkeys(s for s in self.strategies if s not in (TORCH, "reference")))
        object.__setattr__(self, "strategies", strategies)
        object.__setattr__(self, "cases", tuple(self.cases))
        if self.warmup < 0 or self.iters < 1:
            raise ValueError(f"need warmup >= 0 and iters >= 1, got warmup={self.warmup}, iters={self.iters}")
