#include "rotary_checks.hpp"

#include <cmath>
#include <string>

#include "absolute_checks.hpp"

namespace posenc::detail {
namespace {

constexpr const char* kWhere = "rope_apply";

std::string shape_text(const HeadsGrid& g) {
  return "[" + std::to_string(g.batch) + ", " + std::to_string(g.seq) + ", " + std::to_string(g.heads) + ", " +
         std::to_string(g.dim) + "]";
}

bool is_empty_view(ConstTensorView v) { return v.rank() == 0 && v.data() == nullptr; }

// An output of a rotation: the input's shape and dtype, writable, and the input itself or
// disjoint from it.
HeadsGrid check_output(const char* name, ConstTensorView out, const char* in_name, ConstTensorView in,
                       const HeadsGrid& in_grid) {
  const HeadsGrid g = heads_grid(kWhere, name, out);
  if (g.batch != in_grid.batch || g.seq != in_grid.seq || g.heads != in_grid.heads || g.dim != in_grid.dim) {
    throw Error(kWhere, std::string(name) + " shape", shape_text(g),
                "the shape of " + std::string(in_name) + ", " + shape_text(in_grid));
  }
  check_dtype(kWhere, name, out.dtype(), in.dtype());
  check_writable(kWhere, name, out);
  check_alias(kWhere, name, out, in_name, in, Alias::kDisjointOrInPlace);
  return g;
}

}  // namespace

RopeGrids check_rope(const RopeParams& params, const Positions& positions, ConstTensorView q, ConstTensorView k,
                     ConstTensorView q_out, ConstTensorView k_out) {
  RopeGrids g;
  g.q = heads_grid(kWhere, "q", q);
  if (g.q.dim != params.head_dim()) {
    throw Error(kWhere, "q.size(-1)", std::to_string(g.q.dim),
                "params.head_dim() = " + std::to_string(params.head_dim()));
  }
  positions.check_grid(kWhere, g.q.batch, g.q.seq);
  g.q_out = check_output("q_out", q_out, "q", q, g.q);
  g.has_k = !is_empty_view(k);
  if (g.has_k != !is_empty_view(k_out)) {
    throw Error(kWhere, "k_out", g.has_k ? "empty" : k_out.describe(), "a view exactly when k is one");
  }
  if (g.has_k) {
    g.k = heads_grid(kWhere, "k", k);
    if (g.k.batch != g.q.batch || g.k.seq != g.q.seq || g.k.dim != g.q.dim) {
      throw Error(kWhere, "k shape", shape_text(g.k),
                  "the tokens and head_dim of q " + shape_text(g.q) + " (any number of heads)");
    }
    check_dtype(kWhere, "k", k.dtype(), q.dtype());
    g.k_out = check_output("k_out", k_out, "k", k, g.k);
    check_alias(kWhere, "k_out", k_out, "q", q, Alias::kDisjoint);
    check_alias(kWhere, "k_out", k_out, "q_out", q_out, Alias::kDisjoint);
    check_alias(kWhere, "q_out", q_out, "k", k, Alias::kDisjoint);
  }
  return g;
}

std::vector<std::int64_t> sections_to_axes(const char* where, std::span<const std::int64_t> sections,
                                           MropeLayout layout, std::int64_t pairs) {
  std::int64_t total = 0;
  for (std::size_t a = 0; a < sections.size(); ++a) {
    if (sections[a] < 1 || sections[a] > (pairs > 0 ? pairs : std::int64_t{1} << 30)) {
      throw Error(where, "sections[" + std::to_string(a) + "]", std::to_string(sections[a]),
                  pairs > 0 ? "1 to rotary_dim / 2 = " + std::to_string(pairs) + " pairs" : "1 to 2^30 pairs");
    }
    total += sections[a];
  }
  if (sections.empty()) throw Error(where, "sections", "empty", "at least one section");
  if (pairs > 0 && total != pairs) {
    throw Error(where, "sum of sections", std::to_string(total), "rotary_dim / 2 = " + std::to_string(pairs));
  }
  std::vector<std::int64_t> axes;
  if (layout == MropeLayout::kSections) {
    for (std::size_t a = 0; a < sections.size(); ++a)
      axes.insert(axes.end(), static_cast<std::size_t>(sections[a]), static_cast<std::int64_t>(a));
    return axes;
  }
  if (sections.size() != 3) {
    throw Error(where, "sections.size()", std::to_string(sections.size()),
                "3 (time, height, width) for interleaved M-RoPE");
  }
  std::vector<std::int64_t> counts(3, 0);
  for (std::int64_t i = 0; i < total; ++i) {
    const std::int64_t a = i % 3 == 1 && i < 3 * sections[1] ? 1 : i % 3 == 2 && i < 3 * sections[2] ? 2 : 0;
    axes.push_back(a);
    ++counts[static_cast<std::size_t>(a)];
  }
  for (std::size_t a = 0; a < 3; ++a) {
    if (counts[a] != sections[a]) {
      throw Error(where, "sections[" + std::to_string(a) + "]", std::to_string(sections[a]),
                  std::to_string(counts[a]) + " (interleaving gives axis " + std::to_string(a) +
                      " that many pairs: each of h and w at most a third of the pairs)");
    }
  }
  return axes;
}

MultiAxis check_rope_multi(const RopeParams& params, std::span<const std::int64_t> axis_of_pair,
                           std::span<const Positions> axis_positions, ConstTensorView q, ConstTensorView k,
                           ConstTensorView q_out, ConstTensorView k_out, bool restart_frequencies,
                           std::int64_t seq_len) {
  const char* where = "rope_apply_axes";
  const std::int64_t pairs = params.rotary_dim() / 2;
  if (axis_positions.empty()) throw Error(where, "axis_positions.size()", "0", "at least one axis");
  if (static_cast<std::int64_t>(axis_of_pair.size()) != pairs) {
    throw Error(where, "axis_of_pair.size()", std::to_string(axis_of_pair.size()),
                "rotary_dim / 2 = " + std::to_string(pairs));
  }
  const auto axes = static_cast<std::int64_t>(axis_positions.size());
  std::vector<std::int64_t> per_axis(static_cast<std::size_t>(axes), 0);
  for (std::size_t i = 0; i < axis_of_pair.size(); ++i) {
    if (axis_of_pair[i] < 0 || axis_of_pair[i] >= axes) {
      throw Error(where, "axis_of_pair[" + std::to_string(i) + "]", std::to_string(axis_of_pair[i]),
                  "an axis in [0, " + std::to_string(axes) + ") (one Positions each)");
    }
    ++per_axis[static_cast<std::size_t>(axis_of_pair[i])];
  }
  if (params.xpos()) throw Error(where, "params.xpos()", "true", "false (xPos is defined for one axis)");
  if (restart_frequencies && params.scaling().type != RopeType::kDefault) {
    throw Error(where, "params.scaling().type", std::string(rope_type_name(params.scaling().type)),
                "default when frequencies restart per axis");
  }
  MultiAxis m;
  m.grids = check_rope(params, axis_positions[0], q, k, q_out, k_out);
  std::int64_t max_position = 0;
  for (const Positions& p : axis_positions) {
    p.check_grid(where, m.grids.q.batch, m.grids.q.seq);
    max_position = std::max(max_position, p.max_position());
  }
  const std::vector<double> w = params.inv_frequencies(seq_len > 0 ? seq_len : max_position + 1);
  std::vector<std::int64_t> rank(static_cast<std::size_t>(axes), 0);  // pairs of each axis so far
  for (std::size_t i = 0; i < axis_of_pair.size(); ++i) {
    const auto a = static_cast<std::size_t>(axis_of_pair[i]);
    m.pair_axis.push_back(axis_of_pair[i]);
    m.pair_freq.push_back(restart_frequencies ? sinusoid_inv_frequency(params.base(), 2 * per_axis[a], rank[a]) : w[i]);
    ++rank[a];
  }
  return m;
}

void check_xpos_range(const RopeParams& params, const Positions& positions, std::int64_t batch, std::int64_t seq) {
  const double log_zeta0 = std::fabs(std::log(params.xpos_zeta(0)));
  const std::int64_t rows = positions.batch() == 0 ? 1 : batch;
  for (std::int64_t b = 0; b < rows; ++b) {
    for (std::int64_t s = 0; s < seq; ++s) {
      const std::int64_t p = positions.at(b, s);
      const double exponent = std::fabs(params.xpos_exponent(static_cast<double>(p)));
      if (exponent * log_zeta0 > 80.0) {
        throw Error("rope (xPos)", "position", std::to_string(p),
                    "|position − center| <= " + to_text(80.0 / log_zeta0 * params.xpos_scale_base()) + " (center " +
                        to_text(params.xpos_center()) +
                        "): xPos scales by ζ^((p − center)/scale_base), which leaves f32 range beyond");
      }
    }
  }
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
