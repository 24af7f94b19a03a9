// Row kernels shared by several kernel families (Highway, dynamic dispatch). See row_kernels.hpp.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/common/row_kernels.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/cache_control.h>

#include <cstdint>

#include "kernels/common/row_kernels.hpp"
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

void AddRowsF32(const float* a, const float* b, float* out, std::int64_t n, bool stream) {
  const hn::ScalableTag<float> df;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(df));
  const bool streamable = stream && StreamableTag(df);
  std::int64_t j = 0;
  for (; j + lanes <= n; j += lanes) {
    StoreOrStream(hn::Add(hn::LoadU(df, a + j), hn::LoadU(df, b + j)), df, out + j, streamable);
  }
  for (; j < n; ++j) out[j] = a[j] + b[j];
}

void FlushStreams() { hwy::FlushStream(); }

// The Highway target this translation unit's dispatch selects (for runtime.hpp's active_target).
std::int64_t DispatchedTarget() { return HWY_TARGET; }

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace posenc::kernels {

HWY_EXPORT(CopyRowF32);
HWY_EXPORT(AddRowsF32);
HWY_EXPORT(FlushStreams);
HWY_EXPORT(DispatchedTarget);

void copy_row_f32(const float* src, float* dst, std::int64_t n, bool stream) {
  HWY_DYNAMIC_DISPATCH(CopyRowF32)(src, dst, n, stream);
}
void add_rows_f32(const float* a, const float* b, float* out, std::int64_t n, bool stream) {
  HWY_DYNAMIC_DISPATCH(AddRowsF32)(a, b, out, n, stream);
}
void flush_streams() { HWY_DYNAMIC_DISPATCH(FlushStreams)(); }
std::int64_t dispatched_target() { return HWY_DYNAMIC_DISPATCH(DispatchedTarget)(); }

}  // namespace posenc::kernels
#endif  // HWY_ONCE
