"""Compile overlap's Triton kernels ahead of time for sm_90 with no GPU; print a JSON report.

Run in its own process with TRITON_INTERPRET=0 (kernels defined under the interpreter cannot be
compiled). Used by tests/test_kernels_aot.py. Each kernel is compiled at the tiles and launch
options its op uses (`overlap.ops.fused.fused_tiles`; the ops of `matmul_scatter_kernel` and
`reduce_chunks_kernel` launch with Triton's default 4 warps and 3 stages), and the report says
what the PTX shows: the GEMM on ``wgmma`` (bf16/f16, and tf32 for fp32 inputs), the flag
protocol's system-scope release/acquire, the CTA barrier before the chunk count, the
``%globaltimer`` bound of the waits.
"""

import json
import os
import re
import sys
import time

os.environ["TRITON_INTERPRET"] = "0"

from overlap.kernels import ag_matmul, flags, mm_rs, moe  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
DEFAULT_OPTIONS = {"num_warps": 4, "num_stages": 3}  # Triton's defaults: how the ops launch mm_rs


def _compile(fn, signature: dict, constexprs: dict, options: dict) -> tuple[str, int]:
    """PTX text and cubin size. The signature must name every parameter, in order: a kernel that
    gains or loses one fails here instead of compiling something the op never launches."""
    assert list(signature) == list(fn.arg_names), (list(signature), fn.arg_names)
    kernel = compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=TARGET, options=options)
    return kernel.asm["ptx"], len(kernel.asm.get("cubin", b""))


def _scoped(ptx: str, op: str, sems: tuple[str, ...]) -> bool:
    """Whether one memory instruction `op` (``ld``, ``atom``) has system scope and one of `sems`
    (``@%p1 atom.global.sys.acq_rel.add.u32 ...``: the qualifiers of one instruction)."""
    for line in ptx.splitlines():
        words = line.split()
        if words and words[0].startswith("@"):  # a predicate guard
            words = words[1:]
        if not words:
            continue
        parts = words[0].split(".")
        if parts[0] == op and "sys" in parts and any(s in parts for s in sems):
            return True
    return False


def _wgmma_types(ptx: str) -> list[str]:
    """Input types of the wgmma instructions (``wgmma.mma_async...m64nNk16.f32.bf16.bf16`` -> bf16)."""
    found = re.findall(r"wgmma\.mma_async\S*\.f32\.(\w+)\.\w+\s", ptx)
    return sorted(set(found))


def _barrier_at_line(ptx: str, path_suffix: str, line: int) -> bool:
    """Whether a ``bar.sync`` is the first instruction emitted for source line `line` of the file
    ending in `path_suffix` (Triton also puts barriers around scalar atomics, so a bare ``bar.sync``
    proves nothing about ``tl.debug_barrier``)."""
    files = {m.group(2): m.group(1) for m in re.finditer(r'\.file\s+(\d+)\s+"([^"]+)"', ptx)}
    index = next((i for p, i in files.items() if p.endswith(path_suffix)), None)
    if index is None:
        return False
    lines = ptx.splitlines()
    loc = re.compile(rf"^\s*\.loc\s+{index}\s+{line}\s")
    for i, text in enumerate(lines):
        if loc.match(text):
            nxt = next((t.strip() for t in lines[i + 1 :] if t.strip() and not t.strip().startswith("//")), "")
            if nxt.startswith("bar.sync") or nxt.startswith("barrier.sync"):
                return True
    return False


def _source_line(fn, needle: str) -> int:
    """Line number (in its file) of the first source line of `fn` containing `needle`."""
    import inspect

    lines, first = inspect.getsourcelines(fn.fn)
    return first + next(i for i, text in enumerate(lines) if needle in text)


def compile_ag_matmul(dtype: str, block: tuple[int, int, int]) -> dict:
    t0 = time.time()
    bm, bn, bk = block
    signature = {
        "out_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "ptr_table": "*i64", "flag_table": "*i64",
        "epoch": "i32", "rank": "i32", "world_size": "i32", "abort_ptr": "*i32", "err_ptr": "*i32",
        "timeout_ns": "i64", "M": "i32", "N": "i32", "K": "i32", "stride_am": "i32",
        "stride_bk": "i32", "stride_bn": "i32", "stride_om": "i32", "stride_on": "i32",
        "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "GROUP_M": "constexpr",
        "UPCAST": "constexpr", "INTERPRETED": "constexpr",
    }
    constexprs = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "UPCAST": False, "INTERPRETED": False}
    ptx, cubin = _compile(ag_matmul.all_gather_matmul_kernel, signature, constexprs, {"num_warps": 8, "num_stages": 3})
    return {
        "kernel": "all_gather_matmul_kernel", "dtype": dtype, "block": list(block),
        "wgmma": "wgmma" in ptx, "globaltimer": "globaltimer" in ptx,
        "acquire": ".acquire" in ptx, "sys_scope": ".sys" in ptx,
        "cubin_bytes": cubin, "seconds": round(time.time() - t0, 2),
    }


def compile_matmul_scatter(dtype: str, block: tuple[int, int, int]) -> dict:
    t0 = time.time()
    bm, bn, bk = block
    fn = mm_rs.matmul_scatter_kernel
    # Ints are "i32" even where a launch passes 1 (NUM_DEST of the one-shot all-reduce, NCH, rank):
    # the JIT specializes those to constants, which only removes code.
    signature = {
        "a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}",
        "dst_table": "*i64", "counters_ptr": "*i32", "flag_table": "*i64", "FLAG_STRIDE": "i32",
        "epoch": "i32", "rank": "i32",
        "M": "i32", "N": "i32", "K": "i32", "MB": "i32", "NUM_DEST": "i32", "NCH": "i32",
        "stride_am": "i32", "stride_bk": "i32", "stride_bn": "i32", "stride_dm": "i32",
        "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "GROUP_M": "constexpr",
        "UPCAST": "constexpr",
    }
    constexprs = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "UPCAST": False}
    ptx, cubin = _compile(fn, signature, constexprs, DEFAULT_OPTIONS)
    barrier_line = _source_line(flags.count_and_release, "tl.debug_barrier()")
    return {
        "kernel": "matmul_scatter_kernel", "dtype": dtype, "block": list(block),
        "wgmma": "wgmma.mma_async" in ptx, "wgmma_types": _wgmma_types(ptx),
        # the chunk count (acq_rel) and the flag publication (release), both at system scope
        "count_acq_rel_sys": _scoped(ptx, "atom", ("acq_rel",)),
        "flag_release_sys": _scoped(ptx, "atom", ("release",)),
        "bar_sync": "bar.sync" in ptx or "barrier.sync" in ptx,
        "debug_barrier": _barrier_at_line(ptx, "flags.py", barrier_line),
        "cubin_bytes": cubin, "seconds": round(time.time() - t0, 2),
    }


def compile_reduce_chunks(dtype: str, block: tuple[int, int]) -> dict:
    t0 = time.time()
    bm, bn = block
    signature = {
        "out_ptr": f"*{dtype}", "src_table": "*i64", "flag_table": "*i64",
        "epoch": "i32", "abort_ptr": "*i32", "err_ptr": "*i32", "timeout_ns": "i64",
        "M": "i32", "N": "i32", "MB": "i32", "NUM_SRC": "i32", "NCH": "i32",
        "stride_sm": "i32", "stride_om": "i32", "stride_on": "i32",
        "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "INTERPRETED": "constexpr",
    }
    constexprs = {"BLOCK_M": bm, "BLOCK_N": bn, "INTERPRETED": False}
    ptx, cubin = _compile(mm_rs.reduce_chunks_kernel, signature, constexprs, DEFAULT_OPTIONS)
    return {
        "kernel": "reduce_chunks_kernel", "dtype": dtype, "block": list(block),
        # the flag wait: a system-scope acquire (Triton 3.9 lowers atomic_add(p, 0) to ld.acquire)
        "flag_acquire_sys": _scoped(ptx, "ld", ("acquire",)) or _scoped(ptx, "atom", ("acquire", "acq_rel")),
        "globaltimer": "%globaltimer" in ptx,
        "cubin_bytes": cubin, "seconds": round(time.time() - t0, 2),
    }


def compile_moe_wait(dtype: str, block: tuple[int, int, int]) -> dict:
    """The dispatch-direction grouped GEMM (`kernels/moe.py`), launched with Triton's defaults."""
    t0 = time.time()
    bm, bn, bk = block
    signature = {
        "src_table": "*i64", "flag_table": "*i64", "tile_table": "*i32",
        "w_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "rows_ptr": f"*{dtype}",
        "epoch": "i32", "abort_ptr": "*i32", "err_ptr": "*i32", "timeout_ns": "i64",
        "N": "i32", "K": "i32",
        "stride_we": "i32", "stride_wk": "i32", "stride_wn": "i32", "stride_om": "i32", "stride_rm": "i32",
        "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "INTERPRETED": "constexpr",
        "UPCAST": "constexpr",
    }
    constexprs = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "INTERPRETED": False, "UPCAST": False}
    ptx, cubin = _compile(moe.grouped_matmul_wait_kernel, signature, constexprs, DEFAULT_OPTIONS)
    return {
        "kernel": "grouped_matmul_wait_kernel", "dtype": dtype, "block": list(block),
        "wgmma": "wgmma.mma_async" in ptx, "wgmma_types": _wgmma_types(ptx),
        "flag_acquire_sys": _scoped(ptx, "ld", ("acquire",)) or _scoped(ptx, "atom", ("acquire", "acq_rel")),
        "globaltimer": "%globaltimer" in ptx,
        "cubin_bytes": cubin, "seconds": round(time.time() - t0, 2),
    }


def compile_moe_scatter(dtype: str, block: tuple[int, int, int]) -> dict:
    """The combine-direction grouped GEMM (`kernels/moe.py`), launched with Triton's defaults."""
    t0 = time.time()
    bm, bn, bk = block
    fn = moe.grouped_matmul_scatter_kernel
    signature = {
        "y_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "tile_table": "*i32",
        "dst_table": "*i64", "counters_ptr": "*i32", "flag_table": "*i64",
        "epoch": "i32", "rank": "i32", "N": "i32", "K": "i32",
        "stride_ym": "i32", "stride_we": "i32", "stride_wk": "i32", "stride_wn": "i32", "stride_dm": "i32",
        "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "UPCAST": "constexpr",
    }
    constexprs = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "UPCAST": False}
    ptx, cubin = _compile(fn, signature, constexprs, DEFAULT_OPTIONS)
    return {
        "kernel": "grouped_matmul_scatter_kernel", "dtype": dtype, "block": list(block),
        "wgmma": "wgmma.mma_async" in ptx, "wgmma_types": _wgmma_types(ptx),
        "count_acq_rel_sys": _scoped(ptx, "atom", ("acq_rel",)),
        "flag_release_sys": _scoped(ptx, "atom", ("release",)),
        "bar_sync": "bar.sync" in ptx or "barrier.sync" in ptx,
        "debug_barrier": _barrier_at_line(ptx, "flags.py", _source_line(flags.count_and_release,
                                                                          "tl.debug_barrier()")),
        "cubin_bytes": cubin, "seconds": round(time.time() - t0, 2),
    }


if __name__ == "__main__":
    # fused_tiles' defaults: 128x128x64 for 16-bit types, 128x64x32 for fp32 (TF32 on Hopper)
    report = [compile_ag_matmul("bf16", (128, 128, 64)), compile_ag_matmul("fp16", (128, 128, 64)),
              compile_ag_matmul("fp32", (128, 64, 32)),
              compile_matmul_scatter("bf16", (128, 128, 64)), compile_matmul_scatter("fp16", (128, 128, 64)),
              compile_matmul_scatter("fp32", (128, 64, 32)),
              compile_reduce_chunks("bf16", (128, 128)), compile_reduce_chunks("fp32", (128, 64)),
              compile_moe_wait("bf16", (128, 128, 64)), compile_moe_wait("fp32", (128, 64, 32)),
              compile_moe_scatter("bf16", (128, 128, 64)), compile_moe_scatter("fp32", (128, 64, 32))]
    json.dump(report, sys.stdout)
