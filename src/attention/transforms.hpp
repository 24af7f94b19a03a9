// The query/key transforms' part in the fused attention: each transform of a HeadGroup
// (posenc/attention.hpp: QKTransform) tabulates itself for a call in its scheme's file
// (src/schemes/rope_transform.cpp, absolute_transform.cpp), and the plan asks for the tables
// without naming it. Any other transform is a QKTransformScheme (posenc/scheme.hpp) held by
// QKTransformRef, tabulated from its fp64 definition (generic_transform.cpp). Internal.
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "attention/attention_plan.hpp"
#include "posenc/error.hpp"

namespace posenc::detail {

// The rows a call's tables hold: a position per row (a dense range, or one per token), the
// largest position (dynamic / longrope frequencies), q's head size and the call's positions.
struct TransformRows {
  const char* where;
  std::string name;  // "groups[g].transform", for errors
  const std::vector<std::int64_t>& table_ids;
  const Positions& table_positions;
  std::int64_t p_max, head_dim;
  const Positions &q_positions, &k_positions;
  std::int64_t batch_rows, q_len, k_len;
};

// Whether the transform changes the keys too (not RoPE over a cache of rotated keys): where no
// group's does, the tables hold the queries' positions alone.
inline bool transforms_keys(const std::monostate&) { return false; }
inline bool transforms_keys(const RotaryQK& rope) { return !rope.keys_rotated; }
inline bool transforms_keys(const AbsoluteQK&) { return true; }
inline bool transforms_keys(const QKTransformRef&) { return true; }

inline QKTables qk_tables(const std::monostate&, const TransformRows&) { return {}; }
QKTables qk_tables(const RotaryQK& rope, const TransformRows& rows);
QKTables qk_tables(const AbsoluteQK& absolute, const TransformRows& rows);
QKTables qk_tables(const QKTransformRef& transform, const TransformRows& rows);

}  // namespace posenc::detail
