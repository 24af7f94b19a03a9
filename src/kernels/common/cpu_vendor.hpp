// The processor's family, for the few kernel choices measured to differ between processors.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace posenc::kernels {

// AMD's processor family from cpuid (0x19 Zen 3 and Zen 4, 0x1A Zen 5); 0 on other vendors and
// off x86.
inline unsigned amd_family() {
#if defined(__x86_64__) || defined(__i386__)
  static const unsigned family = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return 0u;
    if (ebx != 0x68747541u || edx != 0x69746e65u || ecx != 0x444d4163u) return 0u;  // "Auth" "enti" "cAMD"
    if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return 0u;
    const unsigned base = (eax >> 8) & 0xFu;
    return base == 0xFu ? base + ((eax >> 20) & 0xFFu) : base;
  }();
  return family;
#else
  return 0;
#endif
}

}  // namespace posenc::kernels
