"""Compile overlap's Triton kernels ahead of time for sm_90 with no GPU; print a JSON report.

Run in its own process (``python -m tests.support.aot_compile`` from the repository's root) with TRITON_INTERPRET=0
(kernels defined under the interpreter cannot be compiled). Used by tests/gpu/cpu/test_kernels_aot.py. Each kernel is
compiled as its launcher launches it: the launcher runs with CPU tensors of realistic shapes under
`launch_specs.recording`, and the variant Triton would compile for that launch on an sm_90 GPU (the same specialization:
which ints are constants, which arguments divisible by 16) is compiled, at the tiles the ops use
(`overlap.kernels.host.fused_tiles`'s defaults, Triton's default warps and stages; the all-gather kernel also at 8
warps). The report says what the PTX shows: the GEMM on ``wgmma`` (bf16/f16, and tf32 for fp32 inputs) fed by 16-byte
loads, the flag protocol's system-scope release/acquire, the CTA barrier before the chunk count, the ``%globaltimer``
bound of the waits, and the branches that could take different warps past different barriers (`ptx_flow`: a wait loop
that warps leave on different iterations). A kernel with the per-thread wait that overlap had before
(`per_thread_wait_kernel`) is compiled too, to show that the analysis finds it. fp8 rows say which scales they take
(``scales``: ``rowwise``, or ``mxfp8``: 1x32 block scales applied in the K loop). Every product of an index and a
``stride_*`` argument is reported with its width, in the PTX and in the TTIR (`stride_products`): the GEMM kernels are
also compiled with a column-major weight (``w.t()``, the usual layout), whose column offsets ``n * stride_bn`` pass
2^31 elements for a weight of 2^31 elements or more.
"""

import dataclasses
import json
import os
import re
import sys
import time

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from overlap.kernels import flags  # noqa: E402
from triton.compiler import ASTSource, compile  # noqa: E402

from overlap.ops.fused import kernels as _kernel_modules  # noqa: E402
from tests.protocol.sequences import plain_global_stores_after, ptx_sequence  # noqa: E402
from tests.support.launch_specs import TARGET, recording  # noqa: E402
from tests.support.ptx_flow import divergent_barriers, parse  # noqa: E402

_k = _kernel_modules()  # the kernel files, one per op
ag, agw, rs = _k.all_gather_matmul, _k.all_gather_weight_matmul, _k.matmul_reduce_scatter
gwait, gscatter = _k.dispatch_grouped_matmul, _k.grouped_matmul_combine
# the sequence-parallel kernels (not in `overlap.ops.fused.kernels`' tuple yet): their files directly
from overlap.kernels import all_to_all_matmul as a2a_mm  # noqa: E402
from overlap.kernels import matmul_all_to_all as mm_a2a  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
W = 8  # ranks of the tables (the kernels are the same for any: W is not specialized on)


def _compile_kernel(fn, signature: dict, constexprs: dict, attrs: dict, options: dict):
    """One variant, compiled (its ``asm``: ``ttir``, ``ptx``, ``cubin``, ...)."""
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return compile(src, target=TARGET, options=options)


def _compile(fn, signature: dict, constexprs: dict, attrs: dict, options: dict) -> tuple[str, int]:
    """PTX text and cubin size of one variant."""
    kernel = _compile_kernel(fn, signature, constexprs, attrs, options)
    return kernel.asm["ptx"], len(kernel.asm.get("cubin", b""))


def _compile_launch(launch_fn) -> tuple[dict, str, int]:
    """Run `launch_fn` (one launcher call) under `recording`; compile the variant it launched (the head of its row:
    the launch, and its `stride_products`)."""
    with recording() as recorders:
        launch_fn()
    launches = [launch for r in recorders.values() for launch in r.launches]
    assert len(launches) == 1, [launch.kernel for launch in launches]
    launch = launches[0]
    kernel = _compile_kernel(launch.jit, launch.signature, launch.constexprs, launch.attrs, launch.options)
    ptx, cubin = kernel.asm["ptx"], len(kernel.asm.get("cubin", b""))
    params = [name for name, kind in launch.signature.items() if kind != "constexpr"]
    return {"kernel": launch.kernel, "key": launch.key, "num_warps": launch.options["num_warps"],
            "stride_products": stride_products(ptx, kernel.asm["ttir"], params)}, ptx, cubin


def _wide(op: str) -> bool:
    """Whether a PTX multiply or shift computes its product in 64 bits (``mul.wide.s32``, ``mad.wide.u32``,
    ``mul.lo.s64``, ``shl.b64``), not 32 (``mul.lo.s32``, ``mad.lo.s32``, ``mul24.lo.s32``, ``shl.b32``)."""
    parts = op.split(".")
    return "wide" in parts or parts[-1] in ("s64", "u64", "b64")


def ptx_stride_products(ptx: str, params: list[str]) -> dict[str, list[str]]:
    """The PTX's multiplies of each ``stride_*`` parameter: its ``ld.param`` register (or a ``mov``/``cvt`` copy of
    it) as a factor of a ``mul``/``mad`` or the shifted operand of a ``shl``, by parameter name, the opcodes in text
    order. `params`: the kernel's parameters as the PTX numbers them (``<kernel>_param_<i>``: the non-constexpr
    ones, in order)."""
    instrs, _ = parse(ptx)
    strides: dict[str, str] = {}  # register -> the stride it holds
    for ins in instrs:
        if ins.op.startswith("ld.param") and ins.dests and ins.srcs:
            m = re.search(r"_param_(\d+)$", ins.srcs[0])
            if m and int(m.group(1)) < len(params) and params[int(m.group(1))].startswith("stride_"):
                strides[ins.dests[0]] = params[int(m.group(1))]
    changed = True
    while changed:  # copies: mov, cvt (a widening cvt.s64.s32 too)
        changed = False
        for ins in instrs:
            if ins.op.split(".")[0] in ("mov", "cvt") and ins.dests and ins.srcs and ins.srcs[0] in strides \
                    and ins.dests[0] not in strides:
                strides[ins.dests[0]] = strides[ins.srcs[0]]
                changed = True
    found: dict[str, list[str]] = {}
    for ins in instrs:
        base = ins.op.split(".")[0]
        if base not in ("mul", "mad", "mul24", "mad24", "shl"):
            continue
        operands = [o.strip() for o in ins.text.partition(" ")[2].split(",")]  # (no vectors or addresses here)
        factors = operands[1:2] if base == "shl" else operands[1:3]  # (mad's third operand is an addend)
        for name in {strides[f] for f in factors if f in strides}:
            found.setdefault(name, []).append(ins.op)
    return found


_TTIR_OP = re.compile(r"^\s*(%[\w$.\-]+)(?::\d+)?\s*=\s*([\w.]+)\s*(.*)$")
#: TTIR operations that only extend, splat, broadcast or reshape a value: their result is the stride still
_TTIR_SAME_VALUE = ("arith.extsi", "arith.extui", "tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape",
                    "ttg.convert_layout", "triton_gpu.convert_layout")


def ttir_stride_products(ttir: str, params: list[str]) -> dict[str, list[str]]:
    """The TTIR's multiplies (``arith.muli``) of each ``stride_*`` argument (or its extension, splat or broadcast), by
    argument name: the integer type of each product (``i32``, ``i64``), in text order. `params`: the kernel
    function's arguments, in order (the non-constexpr parameters)."""
    header = next(line for line in ttir.splitlines() if "tt.func" in line)
    names = re.findall(r"(%[\w$.\-]+): ", header.partition("(")[2])
    strides = {ssa: name for ssa, name in zip(names, params, strict=False) if name.startswith("stride_")}
    found: dict[str, list[str]] = {}
    for line in ttir.splitlines():
        m = _TTIR_OP.match(line)
        if not m:
            continue
        result, op, rest = m.groups()
        rest = rest.rsplit(" loc(", 1)[0]
        args, _, types = rest.partition(" : ")
        used = {strides[a] for a in re.findall(r"%[\w$.\-]+", args) if a in strides}
        if not used:
            continue
        if op in _TTIR_SAME_VALUE and len(used) == 1:
            strides[result] = used.pop()
        elif op == "arith.muli":
            width = re.search(r"(i\d+)>?$", types.strip())  # i32, tensor<1x128xi32>
            for name in used:
                found.setdefault(name, []).append(width.group(1) if width else types.strip())
    return found


def stride_products(ptx: str, ttir: str, params: list[str]) -> dict[str, dict[str, list[str]]]:
    """Every product of a ``stride_*`` argument and an index, split by width: ``{"narrow": {stride: [...]}, "wide":
    {stride: [...]}}`` (PTX opcodes, ``ttir:`` the TTIR ``arith.muli``'s type). A narrow one (32 bits) wraps once the
    offset passes 2^31 elements (`ptx_stride_products`, `ttir_stride_products`)."""
    out: dict[str, dict[str, list[str]]] = {"narrow": {}, "wide": {}}
    for name, ops in ptx_stride_products(ptx, params).items():
        for op in ops:
            out["wide" if _wide(op) else "narrow"].setdefault(name, []).append(op)
    for name, types in ttir_stride_products(ttir, params).items():
        for t in types:
            out["wide" if t == "i64" else "narrow"].setdefault(name, []).append(f"ttir:arith.muli:{t}")
    for side in out.values():
        for name in side:
            side[name] = sorted(set(side[name]))
    return out


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


def _loads(ptx: str) -> dict[str, int]:
    """Global loads by width: 16-byte copies into shared memory (``cp.async ... 0x10``) and vector loads
    (``ld.global.v4``/``.v2``) against 2-byte scalar loads (``ld.global.b16``: a GEMM without alignment)."""
    return {
        "cp_async_16": len(re.findall(r"cp\.async\.\w+\.shared\.global[^;]*,\s*0x10\s*(,|;)", ptx)),
        "vector": len(re.findall(r"\bld\.global(?:\.\w+)*\.v[24]\.", ptx)),
        "scalar_16bit": len(re.findall(r"\bld\.global(?:\.\w+)*\.[bu]16\b", ptx)),
    }


def _barrier_at_line(ptx: str, path_suffix: str, line: int | None) -> bool:
    """Whether a ``bar.sync`` is the first instruction emitted for source line `line` of the file
    ending in `path_suffix` (Triton also puts barriers around scalar atomics, so a bare ``bar.sync``
    proves nothing about ``tl.debug_barrier``)."""
    if line is None:
        return False
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


def _source_line(fn, needle: str) -> int | None:
    """Line number (in its file) of the first source line of `fn` containing `needle` (None: no such line)."""
    import inspect

    lines, first = inspect.getsourcelines(fn.fn)
    return next((first + i for i, text in enumerate(lines) if needle in text), None)


def _common(head: dict, dtype: str, block: tuple, ptx: str, cubin: int, t0: float) -> dict:
    """What every row reports: the launch, the waits' loops (`ptx_flow`), the loads, the flag protocol."""
    instrs, _ = parse(ptx)
    return {
        **head, "dtype": dtype, "block": list(block),
        "divergent": [vars(d) for d in divergent_barriers(ptx)],
        "bar_red": sum(i.op.startswith("bar.red") for i in instrs),
        "globaltimer": "%globaltimer" in ptx,
        "loads": _loads(ptx),
        "wgmma": "wgmma.mma_async" in ptx, "wgmma_types": _wgmma_types(ptx),
        # the flag wait: a system-scope acquire (Triton 3.9 lowers atomic_add(p, 0) to ld.acquire)
        "flag_acquire_sys": _scoped(ptx, "ld", ("acquire",)) or _scoped(ptx, "atom", ("acquire", "acq_rel")),
        # the chunk count (acq_rel) and the flag publication (release), both at system scope
        "count_acq_rel_sys": _scoped(ptx, "atom", ("acq_rel",)),
        "flag_release_sys": _scoped(ptx, "atom", ("release",)),
        "bar_sync": "bar.sync" in ptx or "barrier.sync" in ptx,
        # system-scope read-modify-writes other than the flag protocol's (the count's add, the flag's release
        # exchange): an atomic max or a relaxed exchange at system scope is on a host word (the error word, a mark)
        "other_atomics": sorted({i.op for i in instrs if i.op.startswith("atom") and ".sys" in i.op and
                                 ".add" not in i.op and not (".exch" in i.op and ".release" in i.op)}),
        "debug_barrier": _barrier_at_line(ptx, "flags.py", _source_line(flags.count_and_release, "tl.debug_barrier()")),
        "cubin_bytes": cubin, "seconds": round(time.time() - t0, 2),
        # the ordering operations in text order (tests/protocol/test_sequences.py compares them with the protocol)
        "sync": [dataclasses.asdict(step) for step in ptx_sequence(ptx)],
        "plain_stores_after_release": plain_stores_after_release(ptx),
    }


def plain_stores_after_release(ptx: str) -> list[str]:
    """The plain global stores after the kernel's last release (a data store the flag would not cover)."""
    released = [step.line for step in ptx_sequence(ptx) if step.sem == "release"]
    return plain_global_stores_after(ptx, max(released)) if released else []


def _words(n: int = 1, value: int = 0) -> torch.Tensor:
    return torch.full((n,), value, dtype=torch.int32)


def _table() -> torch.Tensor:
    return torch.zeros(W, dtype=torch.int64)


def _weight(k: int, n: int, dtype: str, weight: str, experts: int = 0) -> torch.Tensor:
    """A ``[k, n]`` weight (``[experts, k, n]`` where `experts`): row-major, or column-major (a ``[n, k]`` weight's
    transpose, as ``nn.Linear``'s is passed)."""
    lead = (experts,) if experts else ()
    if weight == "row-major":
        return torch.empty(*lead, k, n, dtype=DTYPES[dtype])
    assert weight == "column-major", weight
    return torch.empty(*lead, n, k, dtype=DTYPES[dtype]).transpose(-1, -2)


def _mx_weight_scale(k: int, n: int) -> torch.Tensor:
    """MX block scales of a ``[k, n]`` weight as the ops hold them (`overlap.ops.fp8.quantize_weight`: the scales of
    ``w [n, k]``, transposed): ``[k / 32, n]``, column-major."""
    return torch.empty(n, k // 32, dtype=torch.float8_e8m0fnu).t()


def _scales_of(dtype: str, scales: str) -> dict:
    """What a row reports of its fp8 scales (``rowwise``, or ``mxfp8``: 1x32 blocks along K, scaled in the K loop)."""
    return {"scales": scales} if dtype == "fp8" else {}


def compile_all_gather_matmul(dtype: str, block: tuple[int, int, int], num_warps: int = 4,
                              weight: str = "row-major", scales: str = "rowwise") -> dict:
    """The all-gather GEMM as the op launches it: a shard of 1024 x 4096 rows per rank, b [4096, 2048]."""
    t0 = time.time()
    b = _weight(4096, 2048, dtype, weight)
    # fp8: rows packed with their scales (`overlap.ops.tp.operands.Packed`), the weight's scale per column; MX: each
    # row's 4096 bytes then its 128 e8m0 block scales (16-byte rows), the weight's [128, 2048]
    fp8 = {}
    if dtype == "fp8":
        fp8 = (dict(b_scale=_mx_weight_scale(4096, 2048), scale_offset=4096, row_bytes=4096 + 128)
               if scales == "mxfp8" else dict(b_scale=torch.ones(1, 2048), scale_offset=4096, row_bytes=4112))
    head, ptx, cubin = _compile_launch(lambda: ag.launch_all_gather_matmul(
        b, _table(), _table(), rows=1024, epoch=_words(1, 3), rank=1, err=_words(), timeout_ns=30 * 10**9,
        block=block, num_warps=num_warps, **fp8))
    return _common({**head, "weight": weight, **_scales_of(dtype, scales)}, dtype, block, ptx, cubin, t0)


def compile_all_gather_weight_matmul(dtype: str, block: tuple[int, int, int], scales: str = "rowwise") -> dict:
    """The weight-side all-gather GEMM as the op launches it: a [2048, 4096] per rank, shards [1024, 4096]; fp8: the
    shards' rows packed with their scales (`Packed`: 4096 bytes, then one float32, 16-byte rows; MX: then 128 e8m0
    block scales), a's scales one per row (tensorwise: one), or MX [2048, 128]."""
    t0 = time.time()
    a = torch.empty(2048, 4096, dtype=DTYPES[dtype])
    fp8 = {}
    if dtype == "fp8":
        a_scale = {"rowwise": torch.ones(2048, 1), "tensorwise": torch.ones(()),
                   "mxfp8": torch.empty(2048, 128, dtype=torch.float8_e8m0fnu)}[scales]
        fp8 = dict(a_scale=a_scale, scale_offset=4096, row_bytes=4096 + 128 if scales == "mxfp8" else 4112)
    head, ptx, cubin = _compile_launch(lambda: agw.launch_all_gather_weight_matmul(
        a, _table(), _table(), n=1024, epoch=_words(1, 3), rank=1, err=_words(), timeout_ns=30 * 10**9,
        block=block, **fp8))
    return _common({**head, **_scales_of(dtype, scales)}, dtype, block, ptx, cubin, t0)


def compile_matmul_scatter(dtype: str, block: tuple[int, int, int], weight: str = "row-major",
                           scales: str = "rowwise") -> dict:
    """The reduce-scatter's producer: a [W * 512, 1024] @ [1024, 2048], 2 chunks per destination."""
    t0 = time.time()
    a, b = torch.empty(W * 512, 1024, dtype=DTYPES[dtype]), _weight(1024, 2048, dtype, weight)
    fp8 = {}
    if dtype == "fp8":  # MX: a's [M, 32] block scales (contiguous), b's [32, 2048]
        fp8 = (dict(a_scale=torch.empty(W * 512, 1024 // 32, dtype=torch.float8_e8m0fnu),
                    b_scale=_mx_weight_scale(1024, 2048))
               if scales == "mxfp8" else dict(a_scale=torch.ones(W * 512, 1), b_scale=torch.ones(1, 2048)))
    head, ptx, cubin = _compile_launch(lambda: rs.launch_matmul_scatter(
        a, b, _table(), _words(256), _table(), block_rows=512, num_chunks=2, flag_stride=16, epoch=_words(1, 3),
        rank=1, block=block, **fp8))
    return _common({**head, "weight": weight, **_scales_of(dtype, scales)}, dtype, block, ptx, cubin, t0)


def compile_reduce_chunks(dtype: str, block: tuple[int, int]) -> dict:
    """The reduction of W partials of [512, 2048], 2 chunks."""
    t0 = time.time()
    out = torch.empty(512, 2048, dtype=DTYPES[dtype])
    head, ptx, cubin = _compile_launch(lambda: rs.launch_reduce_chunks(
        out, _table(), _table(), block_rows=512, num_chunks=2, epoch=_words(1, 3), err=_words(),
        timeout_ns=30 * 10**9, block=block))
    return _common(head, dtype, block, ptx, cubin, t0)


def compile_moe_wait(dtype: str, block: tuple[int, int, int], weight: str = "row-major",
                     scales: str = "rowwise") -> dict:
    """The dispatch-direction grouped GEMM: 1024 received rows of 2048 times 4 local experts' [2048, 1024]; fp8: the
    MoE dispatch's packed fp8 tokens (`overlap.ops.fp8_rows.Packed` on a GPU: 16-byte rows) and the experts' scales,
    per column or MX (`overlap.ops.moe.fp8.Fp8Experts`), into bf16."""
    t0 = time.time()
    d = DTYPES[dtype]
    w = _weight(2048, 1024, dtype, weight, experts=4)
    out = torch.empty(1024, 1024, dtype=torch.bfloat16 if dtype == "fp8" else d)
    rows, fp8 = torch.empty(1024, 2048, dtype=d), {}
    if dtype == "fp8":
        mx = scales == "mxfp8"
        w_scale = (torch.empty(4, 1024, 2048 // 32, dtype=torch.float8_e8m0fnu).transpose(1, 2) if mx
                   else torch.empty(4, 1, 1024))
        rows, fp8 = None, dict(w_scale=w_scale, scale_offset=2048, row_bytes=2048 + (64 if mx else 16))
    tiles = torch.zeros(8, 6, dtype=torch.int32)
    head, ptx, cubin = _compile_launch(lambda: gwait.launch_grouped_matmul_wait(
        _table(), _table(), tiles, w, out, rows, epoch=_words(1, 3), err=_words(), timeout_ns=30 * 10**9, block=block,
        **fp8))
    return _common({**head, "weight": weight, **_scales_of(dtype, scales)}, dtype, block, ptx, cubin, t0)


def compile_moe_scatter(dtype: str, block: tuple[int, int, int], weight: str = "row-major") -> dict:
    """The combine-direction grouped GEMM: 1024 rows of 1024 times 4 local experts' [1024, 2048]."""
    t0 = time.time()
    d = DTYPES[dtype]
    y, w = torch.empty(1024, 1024, dtype=d), _weight(1024, 2048, dtype, weight, experts=4)
    tiles = torch.zeros(8, 7, dtype=torch.int32)
    head, ptx, cubin = _compile_launch(lambda: gscatter.launch_grouped_matmul_scatter(
        y, w, tiles, _table(), _words(256), _table(), epoch=_words(1, 3), rank=1, block=block))
    return _common({**head, "weight": weight}, dtype, block, ptx, cubin, t0)


def compile_matmul_all_to_all(dtype: str, block: tuple[int, int, int], weight: str = "row-major") -> dict:
    """The sequence-parallel producer (QKV projection, then the all-to-all to heads): a [1024, 4096] @ [4096, W * 512]
    (every destination 512 columns), 2 chunks per destination."""
    t0 = time.time()
    a, b = torch.empty(1024, 4096, dtype=DTYPES[dtype]), _weight(4096, W * 512, dtype, weight)
    head, ptx, cubin = _compile_launch(lambda: mm_a2a.launch_matmul_all_to_all(
        a, b, _table(), _words(256), _table(), num_chunks=2, flag_stride=32, epoch=_words(1, 3), rank=1, block=block))
    return _common({**head, "weight": weight}, dtype, block, ptx, cubin, t0)


def compile_gather_blocks(dtype: str, block: tuple[int, int]) -> dict:
    """The sequence-parallel receiver's copy: W regions of [1024, 512] into [W, 1024, 512], 2 chunks."""
    t0 = time.time()
    out = torch.empty(W, 1024, 512, dtype=DTYPES[dtype])
    head, ptx, cubin = _compile_launch(lambda: mm_a2a.launch_gather_blocks(
        out, _table(), _table(), num_chunks=2, epoch=_words(1, 3), err=_words(), timeout_ns=30 * 10**9, block=block))
    return _common(head, dtype, block, ptx, cubin, t0)


def compile_all_to_all_matmul(dtype: str, block: tuple[int, int, int], weight: str = "row-major") -> dict:
    """The sequence-parallel consumer GEMM (the all-to-all back, then the output projection): W regions of [1024, 512]
    times b [W * 512, 4096], 2 chunks."""
    t0 = time.time()
    out, b = torch.empty(1024, 4096, dtype=DTYPES[dtype]), _weight(W * 512, 4096, dtype, weight)
    head, ptx, cubin = _compile_launch(lambda: a2a_mm.launch_all_to_all_matmul(
        out, _table(), _table(), b, num_chunks=2, epoch=_words(1, 3), err=_words(), timeout_ns=30 * 10**9,
        block=block))
    return _common({**head, "weight": weight}, dtype, block, ptx, cubin, t0)


@triton.jit
def per_thread_wait_kernel(flag_ptr, err_ptr, out_ptr, epoch, timeout_ns, BLOCK: tl.constexpr):
    """overlap's wait before issue 17 (each thread's clock and its own load of the error word decide when it
    leaves; the flag's acquire is broadcast through shared memory with barriers), then a use of shared memory.
    Compiled only to show that `ptx_flow` finds the divergent exit: never launched."""
    ready = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    start = tl.extra.cuda.globaltimer()
    now = start
    failed = ready * 0
    while ((ready - epoch) < 0) & (now - start < timeout_ns) & (failed == 0):
        ready = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        now = tl.extra.cuda.globaltimer()
        if now - start > 1_000_000:
            failed = tl.load(err_ptr, volatile=True)
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(out_ptr + offs) + ready)


@triton.jit
def narrow_offsets_kernel(b_ptr, out_ptr, K, stride_bk, stride_bn, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Weight offsets as overlap's GEMMs computed them before 64-bit offsets (``k * stride_bk``, ``n * stride_bn`` and
    the K step ``BLOCK_K * stride_bk`` in int32, wrapping at 2^31 elements). Compiled only to show that
    `stride_products` finds the 32-bit products: never launched."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for _ in range(0, tl.cdiv(K, BLOCK_K)):
        acc += tl.sum(tl.load(b_ptrs), axis=0)
        b_ptrs += BLOCK_K * stride_bk
    tl.store(out_ptr + offs_n, acc)


def compile_narrow_offsets() -> dict:
    t0 = time.time()
    signature = {"b_ptr": "*fp32", "out_ptr": "*fp32", "K": "i32", "stride_bk": "i32", "stride_bn": "i32",
                 "BLOCK_K": "constexpr", "BLOCK_N": "constexpr"}
    kernel = _compile_kernel(narrow_offsets_kernel, signature, {"BLOCK_K": 32, "BLOCK_N": 64}, {}, {"num_warps": 4})
    ptx, cubin = kernel.asm["ptx"], len(kernel.asm.get("cubin", b""))
    params = [name for name, kind in signature.items() if kind != "constexpr"]
    head = {"kernel": "narrow_offsets_kernel", "key": "", "num_warps": 4,
            "stride_products": stride_products(ptx, kernel.asm["ttir"], params)}
    return _common(head, "fp32", (32, 64), ptx, cubin, t0)


def compile_occupy() -> dict:
    """The GPU tests' SM-occupying kernel (tests/gpu/test_host_waits.py): it writes and polls pinned host words."""
    from tests.gpu import test_host_waits

    t0 = time.time()
    signature = {"release_ptr": "*i32", "started_ptr": "*i32", "timeout_ns": "i64"}
    ptx, cubin = _compile(test_host_waits._occupy, signature, {}, {}, {"num_warps": 1})
    return _common({"kernel": "_occupy", "key": "", "num_warps": 1}, "i32", (), ptx, cubin, t0)


def compile_per_thread_wait() -> dict:
    t0 = time.time()
    signature = {"flag_ptr": "*i32", "err_ptr": "*i32", "out_ptr": "*i32", "epoch": "i32", "timeout_ns": "i64",
                 "BLOCK": "constexpr"}
    ptx, cubin = _compile(per_thread_wait_kernel, signature, {"BLOCK": 256}, {}, {"num_warps": 4})
    return _common({"kernel": "per_thread_wait_kernel", "key": "", "num_warps": 4}, "i32", (256,), ptx, cubin, t0)


if __name__ == "__main__":
    # fused_tiles' defaults: 128x128x64 for 16-bit types, 128x64x32 for fp32 (TF32 on Hopper)
    report = [compile_all_gather_matmul("bf16", (128, 128, 64)),
              compile_all_gather_matmul("bf16", (128, 128, 64), num_warps=8),
              compile_all_gather_matmul("fp16", (128, 128, 64)), compile_all_gather_matmul("fp32", (128, 64, 32)),
              compile_all_gather_matmul("fp8", (128, 128, 64)),
              # MX (1x32 block scales, every block's fp8 dot scaled in the K loop), the ops' column-major weight
              compile_all_gather_matmul("fp8", (128, 128, 64), weight="column-major", scales="mxfp8"),
              compile_matmul_scatter("fp8", (128, 128, 64), weight="column-major", scales="mxfp8"),
              compile_all_gather_weight_matmul("bf16", (128, 128, 64)),
              compile_all_gather_weight_matmul("fp32", (128, 64, 32)),
              *(compile_all_gather_weight_matmul("fp8", (128, 128, 64), scales=s)
                for s in ("rowwise", "tensorwise", "mxfp8")),
              compile_matmul_scatter("bf16", (128, 128, 64)), compile_matmul_scatter("fp16", (128, 128, 64)),
              compile_matmul_scatter("fp32", (128, 64, 32)), compile_matmul_scatter("fp8", (128, 128, 64)),
              compile_reduce_chunks("bf16", (128, 128)), compile_reduce_chunks("fp32", (128, 64)),
              compile_moe_wait("bf16", (128, 128, 64)), compile_moe_wait("fp32", (128, 64, 32)),
              # the MoE dispatch's fp8 tokens: rowwise scales in the epilogue, MX in the K loop
              compile_moe_wait("fp8", (128, 128, 64)),
              compile_moe_wait("fp8", (128, 128, 64), weight="column-major", scales="mxfp8"),
              compile_moe_scatter("bf16", (128, 128, 64)), compile_moe_scatter("fp32", (128, 64, 32)),
              # a column-major weight (w.t()): its column offsets n * stride_bn reach 2^31 elements with the weight
              *(f("bf16", (128, 128, 64), weight="column-major") for f in (
                  compile_all_gather_matmul, compile_matmul_scatter, compile_moe_wait, compile_moe_scatter)),
              # the sequence-parallel kernels (bf16 and fp32 tiles; the ops' column-major weight)
              compile_matmul_all_to_all("bf16", (128, 128, 64)), compile_matmul_all_to_all("fp32", (128, 64, 32)),
              compile_matmul_all_to_all("bf16", (128, 128, 64), weight="column-major"),
              compile_gather_blocks("bf16", (128, 128)), compile_gather_blocks("fp32", (128, 64)),
              compile_all_to_all_matmul("bf16", (128, 128, 64)), compile_all_to_all_matmul("fp32", (128, 64, 32)),
              compile_all_to_all_matmul("bf16", (128, 128, 64), weight="column-major"),
              compile_per_thread_wait(), compile_narrow_offsets(), compile_occupy()]
    json.dump(report, sys.stdout)
