// Denormals flushed while a thread runs attention kernels (the softmax engine and stick-breaking
// attention). Internal.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace posenc::detail {

// Denormals flushed to zero (FTZ) and read as zero (DAZ) while a thread runs attention: ALiBi's
// far keys give probabilities near FLT_MIN whose products with values are denormal, and each
// denormal result costs a microcode assist (~100 cycles) on x86 — the forward pass ran at half
// speed. Flushing changes results only below FLT_MIN (absolute), and identically on every
// thread, so results stay bitwise reproducible. The caller's mode is restored afterwards.
class FlushDenormals {
 public:
  FlushDenormals() {
#if defined(__x86_64__) || defined(__i386__)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ | 0x8040u);  // FTZ (bit 15) | DAZ (bit 6)
#endif
  }
  ~FlushDenormals() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(saved_);
#endif
  }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  unsigned saved_ = 0;
};

}  // namespace posenc::detail
