// The query/key transforms as the fp64 attention reference applies them: each transform of a
// HeadGroup (posenc/attention.hpp: QKTransform) has an overload in its scheme's reference file
// (rotary_ref.cpp, absolute_ref.cpp; a QKTransformScheme's in transform_ref.cpp), and the
// reference visits a group's transform without naming it, as the fused plan does with qk_tables
// (attention/transforms.hpp). Internal.
#pragma once

#include <cstdint>
#include <variant>
#include <vector>

#include "posenc/attention.hpp"
#include "posenc/error.hpp"

namespace posenc::ref {

// n rows of d values (row-major, fp64) at `positions`, changed in place: queries or keys, by the
// transform or by its transpose (the gradient's way back). default_seq_len: the call's largest
// position + 1 (RoPE's seq_len when none is given).
struct TransformedRows {
  bool is_q = true, transpose = false;
  const Positions& positions;
  std::int64_t default_seq_len = 1;
  std::int64_t n = 0, d = 0;
  std::vector<double>& v;
};

inline void apply_transform(const std::monostate& /* none */, const TransformedRows& /* rows */) {}
void apply_transform(const RotaryQK& rope, const TransformedRows& rows);
void apply_transform(const AbsoluteQK& absolute, const TransformedRows& rows);
// Any other transform, by its fp64 definition (transform_ref.cpp).
void apply_transform(const QKTransformRef& transform, const TransformedRows& rows);

}  // namespace posenc::ref
