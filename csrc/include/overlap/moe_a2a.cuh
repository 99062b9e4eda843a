// Device code of the MoE all-to-all within a node (expert parallelism over peer-mapped buffers).
// Raw pointers only; no torch headers. Launchers: csrc/cuda/moe_a2a.cu.
//
// Layout (overlap/ops/_moe.py): every rank's heap slot holds W regions; region s of rank d's
// buffer holds what source s sends to d, in s's *send order* (pairs sorted by destination rank,
// then local expert, then token). A source's send positions split into W*G contiguous *blocks*,
// block i = (destination d = i / G, expert group g = i % G), whose rows a consumer may read once
// the block's ready flag carries the call's epoch.
//
// Dispatch (source side): copy each send position's row into the destination's region, then
// release the block's flag. Combine (source side, after the flags of every block this rank
// expects were waited for by stream-ordered bounded waits): out[t] = sum_k w[t,k] * row(t, k).
//
// Memory ordering of a block's flag (the one subtle part):
//   1. every thread of a CTA stores its part of the rows (plain weak stores, possibly to a peer
//      GPU's memory over NVLink), then runs fence.sc.sys (__threadfence_system): its stores are
//      ordered before anything it does afterwards, for observers anywhere in the system;
//   2. bar.sync (__syncthreads) orders every thread's fence before thread 0's next step;
//   3. thread 0 adds 1 to the block's counter with atom.acq_rel.sys: the release half publishes
//      the CTA's rows to whoever acquires the counter later; the acquire half (for the CTA that
//      finishes last) makes every earlier CTA's rows of the block happen-before what follows;
//   4. the last CTA of the block (the one that brings the counter to the block's CTA count)
//      resets the counter (a plain store; the next kernel on the stream sees it) and stores the
//      epoch into the flag with st.release.sys. A consumer that loads the flag with
//      ld.acquire.sys (cuda::wait_flag_geq_bounded, or a Triton atomic with sem="acquire",
//      scope="sys") and sees the epoch therefore sees every row of the block.
// Every synchronizing operation is system-scoped: the flag's reader is another GPU, and a
// .gpu-scoped release would not order against it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "overlap/cuda_signal.cuh"

namespace overlap {
namespace cuda {

// Bytes moved by one vectorized load/store (int4): rows must be a multiple of it.
constexpr int64_t kRowAlignBytes = 16;

// Dtype codes of the combine kernel (overlap/ops/_moe_cuda.py maps torch dtypes to them).
constexpr int kDtypeFloat32 = 0;
constexpr int kDtypeBFloat16 = 1;
constexpr int kDtypeFloat16 = 2;

// Returns the old value. acq_rel at system scope: see the ordering notes at the top.
__device__ __forceinline__ int32_t atomic_add_acq_rel_sys(int32_t* addr, int32_t value) {
  int32_t old;
  asm volatile("atom.acq_rel.sys.global.add.s32 %0, [%1], %2;"
               : "=r"(old)
               : "l"(addr), "r"(value)
               : "memory");
  return old;
}

// The last index i in [0, n) with offsets[i] <= value, for a non-decreasing `offsets` whose
// first entry is <= value (an upper bound minus one). Where several entries are equal (empty
// blocks or destinations) it picks the last of them, the one whose range holds `value`.
__device__ __forceinline__ int last_at_or_below(const int64_t* offsets, int n, int64_t value) {
  int lo = 0, hi = n;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (offsets[mid] <= value) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// ---- dispatch -------------------------------------------------------------------------------

// One CTA per chunk of at most rows_per_chunk rows of one block (a chunk never crosses a block,
// so each CTA counts towards exactly one flag).
//   src:           source rows, row r at src + r * row_bytes (16-byte aligned, row_bytes % 16 == 0)
//   row_index:     [P] source row of each send position
//   dst_table:     [W] address of this rank's region in destination d's buffer
//   block_offsets: [W*G + 1] first send position of each block (block_offsets[d*G] is d's first)
//   chunk_offsets: [W*G + 1] first chunk (CTA) of each block
//   counters:      [W*G] int32 workspace, zero on entry, left at zero
//   flag_addrs:    [W*G] address of this rank's ready flag of each block
__global__ void moe_dispatch_rows_kernel(const char* __restrict__ src, const int64_t* __restrict__ row_index,
                                         int64_t row_bytes, const int64_t* __restrict__ dst_table,
                                         const int64_t* __restrict__ block_offsets,
                                         const int64_t* __restrict__ chunk_offsets, int num_blocks,
                                         int groups_per_dest, int64_t rows_per_chunk, int32_t* counters,
                                         const int64_t* __restrict__ flag_addrs, int32_t epoch) {
  // ---- find this CTA's block and rows ----
  __shared__ int s_block;
  const int64_t chunk = blockIdx.x;
  if (threadIdx.x == 0) s_block = last_at_or_below(chunk_offsets, num_blocks, chunk);
  __syncthreads();
  const int block = s_block;
  const int dest = block / groups_per_dest;
  const int64_t begin = block_offsets[block] + (chunk - chunk_offsets[block]) * rows_per_chunk;
  const int64_t block_end = block_offsets[block + 1];
  const int64_t end = begin + rows_per_chunk < block_end ? begin + rows_per_chunk : block_end;
  // Send position p lands at row p - (first send position of dest) of the region.
  char* region = reinterpret_cast<char*>(dst_table[dest]);
  const int64_t region_first = block_offsets[dest * groups_per_dest];

  // ---- copy: 16-byte vectors, consecutive threads on consecutive vectors of a row ----
  // (rows_per_chunk * row_bytes / 16 < 2^31 is checked by the launcher: 32-bit index math)
  const uint32_t vecs_per_row = static_cast<uint32_t>(row_bytes / kRowAlignBytes);
  const uint32_t total = static_cast<uint32_t>(end - begin) * vecs_per_row;
  for (uint32_t i = threadIdx.x; i < total; i += blockDim.x) {
    const uint32_t r = i / vecs_per_row;
    const uint32_t v = i - r * vecs_per_row;
    const int64_t pos = begin + r;
    const int4* from = reinterpret_cast<const int4*>(src + row_index[pos] * row_bytes) + v;
    int4* to = reinterpret_cast<int4*>(region + (pos - region_first) * row_bytes) + v;
    *to = __ldg(from);  // the source rows are not written while the kernel runs
  }

  // ---- publish: the block's last CTA releases its flag (ordering: top of this file) ----
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int32_t ctas = static_cast<int32_t>(chunk_offsets[block + 1] - chunk_offsets[block]);
    if (atomic_add_acq_rel_sys(&counters[block], 1) == ctas - 1) {
      counters[block] = 0;  // every CTA of the block has counted: nobody else touches it in this launch
      flag_store_release(reinterpret_cast<int32_t*>(flag_addrs[block]), epoch);
    }
  }
}

// ---- combine --------------------------------------------------------------------------------

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

__device__ __forceinline__ void from_float(float x, float* out) { *out = x; }
__device__ __forceinline__ void from_float(float x, __nv_bfloat16* out) { *out = __float2bfloat16_rn(x); }
__device__ __forceinline__ void from_float(float x, __half* out) { *out = __float2half_rn(x); }

// Elements per thread per CTA tile (strided by blockDim.x, so loads stay coalesced).
constexpr int kCombineElemsPerThread = 4;

// out[t, c] = sum_k w[t, k] * row(t, k)[c], in fp32 with k in order, each product rounded
// before it is added (__fmul_rn/__fadd_rn: no fused multiply-add), cast once: the same
// operations as overlap.ops._moe.weighted_sum (to fp32, multiply, sum over k, cast).
// One CTA per (token, tile of columns); grid.x = T * tiles, t = blockIdx.x / tiles.
//   back_table:   [W] address of region d of this rank's buffer (where rank d wrote its results)
//   send_offsets: [W + 1] first send position of each destination rank
//   pos:          [T*K] send position of pair t*K + k (the row sits in region d at pos - send_offsets[d])
//   weights:      [T, K] fp32
//   out:          [T, H] contiguous; rows in the regions are H elements, contiguous
// Dynamic shared memory: K row addresses and K weights.
template <class T>
__global__ void moe_combine_rows_kernel(const int64_t* __restrict__ back_table,
                                        const int64_t* __restrict__ send_offsets, int world_size,
                                        const int64_t* __restrict__ pos, const float* __restrict__ weights,
                                        T* __restrict__ out, int64_t top_k, int64_t hidden, int64_t tiles) {
  extern __shared__ int64_t s_rows[];  // [K] row addresses, then [K] fp32 weights
  float* s_weights = reinterpret_cast<float*>(s_rows + top_k);
  const int64_t t = blockIdx.x / tiles;
  const int64_t tile = blockIdx.x - t * tiles;

  // ---- the K rows of token t: region d, row pos - send_offsets[d] ----
  for (int64_t k = threadIdx.x; k < top_k; k += blockDim.x) {
    const int64_t p = pos[t * top_k + k];
    const int d = last_at_or_below(send_offsets, world_size, p);
    s_rows[k] = back_table[d] + (p - send_offsets[d]) * hidden * static_cast<int64_t>(sizeof(T));
    s_weights[k] = weights[t * top_k + k];
  }
  __syncthreads();

  // ---- weighted sum over k, in order ----
  const int64_t first = tile * blockDim.x * kCombineElemsPerThread + threadIdx.x;
#pragma unroll
  for (int j = 0; j < kCombineElemsPerThread; ++j) {
    const int64_t c = first + static_cast<int64_t>(j) * blockDim.x;
    if (c >= hidden) break;
    float acc = 0.0f;
    for (int64_t k = 0; k < top_k; ++k) {
      const T* row = reinterpret_cast<const T*>(s_rows[k]);
      acc = __fadd_rn(acc, __fmul_rn(s_weights[k], to_float(row[c])));
    }
    from_float(acc, out + t * hidden + c);
  }
}

}  // namespace cuda
}  // namespace overlap
