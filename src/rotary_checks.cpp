#include "rotary_checks.hpp"

#include <string>

#include "absolute_checks.hpp"

namespace posenc::detail {
namespace {

constexpr const char* kWhere = "rope_apply";

HeadsGrid heads_grid(const char* name, ConstTensorView v) {
  HeadsGrid g;
  if (v.rank() == 4) {
    g = {v.size(0), v.size(1), v.size(2), v.size(3), v.stride(0), v.stride(1), v.stride(2), v.stride(3)};
  } else if (v.rank() == 3) {
    g = {1, v.size(0), v.size(1), v.size(2), 0, v.stride(0), v.stride(1), v.stride(2)};
  } else {
    throw Error(kWhere, std::string(name) + ".rank()", std::to_string(v.rank()),
                "4 ([B, S, H, D]) or 3 (packed [T, H, D])");
  }
  return g;
}

std::string shape_text(const HeadsGrid& g) {
  return "[" + std::to_string(g.batch) + ", " + std::to_string(g.seq) + ", " + std::to_string(g.heads) +
         ", " + std::to_string(g.dim) + "]";
}

bool is_empty_view(ConstTensorView v) { return v.rank() == 0 && v.data() == nullptr; }

}  // namespace

RopeGrids check_rope(const RopeParams& params, const Positions& positions, ConstTensorView q,
                     ConstTensorView k, ConstTensorView q_out, ConstTensorView k_out) {
  RopeGrids g;
  g.q = heads_grid("q", q);
  if (g.q.dim != params.head_dim()) {
    throw Error(kWhere, "q.size(-1)", std::to_string(g.q.dim), "params.head_dim() = " + std::to_string(params.head_dim()));
  }
  positions.check_grid(kWhere, g.q.batch, g.q.seq);
  g.q_out = heads_grid("q_out", q_out);
  if (g.q_out.batch != g.q.batch || g.q_out.seq != g.q.seq || g.q_out.heads != g.q.heads || g.q_out.dim != g.q.dim) {
    throw Error(kWhere, "q_out shape", shape_text(g.q_out), "the shape of q, " + shape_text(g.q));
  }
  check_dtype(kWhere, "q_out", q_out.dtype(), q.dtype());
  check_writable(kWhere, "q_out", q_out);
  check_alias(kWhere, "q_out", q_out, "q", q, Alias::kDisjointOrInPlace);
  g.has_k = !is_empty_view(k);
  if (g.has_k != !is_empty_view(k_out)) {
    throw Error(kWhere, "k_out", g.has_k ? "empty" : k_out.describe(), "a view exactly when k is one");
  }
  if (g.has_k) {
    g.k = heads_grid("k", k);
    if (g.k.batch != g.q.batch || g.k.seq != g.q.seq || g.k.dim != g.q.dim) {
      throw Error(kWhere, "k shape", shape_text(g.k),
                  "the tokens and head_dim of q " + shape_text(g.q) + " (any number of heads)");
    }
    check_dtype(kWhere, "k", k.dtype(), q.dtype());
    g.k_out = heads_grid("k_out", k_out);
    if (g.k_out.batch != g.k.batch || g.k_out.seq != g.k.seq || g.k_out.heads != g.k.heads || g.k_out.dim != g.k.dim) {
      throw Error(kWhere, "k_out shape", shape_text(g.k_out), "the shape of k, " + shape_text(g.k));
    }
    check_dtype(kWhere, "k_out", k_out.dtype(), q.dtype());
    check_writable(kWhere, "k_out", k_out);
    check_alias(kWhere, "k_out", k_out, "k", k, Alias::kDisjointOrInPlace);
    check_alias(kWhere, "k_out", k_out, "q", q, Alias::kDisjoint);
    check_alias(kWhere, "k_out", k_out, "q_out", q_out, Alias::kDisjoint);
    check_alias(kWhere, "q_out", q_out, "k", k, Alias::kDisjoint);
  }
  return g;
}

Grid check_rope_cos_sin(const RopeParams& params, const Positions& positions, ConstTensorView cos,
                        ConstTensorView sin) {
  const char* where = "rope_cos_sin";
  const Grid g = matrix_grid(where, "cos", cos);
  const Grid gs = matrix_grid(where, "sin", sin);
  const std::int64_t pairs = params.rotary_dim() / 2;
  if (g.dim != pairs) {
    throw Error(where, "cos.size(1)", std::to_string(g.dim), "rotary_dim / 2 = " + std::to_string(pairs));
  }
  check_same_dims(where, "sin", gs, "cos", g);
  check_dtype(where, "sin", sin.dtype(), cos.dtype());
  if (positions.batch() > 1) {
    throw Error(where, "positions.batch()", std::to_string(positions.batch()), "0 or 1 (one row per position)");
  }
  positions.check_grid(where, 1, g.seq);
  check_writable(where, "cos", cos);
  check_writable(where, "sin", sin);
  check_alias(where, "sin", sin, "cos", cos, Alias::kDisjoint);
  return g;
}

}  // namespace posenc::detail
