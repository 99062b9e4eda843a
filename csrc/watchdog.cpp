// The host watchdog that bounds stream-ordered waits (cuStreamWaitValue32 has no limit of its own).
//
// A GPU rank enqueues a wait on a flag word in host memory (a control pad, mapped for the device)
// and arms the watchdog with the word, the value, a deadline and where to report. A C++ thread
// (it never takes the GIL, so it runs while Python blocks in a device synchronisation) sleeps
// until the earliest deadline; an entry whose word has not reached its value by then is released:
// the thread raises the word to the value itself (the GPU's queue moves on: nothing else can
// release a stream blocked that way, least of all more queued work), sets the error word to 1 and
// the abort word to peer + 1 (both only when 0), so the next call on the group raises naming the
// peer. Host code only: built and tested without CUDA.
#include <algorithm>
#include <condition_variable>
#include <limits>
#include <map>
#include <mutex>
#include <thread>

#include "launchers.h"

namespace overlap {

namespace {

struct Entry {
  int32_t* word;
  int32_t value;
  int32_t* err;
  int32_t* abort;
  int32_t peer;
};

// Pruned of arrived entries when it grows past this (calls arm far more often than deadlines pass).
constexpr size_t kPruneAt = 4096;

class Watchdog {
 public:
  void arm(const Entry& e, Clock::time_point deadline) {
    std::lock_guard<std::mutex> lock(mu_);
    if (entries_.size() >= kPruneAt) prune_locked();
    const bool earliest = entries_.empty() || deadline < entries_.begin()->first;
    entries_.emplace(deadline, e);
    if (!started_) {
      std::thread([this] { run(); }).detach();
      started_ = true;
    }
    if (earliest) cv_.notify_one();
  }

  int64_t pending() {
    std::lock_guard<std::mutex> lock(mu_);
    prune_locked();
    return static_cast<int64_t>(entries_.size());
  }

  int64_t fired() {
    std::lock_guard<std::mutex> lock(mu_);
    return fired_;
  }

  // Drops every entry that touches [lo, lo + nbytes): the memory is about to be unmapped or reset.
  int64_t cancel(uint64_t lo, uint64_t nbytes) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto inside = [&](const void* p) {
      const auto a = reinterpret_cast<uint64_t>(p);
      return a >= lo && a - lo < nbytes;
    };
    int64_t n = 0;
    for (auto it = entries_.begin(); it != entries_.end();) {
      const Entry& e = it->second;
      if (inside(e.word) || inside(e.err) || inside(e.abort)) {
        it = entries_.erase(it);
        ++n;
      } else {
        ++it;
      }
    }
    return n;
  }

 private:
  void prune_locked() {
    for (auto it = entries_.begin(); it != entries_.end();) {
      const Entry& e = it->second;
      it = flag_reached(flag_load_acquire(e.word), e.value) ? entries_.erase(it) : std::next(it);
    }
  }

  // Raise *addr to at least `value` (never lower it: the producer may have published a later epoch).
  static void raise_to(int32_t* addr, int32_t value) {
    int32_t seen = flag_load_acquire(addr);
    while (!flag_reached(seen, value) &&
           !__atomic_compare_exchange_n(addr, &seen, value, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
    }
  }

  static void set_if_zero(int32_t* addr, int32_t value) {
    int32_t zero = 0;
    __atomic_compare_exchange_n(addr, &zero, value, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  }

  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (entries_.empty()) {
        cv_.wait(lock);
        continue;
      }
      const auto deadline = entries_.begin()->first;
      if (Clock::now() < deadline) {
        cv_.wait_until(lock, deadline);
        continue;
      }
      const Entry e = entries_.begin()->second;
      entries_.erase(entries_.begin());
      if (flag_reached(flag_load_acquire(e.word), e.value)) continue;
      // Report first, then release: whoever the release lets through can already see the error.
      set_if_zero(e.err, 1);
      set_if_zero(e.abort, e.peer + 1);
      raise_to(e.word, e.value);
      ++fired_;
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::multimap<Clock::time_point, Entry> entries_;
  bool started_ = false;
  int64_t fired_ = 0;
};

// Never destroyed: the detached thread may still wait on its condition variable at exit.
Watchdog& watchdog() {
  static Watchdog* w = new Watchdog();
  return *w;
}

}  // namespace

void watchdog_arm(uint64_t word_addr, int64_t value, double timeout_s, uint64_t err_addr, uint64_t abort_addr,
                  int64_t peer) {
  Entry e{check_flag_address(word_addr, "word_addr"), check_int32(value, "value"),
          check_flag_address(err_addr, "err_addr"), check_flag_address(abort_addr, "abort_addr"), 0};
  if (peer < 0 || peer >= std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument(cat("overlap._C: peer must be in [0, 2^31 - 1), got peer=", peer));
  }
  e.peer = static_cast<int32_t>(peer);
  watchdog().arm(e, deadline_after(timeout_s));
}

int64_t watchdog_pending() { return watchdog().pending(); }

int64_t watchdog_fired() { return watchdog().fired(); }

int64_t watchdog_cancel(uint64_t addr, uint64_t nbytes) { return watchdog().cancel(addr, nbytes); }

}  // namespace overlap
