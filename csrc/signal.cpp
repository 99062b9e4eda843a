// Host launchers for flags: argument checks, then the primitives of overlap/signal.h.
#include <cmath>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>

#include "launchers.h"

namespace overlap {

namespace {

// Longest accepted timeout (~31 years): keeps now() + timeout inside steady_clock's range.
constexpr double kMaxTimeoutS = 1e9;

}  // namespace

int32_t check_int32(int64_t value, const char* what) {
  if (value < std::numeric_limits<int32_t>::min() || value > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument(cat("overlap._C: ", what, "=", value,
                                    " is outside the int32 range [-2147483648, 2147483647]"));
  }
  return static_cast<int32_t>(value);
}

int32_t* check_flag_address(uint64_t addr, const char* what) {
  if (addr == 0) {
    throw std::invalid_argument(cat("overlap._C: ", what, " is a null address (", what, "=0)"));
  }
  if (addr % alignof(int32_t) != 0) {
    throw std::invalid_argument(cat("overlap._C: ", what, "=0x", std::hex, addr, std::dec,
                                    " is not 4-byte aligned (", what, " % 4 = ", addr % 4, ")"));
  }
  return reinterpret_cast<int32_t*>(addr);
}

Clock::time_point deadline_after(double timeout_s) {
  // Every wait has a deadline (no hangs): infinity and NaN are refused, not "forever".
  if (!std::isfinite(timeout_s) || timeout_s < 0) {
    throw std::invalid_argument(
        cat("overlap._C: timeout_s must be a finite number >= 0, got timeout_s=", timeout_s));
  }
  const double capped = timeout_s < kMaxTimeoutS ? timeout_s : kMaxTimeoutS;
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(capped));
}

void signal_store(uint64_t addr, int64_t value) {
  int32_t* flag = check_flag_address(addr, "addr");
  flag_store_release(flag, check_int32(value, "value"));
}

int32_t signal_load(uint64_t addr) {
  return flag_load_acquire(check_flag_address(addr, "addr"));
}

int32_t signal_add(uint64_t addr, int64_t value) {
  int32_t* flag = check_flag_address(addr, "addr");
  return flag_fetch_add_acq_rel(flag, check_int32(value, "value"));
}

bool signal_wait_until(uint64_t addr, int32_t value, Clock::time_point deadline) {
  return flag_wait_geq(check_flag_address(addr, "addr"), value, deadline);
}

int64_t signal_wait_all_until(const std::vector<uint64_t>& addrs, int32_t value,
                              Clock::time_point deadline) {
  // Check every address before waiting on any, so a bad one fails fast.
  std::vector<const int32_t*> flags;
  flags.reserve(addrs.size());
  for (size_t i = 0; i < addrs.size(); ++i) {
    flags.push_back(check_flag_address(addrs[i], cat("addrs[", i, "]").c_str()));
  }
  // One shared deadline: wait on each flag in turn. Once one times out, report the first
  // flag that is still below `value` (an earlier one may have been lowered meanwhile;
  // a later one may have arrived), or success if all arrived at the last moment.
  for (const int32_t* flag : flags) {
    if (!flag_wait_geq(flag, value, deadline)) {
      for (size_t i = 0; i < flags.size(); ++i) {
        if (!flag_reached(flag_load_acquire(flags[i]), value)) return static_cast<int64_t>(i);
      }
      return -1;
    }
  }
  return -1;
}

#ifndef OVERLAP_WITH_CUDA
// Built without the CUDA half: the CUDA exports exist and say why they cannot work.
namespace {
#ifdef OVERLAP_CUDA_DISABLED  // CMake: nvcc was there, but OVERLAP_BUILD_CUDA=0
constexpr const char* kNoCudaReason = "OVERLAP_BUILD_CUDA=0 at build time";
#else
constexpr const char* kNoCudaReason = "nvcc not found at build time";
#endif

[[noreturn]] void no_cuda() {
  throw std::runtime_error(cat("overlap._C was built without CUDA (", kNoCudaReason, ")"));
}
}  // namespace

int cuda_device_count() { return 0; }
void cuda_stream_write_value32(uint64_t, int64_t, uint64_t) { no_cuda(); }
void cuda_stream_wait_value32(uint64_t, int64_t, uint64_t) { no_cuda(); }
void cuda_wait_flag_bounded(uint64_t, int64_t, int64_t, uint64_t, uint64_t) { no_cuda(); }
uint64_t cuda_host_register(uint64_t, int64_t, int64_t) { no_cuda(); }
void cuda_host_unregister(uint64_t) { no_cuda(); }
#endif

}  // namespace overlap
