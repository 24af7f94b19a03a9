// fp64 scalar reference of the absolute encodings (see posenc/absolute.hpp for the math).
// Plain loops over any dtype and strides; every value is computed and accumulated in fp64 and
// rounded once on store. Deliberately written without the column tables or the angle reduction
// of the SIMD kernels, so that it is an independent oracle for them.
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "absolute_checks.hpp"
#include "posenc/reference.hpp"
#include "ref/transforms_ref.hpp"

namespace posenc::ref {
namespace {

// PE(p, column j) for either layout.
double sinusoid_value(const SinusoidalParams& params, std::int64_t position, std::int64_t j) {
  const std::int64_t d = params.dim();
  const bool interleaved = params.layout() == SinusoidalLayout::kInterleaved;
  const std::int64_t i = interleaved ? j / 2 : (j < d / 2 ? j : j - d / 2);
  const bool is_cos = interleaved ? (j % 2 == 1) : (j >= d / 2);
  const double angle = static_cast<double>(position) * detail::sinusoid_inv_frequency(params.base(), d, i);
  return is_cos ? std::cos(angle) : std::sin(angle);
}

}  // namespace

void sinusoidal_table(const SinusoidalParams& params, const Positions& positions, TensorView out) {
  detail::init_dispatch();
  const detail::Grid g = detail::check_sinusoidal_table(params, positions, out);
  for (std::int64_t n = 0; n < g.seq; ++n) {
    const std::int64_t p = positions.at(0, n);
    for (std::int64_t j = 0; j < g.dim; ++j) {
      detail::store(out.data(), out.dtype(), g.offset(0, n) + j * g.dim_stride, sinusoid_value(params, p, j));
    }
  }
}

void sinusoidal_add(const SinusoidalParams& params, ConstTensorView x, const Positions& positions, TensorView out) {
  detail::init_dispatch();
  const detail::AddGrids g = detail::check_sinusoidal_add(params, x, positions, out);
  for (std::int64_t b = 0; b < g.x.batch; ++b) {
    for (std::int64_t s = 0; s < g.x.seq; ++s) {
      const std::int64_t p = positions.at(b, s);
      for (std::int64_t j = 0; j < g.x.dim; ++j) {
        const double xv = detail::load(x.data(), x.dtype(), g.x.offset(b, s) + j * g.x.dim_stride);
        detail::store(out.data(), out.dtype(), g.out.offset(b, s) + j * g.out.dim_stride,
                      xv + sinusoid_value(params, p, j));
      }
    }
  }
}

void learned_forward(ConstTensorView table, ConstTensorView x, const Positions& positions, TensorView y) {
  detail::init_dispatch();
  const detail::LearnedGrids g = detail::check_learned_forward(table, x, positions, y);
  for (std::int64_t b = 0; b < g.x.batch; ++b) {
    for (std::int64_t s = 0; s < g.x.seq; ++s) {
      const std::int64_t row = positions.at(b, s);
      for (std::int64_t j = 0; j < g.x.dim; ++j) {
        const double xv = detail::load(x.data(), x.dtype(), g.x.offset(b, s) + j * g.x.dim_stride);
        const double wv = detail::load(table.data(), table.dtype(), g.table.offset(0, row) + j * g.table.dim_stride);
        detail::store(y.data(), y.dtype(), g.out.offset(b, s) + j * g.out.dim_stride, xv + wv);
      }
    }
  }
}

void learned_backward(ConstTensorView dy, const Positions& positions, TensorView d_table, TensorView dx) {
  detail::init_dispatch();
  const detail::LearnedGrids g = detail::check_learned_backward(dy, positions, d_table, dx);
  // Restating the forward: y[b, s] = x[b, s] + W[pos(b, s)].
  // Each table row accumulates in fp64 over its tokens in token order, then rounds once. Tokens
  // are grouped by row with a stable sort of (row, token index).
  std::vector<std::pair<std::int64_t, std::int64_t>> by_row;  // (row, token)
  by_row.reserve(static_cast<std::size_t>(g.x.batch * g.x.seq));
  for (std::int64_t t = 0; t < g.x.batch * g.x.seq; ++t) {
    by_row.emplace_back(positions.at(t / g.x.seq, t % g.x.seq), t);
  }
  std::sort(by_row.begin(), by_row.end());
  std::vector<double> row_sum(static_cast<std::size_t>(g.table.dim));
  for (std::size_t first = 0; first < by_row.size();) {
    const std::int64_t row = by_row[first].first;
    const std::int64_t row_off = g.table.offset(0, row);
    for (std::int64_t j = 0; j < g.table.dim; ++j) {
      row_sum[static_cast<std::size_t>(j)] =
          detail::load(d_table.data(), d_table.dtype(), row_off + j * g.table.dim_stride);
    }
    std::size_t last = first;
    for (; last < by_row.size() && by_row[last].first == row; ++last) {
      const std::int64_t t = by_row[last].second;
      const std::int64_t dy_off = g.x.offset(t / g.x.seq, t % g.x.seq);
      for (std::int64_t j = 0; j < g.x.dim; ++j) {
        row_sum[static_cast<std::size_t>(j)] += detail::load(dy.data(), dy.dtype(), dy_off + j * g.x.dim_stride);
      }
    }
    for (std::int64_t j = 0; j < g.table.dim; ++j) {
      detail::store(d_table.data(), d_table.dtype(), row_off + j * g.table.dim_stride,
                    row_sum[static_cast<std::size_t>(j)]);
    }
    first = last;
  }
  if (!g.has_dx) return;
  for (std::int64_t b = 0; b < g.x.batch; ++b) {
    for (std::int64_t s = 0; s < g.x.seq; ++s) {
      for (std::int64_t j = 0; j < g.x.dim; ++j) {
        const std::int64_t o = g.out.offset(b, s) + j * g.out.dim_stride;
        detail::store(dx.data(), dx.dtype(), o,
                      detail::load(dx.data(), dx.dtype(), o) +
                          detail::load(dy.data(), dy.dtype(), g.x.offset(b, s) + j * g.x.dim_stride));
      }
    }
  }
}

// Shortformer adds the sinusoid to the rows; its transpose leaves a gradient as it is.
void apply_transform(const AbsoluteQK& absolute, const TransformedRows& rows) {
  if (rows.transpose) return;
  std::vector<double> table(static_cast<std::size_t>(rows.n * rows.d));
  ref::sinusoidal_table(absolute.params, rows.positions, TensorView::of(table.data(), {rows.n, rows.d}));
  for (std::size_t t = 0; t < table.size(); ++t) rows.v[t] += table[t];
}

}  // namespace posenc::ref
