"""What the kernels' host launchers share: whether the kernels run interpreted, the interpreter's watchdog,
and the argument checks.

A launcher (``launch_*`` beside each kernel) checks its arguments, raising `ValueError` with the values
that are wrong, allocates what belongs to the launch (an output where none is given, the abort word of an
interpreted run), computes the grid and launches on the current stream. It never synchronizes: on GPUs
a wait that gives up is reported through the error word the caller passes (pinned host memory in the ops),
and the caller reads it. Where the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by
``import overlap`` where no GPU exists) an in-kernel spin cannot read a clock: a `Watchdog` thread sets the
abort word at the deadline instead.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, NoReturn

import torch

from .. import envs

#: tensor dtypes the GEMM kernels take (fp32 runs as TF32 on Hopper)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the fp8 operands the GEMM kernels take with their scales (fp8 wgmma on Hopper; the epilogue scales)
FP8_DTYPES = (torch.float8_e4m3fn,)
#: MX block scales (OCP MX, `overlap.ops.fp8`): one e8m0 scale per `MX_BLOCK` elements along K
MX_BLOCK = 32
MX_SCALE_DTYPE = torch.float8_e8m0fnu
#: the scale mode of MX operands (the kernels' ``A_SCALE``/``B_SCALE``: 0 none, 1 one value, 2 one per row of a or
#: column of b, 3 MX blocks; `overlap.kernels.flags.MX_SCALES`)
MX_SCALES = 3


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET``, read now: once per launch)."""
    return envs.triton_interpret()


def cdiv(x: int, y: int) -> int:
    """``ceil(x / y)`` for ints (host arithmetic; ``triton.cdiv`` is a JIT function, slower to call)."""
    return -(-x // y)


#: The fused GEMMs' default tiles ``(BLOCK_M, BLOCK_N, BLOCK_K)`` where the plan names none. On a GPU, 16-bit and fp8
#: operands: a 128 x 128 output tile per CTA (Hopper's ``wgmma`` works on 64-row slices, two per tile) over k in steps
#: of 64 (128 bytes of a 16-bit row: one swizzled shared-memory line).
GPU_TILES = (128, 128, 64)
#: fp32 on a GPU (TF32 ``wgmma``): half the columns and half the k step, so the tile's operands fit the same shared
#: memory as a 16-bit tile's.
GPU_FP32_TILES = (128, 64, 32)
#: Interpreted on CPU ranks: the interpreter runs every tile in numpy, and small tiles keep its launches short.
INTERPRETED_TILES = (32, 32, 32)
#: ``block_k`` of a plan that names ``block_m`` only (and ``block_n`` defaults to ``block_m``).
PLAN_BLOCK_K = 32


def fused_tiles(block_m: int, block_n: int, block_k: int, interpreted: bool,
                dtype: torch.dtype) -> tuple[int, int, int]:
    """Tile shape of a fused GEMM kernel: the plan's, else a default per dtype (small when interpreted)."""
    if block_m:
        return block_m, block_n or block_m, block_k or PLAN_BLOCK_K
    if interpreted:
        return INTERPRETED_TILES
    return GPU_TILES if dtype != torch.float32 else GPU_FP32_TILES


class Watchdog:
    """Sets ``abort[0] = 1`` after `timeout` seconds, releasing interpreted in-kernel spins."""

    def __init__(self, abort: torch.Tensor, timeout: float):
        self._timer = threading.Timer(timeout, lambda: abort.fill_(1))
        self._timer.daemon = True

    def __enter__(self) -> Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()


def bounded(abort: torch.Tensor, timeout_ns: int, watchdog: bool,
            interpreted: bool) -> contextlib.AbstractContextManager:
    """The guard of one interpreted launch: a `Watchdog` on `abort` after `timeout_ns` where `watchdog` is set
    and the kernels run `interpreted`; nothing otherwise (on GPUs the kernels read ``%globaltimer``)."""
    if watchdog and interpreted:
        return Watchdog(abort, timeout_ns / 1e9)
    return contextlib.nullcontext()


def abort_word(kernel: str, abort: torch.Tensor | None, err: torch.Tensor, interpreted: bool) -> torch.Tensor:
    """`abort`, else a fresh zero word where the kernels run `interpreted` (the watchdog's), else `err` (a GPU
    kernel never reads the abort word, so any valid int32 pointer does)."""
    if abort is not None:
        check_word(kernel, "abort", abort)
        return abort
    return torch.zeros(1, dtype=torch.int32, device=err.device) if interpreted else err


def meta_options(num_warps: int | None, num_stages: int | None, interpreted: bool) -> dict[str, int]:
    """Triton launch options given (none when `interpreted`: they only shape GPU code)."""
    if interpreted:
        return {}
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return {k: v for k, v in options.items() if v is not None}


# ----------------------------------------------------------------------------------------------
# Argument checks (cheap: shapes, dtypes and devices only, nothing that waits for the device)
# ----------------------------------------------------------------------------------------------


def fail(kernel: str, msg: str) -> NoReturn:
    raise ValueError(f"overlap.kernels.{kernel}: {msg}")


def check_tile(kernel: str, **sizes: int) -> None:
    """Tile sizes are powers of two >= 16 (``tl.arange`` and ``tl.dot`` need them)."""
    for name, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 16 or v & (v - 1):
            fail(kernel, f"{name} must be a power of two >= 16, got {v!r}")


def check_word(kernel: str, name: str, word: torch.Tensor) -> None:
    """An int32 word (error or abort word) a kernel writes or reads."""
    if not isinstance(word, torch.Tensor) or word.dtype != torch.int32 or word.numel() < 1:
        got = f"{word.dtype} {tuple(word.shape)}" if isinstance(word, torch.Tensor) else type(word).__name__
        fail(kernel, f"{name} must be an int32 tensor of at least one word, got {got}")


def check_epoch(kernel: str, epoch: torch.Tensor, device: torch.device) -> None:
    """The epoch word: an int32 tensor of at least one word on the kernel's device (never an int, which
    Triton would specialize on)."""
    if isinstance(epoch, int):
        fail(kernel, f"epoch must be an int32 word on {device} (overlap.kernels.epoch_word({epoch}, device)), "
                     f"got the int {epoch}")
    check_word(kernel, "epoch", epoch)
    check_device(kernel, "epoch", epoch, device)


def epoch_word(epoch: int, device: torch.device | str) -> torch.Tensor:
    """A new int32 ``[1]`` tensor holding `epoch` on `device`, for launches without a heap (the GPU check,
    tests). Written on the current stream (a fill kernel on GPUs, no synchronization): launch the kernels that
    read it on that stream, or order the others after it. The ops use their heap slot's word instead
    (`overlap.symm.Call.epoch_word`)."""
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not -(1 << 31) <= epoch < 1 << 31:
        raise ValueError(f"overlap.kernels.epoch_word: epoch must be an int32, got {epoch!r}")
    return torch.full((1,), epoch, dtype=torch.int32, device=device)


def check_table(kernel: str, name: str, table: torch.Tensor, size: int | None, device: torch.device,
                dtype: torch.dtype = torch.int64, width: int | None = None) -> None:
    """An address table (int64 ``[size]``) or a tile table (int32 ``[rows, width]``) on the kernel's device,
    contiguous; `size` None: any length."""
    if not isinstance(table, torch.Tensor):
        fail(kernel, f"{name} must be a tensor, got {type(table).__name__}")
    shape = tuple(table.shape)
    want = (size,) if width is None else (size, width)
    if table.dtype != dtype or len(shape) != len(want) or any(w is not None and g != w for g, w in zip(shape, want)):
        what = ", ".join("n" if w is None else str(w) for w in want)
        fail(kernel, f"{name} must be {dtype} [{what}], got {table.dtype} {list(shape)}")
    if not table.is_contiguous():
        fail(kernel, f"{name} must be contiguous, got strides {table.stride()}")
    check_device(kernel, name, table, device)


def table_size(table: torch.Tensor) -> int | None:
    """Entries of a 1-D table (None for anything else: `check_table` then says what is wrong)."""
    return table.shape[0] if isinstance(table, torch.Tensor) and table.dim() == 1 else None


def check_device(kernel: str, name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        fail(kernel, f"{name} is on {t.device}, the kernel runs on {device}")


def check_matrix(kernel: str, name: str, t: torch.Tensor, dtype: torch.dtype | None = None,
                 unit_cols: bool = False, fp8: bool = False) -> None:
    """A 2-D tensor of a kernel dtype (`dtype` where given; `fp8`: an fp8 one too); `unit_cols`: rows of unit
    column stride."""
    dtypes = DTYPES + FP8_DTYPES if fp8 else DTYPES
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        fail(kernel, f"{name} must be a 2-D tensor, got "
                     f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if t.dtype not in dtypes or (dtype is not None and t.dtype != dtype):
        fail(kernel, f"{name} must be {dtype or dtypes}, got {t.dtype}")
    if unit_cols and t.shape[1] > 1 and t.stride(1) != 1:
        fail(kernel, f"{name} must have unit column stride, got strides {t.stride()}")


def check_b_scale(kernel: str, b: torch.Tensor, b_scale: torch.Tensor | None) -> int:
    """An fp8 GEMM's weight `b` ``[K, N]`` (e4m3) and its scale on `b`'s device: float32, one element (returns 1)
    or ``[1, N]`` (returns 2, one per column); or MX block scales, e8m0 ``[K / 32, N]`` with any strides, ``K`` a
    multiple of 32 (returns `MX_SCALES`)."""
    if b.dtype != torch.float8_e4m3fn:
        fail(kernel, f"with b_scale, b must be {torch.float8_e4m3fn}, got {b.dtype}")
    k, n = b.shape
    if isinstance(b_scale, torch.Tensor) and b_scale.dtype == MX_SCALE_DTYPE:
        if k % MX_BLOCK or tuple(b_scale.shape) != (k // MX_BLOCK, n) or b_scale.device != b.device:
            fail(kernel, f"MX b_scale must be [K/{MX_BLOCK}, N] = [{k // MX_BLOCK}, {n}] on {b.device} with K={k} a "
                         f"multiple of {MX_BLOCK}; got {list(b_scale.shape)} on {b_scale.device}")
        return MX_SCALES
    if (not isinstance(b_scale, torch.Tensor) or b_scale.dtype != torch.float32 or b_scale.device != b.device
            or not (b_scale.numel() == 1 or tuple(b_scale.shape) == (1, n))):
        got = (f"{b_scale.dtype} {list(b_scale.shape)} on {b_scale.device}" if isinstance(b_scale, torch.Tensor)
               else type(b_scale).__name__)
        fail(kernel, f"b_scale must be float32, one element or [1, {n}], on {b.device}; got {got}")
    return 1 if b_scale.numel() == 1 and tuple(b_scale.shape) != (1, n) else 2


def check_a_scale(kernel: str, a: torch.Tensor, a_scale: torch.Tensor) -> int:
    """An fp8 GEMM's activation `a` ``[M, K]`` (e4m3) and its scale: float32, one element (returns 1) or ``[M, 1]``
    contiguous (returns 2, one per row); or MX block scales, e8m0 ``[M, K / 32]`` contiguous (returns
    `MX_SCALES`)."""
    m, k = a.shape
    if a.dtype != torch.float8_e4m3fn:
        fail(kernel, f"with a_scale, a must be {torch.float8_e4m3fn}, got {a.dtype}")
    if isinstance(a_scale, torch.Tensor) and a_scale.dtype == MX_SCALE_DTYPE:
        if (k % MX_BLOCK or tuple(a_scale.shape) != (m, k // MX_BLOCK) or not a_scale.is_contiguous()
                or a_scale.device != a.device):
            fail(kernel, f"MX a_scale must be [M, K/{MX_BLOCK}] = [{m}, {k // MX_BLOCK}] contiguous on {a.device} "
                         f"with K={k} a multiple of {MX_BLOCK}; got {list(a_scale.shape)} strides "
                         f"{a_scale.stride()} on {a_scale.device}")
        return MX_SCALES
    if (not isinstance(a_scale, torch.Tensor) or a_scale.dtype != torch.float32 or a_scale.device != a.device
            or not (a_scale.numel() == 1 or (tuple(a_scale.shape) == (m, 1) and a_scale.is_contiguous()))):
        got = (f"{a_scale.dtype} {list(a_scale.shape)} on {a_scale.device}" if isinstance(a_scale, torch.Tensor)
               else type(a_scale).__name__)
        fail(kernel, f"a_scale must be float32, one element or [{m}, 1] contiguous, on {a.device}; got {got}")
    return 1 if a_scale.numel() == 1 and tuple(a_scale.shape) != (m, 1) else 2


def check_mx_tile(kernel: str, block_k: int) -> None:
    """An MX GEMM's K step: whole blocks of `MX_BLOCK` (the K loop scales one block at a time)."""
    if block_k % MX_BLOCK:
        fail(kernel, f"with MX scales BLOCK_K must be a multiple of {MX_BLOCK}, got {block_k}")


def check_packed_rows(kernel: str, k: int, mx: bool, block_k: int, scale_offset: Any, row_bytes: Any) -> int:
    """Packed fp8 rows (`overlap.ops.tp.operands.Packed`): `k` fp8 bytes, the scales from byte `scale_offset` (a
    float32 at a multiple of 4, or MX's ``k / 32`` e8m0 bytes), `row_bytes` a row (None: the scales' end). Returns
    `row_bytes`."""
    if mx:
        check_mx_tile(kernel, block_k)
    if not isinstance(scale_offset, int) or scale_offset < k or (scale_offset % 4 and not mx):
        fail(kernel, f"scale_offset must be {'' if mx else 'a multiple of 4 '}at least K={k}, got {scale_offset!r}")
    end = scale_offset + (k // MX_BLOCK if mx else 4)
    row_bytes = end if row_bytes is None else row_bytes
    if not isinstance(row_bytes, int) or row_bytes < end:
        fail(kernel, f"row_bytes must be at least scale_offset + {end - scale_offset} = {end}, got {row_bytes!r}")
    return row_bytes


def scale_arg(scale: torch.Tensor | None, mode: int, like: torch.Tensor) -> torch.Tensor:
    """A scale as a kernel takes it: MX scales as their bytes (uint8, a view), float32 ones as they are; `like` (any
    tensor: the argument is not read) where `mode` is 0."""
    if not mode:
        return like
    return scale.view(torch.uint8) if mode == MX_SCALES else scale


def scale_strides(scale: torch.Tensor | None, mode: int) -> tuple[int, int]:
    """The strides of MX block scales ``[K / 32, N]`` (along K, along N); ``(0, 0)`` for any other mode."""
    return (scale.stride(0), scale.stride(1)) if mode == MX_SCALES else (0, 0)


def check_range(kernel: str, name: str, value: int, lo: int, hi: int) -> None:
    """``lo <= value < hi`` for an int."""
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value < hi:
        fail(kernel, f"{name} must be an int in [{lo}, {hi}), got {value!r}")


# ----------------------------------------------------------------------------------------------
# The grouped GEMMs' (`dispatch_grouped_matmul`, `grouped_matmul_combine`)
# ----------------------------------------------------------------------------------------------


def grouped_matmul_grid(num_tiles: int, n: int, block_n: int) -> int:
    """Programs of one launch: every tile table entry times the ``N`` columns in `block_n` tiles."""
    return num_tiles * cdiv(n, block_n)


def check_expert_scales(kernel: str, w: torch.Tensor, w_scale: torch.Tensor) -> int:
    """fp8 expert weights `w` ``[L, K, N]`` (e4m3) and their scales on `w`'s device: float32 ``[L, 1, N]`` (returns 2,
    one per column) or MX block scales, e8m0 ``[L, K / 32, N]`` with any strides, ``K`` a multiple of 32 (returns
    `MX_SCALES`)."""
    if w.dtype != torch.float8_e4m3fn:
        fail(kernel, f"with w_scale, w must be {torch.float8_e4m3fn}, got {w.dtype}")
    num, k, n = w.shape
    mx = isinstance(w_scale, torch.Tensor) and w_scale.dtype == MX_SCALE_DTYPE
    want = (num, k // MX_BLOCK, n) if mx else (num, 1, n)
    if (not isinstance(w_scale, torch.Tensor) or (not mx and w_scale.dtype != torch.float32)
            or tuple(w_scale.shape) != want or w_scale.device != w.device or (mx and k % MX_BLOCK)):
        got = (f"{w_scale.dtype} {list(w_scale.shape)} on {w_scale.device}" if isinstance(w_scale, torch.Tensor)
               else type(w_scale).__name__)
        fail(kernel, f"w_scale must be float32 [{num}, 1, {n}] or e8m0 [{num}, K/{MX_BLOCK}, {n}] (K={k} a multiple of "
                     f"{MX_BLOCK}) on {w.device}; got {got}")
    return MX_SCALES if mx else 2


def check_expert_weights(kernel: str, w: torch.Tensor, k: int, like: torch.Tensor) -> None:
    """The grouped GEMMs' stacked expert weights: ``[L, k, N]`` of `like`'s dtype and device."""
    if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.shape[1] != k or w.dtype != like.dtype \
            or w.device != like.device:
        got = f"{w.dtype} {list(w.shape)} on {w.device}" if isinstance(w, torch.Tensor) else type(w).__name__
        fail(kernel, f"w must be {like.dtype} [L, {k}, N] on {like.device}, got {got}")


def address_tables(kernel: str, device: torch.device, **tables: torch.Tensor) -> int:
    """Check int64 ``[W]`` address tables of one size; returns ``W``."""
    size = table_size(next(iter(tables.values())))
    for name, table in tables.items():
        check_table(kernel, name, table, size, device)
    return size
