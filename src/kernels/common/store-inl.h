// Stores that may bypass the caches, shared by the kernel families (Highway per-target header:
// included from each kernel translation unit after foreach_target.h).
//
// StreamableTag(d): whether non-temporal stores may be used for vectors of d at all — x86 streams
//   whole vectors of 16 bytes or more (SSE4's 2-lane float vectors demoted from doubles are 8);
//   HWY_SCALAR's Stream is an ordinary store.
// StoreOrStream(v, d, dst, stream): a non-temporal store when `stream` and dst is aligned to the
//   vector, else an unaligned store. Callers run hwy::FlushStream() before others read the output.
#if defined(POSENC_KERNELS_COMMON_STORE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef POSENC_KERNELS_COMMON_STORE_INL_H_
#undef POSENC_KERNELS_COMMON_STORE_INL_H_
#else
#define POSENC_KERNELS_COMMON_STORE_INL_H_
#endif

#include <hwy/highway.h>

#include <cstdint>

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels::common {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

template <class D>
HWY_INLINE bool StreamableTag(D d) {
  return hn::Lanes(d) * sizeof(hn::TFromD<D>) >= 16 || HWY_TARGET == HWY_SCALAR;
}

template <class D, class V>
HWY_INLINE void StoreOrStream(V v, D d, hn::TFromD<D>* dst, bool stream) {
  if (stream && reinterpret_cast<std::uintptr_t>(dst) % (hn::Lanes(d) * sizeof(hn::TFromD<D>)) == 0) {
    hn::Stream(v, d, dst);
  } else {
    hn::StoreU(v, d, dst);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels::common
HWY_AFTER_NAMESPACE();

#endif  // include guard
