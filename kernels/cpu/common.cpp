// The checks and CPU facts common.h and prefetch.h declare: the KV cache's layouts, where reads ahead go on
// this CPU, and AMX's permission and switch.

#include "common.h"

#include <ATen/core/Tensor.h>

#include <atomic>

#include "ops.h"
#include "prefetch.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif
#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pagedserve::cpu {

bool is_cache_layout(const at::Tensor& cache) {
  if (cache.dim() != 4) return false;
  const int64_t block_size = cache.size(1), heads = cache.size(2), head_dim = cache.size(3);
  const bool token_major = cache.stride(1) == heads * head_dim && cache.stride(2) == head_dim;
  const bool head_major = cache.stride(1) == head_dim && cache.stride(2) == block_size * head_dim;
  return cache.stride(3) == 1 && cache.stride(0) == block_size * heads * head_dim &&
         (token_major || head_major);
}

void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4, "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache ", v_cache.sizes(), " != k_cache ",
              k_cache.sizes());
  TORCH_CHECK(is_cache_layout(k_cache) && v_cache.strides() == k_cache.strides(),
              "the KV cache must be contiguous, or a view of a contiguous [num_blocks, num_kv_heads, "
              "block_size, head_dim] tensor (strides ",
              k_cache.strides(), " and ", v_cache.strides(), ")");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "k_cache and v_cache differ in dtype");
}

bool reads_ahead_into_l2() {
#if defined(__x86_64__)
  static const bool into_l2 = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return true;
    const bool amd = ebx == 0x68747541 && edx == 0x69746e65 && ecx == 0x444d4163;  // "AuthenticAMD"
    if (!amd || __get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return true;
    const unsigned base = (eax >> 8) & 0xf, family = base == 0xf ? base + ((eax >> 20) & 0xff) : base;
    return family != 26;
  }();
  return into_l2;
#else
  return true;
#endif
}

bool prefetches_into_l2() { return reads_ahead_into_l2(); }

namespace {
std::atomic<bool> invariant_switch{false};
}  // namespace

bool batch_invariant() { return invariant_switch.load(std::memory_order_relaxed); }
bool set_batch_invariant(bool on) { return invariant_switch.exchange(on); }

std::string instruction_set() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  return "avx512-bf16-amx";
#elif defined(__AVX512BF16__)
  return "avx512-bf16";
#elif defined(PAGEDSERVE_AVX512)
  return "avx512";
#elif defined(PAGEDSERVE_AVX2)
  return "avx2";
#else
  return "plain";
#endif
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
namespace {

// Linux hands a process the AMX tile state (8 KB more in each thread's saved state) only once asked
// (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA); before that a tile instruction faults.
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

std::atomic<bool> amx_switch{true};

}  // namespace

bool amx_enabled() { return amx_switch.load(std::memory_order_relaxed) && amx_permitted(); }
bool has_amx() { return amx_permitted(); }
bool set_amx_enabled(bool enabled) { return amx_switch.exchange(enabled); }
#else
bool amx_enabled() { return false; }
bool has_amx() { return false; }
bool set_amx_enabled(bool) { return false; }
#endif

}  // namespace pagedserve::cpu
