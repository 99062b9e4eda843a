// CUDA launchers of the MoE all-to-all within a node: dispatch (rows into the destinations'
// regions, a flag released per (destination, expert group) block) and combine (the K rows of
// each token gathered from this rank's regions and summed with their routing weights).
//
// Every launcher checks its arguments first (std::invalid_argument -> ValueError, with the
// values), then that a device is usable (std::runtime_error -> RuntimeError), then launches on
// `stream`. Device code and memory ordering: overlap/moe_a2a.cuh.
#include <cuda_runtime.h>

#include <limits>
#include <stdexcept>
#include <string>

#include "../launchers.h"
#include "overlap/moe_a2a.cuh"

namespace overlap {
namespace {

constexpr int kDispatchThreads = 256;
constexpr int kCombineThreads = 256;
constexpr int64_t kMaxWorld = 128;      // overlap.symm.MAX_PEERS
constexpr int64_t kMaxBlocks = 1 << 16;  // (destination, expert group) blocks of one call
constexpr int64_t kMaxTopK = 1024;      // combine: K addresses and weights in shared memory
constexpr int64_t kMaxGrid = std::numeric_limits<int32_t>::max();

// Throws unless this process can use a CUDA device (the same check as signal_cuda.cu's).
void require_device(const char* op) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear it, so later runtime calls do not report it again
    throw std::runtime_error(cat("overlap._C.", op, ": no usable CUDA device (cudaGetDeviceCount: ",
                                 cudaGetErrorString(e), ")"));
  }
  if (count == 0) {
    throw std::runtime_error(cat("overlap._C.", op, ": no usable CUDA device (cudaGetDeviceCount: 0 devices)"));
  }
}

void check_launch(const char* op, uint64_t stream) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    throw std::runtime_error(cat("overlap._C.", op, ": launch failed: ", cudaGetErrorString(e), " (stream=0x",
                                 std::hex, stream, ")"));
  }
}

// A device address that must be non-null and aligned to `align` bytes.
void check_ptr(const char* op, const char* what, uint64_t addr, uint64_t align) {
  if (addr == 0) {
    throw std::invalid_argument(cat("overlap._C.", op, ": ", what, " is a null address (", what, "=0)"));
  }
  if (addr % align != 0) {
    throw std::invalid_argument(cat("overlap._C.", op, ": ", what, "=0x", std::hex, addr, std::dec, " is not ",
                                    align, "-byte aligned (", what, " % ", align, " = ", addr % align, ")"));
  }
}

void check_range(const char* op, const char* what, int64_t value, int64_t lo, int64_t hi) {
  if (value < lo || value > hi) {
    throw std::invalid_argument(
        cat("overlap._C.", op, ": ", what, "=", value, " is outside [", lo, ", ", hi, "]"));
  }
}

}  // namespace

void moe_dispatch_rows(uint64_t src_rows, uint64_t row_index, int64_t num_sends, int64_t row_bytes,
                       uint64_t dst_table, uint64_t block_offsets, uint64_t chunk_offsets, int64_t num_blocks,
                       int64_t groups_per_dest, int64_t num_chunks, int64_t rows_per_chunk, uint64_t counters,
                       uint64_t flag_addrs, int64_t epoch, uint64_t stream) {
  constexpr const char* op = "moe_dispatch_rows";
  check_range(op, "num_sends", num_sends, 0, kMaxGrid);
  check_range(op, "num_blocks", num_blocks, 1, kMaxBlocks);
  check_range(op, "groups_per_dest", groups_per_dest, 1, num_blocks);
  if (num_blocks % groups_per_dest != 0 || num_blocks / groups_per_dest > kMaxWorld) {
    throw std::invalid_argument(cat("overlap._C.", op, ": num_blocks=", num_blocks,
                                    " must be (destinations <= ", kMaxWorld, ") x groups_per_dest=",
                                    groups_per_dest));
  }
  check_range(op, "num_chunks", num_chunks, 0, num_sends);
  if (row_bytes <= 0 || row_bytes % cuda::kRowAlignBytes != 0) {
    throw std::invalid_argument(cat("overlap._C.", op, ": row_bytes=", row_bytes, " must be a positive multiple of ",
                                    cuda::kRowAlignBytes, " (row_bytes % ", cuda::kRowAlignBytes, " = ",
                                    row_bytes % cuda::kRowAlignBytes, ")"));
  }
  check_range(op, "rows_per_chunk", rows_per_chunk, 1, kMaxGrid);
  if (rows_per_chunk > kMaxGrid / (row_bytes / cuda::kRowAlignBytes)) {
    throw std::invalid_argument(cat("overlap._C.", op, ": rows_per_chunk=", rows_per_chunk, " x row_bytes=",
                                    row_bytes, " is too large for one CTA (at most ", kMaxGrid,
                                    " 16-byte vectors)"));
  }
  const int32_t word = check_int32(epoch, "epoch");
  if ((num_sends == 0) != (num_chunks == 0)) {
    throw std::invalid_argument(cat("overlap._C.", op, ": num_chunks=", num_chunks, " with num_sends=", num_sends,
                                    " (both are zero or neither)"));
  }
  if (num_sends == 0) return;  // nothing to send: no block has rows, no flag is due
  check_ptr(op, "src_rows", src_rows, cuda::kRowAlignBytes);
  check_ptr(op, "row_index", row_index, 8);
  check_ptr(op, "dst_table", dst_table, 8);
  check_ptr(op, "block_offsets", block_offsets, 8);
  check_ptr(op, "chunk_offsets", chunk_offsets, 8);
  check_ptr(op, "counters", counters, 4);
  check_ptr(op, "flag_addrs", flag_addrs, 8);
  require_device(op);
  cuda::moe_dispatch_rows_kernel<<<static_cast<unsigned int>(num_chunks), kDispatchThreads, 0,
                                   reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const char*>(src_rows), reinterpret_cast<const int64_t*>(row_index), row_bytes,
      reinterpret_cast<const int64_t*>(dst_table), reinterpret_cast<const int64_t*>(block_offsets),
      reinterpret_cast<const int64_t*>(chunk_offsets), static_cast<int>(num_blocks),
      static_cast<int>(groups_per_dest), rows_per_chunk, reinterpret_cast<int32_t*>(counters),
      reinterpret_cast<const int64_t*>(flag_addrs), word);
  check_launch(op, stream);
}

void moe_combine_rows(uint64_t back_table, uint64_t send_offsets, int64_t world_size, uint64_t pos,
                      uint64_t weights, uint64_t out, int64_t num_tokens, int64_t top_k, int64_t hidden,
                      int64_t dtype, uint64_t stream) {
  constexpr const char* op = "moe_combine_rows";
  check_range(op, "world_size", world_size, 1, kMaxWorld);
  check_range(op, "num_tokens", num_tokens, 0, kMaxGrid);
  check_range(op, "top_k", top_k, 1, kMaxTopK);
  check_range(op, "hidden", hidden, 1, kMaxGrid);
  if (dtype != cuda::kDtypeFloat32 && dtype != cuda::kDtypeBFloat16 && dtype != cuda::kDtypeFloat16) {
    throw std::invalid_argument(cat("overlap._C.", op, ": dtype=", dtype, " is not one of ", cuda::kDtypeFloat32,
                                    " (float32), ", cuda::kDtypeBFloat16, " (bfloat16), ", cuda::kDtypeFloat16,
                                    " (float16)"));
  }
  const int64_t elem = dtype == cuda::kDtypeFloat32 ? 4 : 2;
  const int64_t tile = static_cast<int64_t>(kCombineThreads) * cuda::kCombineElemsPerThread;
  const int64_t tiles = (hidden + tile - 1) / tile;
  if (num_tokens > kMaxGrid / tiles) {
    throw std::invalid_argument(cat("overlap._C.", op, ": num_tokens=", num_tokens, " x ", tiles,
                                    " column tiles (hidden=", hidden, ") exceeds the grid limit ", kMaxGrid));
  }
  if (num_tokens == 0) return;
  check_ptr(op, "back_table", back_table, 8);
  check_ptr(op, "send_offsets", send_offsets, 8);
  check_ptr(op, "pos", pos, 8);
  check_ptr(op, "weights", weights, 4);
  check_ptr(op, "out", out, static_cast<uint64_t>(elem));
  require_device(op);
  const dim3 grid(static_cast<unsigned int>(num_tokens * tiles));
  const size_t smem = static_cast<size_t>(top_k) * (sizeof(int64_t) + sizeof(float));
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  const auto* table = reinterpret_cast<const int64_t*>(back_table);
  const auto* offsets = reinterpret_cast<const int64_t*>(send_offsets);
  const auto* positions = reinterpret_cast<const int64_t*>(pos);
  const auto* w = reinterpret_cast<const float*>(weights);
  const int W = static_cast<int>(world_size);
  switch (dtype) {
    case cuda::kDtypeFloat32:
      cuda::moe_combine_rows_kernel<float><<<grid, kCombineThreads, smem, s>>>(
          table, offsets, W, positions, w, reinterpret_cast<float*>(out), top_k, hidden, tiles);
      break;
    case cuda::kDtypeBFloat16:
      cuda::moe_combine_rows_kernel<__nv_bfloat16><<<grid, kCombineThreads, smem, s>>>(
          table, offsets, W, positions, w, reinterpret_cast<__nv_bfloat16*>(out), top_k, hidden, tiles);
      break;
    default:
      cuda::moe_combine_rows_kernel<__half><<<grid, kCombineThreads, smem, s>>>(
          table, offsets, W, positions, w, reinterpret_cast<__half*>(out), top_k, hidden, tiles);
      break;
  }
  check_launch(op, stream);
}

}  // namespace overlap
