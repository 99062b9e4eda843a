"""Compile overlap's Triton kernels ahead of time for sm_90 with no GPU; print a JSON report.

Run in its own process with TRITON_INTERPRET=0 (kernels defined under the interpreter cannot be
compiled). Used by tests/test_kernels_aot.py.
"""

import json
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "0"

from overlap.kernels import ag_matmul  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


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
    src = ASTSource(fn=ag_matmul.all_gather_matmul_kernel, signature=signature, constexprs=constexprs)
    kernel = compile(src, target=TARGET, options={"num_warps": 8, "num_stages": 3})
    ptx = kernel.asm["ptx"]
    return {
        "kernel": "all_gather_matmul_kernel", "dtype": dtype, "block": list(block),
        "wgmma": "wgmma" in ptx, "globaltimer": "globaltimer" in ptx,
        "acquire": ".acquire" in ptx, "sys_scope": ".sys" in ptx,
        "cubin_bytes": len(kernel.asm.get("cubin", b"")), "seconds": round(time.time() - t0, 2),
    }


if __name__ == "__main__":
    report = [compile_ag_matmul("bf16", (128, 128, 64)), compile_ag_matmul("fp16", (128, 128, 64)),
              compile_ag_matmul("fp32", (128, 64, 32))]
    json.dump(report, sys.stdout)
