// BlockRuns: the blocks of a packed W shared out among a linear's threads (linear_bf16_avx512.cpp,
// linear_bf16_widen.cpp, linear_f32.cpp).

#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

namespace pagedserve::cpu {

// The blocks (or slots of blocks) of W as runs, thread t's run being slots slots * t / threads .. slots * (t
// + 1) / threads - 1: one sequential stream of W a thread. A run is taken in units: with `streams` > 1 first
// steps over its `streams` parts side by side (step u reading block u of each part: a core reads faster from
// several streams than from one), then the blocks the parts leave over, one at a time. A thread takes its own
// run's units from the front, then the last units of the others' runs, back to front, so that a thread
// slowed down (the cores being shared) is helped rather than waited for; a run read back to front streams
// worse, so each thread starts at the front of its own.
class BlockRuns {
 public:
  BlockRuns(int64_t slots, int threads, int64_t streams)
      : slots_(slots), threads_(threads), streams_(streams), runs_(new Run[threads]) {
    for (int r = 0; r < threads; ++r) {
      int64_t first, units, steps;
      run_of(r, first, units, steps);
      runs_[r].left = static_cast<uint64_t>(units);
    }
  }

  // Unit u of run r: true for a step, with its first slot and the parts' size (the step reads slots first +
  // s * parts, s < streams); false for a slot taken alone, first.
  bool parts_of(int r, int64_t u, int64_t& first, int64_t& parts) const {
    int64_t units;
    run_of(r, first, units, parts);
    if (u < parts && streams_ > 1) {
      first += u;
      return true;
    }
    first += parts * (streams_ - 1) + u;
    return false;
  }

  // Thread t's share: f(r, u, dir) for each unit u of run r it takes, dir 1 for its own run (front to back),
  // -1 for the others' (back to front); all the runs where OpenMP gave fewer threads than asked.
  template <typename F>
  void work(int t, F&& f) {
    for (int64_t u; (u = claim(t, true)) >= 0;) f(t, u, 1);
    for (int o = 1; o < threads_; ++o)
      for (int64_t u; (u = claim((t + o) % threads_, false)) >= 0;) f((t + o) % threads_, u, -1);
  }

 private:
  struct alignas(64) Run {       // a cache line each: its thread takes it for itself with every unit
    std::atomic<uint64_t> left;  // the units not yet taken, [first, end) as first << 32 | end
  };

  // Run r's first slot, its units (steps and slots left over), and the steps.
  void run_of(int r, int64_t& first, int64_t& units, int64_t& steps) const {
    first = slots_ * r / threads_;
    const int64_t size = slots_ * (r + 1) / threads_ - first;
    steps = size / streams_;
    units = steps + size - steps * streams_;
  }

  // A unit of run r from the front or the back, or -1 when none is left.
  int64_t claim(int r, bool front) {
    uint64_t v = runs_[r].left.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t first = v >> 32, end = v & 0xFFFFFFFFu;
      if (first >= end) return -1;
      const uint64_t next = front ? (first + 1) << 32 | end : first << 32 | (end - 1);
      if (runs_[r].left.compare_exchange_weak(v, next, std::memory_order_relaxed))
        return static_cast<int64_t>(front ? first : end - 1);
    }
  }

  const int64_t slots_;
  const int threads_;
  const int64_t streams_;
  std::unique_ptr<Run[]> runs_;
};

}  // namespace pagedserve::cpu
