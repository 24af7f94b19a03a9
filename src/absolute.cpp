// Public entry points of the absolute encodings: validation, threading and dtype handling around
// the SIMD row kernels (kernels/absolute/). f64 tensors and POSENC_TARGET=ref go to the fp64
// reference; f32 rows with unit column stride run the kernels in place; other f32/bf16/f16 rows go
// through a per-thread f32 scratch row.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "absolute_checks.hpp"
#include "kernels/absolute/absolute_kernels.hpp"
#include "kernels/common/row_kernels.hpp"
#include "posenc/absolute.hpp"
#include "posenc/reference.hpp"

namespace posenc {
namespace {

using detail::Grid;

constexpr std::int64_t kMaxSinusoidDim = std::int64_t{1} << 20;

// Column tables of a sinusoidal encoding (kernels/absolute/absolute_kernels.hpp), cached per
// thread: building them costs d/2 powl/sin/cos calls, and an encoding is typically applied many
// times with the same parameters.
class ColumnCache {
 public:
  kernels::SinusoidColumns get(const SinusoidalParams& params) {
    if (params.dim() != dim_ || params.base() != base_ || params.layout() != layout_) {
      build(params);
    }
    const std::size_t stride = static_cast<std::size_t>(dim_ / 2 + kernels::kColumnPadding);
    const double* t = table_.data();
    return {t, t + stride, t + 2 * stride, dim_, layout_ == SinusoidalLayout::kInterleaved};
  }

 private:
  void build(const SinusoidalParams& params) {
    dim_ = params.dim();
    base_ = params.base();
    layout_ = params.layout();
    const std::vector<double> inv_freq = params.inv_frequencies();
    const auto stride = static_cast<std::size_t>(dim_ / 2 + kernels::kColumnPadding);
    table_.assign(3 * stride, 0.0);
    double* freq = table_.data();
    double* step_cos = freq + stride;
    double* step_sin = freq + 2 * stride;
    for (std::size_t i = 0; i < inv_freq.size(); ++i) {
      freq[i] = inv_freq[i];
      step_cos[i] = std::cos(inv_freq[i]);
      step_sin[i] = std::sin(inv_freq[i]);
    }
  }

  std::int64_t dim_ = -1;
  double base_ = 0.0;
  SinusoidalLayout layout_ = SinusoidalLayout::kInterleaved;
  std::vector<double> table_;
};

kernels::SinusoidColumns columns_for(const SinusoidalParams& params) {
  thread_local ColumnCache cache;
  return cache.get(params);
}

// Outputs this large are written past the caches where the target streams (kernels decide), and
// their tables use runs of kernels::kMaxRun rows, which amortise the exact rows best.
constexpr std::int64_t kStreamBytes = std::int64_t{8} << 20;

// Rows per run of smaller outputs and of sinusoid-add. Where a run starts, its row is computed
// exactly; the rows after it are rotated, which moves the last fp64 bits and now and then an f32
// one. The run length is thus part of the values' bits (the study's golden results among them),
// not only of the speed: the kernels walk long runs in groups of kernels::kGroupRows rows anyway.
constexpr std::int64_t kCachedRun = 16;

// Per-thread f32 rows for dtypes or strides the kernels do not write directly. Grown on demand,
// never shrunk: no allocation per call once warm.
std::vector<float>& scratch_rows(std::int64_t dim) {
  thread_local std::vector<float> rows;
  const auto size = static_cast<std::size_t>(kCachedRun * dim);  // only unstreamed runs use it
  if (rows.size() < size) rows.resize(size);
  return rows;
}

// Per-thread rotation state of runs longer than kernels::kGroupRows rows.
double* run_state(std::int64_t dim) {
  thread_local std::vector<double> state;
  const auto size = static_cast<std::size_t>(kernels::sinusoid_state_doubles(dim));
  if (state.size() < size) state.resize(size);
  return state.data();
}

// Length of the run of consecutive positions starting at token s (at most `limit` tokens).
std::int64_t run_length(const Positions& positions, std::int64_t b, std::int64_t s, std::int64_t limit) {
  const std::int64_t first = positions.at(b, s);
  std::int64_t n = 1;
  while (n < limit && positions.at(b, s + n) == first + n) ++n;
  return n;
}

}  // namespace

SinusoidalParams::SinusoidalParams(std::int64_t dim, double base, SinusoidalLayout layout)
    : dim_(dim), base_(base), layout_(layout) {
  if (dim < 2 || dim % 2 != 0 || dim > kMaxSinusoidDim) {
    throw Error("sinusoidal", "dim", std::to_string(dim), "an even number in [2, 2^20]");
  }
  if (!(base > 1.0) || !std::isfinite(base)) {
    throw Error("sinusoidal", "base", detail::to_text(base), "a finite number > 1");
  }
  if (layout != SinusoidalLayout::kInterleaved && layout != SinusoidalLayout::kSplitHalves) {
    throw Error("sinusoidal", "layout", std::to_string(static_cast<int>(layout)), "kInterleaved or kSplitHalves");
  }
}

std::vector<double> SinusoidalParams::inv_frequencies() const {
  std::vector<double> inv_freq(static_cast<std::size_t>(dim_ / 2));
  for (std::int64_t i = 0; i < dim_ / 2; ++i) {
    inv_freq[static_cast<std::size_t>(i)] = detail::sinusoid_inv_frequency(base_, dim_, i);
  }
  return inv_freq;
}

// Both sinusoid entry points walk blocks of `run` tokens at fixed offsets (never split by the
// thread count) and, inside a block, runs of consecutive positions: the values depend only on
// the positions, never on how work was shared, so results are bitwise identical for any thread
// count.
void sinusoidal_table(const SinusoidalParams& params, const Positions& positions, TensorView out) {
  detail::init_dispatch();
  const Grid g = detail::check_sinusoidal_table(params, positions, out);
  if (detail::use_reference() || out.dtype() == DType::kF64) {
    ref::sinusoidal_table(params, positions, out);
    return;
  }
  const kernels::SinusoidColumns cols = columns_for(params);
  const bool direct = out.dtype() == DType::kF32 && g.dim_stride == 1;
  const bool stream = direct && g.seq * g.dim * 4 >= kStreamBytes;
  const std::int64_t run = stream ? kernels::kMaxRun : kCachedRun;
  const std::int64_t blocks = (g.seq + run - 1) / run;
  const int threads = detail::threads_for(g.seq * g.dim * 4);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float>& buf = scratch_rows(g.dim);
    double* state = run_state(g.dim);
#pragma omp for schedule(static)
    for (std::int64_t block = 0; block < blocks; ++block) {
      const std::int64_t end = std::min(g.seq, (block + 1) * run);
      for (std::int64_t n = block * run; n < end;) {
        const std::int64_t rows = run_length(positions, 0, n, end - n);
        const auto p = static_cast<double>(positions.at(0, n));
        if (direct) {
          kernels::sinusoid_run_f32(cols, p, rows, out.typed<float>(g.offset(0, n)), g.seq_stride, stream, state);
        } else {
          kernels::sinusoid_run_f32(cols, p, rows, buf.data(), g.dim, false, state);
          for (std::int64_t r = 0; r < rows; ++r) {
            for (std::int64_t j = 0; j < g.dim; ++j) {
              detail::store(out.data(), out.dtype(), g.offset(0, n + r) + j * g.dim_stride,
                            buf[static_cast<std::size_t>(r * g.dim + j)]);
            }
          }
        }
        n += rows;
      }
    }
    if (stream) kernels::flush_streams();
  }
}

void sinusoidal_add(const SinusoidalParams& params, ConstTensorView x, const Positions& positions, TensorView out) {
  detail::init_dispatch();
  const detail::AddGrids g = detail::check_sinusoidal_add(params, x, positions, out);
  if (detail::use_reference() || x.dtype() == DType::kF64) {
    ref::sinusoidal_add(params, x, positions, out);
    return;
  }
  const kernels::SinusoidColumns cols = columns_for(params);
  const bool direct = x.dtype() == DType::kF32 && g.x.dim_stride == 1 && g.out.dim_stride == 1;
  // Out of place and large: the output bypasses the caches (in place, the lines were just read).
  const bool stream = direct && x.data() != out.data() && g.x.batch * g.x.seq * g.x.dim * 4 >= kStreamBytes;
  const std::int64_t blocks_per_row = (g.x.seq + kCachedRun - 1) / kCachedRun;
  const std::int64_t blocks = g.x.batch * blocks_per_row;
  const int threads = detail::threads_for(g.x.batch * g.x.seq * g.x.dim * 4);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float>& buf = scratch_rows(g.x.dim);
    double* state = run_state(g.x.dim);
#pragma omp for schedule(static)
    for (std::int64_t block = 0; block < blocks; ++block) {
      const std::int64_t b = block / blocks_per_row;
      const std::int64_t begin = (block % blocks_per_row) * kCachedRun;
      const std::int64_t end = std::min(g.x.seq, begin + kCachedRun);
      for (std::int64_t s = begin; s < end;) {
        const std::int64_t rows = run_length(positions, b, s, end - s);
        const auto p = static_cast<double>(positions.at(b, s));
        if (direct) {
          kernels::sinusoid_add_run_f32(cols, p, rows, x.typed<float>(g.x.offset(b, s)), g.x.seq_stride,
                                        out.typed<float>(g.out.offset(b, s)), g.out.seq_stride, stream, state);
        } else {
          kernels::sinusoid_run_f32(cols, p, rows, buf.data(), g.x.dim, false, state);
          for (std::int64_t r = 0; r < rows; ++r) {
            for (std::int64_t j = 0; j < g.x.dim; ++j) {
              // f32 arithmetic, as the direct path: x is exact in f32 for every supported dtype.
              const auto xv =
                  static_cast<float>(detail::load(x.data(), x.dtype(), g.x.offset(b, s + r) + j * g.x.dim_stride));
              detail::store(out.data(), out.dtype(), g.out.offset(b, s + r) + j * g.out.dim_stride,
                            xv + buf[static_cast<std::size_t>(r * g.x.dim + j)]);
            }
          }
        }
        s += rows;
      }
    }
    if (stream) kernels::flush_streams();
  }
}

// ─── Learned ───────────────────────────────────────────────────────────────────────────────────

namespace {

// out[j] = a[j] + b[j] along one row of any dtype and column strides (f32 arithmetic).
void add_row(const void* a, std::int64_t a_off, std::int64_t a_stride, const void* b, std::int64_t b_off,
             std::int64_t b_stride, void* out, std::int64_t out_off, std::int64_t out_stride, DType dtype,
             std::int64_t dim, bool stream = false) {
  if (dtype == DType::kF32 && a_stride == 1 && b_stride == 1 && out_stride == 1) {
    kernels::add_rows_f32(static_cast<const float*>(a) + a_off, static_cast<const float*>(b) + b_off,
                          static_cast<float*>(out) + out_off, dim, stream);
    return;
  }
  for (std::int64_t j = 0; j < dim; ++j) {
    const auto sum = static_cast<float>(detail::load(a, dtype, a_off + j * a_stride)) +
                     static_cast<float>(detail::load(b, dtype, b_off + j * b_stride));
    detail::store(out, dtype, out_off + j * out_stride, sum);
  }
}

}  // namespace

void learned_forward(ConstTensorView table, ConstTensorView x, const Positions& positions, TensorView y) {
  detail::init_dispatch();
  const detail::LearnedGrids g = detail::check_learned_forward(table, x, positions, y);
  if (detail::use_reference() || x.dtype() == DType::kF64) {
    ref::learned_forward(table, x, positions, y);
    return;
  }
  const std::int64_t tokens = g.x.batch * g.x.seq;
  const int threads = detail::threads_for(tokens * g.x.dim);
  // Out of place and large: y bypasses the caches.
  const bool stream = x.dtype() == DType::kF32 && y.data() != x.data() && tokens * g.x.dim * 4 >= kStreamBytes;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (std::int64_t t = 0; t < tokens; ++t) {
      const std::int64_t b = t / g.x.seq, s = t % g.x.seq;
      add_row(x.data(), g.x.offset(b, s), g.x.dim_stride, table.data(), g.table.offset(0, positions.at(b, s)),
              g.table.dim_stride, y.data(), g.out.offset(b, s), g.out.dim_stride, x.dtype(), g.x.dim, stream);
    }
    if (stream) kernels::flush_streams();
  }
}

void learned_backward(ConstTensorView dy, const Positions& positions, TensorView d_table, TensorView dx) {
  detail::init_dispatch();
  const detail::LearnedGrids g = detail::check_learned_backward(dy, positions, d_table, dx);
  if (detail::use_reference() || dy.dtype() == DType::kF64) {
    ref::learned_backward(dy, positions, d_table, dx);
    return;
  }
  // Restating the forward: y[b, s] = x[b, s] + W[pos(b, s)].
  // d_table: thread t owns the rows with pos % threads == t and walks all tokens in order, so a
  // row's sum runs in token order whatever the thread count: bitwise identical results, no
  // atomics. Every thread reads all positions (cheap: T int64 loads).
  const std::int64_t tokens = g.x.batch * g.x.seq;
  const int threads = detail::threads_for(tokens * g.x.dim);
#pragma omp parallel num_threads(threads)
  {
    const auto owners = static_cast<std::int64_t>(omp_get_num_threads());
    const auto me = static_cast<std::int64_t>(omp_get_thread_num());
    for (std::int64_t t = 0; t < tokens; ++t) {
      const std::int64_t b = t / g.x.seq, s = t % g.x.seq;
      const std::int64_t row = positions.at(b, s);
      if (row % owners != me) continue;
      const std::int64_t row_off = g.table.offset(0, row);
      add_row(d_table.data(), row_off, g.table.dim_stride, dy.data(), g.x.offset(b, s), g.x.dim_stride, d_table.data(),
              row_off, g.table.dim_stride, dy.dtype(), g.x.dim);
    }
    if (g.has_dx) {
#pragma omp for schedule(static)
      for (std::int64_t t = 0; t < tokens; ++t) {
        const std::int64_t b = t / g.x.seq, s = t % g.x.seq;
        add_row(dx.data(), g.out.offset(b, s), g.out.dim_stride, dy.data(), g.x.offset(b, s), g.x.dim_stride, dx.data(),
                g.out.offset(b, s), g.out.dim_stride, dy.dtype(), g.x.dim);
      }
    }
  }
}

void learned_init_normal(TensorView table, double std, std::uint64_t seed) {
  detail::init_dispatch();
  const char* where = "learned_init_normal";
  const Grid g = detail::matrix_grid(where, "table", table);
  detail::check_writable(where, "table", table);
  if (!(std >= 0.0) || !std::isfinite(std)) {
    throw Error(where, "std", detail::to_text(std), "a finite number >= 0");
  }
  const std::int64_t count = g.seq * g.dim;
  const int threads = detail::threads_for(count * 16);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (std::int64_t k = 0; k < count; ++k) {
    const double z = detail::seeded_normal(seed, static_cast<std::uint64_t>(k));
    const std::int64_t row = k / g.dim, col = k % g.dim;
    detail::store(table.data(), table.dtype(), g.offset(0, row) + col * g.dim_stride, std * z);
  }
}

void learned_init_zeros(TensorView table) {
  detail::init_dispatch();
  const Grid g = detail::matrix_grid("learned_init_zeros", "table", table);
  detail::check_writable("learned_init_zeros", "table", table);
  for (std::int64_t r = 0; r < g.seq; ++r) {
    for (std::int64_t j = 0; j < g.dim; ++j) {
      detail::store(table.data(), table.dtype(), g.offset(0, r) + j * g.dim_stride, 0.0);
    }
  }
}

LearnedTable::LearnedTable(std::int64_t max_len, std::int64_t dim) : max_len_(max_len), dim_(dim) {
  if (max_len < 1) throw Error("LearnedTable", "max_len", std::to_string(max_len), ">= 1");
  if (dim < 1) throw Error("LearnedTable", "dim", std::to_string(dim), ">= 1");
  const std::int64_t count = checked_mul(max_len, dim, "LearnedTable size");
  try {
    values_.assign(static_cast<std::size_t>(count), 0.0f);
  } catch (const std::exception&) {  // bad_alloc, length_error
    throw Error("LearnedTable", "max_len × dim", std::to_string(max_len) + " × " + std::to_string(dim),
                "a table that fits in memory");
  }
}

}  // namespace posenc
