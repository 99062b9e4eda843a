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

}  // namespace overlap
