// Prefetches: the next block of a sequence lies anywhere in the KV pool, and the kernels fetch it while they
// compute the one before, where the hardware's prefetchers cannot guess it.

#pragma once

#include <algorithm>
#include <cstdint>

namespace pagedserve::cpu {

// Where a prefetched line goes: into L1 for reading (prefetcht0), into L2 only for reading (prefetcht1), or
// into L1 for writing (prefetchw).
enum class Fetch { kRead, kReadL2, kWrite };

// One line on its way to the cache. NOTE: on x86-64 an asm statement, because GCC gives __builtin_prefetch
// no side effects: a helper that only prefetches looks const to it, and its calls were deleted.
inline void prefetch_line(const char* p, Fetch kind) {
#if defined(__x86_64__)
  switch (kind) {
    case Fetch::kRead:
      asm volatile("prefetcht0 %0" : : "m"(*p));
      break;
    case Fetch::kReadL2:
      asm volatile("prefetcht1 %0" : : "m"(*p));
      break;
    case Fetch::kWrite:
      asm volatile("prefetchw %0" : : "m"(*p));
      break;
  }
#else
  switch (kind) {
    case Fetch::kRead:
      __builtin_prefetch(p, 0, 3);
      break;
    case Fetch::kReadL2:
      __builtin_prefetch(p, 0, 2);
      break;
    case Fetch::kWrite:
      __builtin_prefetch(p, 1, 1);
      break;
  }
#endif
}

inline void prefetch_lines(const void* ptr, int64_t bytes, Fetch kind) {
  const char* p = static_cast<const char*>(ptr);
  for (int64_t off = 0; off < bytes; off += 64) prefetch_line(p + off, kind);
}

// The bytes [ptr, ptr + bytes) towards L1, towards L2 only, or towards L1 to be written (owned by this core
// when the stores come).
inline void prefetch(const void* ptr, int64_t bytes) { prefetch_lines(ptr, bytes, Fetch::kRead); }
inline void prefetch_l2(const void* ptr, int64_t bytes) { prefetch_lines(ptr, bytes, Fetch::kReadL2); }
inline void prefetch_write(const void* ptr, int64_t bytes) { prefetch_lines(ptr, bytes, Fetch::kWrite); }

// Whether reads ahead (the tiled attention's next block, the bf16 linear's decode streams) go into L2 only
// rather than into L1: everywhere but on an AMD Zen 5, where L1 did better (docs/performance.md).
bool reads_ahead_into_l2();

// The bytes [at, at + bytes) (a block of the cache) prefetched into L2 a share at a time over `steps` steps
// of a kernel, so that the prefetches do not queue up behind each other in one burst.
struct FetchShare {
  const char* at;
  int64_t bytes, per_step;
  FetchShare(const char* at, int64_t bytes, int64_t steps)
      : at(at),
        bytes(bytes),
        per_step(bytes > 0 ? ((bytes + 63) / 64 + steps - 1) / std::max<int64_t>(1, steps) * 64 : 0) {}
  void step() {
    const int64_t now = std::min(per_step, bytes);
    prefetch_l2(at, now);
    at += now, bytes -= now;
  }
  void rest() {
    prefetch_l2(at, bytes);
    bytes = 0;
  }
};

}  // namespace pagedserve::cpu
