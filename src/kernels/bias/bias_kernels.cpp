// SIMD kernels of the score biases (Highway, dynamic dispatch). See bias_kernels.hpp.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/bias/bias_kernels.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <cstdint>

#include "kernels/bias/bias_kernels.hpp"
#include "kernels/common/store-inl.h"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using common::HWY_NAMESPACE::StoreOrStream;
using common::HWY_NAMESPACE::StreamableTag;

void CopyRowF32(const float* HWY_RESTRICT src, float* HWY_RESTRICT dst, std::int64_t n, bool stream) {
  const hn::ScalableTag<float> df;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(df));
  stream = stream && StreamableTag(df);
  std::int64_t t = 0;
  for (; t + lanes <= n; t += lanes) StoreOrStream(hn::LoadU(df, src + t), df, dst + t, stream);
  for (; t < n; ++t) dst[t] = src[t];
}

void AccumulateRowF64(const float* HWY_RESTRICT src, double* HWY_RESTRICT sum, std::int64_t n) {
  std::int64_t t = 0;
#if HWY_TARGET != HWY_SCALAR
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> df;  // half a vector of floats per vector of doubles
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(dd));
  for (; t + lanes <= n; t += lanes) {
    hn::StoreU(hn::Add(hn::LoadU(dd, sum + t), hn::PromoteTo(dd, hn::LoadU(df, src + t))), dd, sum + t);
  }
#endif
  for (; t < n; ++t) sum[t] += static_cast<double>(src[t]);
}

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace posenc::kernels {

HWY_EXPORT(CopyRowF32);
HWY_EXPORT(AccumulateRowF64);

void copy_row_f32(const float* src, float* dst, std::int64_t n, bool stream) {
  HWY_DYNAMIC_DISPATCH(CopyRowF32)(src, dst, n, stream);
}
void accumulate_row_f64(const float* src, double* sum, std::int64_t n) {
  HWY_DYNAMIC_DISPATCH(AccumulateRowF64)(src, sum, n);
}

}  // namespace posenc::kernels
#endif  // HWY_ONCE
