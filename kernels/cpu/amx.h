// AMX's tile configuration, for the kernels that multiply tiles (the bf16 linear, the tiled attention). On
// CPUs with AMX (Intel from Sapphire Rapids) a core multiplies a 16 x 32 bf16 tile by a 32 x 16 tile in one
// instruction (tdpbf16ps: 16 x 16 float32 sums, each adding 32 products).

#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

#include <immintrin.h>

#include <cstdint>
#include <initializer_list>
#include <utility>

namespace pagedserve::cpu {

// A tile configuration (palette 1): tile t has rows[t] rows of colsb[t] bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  constexpr TileConfig(std::initializer_list<std::pair<int, int>> tiles) {
    int t = 0;
    for (const auto& [r, c] : tiles) rows[t] = static_cast<uint8_t>(r), colsb[t++] = static_cast<uint16_t>(c);
  }
};

}  // namespace pagedserve::cpu

#endif  // __AMX_TILE__ && __AMX_BF16__
