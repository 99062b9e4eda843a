// Declarations of the launchers that csrc/bindings.cpp exports as overlap._C.
// Addresses arrive from Python as integers (tensor.data_ptr(), stream.cuda_stream); each
// launcher checks them and throws std::invalid_argument (-> ValueError) with the values,
// or std::runtime_error (-> RuntimeError) when the CUDA half is missing or unusable.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "overlap/signal.h"

namespace overlap {

// Error-message builder: cat("addr=", addr, " ...") streams every argument.
template <class... Args>
std::string cat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

// csrc/signal.cpp: host flags.
int32_t check_int32(int64_t value, const char* what);
int32_t* check_flag_address(uint64_t addr, const char* what);
Clock::time_point deadline_after(double timeout_s);

void signal_store(uint64_t addr, int64_t value);
int32_t signal_load(uint64_t addr);
int32_t signal_add(uint64_t addr, int64_t value);
// Both return as soon as the condition holds, or at `deadline`, whichever comes first.
bool signal_wait_until(uint64_t addr, int32_t value, Clock::time_point deadline);
// -1 when every flag is >= value; else the index of the first one still below it.
int64_t signal_wait_all_until(const std::vector<uint64_t>& addrs, int32_t value,
                              Clock::time_point deadline);

// csrc/cuda/signal_cuda.cu (stubs that throw when built without CUDA).
int cuda_device_count();
void cuda_stream_write_value32(uint64_t addr, int64_t value, uint64_t stream);
void cuda_stream_wait_value32(uint64_t addr, int64_t value, uint64_t stream);
void cuda_wait_flag_bounded(uint64_t addr, int64_t value, int64_t timeout_ns,
                            uint64_t err_addr, uint64_t stream);
// Registers [addr, addr + nbytes) (page-locked host memory, e.g. a mapped POSIX shared-memory
// segment) as mapped and portable, with `device` current; returns its device address.
uint64_t cuda_host_register(uint64_t addr, int64_t nbytes, int64_t device);
void cuda_host_unregister(uint64_t addr);

// csrc/watchdog.cpp: the host thread that bounds stream-ordered waits (no CUDA needed).
void watchdog_arm(uint64_t word_addr, int64_t value, double timeout_s, uint64_t err_addr, uint64_t abort_addr,
                  int64_t peer);
int64_t watchdog_pending();
int64_t watchdog_fired();
int64_t watchdog_cancel(uint64_t addr, uint64_t nbytes);

// csrc/cuda/moe_a2a.cu: the MoE all-to-all within a node (stubs in csrc/moe_a2a_stubs.cpp
// throw when built without CUDA). Tables are int64 device arrays; see overlap/moe_a2a.cuh.
void moe_dispatch_rows(uint64_t src_rows, uint64_t row_index, int64_t num_sends, int64_t row_bytes,
                       uint64_t dst_table, uint64_t block_offsets, uint64_t chunk_offsets, int64_t num_blocks,
                       int64_t groups_per_dest, int64_t num_chunks, int64_t rows_per_chunk, uint64_t counters,
                       uint64_t flag_addrs, int64_t epoch, uint64_t stream);
void moe_combine_rows(uint64_t back_table, uint64_t send_offsets, int64_t world_size, uint64_t pos,
                      uint64_t weights, uint64_t out, int64_t num_tokens, int64_t top_k, int64_t hidden,
                      int64_t dtype, uint64_t stream);

}  // namespace overlap
