"""What ``overlap bench`` does around the ranks (`overlap.cli` parses the arguments and starts them):
the cases of the command line's shapes, the checks of ``--json``, ``--plot`` and ``--compare``
before any rank starts, and ``--compare``'s lines and ``--plot``'s figure after the run.

Shapes (``--shape``, parsed by `overlap.cli`): ``(m, k, n)`` for every tensor-parallel op and, where ``--op`` names
them, the sequence-parallel ops (their own ``m x k x n``, `overlap.plans.sp_ops`), ``("preset", name)`` for a
`models.TP_PRESETS` layer or a `models.SP_PRESETS` attention (expanded here for the number of ranks the command will
run on, so a layer that does not split over them is a usage error before any rank starts), ``(MoEShape, preset name
or "")`` for ``moe``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ..benchmarks import compare
from ..benchmarks.models import SP_PRESETS, TP_PRESETS, sp_problem, tp_problem
from ..benchmarks.names import BENCH_OPS, DEFAULT_OPS, MOE_OPS, SP_OPS, TP_OPS, MoEShape

#: the suffixes ``--plot`` writes (matplotlib's raster and vector formats most people open)
PLOT_FORMATS = ("png", "svg", "pdf", "jpg", "jpeg", "eps", "ps", "webp", "tif", "tiff")


def is_moe_shape(shape: tuple) -> bool:
    """Whether a parsed ``--shape`` is an MoE one (`MoEShape`, preset name)."""
    return isinstance(shape[0], MoEShape)


def _applies(shape: tuple, op: str, named: bool) -> bool:
    """Whether a parsed ``--shape`` makes cases of `op`: an MoE shape of ``moe``, a preset of its family's ops, and
    ``MxKxN`` of the tensor-parallel ops, and of the sequence-parallel ones where ``--op`` names them (`named`: their
    ``m x k x n`` is their own, `overlap.plans.sp_ops`)."""
    if is_moe_shape(shape):
        return op in MOE_OPS
    if shape[0] == "preset":
        return op in (SP_OPS if shape[1] in SP_PRESETS else TP_OPS)
    return op in TP_OPS or (named and op in SP_OPS)


def cases_of(
    ops: Sequence[str] | None, modes: Sequence[str], shapes: Sequence[tuple] | None, dtype: str | None,
    world_size: int,
) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    """``(ops, cases)`` of the command line: `ops` as selected (None: `DEFAULT_OPS`, or with `shapes` the
    ops they are for); the cases of `shapes` in `dtype` (default float32) for `world_size` ranks,
    grouped by op, then shape (a preset's layers in order), then mode; no cases without shapes (the
    defaults are chosen on the ranks). Raises ValueError for an op without a shape, or a preset
    that does not split over `world_size` ranks."""
    named = ops is not None
    if ops is None:
        ops = tuple(op for op in BENCH_OPS if any(_applies(s, op, False) for s in shapes)) if shapes else DEFAULT_OPS
    ops = tuple(ops)
    if not shapes:
        return ops, ()
    missing = [op for op in ops if not any(_applies(s, op, named) for s in shapes)]
    if missing:
        kinds = " or ".join(dict.fromkeys("T,H,F,E,K or a preset" if op in MOE_OPS else "MxKxN or a preset"
                                          for op in missing))
        raise ValueError(f"--shape gives no shape for {', '.join(missing)} ({kinds})")
    from ..benchmarks.cases import preset_cases, sp_preset_cases  # torch: only once the arguments are known right
    from ..benchmarks.definitions import Case, MoECase, SpCase

    dtype = dtype or "float32"
    cases: list[Any] = []
    for op in ops:
        for shape in (s for s in shapes if _applies(s, op, named)):
            if op in MOE_OPS:
                cases += [MoECase.of(shape[0], dtype, backward=mode == "fwd+bwd", preset=shape[1]) for mode in modes]
            elif shape[0] == "preset":
                sp = op in SP_OPS
                why = (sp_problem(SP_PRESETS[shape[1]][0], world_size) if sp
                       else tp_problem(TP_PRESETS[shape[1]][0], world_size))
                if why:
                    raise ValueError(f"--shape {shape[1]} does not apply to {world_size} ranks: {why}")
                cases += (sp_preset_cases if sp else preset_cases)(shape[1], op, world_size, dtype, modes)
            elif op in SP_OPS:
                cases += [SpCase.of(op, *shape, dtype, backward=mode == "fwd+bwd") for mode in modes]
            else:
                cases += [Case.of(op, *shape, dtype, backward=mode == "fwd+bwd") for mode in modes]
    problems = world_problems(cases, world_size)
    if problems:
        raise ValueError(f"--shape: cannot run on {world_size} ranks: {problems}")
    return ops, tuple(dict.fromkeys(cases))


def check_defaults(ops: Sequence[str], modes: Sequence[str], dtype: str | None, device_type: str,
                   world_size: int) -> None:
    """Raise ValueError where none of the default cases of `ops` runs on `world_size` ranks of `device_type`
    (the run would have nothing to do), with the reasons; the runner leaves out those that do not fit and
    says how many ran of how many in its summary."""
    from ..benchmarks.cases import default_cases

    left_out: list[str] = []
    cases = default_cases(ops, device_type, dtype, modes, world_size, left_out)
    if all(c.world_problem(world_size) for c in cases):
        why = "; ".join(filter(None, (*left_out, world_problems(cases, world_size))))
        raise ValueError(f"no default case of {', '.join(ops)} runs on {world_size} ranks ({why}); pick another "
                         "number of ranks (--ranks), or give --shape")


def world_problems(cases: Sequence[Any], world_size: int) -> str:
    """Why `cases` cannot run on `world_size` ranks, once per shape and dtype (not per mode); empty if they can."""
    reasons: dict[str, str] = {}
    for case in cases:
        problem = case.world_problem(world_size)
        if problem:
            name, _, why = problem.partition(": ")
            reasons.setdefault(name.rsplit(" ", 1)[0], why)  # the case's name less its mode
    return "; ".join(f"{name}: {why}" for name, why in reasons.items())



def check_output_path(option: str, path: str) -> None:
    """Raise ValueError naming `option` where `path` cannot be written: its folder is missing or not
    writable, or the path is a folder."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{option}: folder {folder} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"{option}: {path} is a folder, not a file")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"{option}: {path} is not writable")


def check_plot_format(path: str) -> None:
    """Raise ValueError where `path`'s suffix is not a format of `PLOT_FORMATS`."""
    suffix = os.path.splitext(path)[1].lower().lstrip(".")
    if suffix not in PLOT_FORMATS:
        raise ValueError(f"--plot: the suffix gives the format, one of {', '.join('.' + f for f in PLOT_FORMATS)}; "
                         f"got {path!r}")


def check_outputs(json_path: str | None, plot_path: str | None, compare_path: str | None) -> dict[str, Any] | None:
    """Check ``--json``, ``--plot`` and ``--compare`` before any rank starts; returns the payload of
    `compare_path` (None without). Raises ValueError naming the option: a folder that is missing or not
    writable, a plot format matplotlib does not write (`PLOT_FORMATS`), no matplotlib for ``--plot``, an
    earlier file that is not ``overlap bench --json``'s. Imports no torch."""
    for option, path in (("--json", json_path), ("--plot", plot_path)):
        if path is not None:
            check_output_path(option, path)
    if plot_path is not None:
        check_plot_format(plot_path)
        from ..benchmarks.plot import require_matplotlib

        try:
            require_matplotlib()
        except ImportError as exc:
            raise ValueError(str(exc)) from None
    if compare_path is None:
        return None
    try:
        return compare.load(compare_path)
    except ValueError as exc:
        raise ValueError(f"--compare: {exc}") from None


def after_run(json_path: str, earlier: dict[str, Any] | None, compare_path: str | None,
              plot_path: str | None, wide: bool = False) -> tuple[list[str], str | None]:
    """After the run, from rank 0's results in `json_path`: (lines to print: ``--compare``'s, its table one line per
    row with `wide` (``--wide``), then what ``--plot`` wrote; an error of ``--plot``, or None)."""
    current = compare.load(json_path)
    lines: list[str] = []
    if earlier is not None:
        lines += ["", *compare.compare(earlier, current, compare_path or "earlier", wide=wide)]
    if plot_path is not None:
        from ..benchmarks.plot import plot

        try:
            plot(current, plot_path)
        except (ValueError, OSError) as exc:
            return lines, f"--plot: {exc}"
        lines.append(f"wrote {plot_path}")
    return lines, None
