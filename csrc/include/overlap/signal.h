// Host-side signal primitives on raw pointers: 32-bit flags in memory shared between
// processes (POSIX shared memory) or mapped from a device. No torch, no pybind11.
//
// Memory ordering. A producer writes a chunk of data, then stores the flag; a consumer
// waits for the flag, then reads the chunk. The flag store is a *release* (no earlier
// data write may become visible after it) and every flag load is an *acquire* (no later
// data read may be satisfied before it), so a consumer that sees the flag also sees the
// data. fetch_add is acq_rel because a counter (e.g. "peers done reading") is both: it
// publishes this rank's reads being finished and observes the others'.
//
// 32-bit __atomic operations on an aligned int32 are lock-free and address-free on every
// platform we build for, so they work across processes mapping the same page.
#pragma once

#include <sched.h>
#include <time.h>
#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include <chrono>
#include <cstdint>

namespace overlap {

using Clock = std::chrono::steady_clock;

inline void flag_store_release(int32_t* addr, int32_t value) {
  __atomic_store_n(addr, value, __ATOMIC_RELEASE);
}

inline int32_t flag_load_acquire(const int32_t* addr) {
  return __atomic_load_n(addr, __ATOMIC_ACQUIRE);
}

// Returns the value before the add (two's-complement wrap on overflow).
inline int32_t flag_fetch_add_acq_rel(int32_t* addr, int32_t value) {
  return __atomic_fetch_add(addr, value, __ATOMIC_ACQ_REL);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Escalating back-off for a waiter that may share its core with the rank it waits for:
// a few pause-spins (the flag is often about to flip), then sched_yield()s (free when the core has
// nothing else to run, and they give it away when it has), then sleeps that double from 1 us up to
// kMaxSleepNs. The first sleep of a thread sets its timer slack to 1 us: Linux's default slack (50 us)
// would make every short sleep ~50-60 us, and a flag that arrives during a sleep is seen only when it
// ends (a ping-pong between two ranks measured ~90 us per round trip with the default, bench/overhead.py).
class Backoff {
 public:
  static constexpr int kSpins = 64;
  static constexpr int kYields = 256;
  static constexpr long kMaxSleepNs = 50'000;

  void pause() {
    if (step_ < kSpins) {
      cpu_relax();
    } else if (step_ < kSpins + kYields) {
      sched_yield();
    } else {
      fine_timer_slack();
      timespec ts{0, sleep_ns_};
      nanosleep(&ts, nullptr);
      sleep_ns_ = sleep_ns_ * 2 > kMaxSleepNs ? kMaxSleepNs : sleep_ns_ * 2;
    }
    ++step_;
  }

 private:
  static void fine_timer_slack() {
#if defined(__linux__)
    static thread_local bool set = false;
    if (!set) {
      set = true;
      prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
    }
#endif
  }

  int step_ = 0;
  long sleep_ns_ = 1'000;
};

// "flag has reached value" for epochs that wrap around 2^32: the difference, taken modulo
// 2^32, is non-negative as a signed number. Equal to a plain signed >= while the two are
// within 2^31 of each other, which the protocol guarantees (ranks are a few epochs apart),
// and still right after the epoch counter wraps. CU_STREAM_WAIT_VALUE_GEQ compares the same way.
inline bool flag_reached(int32_t flag, int32_t value) {
  return static_cast<int32_t>(static_cast<uint32_t>(flag) - static_cast<uint32_t>(value)) >= 0;
}

// Waits until flag_reached(*addr, value). Returns true as soon as it holds, false once
// `deadline` has passed with it still false. The flag is read once more after the
// deadline, so a store that lands while we sleep past the deadline is not missed.
inline bool flag_wait_geq(const int32_t* addr, int32_t value, Clock::time_point deadline) {
  Backoff backoff;
  for (;;) {
    if (flag_reached(flag_load_acquire(addr), value)) return true;
    if (Clock::now() >= deadline) return flag_reached(flag_load_acquire(addr), value);
    backoff.pause();
  }
}

}  // namespace overlap
