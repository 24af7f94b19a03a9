#include "absolute_checks.hpp"

#include <cstdint>
#include <string>

namespace posenc::detail {
namespace {

// [first byte, one past the last byte] touched by a view.
struct ByteRange {
  std::uintptr_t begin = 0, end = 0;
};

ByteRange byte_range(ConstTensorView v) {
  std::int64_t last = 0;
  for (int axis = 0; axis < v.rank(); ++axis) {
    if (v.size(axis) == 0) return {};
    last += (v.size(axis) - 1) * v.stride(axis);
  }
  const auto begin = reinterpret_cast<std::uintptr_t>(v.data());
  const auto size = static_cast<std::uintptr_t>(dtype_size(v.dtype()));
  return {begin, begin + (static_cast<std::uintptr_t>(last) + 1) * size};
}

bool same_layout(ConstTensorView a, ConstTensorView b) {
  if (a.data() != b.data() || a.rank() != b.rank()) return false;
  for (int axis = 0; axis < a.rank(); ++axis) {
    if (a.size(axis) != b.size(axis) || a.stride(axis) != b.stride(axis)) return false;
  }
  return true;
}

void check_positions_against_table(const char* where, const Positions& positions, std::int64_t max_len) {
  if (positions.seq_len() > 0 && positions.max_position() >= max_len) {
    throw Error(where, "position", std::to_string(positions.max_position()),
                "a position < max_len = " + std::to_string(max_len) +
                    ": a learned table has no row beyond max_len and does not extrapolate");
  }
}

}  // namespace

void check_alias(const char* where, const char* out_name, ConstTensorView out, const char* in_name, ConstTensorView in,
                 Alias allowed) {
  if (allowed == Alias::kDisjointOrInPlace && same_layout(out, in)) return;
  const ByteRange a = byte_range(out), b = byte_range(in);
  if (a.begin < b.end && b.begin < a.end) {
    throw Error(where, out_name, out.describe(),
                std::string("memory disjoint from ") + in_name + " (" + in.describe() + ")" +
                    (allowed == Alias::kDisjointOrInPlace ? " or exactly the same view (in place)" : ""));
  }
}

Grid check_sinusoidal_table(const SinusoidalParams& params, const Positions& positions, ConstTensorView out) {
  const char* where = "sinusoidal_table";
  const Grid g = matrix_grid(where, "out", out);
  if (g.dim != params.dim()) {
    throw Error(where, "out.size(1)", std::to_string(g.dim), "params.dim() = " + std::to_string(params.dim()));
  }
  if (positions.batch() > 1) {
    throw Error(where, "positions.batch()", std::to_string(positions.batch()),
                "0 or 1 (a table has one row per position)");
  }
  positions.check_grid(where, 1, g.seq);
  check_writable(where, "out", out);
  return g;
}

AddGrids check_sinusoidal_add(const SinusoidalParams& params, ConstTensorView x, const Positions& positions,
                              ConstTensorView out) {
  const char* where = "sinusoidal_add";
  AddGrids g{token_grid(where, "x", x), token_grid(where, "out", out)};
  if (g.x.dim != params.dim()) {
    throw Error(where, "x.size(-1)", std::to_string(g.x.dim), "params.dim() = " + std::to_string(params.dim()));
  }
  check_same_dims(where, "out", g.out, "x", g.x);
  check_dtype(where, "out", out.dtype(), x.dtype());
  positions.check_grid(where, g.x.batch, g.x.seq);
  check_writable(where, "out", out);
  check_alias(where, "out", out, "x", x, Alias::kDisjointOrInPlace);
  return g;
}

namespace {

// Names of the three tensors of a learned op, for messages: forward (table, x, y), backward
// (d_table, dy, dx).
struct LearnedNames {
  const char* table;
  const char* x;
  const char* out;
};

LearnedGrids check_learned(const char* where, const LearnedNames& names, ConstTensorView table, ConstTensorView x,
                           const Positions& positions, ConstTensorView out, bool out_optional) {
  LearnedGrids g;
  g.table = matrix_grid(where, names.table, table);
  g.x = token_grid(where, names.x, x);
  if (g.x.dim != g.table.dim) {
    throw Error(where, std::string(names.x) + ".size(-1)", std::to_string(g.x.dim),
                "the width of " + std::string(names.table) + ", " + std::to_string(g.table.dim));
  }
  check_dtype(where, names.x, x.dtype(), table.dtype());
  positions.check_grid(where, g.x.batch, g.x.seq);
  check_positions_against_table(where, positions, g.table.seq);
  g.has_dx = !(out_optional && out.data() == nullptr && out.rank() == 0);
  if (g.has_dx) {
    g.out = token_grid(where, names.out, out);
    check_same_dims(where, names.out, g.out, names.x, g.x);
    check_dtype(where, names.out, out.dtype(), table.dtype());
    check_writable(where, names.out, out);
  }
  return g;
}

}  // namespace

LearnedGrids check_learned_forward(ConstTensorView table, ConstTensorView x, const Positions& positions,
                                   ConstTensorView y) {
  const char* where = "learned_forward";
  const LearnedGrids g = check_learned(where, {"table", "x", "y"}, table, x, positions, y, false);
  check_alias(where, "y", y, "x", x, Alias::kDisjointOrInPlace);
  check_alias(where, "y", y, "table", table, Alias::kDisjoint);
  return g;
}

LearnedGrids check_learned_backward(ConstTensorView dy, const Positions& positions, ConstTensorView d_table,
                                    ConstTensorView dx) {
  const char* where = "learned_backward";
  const LearnedGrids g = check_learned(where, {"d_table", "dy", "dx"}, d_table, dy, positions, dx, true);
  check_writable(where, "d_table", d_table);
  check_alias(where, "d_table", d_table, "dy", dy, Alias::kDisjoint);
  if (g.has_dx) {
    check_alias(where, "dx", dx, "d_table", d_table, Alias::kDisjoint);
    check_alias(where, "dx", dx, "dy", dy, Alias::kDisjoint);
  }
  return g;
}

void check_disjoint(const char* where, std::initializer_list<NamedView> outputs,
                    std::initializer_list<NamedView> inputs) {
  const auto empty = [](ConstTensorView v) { return v.rank() == 0 || v.data() == nullptr; };
  for (auto o = outputs.begin(); o != outputs.end(); ++o) {
    if (empty(o->second)) continue;
    for (const NamedView& in : inputs) {
      if (!empty(in.second)) check_alias(where, o->first, o->second, in.first, in.second, Alias::kDisjoint);
    }
    for (auto other = std::next(o); other != outputs.end(); ++other) {
      if (!empty(other->second)) check_alias(where, o->first, o->second, other->first, other->second, Alias::kDisjoint);
    }
  }
}

}  // namespace posenc::detail
