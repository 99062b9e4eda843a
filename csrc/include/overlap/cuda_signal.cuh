// Device-side signal primitives on raw pointers (sm_70 and newer). No torch headers.
//
// Flags live in memory that other GPUs, the copy engines or the host write (peer or
// host-mapped memory), so every access is at *system* scope: a .gpu-scoped acquire
// would not order against a write made by another device. As on the host: producers
// store flags with release, consumers load them with acquire.
#pragma once

#include <cstdint>

namespace overlap {
namespace cuda {

// Error codes recorded into a kernel's error word; 0 means no error.
constexpr int32_t kErrNone = 0;
constexpr int32_t kErrWaitTimeout = 1;

// Nanoseconds of the GPU's global timer. It ticks in steps of up to ~1 us on some
// parts, which is fine for limits of milliseconds and more.
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ int32_t flag_load_acquire(const int32_t* addr) {
  int32_t v;
  asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
  return v;
}

__device__ __forceinline__ void flag_store_release(int32_t* addr, int32_t value) {
  asm volatile("st.release.sys.global.b32 [%0], %1;" ::"l"(addr), "r"(value) : "memory");
}

// Spins until *flag >= value, compared modulo 2^32 as the host side and
// CU_STREAM_WAIT_VALUE_GEQ do. Returns true once it holds. If timeout_ns
// pass first, records `code` into *err unless an earlier error is already there (the
// first error wins, so the host sees the root cause), and returns false: a spinning
// kernel never hangs its stream, the host checks *err after the stream.
//
// Per thread: the caller's own clock and its own loads decide when it returns, so two threads
// that call it may return at different times and with different results. Call it from one
// thread (wait_flag_bounded_kernel runs <<<1, 1>>>), or have one thread call it and broadcast
// the result (shared memory, then __syncthreads) before any barrier that depends on it: threads
// of one CTA that each wait and then meet at a barrier can leave a loop on different iterations
// and hang there (tests/gpu/cpu/test_wait_uniform.py checks both).
__device__ __forceinline__ bool wait_flag_geq_bounded(const int32_t* flag, int32_t value,
                                                      uint64_t timeout_ns, int32_t* err,
                                                      int32_t code = kErrWaitTimeout) {
  const uint64_t start = globaltimer_ns();
  while (static_cast<int32_t>(static_cast<uint32_t>(flag_load_acquire(flag)) -
                              static_cast<uint32_t>(value)) < 0) {
    if (globaltimer_ns() - start > timeout_ns) {
      atomicCAS_system(err, kErrNone, code);
      __threadfence_system();
      return false;
    }
    // Back off a little so a spinning thread does not flood the memory system with
    // polls of a remote page.
    __nanosleep(128);
  }
  return true;
}

}  // namespace cuda
}  // namespace overlap
