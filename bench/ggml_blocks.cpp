// posenc's q8_0 and q4_0 blocks against ggml's own quantizers, byte for byte, their values
// dequantised by each, and attention over one cache in ggml's own layout by both libraries: the
// check of bench/ggml_side_by_side.sh that a cache written by ggml is read by posenc as it lies
// (and the reverse). Built only by that script, against a ggml checkout.
//
// Rows of 128 values at varied scales (1e-4 … 1e4), with spikes, zero rows and zero blocks.
// ggml's reference quantizer (ggml_quantize_chunk) must give posenc's bytes exactly. The CPU
// backend's vector quantizer (its from_float, which ggml_cpy uses to fill llama.cpp's KV cache)
// scales by 127/amax where the reference scales by 1/(amax/127), and rounds a product exactly
// halfway between two integers to even where the reference rounds it away from zero: the bytes
// where the two differ are counted and listed, not failed. Then ggml_flash_attn_ext and posenc's
// Attention read the same q8_0 and q4_0 caches ([D, keys, kv_heads], ggml's layout, which posenc
// takes through QuantizedRows' strides), both compared with posenc's fp64 reference. Exit status
// 1 when a reference byte or a dequantised value differs, or when either library's attention is
// off the reference by more than its bound (posenc 1e-5: f32 over exact values; ggml 5e-3: it
// quantizes the query to q8_0 as well, an error of about 1e-3 on outputs of about 0.05).
#include <ggml-cpu.h>
#include <ggml.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "posenc/attention.hpp"
#include "posenc/quantized.hpp"
#include "posenc/reference.hpp"

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

// Attention over one quantized cache in ggml's layout: 4 queries × 8 heads against 1000 keys of
// 2 KV heads, D = 128, no mask. Returns whether both libraries are within their bounds.
bool same_attention(ggml_type type, posenc::CacheFormat format, const char* name) {
  constexpr long kQueries = 4, kHeads = 8, kKvHeads = 2, kKeys = 1000;
  const long row_bytes = posenc::cache_row_bytes(format, kDim);
  ggml_init_params init{size_t{64} << 20, nullptr, false};
  ggml_context* ctx = ggml_init(init);
  ggml_tensor* q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, kDim, kQueries, kHeads, 1);
  ggml_tensor* k = ggml_new_tensor_4d(ctx, type, kDim, kKeys, kKvHeads, 1);
  ggml_tensor* v = ggml_new_tensor_4d(ctx, type, kDim, kKeys, kKvHeads, 1);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto* qd = static_cast<float*>(q->data);
  for (long i = 0; i < kQueries * kHeads * kDim; ++i) qd[i] = normal(rng);
  for (ggml_tensor* t : {k, v}) {
    std::vector<float> x(static_cast<size_t>(kKeys * kKvHeads * kDim));
    for (float& e : x) e = normal(rng);
    ggml_quantize_chunk(type, x.data(), t->data, 0, kKeys * kKvHeads, kDim, nullptr);
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  ggml_tensor* out = ggml_flash_attn_ext(ctx, q, k, v, nullptr, scale, 0.0f, 0.0f);
  ggml_flash_attn_ext_set_prec(out, GGML_PREC_F32);
  ggml_cgraph* graph = ggml_new_graph(ctx);
  ggml_build_forward_expand(graph, out);
  if (ggml_graph_compute_with_ctx(ctx, graph, 2) != GGML_STATUS_SUCCESS) {
    std::printf("%s: ggml_graph_compute_with_ctx failed\n", name);
    ggml_free(ctx);
    return false;
  }

  // posenc reads ggml's tensors where they lie: q [D, Sq, H] as [1, Sq, H, D] with strides, the
  // caches [D, keys, G] as rows a row apart along the keys and kKeys rows apart across heads.
  posenc::AttentionSpec spec;
  spec.q = posenc::ConstTensorView::of(static_cast<const float*>(qd), {1, kQueries, kHeads, kDim},
                                       {kQueries * kHeads * kDim, kDim, kQueries * kDim, 1});
  const auto rows_of = [&](const ggml_tensor* t) {
    return posenc::QuantizedRows{t->data,          1, kKeys, kKvHeads, kDim, kKeys * kKvHeads * row_bytes, row_bytes,
                                 kKeys * row_bytes};
  };
  spec.cache = posenc::QuantizedCache{format, rows_of(k), rows_of(v)};
  spec.scale = scale;
  const posenc::Attention attention(spec);
  std::vector<float> ours(static_cast<size_t>(kQueries * kHeads * kDim)), exact(ours.size());
  attention.forward(posenc::TensorView::of(ours.data(), {1, kQueries, kHeads, kDim}));
  posenc::ref::attention_forward(attention, posenc::TensorView::of(exact.data(), {1, kQueries, kHeads, kDim}), {});
  // ggml's output is [D, H, Sq]: the same order as posenc's [1, Sq, H, D].
  const auto* theirs = static_cast<const float*>(out->data);
  double ours_err = 0, theirs_err = 0;
  for (size_t i = 0; i < ours.size(); ++i) {
    ours_err = std::max(ours_err, static_cast<double>(std::fabs(ours[i] - exact[i])));
    theirs_err = std::max(theirs_err, static_cast<double>(std::fabs(theirs[i] - exact[i])));
  }
  ggml_free(ctx);
  std::printf("%s attention over one cache in ggml's layout: largest |posenc − fp64| %.2e, |ggml − fp64| %.2e\n", name,
              ours_err, theirs_err);
  return ours_err <= 1e-5 && theirs_err <= 5e-3;
}

}  // namespace

int main() {
  ggml_cpu_init();  // the CPU backend's type traits (from_float) before their first use
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
      // Each quantizer's own product before rounding.
      const float by_reference = xb[at] * (1.0f / (amax / 127.0f)), by_backend = xb[at] * (127.0f / amax);
      std::printf("  CPU backend: row %ld, block %ld, value %ld: %.9g → %d, where the reference's %.9g → %d\n", r,
                  block, at, static_cast<double>(by_backend), static_cast<signed char>(backend[i]),
                  static_cast<double>(by_reference), static_cast<signed char>(ours[i]));
    }
    std::printf("%s: %ld of %zu bytes differ from the CPU backend's quantizer (its scaling, ties to even)\n", f.name,
                backend_diff, bytes);
    std::vector<float> by_ggml(x.size()), by_posenc(x.size());
    ggml_get_type_traits(f.ggml)->to_float(reference.data(), by_ggml.data(), kRows * kDim);
    posenc::dequantize_rows(f.posenc, reference.data(), row_bytes, kRows, kDim, by_posenc.data());
    long value_diff = 0;
    for (size_t i = 0; i < x.size(); ++i) value_diff += std::memcmp(&by_ggml[i], &by_posenc[i], sizeof(float)) != 0;
    std::printf("%s: %ld of %zu values dequantised differently\n", f.name, value_diff, x.size());
    failed += reference_diff != 0 || value_diff != 0;
    failed += !same_attention(f.ggml, f.posenc, f.name);
  }
  return failed != 0;
}
