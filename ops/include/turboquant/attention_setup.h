// TQAttention's shape contract, shared by every runtime adapter: from the attributes and the input
// shapes to the kernels' AttentionParams and the output shapes, or an InvalidArgument naming what
// was wrong. Element types are the adapters' business (each runtime has its own type enum).
#pragma once

#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "turboquant/params.h"

namespace turboquant {

using Dims = std::vector<int64_t>;

// An invalid input or attribute; the message starts with the op name.
struct InvalidArgument : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

std::string dims_str(const Dims& d);

// Throws InvalidArgument("<op>: <args...>").
template <typename... Args>
[[noreturn]] void throw_invalid(const char* op, Args&&... args) {
  std::ostringstream os;
  os << op << ": ";
  (os << ... << args);
  throw InvalidArgument(os.str());
}

struct AttentionAttrs {
  Format key_format = Format::kMse4, value_format = Format::kUint4;
  bool norm_correction = true, is_causal = false;
  int64_t head_dim = 0, q_num_heads = 0, kv_num_heads = 0;
  float scale = 0.f;
  void validate() const;  // throws InvalidArgument
};

struct AttentionShapes {
  Dims q, k, v;
  std::optional<Dims> mask, past_key, past_value, key_offset, value_offset;
};

struct AttentionSetup {
  AttentionParams params;  // pointers (mask, offsets) left null: the adapter sets them
  Dims y, present_key, present_value;
};

// mask_type: kNone when no mask is given.
AttentionSetup setup_attention(const AttentionAttrs& attrs, const AttentionShapes& shapes, DType dtype,
                               MaskType mask_type);

}  // namespace turboquant
