// posenc/runtime.hpp — which SIMD target runs, how many threads, which version.
//
// Every kernel family is compiled for several instruction sets and picks the best one the CPU
// supports, once, at its first call. Names of targets:
//
//   avx512   AVX-512 F/BW/DQ/VL (Highway AVX3)
//   avx2     AVX2 + FMA + F16C
//   sse4     SSE4.2 + AES/CLMUL
//   scalar   portable C++ with 128-bit emulated vectors (Highway EMU128)
//   ref      the fp64 scalar reference of every kernel (src/ref/): slow, the test oracle
//
// The environment variable POSENC_TARGET=<name> (read at the first posenc call) or set_target()
// forces one, so that tests and benchmarks can run and compare every compiled path. set_target
// is process-wide: do not call it while other threads run posenc kernels. Forcing a SIMD target
// narrows Highway's own run-time choice, which other Highway users in the same process share.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace posenc {

// Targets compiled into this build and supported by this CPU, best first, "ref" last.
std::vector<std::string> available_targets();
// The target kernels currently use.
std::string active_target();
// Force a target by name, or "auto" for the best supported one. Throws posenc::Error for a name
// that is unknown or not supported here.
void set_target(std::string_view name);

// Whether attention with bf16 inputs may now use the host's bf16 dot products
// (AttentionSpec::bf16_products): the CPU has AVX512-BF16 and the active target is avx512.
bool bf16_dot_products();

// OpenMP threads used by posenc kernels (defaults to OpenMP's default). n >= 1.
void set_num_threads(int n);
int num_threads();

std::string_view version();

}  // namespace posenc
