// A step's model inputs built from the runner's per-slot arrays, and its sampled tokens written back into
// them: worker_svc/step_inputs.py's numpy implementation of SlotArrays.inputs and .append, the same values
// in one call each. They run after every forward pass with the caches full of the weights, where each of
// numpy's dozen calls and six tensors costs microseconds (docs/performance.md, "The step's inputs").

#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

void check_arrays(const at::Tensor& token_ids, const at::Tensor& block_tables) {
  TORCH_CHECK(token_ids.dim() == 2 && token_ids.scalar_type() == at::kLong && token_ids.stride(1) == 1,
              "token_ids must be int64 [rows, tokens] with contiguous rows");
  TORCH_CHECK(
      block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1,
      "block_tables must be int32 [rows, blocks] with contiguous rows");
}

// Sequence i (slot slots[i]) computes num_scheduled[i] tokens (one each where num_scheduled is empty: a
// decode step) from position start[i] on. Returns the input ids, positions and slot mapping (int64 [T]),
// the block tables up to the longest sequence's blocks (int32 [S, max_blocks]), the query starts (int32
// [S + 1]) and the context lengths after the step (int32 [S]). The lists come as Python lists: converting
// them costs less than a tensor each.
std::vector<at::Tensor> step_inputs(const at::Tensor& token_ids, const at::Tensor& block_tables,
                                    const std::vector<int64_t>& slots, const std::vector<int64_t>& start,
                                    const std::vector<int64_t>& num_scheduled, int64_t block_size) {
  check_arrays(token_ids, block_tables);
  TORCH_CHECK(start.size() == slots.size(), "slots and start differ in length");
  TORCH_CHECK(num_scheduled.empty() || num_scheduled.size() == slots.size(),
              "slots and num_scheduled differ in length");
  TORCH_CHECK(block_size > 0, "block_size must be positive");
  const int64_t n = static_cast<int64_t>(slots.size());
  const bool decode = num_scheduled.empty();
  int64_t num_tokens = 0, max_blocks = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t count = decode ? 1 : num_scheduled[i], end = start[i] + count;
    TORCH_CHECK(count >= 1, "slot ", slots[i], " computes no token");
    TORCH_CHECK(slots[i] >= 0 && slots[i] < token_ids.size(0) && slots[i] < block_tables.size(0), "slot ",
                slots[i], " is outside the arrays");
    TORCH_CHECK(start[i] >= 0 && end <= token_ids.size(1) && (end - 1) / block_size < block_tables.size(1),
                "position ", end - 1, " of slot ", slots[i], " is outside the arrays");
    num_tokens += count;
    max_blocks = std::max(max_blocks, (end + block_size - 1) / block_size);
  }
  const at::TensorOptions longs = token_ids.options(), ints = block_tables.options();
  at::Tensor ids = at::empty({num_tokens}, longs), positions = at::empty({num_tokens}, longs),
             slot_mapping = at::empty({num_tokens}, longs);
  at::Tensor tables = at::empty({n, max_blocks}, ints), query_start_loc = at::empty({n + 1}, ints),
             context_lens = at::empty({n}, ints);
  const int64_t* tok = token_ids.data_ptr<int64_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  int64_t* id = ids.data_ptr<int64_t>();
  int64_t* pos = positions.data_ptr<int64_t>();
  int64_t* sm = slot_mapping.data_ptr<int64_t>();
  int32_t* tb = tables.data_ptr<int32_t>();
  int32_t* q = query_start_loc.data_ptr<int32_t>();
  int32_t* len = context_lens.data_ptr<int32_t>();
  int64_t row = 0;
  q[0] = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* tokens = tok + slots[i] * token_ids.stride(0);
    const int32_t* table = bt + slots[i] * block_tables.stride(0);
    const int64_t end = start[i] + (decode ? 1 : num_scheduled[i]);
    for (int64_t p = start[i]; p < end; ++p, ++row) {
      id[row] = tokens[p];
      pos[row] = p;
      sm[row] = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
    }
    std::memcpy(tb + i * max_blocks, table, max_blocks * sizeof(int32_t));
    q[i + 1] = static_cast<int32_t>(row);
    len[i] = static_cast<int32_t>(end);
  }
  return {ids, positions, slot_mapping, tables, query_start_loc, context_lens};
}

// token_ids[slots[i], positions[i]] = tokens[i] (tokens int64 [S], a step's sampled tokens), returned as a
// list; every place is checked before any is written.
std::vector<int64_t> append_tokens_(at::Tensor& token_ids, const std::vector<int64_t>& slots,
                                    const std::vector<int64_t>& positions, const at::Tensor& tokens) {
  TORCH_CHECK(token_ids.dim() == 2 && token_ids.scalar_type() == at::kLong && token_ids.stride(1) == 1,
              "token_ids must be int64 [rows, tokens] with contiguous rows");
  const int64_t n = static_cast<int64_t>(slots.size());
  TORCH_CHECK(positions.size() == slots.size(), "slots and positions differ in length");
  TORCH_CHECK(tokens.dim() == 1 && tokens.size(0) == n && tokens.scalar_type() == at::kLong &&
                  tokens.device().is_cpu(),
              "tokens must be int64 [S] on the CPU, a token per slot");
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(slots[i] >= 0 && slots[i] < token_ids.size(0) && positions[i] >= 0 &&
                    positions[i] < token_ids.size(1),
                "position ", positions[i], " of slot ", slots[i], " is outside the token ids");
  const at::Tensor values = tokens.contiguous();
  const int64_t* token = values.data_ptr<int64_t>();
  int64_t* tok = token_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) tok[slots[i] * token_ids.stride(0) + positions[i]] = token[i];
  return std::vector<int64_t>(token, token + n);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pagedserve worker: a step's inputs from the runner's per-slot arrays, and its tokens back";
  m.def("step_inputs", &step_inputs,
        "A step's input ids, positions, slot mapping, block tables, query starts and context lengths");
  m.def("append_tokens_", &append_tokens_, "Each slot's sampled token written at its position");
}
