// A decode step's inputs (decode_inputs) and a greedy step's tokens written back (argmax_append_): the
// runner's step inputs built in C++. NOTE: they leave the kernels once the worker builds its own step
// inputs (worker_svc); kept here, bindings unchanged, until then.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "ops.h"

namespace pagedserve::cpu {

// The inputs of a decode step (one token per sequence) from the runner's per-slot arrays: sequence i (slot
// slots[i]) computes its token at position start[i]. Returns its input ids (token_ids[slot, start]), the
// positions (start itself), its slot mapping (the cache slot of that position through the slot's block
// table), the block tables of the sequences up to the longest one's blocks, the query starts (0 .. S) and
// the context lengths (start + 1), as the runner's general path computes them with numpy
// (worker_svc/runner.py), in one call instead of eight numpy calls and six tensors, which run cold after
// every forward pass. slots and start come as Python lists: converting them costs less than a tensor each.
std::vector<at::Tensor> decode_inputs(const at::Tensor& token_ids, const at::Tensor& block_tables,
                                      const std::vector<int64_t>& slots, const std::vector<int64_t>& start,
                                      int64_t block_size) {
  TORCH_CHECK(token_ids.dim() == 2 && token_ids.scalar_type() == at::kLong && token_ids.stride(1) == 1,
              "token_ids must be int64 [rows, tokens] with contiguous rows");
  TORCH_CHECK(
      block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1,
      "block_tables must be int32 [rows, blocks] with contiguous rows");
  TORCH_CHECK(start.size() == slots.size(), "slots and start differ in length");
  TORCH_CHECK(block_size > 0, "block_size must be positive");
  const int64_t n = static_cast<int64_t>(slots.size());
  const int64_t* slot = slots.data();
  const int64_t* pos = start.data();
  int64_t max_blocks = 0;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < token_ids.size(0) && slot[i] < block_tables.size(0), "slot ",
                slot[i], " is outside the arrays");
    TORCH_CHECK(pos[i] >= 0 && pos[i] < token_ids.size(1) && pos[i] / block_size < block_tables.size(1),
                "position ", pos[i], " of slot ", slot[i], " is outside the arrays");
    max_blocks = std::max(max_blocks, pos[i] / block_size + 1);
  }
  const at::TensorOptions longs = token_ids.options(), ints = block_tables.options();
  at::Tensor ids = at::empty({n}, longs), positions = at::empty({n}, longs),
             slot_mapping = at::empty({n}, longs);
  at::Tensor tables = at::empty({n, max_blocks}, ints), qsl = at::empty({n + 1}, ints),
             lens = at::empty({n}, ints);
  const int64_t* tok = token_ids.data_ptr<int64_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  int64_t* id = ids.data_ptr<int64_t>();
  int64_t* p = positions.data_ptr<int64_t>();
  int64_t* sm = slot_mapping.data_ptr<int64_t>();
  int32_t* tb = tables.data_ptr<int32_t>();
  int32_t* q = qsl.data_ptr<int32_t>();
  int32_t* len = lens.data_ptr<int32_t>();
  q[0] = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* row = tok + slot[i] * token_ids.stride(0);
    const int32_t* table = bt + slot[i] * block_tables.stride(0);
    id[i] = row[pos[i]];
    p[i] = pos[i];
    sm[i] = static_cast<int64_t>(table[pos[i] / block_size]) * block_size + pos[i] % block_size;
    std::memcpy(tb + i * max_blocks, table, max_blocks * sizeof(int32_t));
    q[i + 1] = static_cast<int32_t>(i + 1);
    len[i] = static_cast<int32_t>(pos[i] + 1);
  }
  return {ids, positions, slot_mapping, tables, qsl, lens};
}

// The argmax of each row of logits [S, V] (as argmax_rows), written into the runner's token ids at
// token_ids[slots[i], positions[i]] and returned as a list: a greedy decode step's sampling, in one call
// instead of the sampler's, a tensor's tolist() and a numpy store per sequence, which run cold after every
// forward pass. Every row is checked before any is written.
std::vector<int64_t> argmax_append_(const at::Tensor& logits, at::Tensor& token_ids,
                                    const std::vector<int64_t>& slots,
                                    const std::vector<int64_t>& positions) {
  TORCH_CHECK(token_ids.dim() == 2 && token_ids.scalar_type() == at::kLong && token_ids.stride(1) == 1,
              "token_ids must be int64 [rows, tokens] with contiguous rows");
  const int64_t n = static_cast<int64_t>(slots.size());
  TORCH_CHECK(positions.size() == slots.size(), "slots and positions differ in length");
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == n, "logits must have a row per slot");
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(slots[i] >= 0 && slots[i] < token_ids.size(0) && positions[i] >= 0 &&
                    positions[i] < token_ids.size(1),
                "position ", positions[i], " of slot ", slots[i], " is outside the token ids");
  const at::Tensor best = argmax_rows(logits);
  const int64_t* b = best.data_ptr<int64_t>();
  int64_t* tok = token_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) tok[slots[i] * token_ids.stride(0) + positions[i]] = b[i];
  return std::vector<int64_t>(b, b + n);
}

}  // namespace pagedserve::cpu
