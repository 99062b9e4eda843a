"""Fused all-gather + GEMM: every tile waits only for the rank chunk it reads.

Shapes (legend): ``M`` rows of one rank's shard, ``W`` ranks, ``K`` inner dim, ``N`` columns.
Each rank's shard ``a_MK`` lives in that rank's symmetric buffer; ``ptr_table[r]`` is the address
of rank r's shard in this process, ``flag_table[r]`` the address of rank r's ready flag. The
output ``out_[W*M]N`` holds rank r's rows at ``r*M ... (r+1)*M``.

Program ids are laid out chunk-major starting from this rank's own chunk, then ``rank + 1``,
``rank + 2``, ...: the first tiles need no peer at all, and peers are visited in the order
their data is most likely to have arrived (everyone publishes at about the same time, and
starting at ``rank + 1`` spreads the readers over the producers).

Waiting: a tile acquires the producer's flag (``flag >= epoch``) before it loads the chunk, so
its loads see the producer's data (release/acquire pairing with the producer's flag store).
The spin is bounded: on GPUs by ``%globaltimer`` against ``timeout_ns``, when interpreted by an
abort word that a host watchdog sets at the deadline. A tile that gives up records ``src + 1``
in ``err_ptr`` (atomic max) and the host raises `OverlapTimeout` naming that peer.
"""

import triton
import triton.language as tl

from .flags import matmul_tile, wait_flag


@triton.jit
def all_gather_matmul_kernel(
    # output and the local weight shard
    out_ptr, b_ptr,
    # symmetric memory: per-rank shard addresses and ready-flag addresses (int64 tables)
    ptr_table, flag_table,
    # protocol
    epoch, rank, world_size, abort_ptr, err_ptr, timeout_ns,
    # sizes: M rows per rank, N, K
    M, N, K,
    # strides (the shards are row-major [M, K] in their buffers)
    stride_am,
    stride_bk, stride_bn,
    stride_om, stride_on,
    # meta
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, INTERPRETED: tl.constexpr,
):
    # ---- which tile: chunk-major, own chunk first --------------------------------------------
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_per_chunk = tiles_m * tiles_n
    step = pid // tiles_per_chunk
    src = (rank + step) % world_size
    # Within a chunk, groups of GROUP_M row tiles sweep the columns together so the B tiles they
    # share stay in L2.
    tile = pid % tiles_per_chunk
    group_size = GROUP_M * tiles_n
    first_m = (tile // group_size) * GROUP_M
    rows_in_group = min(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (tile % group_size) % rows_in_group
    tile_n = (tile % group_size) // rows_in_group

    # ---- wait for the chunk this tile reads ---------------------------------------------------
    flag_ptr = tl.load(flag_table + src).to(tl.pointer_type(tl.int32))
    wait_flag(flag_ptr, epoch, abort_ptr, err_ptr, src, timeout_ns, INTERPRETED)

    # ---- GEMM tile, loading A straight from the producer's buffer -----------------------------
    # Buffers are 16-byte aligned (symm.py asserts it); saying so lets the compiler use wide,
    # pipelined loads for a pointer that comes out of a table.
    a_ptr = tl.multiple_of(tl.load(ptr_table + src).to(tl.pointer_type(b_ptr.dtype.element_ty)), 16)
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # 64-bit row offsets: W*M*N and M*K can pass 2^31 elements at long sequences.
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = matmul_tile(a_ptrs, b_ptrs, offs_m < M, offs_k, offs_n, N, K, stride_bk, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)

    # ---- store into this source rank's rows of the output ------------------------------------
    rows = src.to(tl.int64) * M + offs_m
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
