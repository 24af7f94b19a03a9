// SIMD kernels of the score biases (Highway, dynamic dispatch). See bias_kernels.hpp.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/bias/bias_kernels.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/cache_control.h>

#include <cstdint>

#include "kernels/bias/bias_kernels.hpp"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

void AccumulateDiagonalsF64(const float* HWY_RESTRICT ds, std::int64_t row_stride, std::int64_t rows, std::int64_t n,
                            double* HWY_RESTRICT sums) {
  // sums[u] += Σ_k ds[k·row_stride + u + k] over 0 <= u + k < n, u in [−(rows − 1), n).
  std::int64_t u = -(rows - 1);
  const auto scalar_at = [&](std::int64_t at) {
    double total = 0;
    for (std::int64_t k = 0; k < rows; ++k) {
      if (at + k >= 0 && at + k < n) total += static_cast<double>(ds[k * row_stride + at + k]);
    }
    sums[at] += total;
  };
  for (; u < 0 && u < n; ++u) scalar_at(u);  // leading edge: some rows start later
#if HWY_TARGET != HWY_SCALAR
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> df;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(dd));
  // Every row in range: u + k + 2·lanes <= n for k = rows − 1. Each row is its own stream;
  // prefetching 2 KiB ahead in each (kAhead floats) keeps enough misses in flight.
  constexpr std::int64_t kAhead = 512;
  for (; u + rows - 1 + 2 * lanes <= n; u += 2 * lanes) {
    auto a0 = hn::Zero(dd), a1 = hn::Zero(dd);
    for (std::int64_t k = 0; k < rows; ++k) {
      const float* row = ds + k * row_stride + u + k;
      hwy::Prefetch(row + kAhead);
      a0 = hn::Add(a0, hn::PromoteTo(dd, hn::LoadU(df, row)));
      a1 = hn::Add(a1, hn::PromoteTo(dd, hn::LoadU(df, row + lanes)));
    }
    hn::StoreU(hn::Add(hn::LoadU(dd, sums + u), a0), dd, sums + u);
    hn::StoreU(hn::Add(hn::LoadU(dd, sums + u + lanes), a1), dd, sums + u + lanes);
  }
#endif
  for (; u < n; ++u) scalar_at(u);  // trailing edge
}

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace posenc::kernels {

HWY_EXPORT(AccumulateDiagonalsF64);

void accumulate_diagonals_f64(const float* ds, std::int64_t row_stride, std::int64_t rows, std::int64_t n,
                              double* sums) {
  HWY_DYNAMIC_DISPATCH(AccumulateDiagonalsF64)(ds, row_stride, rows, n, sums);
}

}  // namespace posenc::kernels
#endif  // HWY_ONCE
