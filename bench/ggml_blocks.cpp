// posenc's q8_0 and q4_0 blocks against ggml's own quantizers, byte for byte, and their values
// dequantised by each: the check of bench/ggml_side_by_side.sh that a cache written by ggml is
// read by posenc as it lies (and the reverse). Built only by that script, against a ggml checkout.
//
// Rows of 128 values at varied scales (1e-4 … 1e4), with spikes, zero rows and zero blocks.
// ggml's reference quantizer (ggml_quantize_chunk) must give posenc's bytes exactly; the CPU
// backend's vector quantizer (its from_float, which ggml_cpy uses to fill llama.cpp's KV cache)
// rounds a value exactly halfway between two integers to even, where the reference rounds it away
// from zero: such bytes are counted and listed, not failed. Exit status 1 when a reference byte or
// a dequantised value differs.
#include <ggml-cpu.h>
#include <ggml.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "posenc/quantized.hpp"

namespace {

constexpr long kDim = 128, kRows = 20000;

std::vector<float> rows() {
  std::mt19937 rng(7);
  std::vector<float> x(static_cast<size_t>(kRows * kDim));
  for (long r = 0; r < kRows; ++r) {
    std::normal_distribution<float> normal(0.0f, std::pow(10.0f, static_cast<float>(r % 9) - 4.0f));
    for (long c = 0; c < kDim; ++c) {
      float v = normal(rng);
      if (r % 7 == 3 && c % 13 == 0) v *= 50.0f;  // spikes
      if (r % 11 == 5) v = 0.0f;                  // a zero row
      if (r % 17 == 1 && c < 32) v = 0.0f;        // a zero block
      x[static_cast<size_t>(r * kDim + c)] = v;
    }
  }
  return x;
}

}  // namespace

int main() {
  const std::vector<float> x = rows();
  int failed = 0;
  struct Format {
    ggml_type ggml;
    posenc::CacheFormat posenc;
    const char* name;
  };
  for (const Format f : {Format{GGML_TYPE_Q8_0, posenc::CacheFormat::kQ8_0, "q8_0"},
                         Format{GGML_TYPE_Q4_0, posenc::CacheFormat::kQ4_0, "q4_0"}}) {
    const long row_bytes = posenc::cache_row_bytes(f.posenc, kDim);
    if (static_cast<long>(ggml_row_size(f.ggml, kDim)) != row_bytes) {
      std::printf("%s: row of %ld bytes in posenc, %zu in ggml\n", f.name, row_bytes, ggml_row_size(f.ggml, kDim));
      return 1;
    }
    const auto bytes = static_cast<size_t>(kRows * row_bytes);
    std::vector<unsigned char> ours(bytes), reference(bytes), backend(bytes);
    posenc::quantize_rows(f.posenc, x.data(), kRows, kDim, ours.data(), row_bytes);
    ggml_quantize_chunk(f.ggml, x.data(), reference.data(), 0, kRows, kDim, nullptr);
    for (long r = 0; r < kRows; ++r)
      ggml_get_type_traits_cpu(f.ggml)->from_float(x.data() + r * kDim, backend.data() + r * row_bytes, kDim);
    long reference_diff = 0, backend_diff = 0;
    for (size_t i = 0; i < bytes; ++i) reference_diff += ours[i] != reference[i];
    std::printf("%s: %ld of %zu bytes differ from ggml's reference quantizer\n", f.name, reference_diff, bytes);
    for (size_t i = 0; i < bytes; ++i) {
      if (ours[i] == backend[i]) continue;
      ++backend_diff;
      // q8_0 only: a value's byte (2 bytes of scale, then 32 int8 per 34-byte block).
      const long r = static_cast<long>(i) / row_bytes, in_row = static_cast<long>(i) % row_bytes;
      const long block = in_row / 34, at = in_row % 34 - 2;
      if (f.ggml != GGML_TYPE_Q8_0 || at < 0) continue;
      const float* xb = x.data() + r * kDim + block * 32;
      float amax = 0.0f;
      for (int t = 0; t < 32; ++t) amax = std::max(amax, std::fabs(xb[t]));
      const float id = 1.0f / (amax / 127.0f);  // both quantizers scale by 1/d, d = amax/127
      std::printf("  CPU backend: row %ld, block %ld, value %ld: x/d = %.7g, %d where the reference gives %d\n", r,
                  block, at, static_cast<double>(xb[at] * id), static_cast<signed char>(backend[i]),
                  static_cast<signed char>(ours[i]));
    }
    std::printf("%s: %ld of %zu bytes differ from the CPU backend's quantizer (ties rounded to even)\n", f.name,
                backend_diff, bytes);
    std::vector<float> by_ggml(x.size()), by_posenc(x.size());
    ggml_get_type_traits(f.ggml)->to_float(reference.data(), by_ggml.data(), kRows * kDim);
    posenc::dequantize_rows(f.posenc, reference.data(), row_bytes, kRows, kDim, by_posenc.data());
    long value_diff = 0;
    for (size_t i = 0; i < x.size(); ++i) value_diff += std::memcmp(&by_ggml[i], &by_posenc[i], sizeof(float)) != 0;
    std::printf("%s: %ld of %zu values dequantised differently\n", f.name, value_diff, x.size());
    failed += reference_diff != 0 || value_diff != 0;
  }
  return failed != 0;
}
