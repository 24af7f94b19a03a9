// fp64 scalar reference of rotary embedding (see posenc/rotary.hpp). Every angle p·ω_i, its libm
// cos/sin and the rotation in fp64, rounded once on store. Independent of the kernels' exact
// reduction and coefficient layout.
#include <cmath>
#include <vector>

#include "posenc/reference.hpp"
#include "ref/transforms_ref.hpp"
#include "rotary_checks.hpp"

namespace posenc::ref {
namespace {

// Index of the two members of pair i.
struct PairIndex {
  std::int64_t first, second;
};
PairIndex pair_index(const RopeParams& params, std::int64_t i) {
  const std::int64_t o = params.rotary_offset();
  if (params.layout() == RopeLayout::kInterleaved) return {o + 2 * i, o + 2 * i + 1};
  return {o + i, o + i + params.rotary_dim() / 2};
}

void rotate(const detail::HeadsGrid& in_g, const void* in, const detail::HeadsGrid& out_g, void* out, DType dtype,
            std::int64_t b, std::int64_t s, const RopeParams& params, const std::vector<double>& cos_a,
            const std::vector<double>& sin_a) {
  std::vector<double> row(static_cast<std::size_t>(params.head_dim()));
  for (std::int64_t h = 0; h < in_g.heads; ++h) {
    const std::int64_t in_off = in_g.offset(b, s) + h * in_g.head_stride;
    const std::int64_t out_off = out_g.offset(b, s) + h * out_g.head_stride;
    for (std::int64_t j = 0; j < params.head_dim(); ++j) {
      row[static_cast<std::size_t>(j)] = detail::load(in, dtype, in_off + j * in_g.dim_stride);
    }
    for (std::int64_t i = 0; i < params.rotary_dim() / 2; ++i) {
      const PairIndex p = pair_index(params, i);
      const double a = row[static_cast<std::size_t>(p.first)], bb = row[static_cast<std::size_t>(p.second)];
      const double c = cos_a[static_cast<std::size_t>(i)], sn = sin_a[static_cast<std::size_t>(i)];
      row[static_cast<std::size_t>(p.first)] = a * c - bb * sn;
      row[static_cast<std::size_t>(p.second)] = bb * c + a * sn;
    }
    for (std::int64_t j = 0; j < params.head_dim(); ++j) {
      detail::store(out, dtype, out_off + j * out_g.dim_stride, row[static_cast<std::size_t>(j)]);
    }
  }
}

}  // namespace

void rope_apply(const RopeParams& params, const Positions& positions, ConstTensorView q, ConstTensorView k,
                TensorView q_out, TensorView k_out, RopeDirection direction, std::int64_t seq_len) {
  detail::init_dispatch();
  const detail::RopeGrids g = detail::check_rope(params, positions, q, k, q_out, k_out);
  const std::int64_t len = seq_len > 0 ? seq_len : positions.max_position() + 1;
  const std::vector<double> w = params.inv_frequencies(len);
  // forward: α·S·R(θ); backward: α·S·R(−θ); inverse: R(−θ)/(α·S).
  const bool inverse = direction == RopeDirection::kInverse;
  const double alpha = inverse ? 1.0 / params.attention_factor() : params.attention_factor();
  const double sign = direction == RopeDirection::kForward ? 1.0 : -1.0;
  std::vector<double> cos_a(w.size()), sin_a(w.size());
  for (std::int64_t b = 0; b < g.q.batch; ++b) {
    for (std::int64_t s = 0; s < g.q.seq; ++s) {
      const auto p = static_cast<double>(positions.at(b, s));
      for (const double side : {1.0, -1.0}) {  // q, then k (they differ only under xPos)
        if (side < 0 && !g.has_k) break;
        for (std::size_t i = 0; i < w.size(); ++i) {
          double scale = alpha;
          if (params.xpos()) {
            scale *= std::pow(params.xpos_zeta(static_cast<std::int64_t>(i)),
                              (inverse ? -side : side) * params.xpos_exponent(p));
          }
          cos_a[i] = scale * std::cos(p * w[i]);
          sin_a[i] = sign * scale * std::sin(p * w[i]);
        }
        if (side > 0) {
          rotate(g.q, q.data(), g.q_out, q_out.data(), q.dtype(), b, s, params, cos_a, sin_a);
        } else {
          rotate(g.k, k.data(), g.k_out, k_out.data(), k.dtype(), b, s, params, cos_a, sin_a);
        }
      }
    }
  }
}

void rope_apply_multi(const RopeParams& params, std::span<const std::int64_t> sections,
                      std::span<const Positions> axis_positions, ConstTensorView q, ConstTensorView k, TensorView q_out,
                      TensorView k_out, RopeDirection direction, bool restart_frequencies, std::int64_t seq_len) {
  if (axis_positions.empty() || axis_positions.size() != sections.size()) {
    throw Error("rope_apply_multi", "axis_positions.size()", std::to_string(axis_positions.size()),
                "one Positions per section (" + std::to_string(sections.size()) + "), at least one");
  }
  const std::vector<std::int64_t> axes =
      detail::sections_to_axes("rope_apply_multi", sections, MropeLayout::kSections, params.rotary_dim() / 2);
  ref::rope_apply_axes(params, axes, axis_positions, q, k, q_out, k_out, direction, restart_frequencies, seq_len);
}

void rope_apply_axes(const RopeParams& params, std::span<const std::int64_t> axis_of_pair,
                     std::span<const Positions> axis_positions, ConstTensorView q, ConstTensorView k, TensorView q_out,
                     TensorView k_out, RopeDirection direction, bool restart_frequencies, std::int64_t seq_len) {
  detail::init_dispatch();
  const detail::MultiAxis m =
      detail::check_rope_multi(params, axis_of_pair, axis_positions, q, k, q_out, k_out, restart_frequencies, seq_len);
  const detail::RopeGrids& g = m.grids;
  const bool inverse = direction == RopeDirection::kInverse;
  const double alpha = inverse ? 1.0 / params.attention_factor() : params.attention_factor();
  const double sign = direction == RopeDirection::kForward ? 1.0 : -1.0;
  std::vector<double> cos_a(m.pair_freq.size()), sin_a(m.pair_freq.size());
  for (std::int64_t b = 0; b < g.q.batch; ++b) {
    for (std::int64_t s = 0; s < g.q.seq; ++s) {
      for (std::size_t i = 0; i < m.pair_freq.size(); ++i) {
        const auto p = static_cast<double>(axis_positions[static_cast<std::size_t>(m.pair_axis[i])].at(b, s));
        cos_a[i] = alpha * std::cos(p * m.pair_freq[i]);
        sin_a[i] = sign * alpha * std::sin(p * m.pair_freq[i]);
      }
      rotate(g.q, q.data(), g.q_out, q_out.data(), q.dtype(), b, s, params, cos_a, sin_a);
      if (g.has_k) rotate(g.k, k.data(), g.k_out, k_out.data(), k.dtype(), b, s, params, cos_a, sin_a);
    }
  }
}

void rope_rerotate(const RopeParams& from, const Positions& from_positions, std::int64_t from_seq_len,
                   const RopeParams& to, const Positions& to_positions, std::int64_t to_seq_len, ConstTensorView k,
                   TensorView k_out) {
  // The definition: undo `from`, then apply `to` (as keys), both in fp64, through an f64 copy.
  detail::init_dispatch();
  const detail::RopeGrids g = detail::check_rope(to, to_positions, k, {}, k_out, {});
  from_positions.check_grid("rope_rerotate", g.q.batch, g.q.seq);
  const std::vector<std::int64_t> shape = {g.q.batch, g.q.seq, g.q.heads, g.q.dim};
  std::vector<double> keys(static_cast<std::size_t>(g.q.batch * g.q.seq * g.q.heads * g.q.dim));
  const TensorView copy = TensorView::contiguous(keys.data(), DType::kF64, shape);
  std::vector<double> dummy(keys.size());
  const TensorView q_dummy = TensorView::contiguous(dummy.data(), DType::kF64, shape);
  // Keys go in the k slot (xPos treats keys with ζ^(−e)); q is a zero dummy.
  for (std::int64_t b = 0; b < g.q.batch; ++b) {
    for (std::int64_t s = 0; s < g.q.seq; ++s) {
      for (std::int64_t h = 0; h < g.q.heads; ++h) {
        for (std::int64_t j = 0; j < g.q.dim; ++j) {
          keys[static_cast<std::size_t>(((b * g.q.seq + s) * g.q.heads + h) * g.q.dim + j)] =
              detail::load(k.data(), k.dtype(), g.q.offset(b, s) + h * g.q.head_stride + j * g.q.dim_stride);
        }
      }
    }
  }
  ref::rope_apply(from, from_positions, q_dummy, copy, q_dummy, copy, RopeDirection::kInverse, from_seq_len);
  ref::rope_apply(to, to_positions, q_dummy, copy, q_dummy, copy, RopeDirection::kForward, to_seq_len);
  for (std::int64_t b = 0; b < g.q.batch; ++b) {
    for (std::int64_t s = 0; s < g.q.seq; ++s) {
      for (std::int64_t h = 0; h < g.q.heads; ++h) {
        for (std::int64_t j = 0; j < g.q.dim; ++j) {
          detail::store(k_out.data(), k_out.dtype(),
                        g.q_out.offset(b, s) + h * g.q_out.head_stride + j * g.q_out.dim_stride,
                        keys[static_cast<std::size_t>(((b * g.q.seq + s) * g.q.heads + h) * g.q.dim + j)]);
        }
      }
    }
  }
}

void rope_cos_sin(const RopeParams& params, const Positions& positions, TensorView cos, TensorView sin,
                  std::int64_t seq_len) {
  detail::init_dispatch();
  const detail::Grid g = detail::check_rope_cos_sin(params, positions, cos, sin);
  const std::int64_t len = seq_len > 0 ? seq_len : positions.max_position() + 1;
  const std::vector<double> w = params.inv_frequencies(len);
  const double alpha = params.attention_factor();
  for (std::int64_t n = 0; n < g.seq; ++n) {
    const auto p = static_cast<double>(positions.at(0, n));
    for (std::size_t i = 0; i < w.size(); ++i) {
      const auto col = static_cast<std::int64_t>(i);
      detail::store(cos.data(), cos.dtype(), g.offset(0, n) + col * g.dim_stride, alpha * std::cos(p * w[i]));
      detail::store(sin.data(), sin.dtype(), n * sin.stride(0) + col * sin.stride(1), alpha * std::sin(p * w[i]));
    }
  }
}

// Keys go in rope_apply's k slot (xPos scales them the other way); the q slot then holds a
// discarded copy.
void apply_transform(const RotaryQK& rope, const TransformedRows& rows) {
  if (!rows.is_q && rope.keys_rotated) return;
  const TensorView view = TensorView::of(rows.v.data(), {rows.n, 1, rows.d});
  std::vector<double> other(rows.v);
  const TensorView other_view = TensorView::of(other.data(), {rows.n, 1, rows.d});
  const RopeDirection dir = rows.transpose ? RopeDirection::kBackward : RopeDirection::kForward;
  const std::int64_t seq_len = rope.seq_len > 0 ? rope.seq_len : rows.default_seq_len;
  if (rows.is_q) {
    ref::rope_apply(rope.params, rows.positions, view, TensorView{}, view, TensorView{}, dir, seq_len);
  } else {
    ref::rope_apply(rope.params, rows.positions, other_view, view, other_view, view, dir, seq_len);
  }
}

}  // namespace posenc::ref
