// ggml's CPU flash attention (ggml_flash_attn_ext) timed at the shapes of `posenc bench attention`,
// the peer of bench/ggml_side_by_side.sh. Built only by that script, against a ggml checkout
// the user names; not part of posenc's build.
//
//   ggml_attention prefill|decode KV_TYPE SEQ HEADS KV_HEADS HEAD_DIM THREADS ROUNDS
//
// prefill: SEQ queries over SEQ keys, causal (ggml's F16 mask of 0 and −inf); decode: one query
// over SEQ keys, no mask. Q is f32; K and V are KV_TYPE (f32, f16 or q8_0) in ggml's layout
// [D, keys, kv_heads]. Prints the best time in ms, with GFLOP/s (prefill, the causal half of
// 4·S·S·H·D) or the GB/s of the cache read (decode), as `posenc bench attention` counts them.
#include <ggml-cpu.h>
#include <ggml.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

void fill(ggml_tensor* t, std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  const int64_t n_per_row = t->ne[0], rows = ggml_nrows(t);
  std::vector<float> x(static_cast<size_t>(n_per_row * rows));
  for (float& v : x) v = uniform(rng);
  if (t->type == GGML_TYPE_F32) {
    std::memcpy(t->data, x.data(), x.size() * sizeof(float));
  } else if (t->type == GGML_TYPE_F16) {
    ggml_fp32_to_fp16_row(x.data(), static_cast<ggml_fp16_t*>(t->data), static_cast<int64_t>(x.size()));
  } else {
    ggml_quantize_chunk(t->type, x.data(), t->data, 0, rows, n_per_row, nullptr);
  }
}

}  // namespace

int main(int argc, char** argv) {
  ggml_cpu_init();
  if (argc != 9) {
    std::fprintf(stderr, "usage: %s prefill|decode f32|f16|q8_0 SEQ HEADS KV_HEADS HEAD_DIM THREADS ROUNDS\n", argv[0]);
    return 2;
  }
  const std::string pass = argv[1], kv = argv[2];
  const int64_t seq = std::atoll(argv[3]), heads = std::atoll(argv[4]), kv_heads = std::atoll(argv[5]),
                dim = std::atoll(argv[6]);
  const int threads = std::atoi(argv[7]), rounds = std::atoi(argv[8]);
  const ggml_type kv_type = kv == "f32" ? GGML_TYPE_F32 : kv == "f16" ? GGML_TYPE_F16 : GGML_TYPE_Q8_0;
  if ((pass != "prefill" && pass != "decode") || (kv != "f32" && kv != "f16" && kv != "q8_0")) {
    std::fprintf(stderr, "ggml_attention: pass = %s, kv = %s; expected prefill|decode and f32|f16|q8_0\n", pass.c_str(),
                 kv.c_str());
    return 2;
  }
  const int64_t queries = pass == "prefill" ? seq : 1;

  const size_t cache_bytes = 2 * ggml_row_size(kv_type, dim) * static_cast<size_t>(seq * kv_heads);
  const size_t mem = cache_bytes + static_cast<size_t>(queries * heads * dim) * 8 +
                     (pass == "prefill" ? static_cast<size_t>(seq * seq) * 2 : 0) + (size_t{64} << 20);
  ggml_init_params init{mem, nullptr, false};
  ggml_context* ctx = ggml_init(init);
  ggml_tensor* q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, dim, queries, heads, 1);
  ggml_tensor* k = ggml_new_tensor_4d(ctx, kv_type, dim, seq, kv_heads, 1);
  ggml_tensor* v = ggml_new_tensor_4d(ctx, kv_type, dim, seq, kv_heads, 1);
  std::mt19937 rng(1);
  fill(q, rng);
  fill(k, rng);
  fill(v, rng);
  ggml_tensor* mask = nullptr;
  if (pass == "prefill") {
    mask = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, seq, queries, 1, 1);
    auto* m = static_cast<ggml_fp16_t*>(mask->data);
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), minus_inf = ggml_fp32_to_fp16(-INFINITY);
    for (int64_t i = 0; i < queries; ++i) {
      for (int64_t j = 0; j < seq; ++j) m[i * seq + j] = j <= i ? zero : minus_inf;
    }
  }
  ggml_tensor* out = ggml_flash_attn_ext(ctx, q, k, v, mask, 1.0f / std::sqrt(static_cast<float>(dim)), 0.0f, 0.0f);
  ggml_flash_attn_ext_set_prec(out, GGML_PREC_F32);
  ggml_cgraph* graph = ggml_new_graph(ctx);
  ggml_build_forward_expand(graph, out);

  // One thread pool and work buffer for every call, as llama.cpp keeps them between tokens.
  ggml_threadpool_params pool_params = ggml_threadpool_params_default(threads);
  ggml_threadpool* pool = ggml_threadpool_new(&pool_params);
  ggml_cplan plan = ggml_graph_plan(graph, threads, pool);
  std::vector<unsigned char> work(plan.work_size);
  plan.work_data = work.data();
  const auto compute = [&] {
    if (ggml_graph_compute(graph, &plan) != GGML_STATUS_SUCCESS) {
      std::fprintf(stderr, "ggml_attention: ggml_graph_compute failed\n");
      std::exit(1);
    }
  };
  compute();  // warm-up: first touch of the output and the work buffer
  double best = 1e30;
  for (int r = 0; r < rounds; ++r) {
    // Repeated calls for at least 0.3 s and 5 calls per round, as posenc's bench repeats its calls
    // (cli/bench.cpp, time_best).
    int calls = 0;
    const auto t0 = std::chrono::steady_clock::now();
    double elapsed = 0;
    do {
      const auto c0 = std::chrono::steady_clock::now();
      compute();
      const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count();
      best = std::min(best, t);
      ++calls;
      elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    } while (elapsed < 0.3 || calls < 5);
  }
  const double flops = pass == "prefill" ? 4.0 * seq * seq * heads * dim / 2 : 0;
  if (pass == "prefill") {
    std::printf("ggml prefill %s: %.3f ms, %.2f GFLOP/s\n", kv.c_str(), best * 1e3, flops / best * 1e-9);
  } else {
    std::printf("ggml decode %s: %.3f ms, %.2f GB/s of cache\n", kv.c_str(), best * 1e3,
                static_cast<double>(cache_bytes) / best * 1e-9);
  }
  const float* o = static_cast<const float*>(out->data);
  double checksum = 0;
  for (int64_t i = 0; i < ggml_nelements(out); ++i) checksum += o[i];
  std::printf("  checksum %.6f over %lld outputs\n", checksum, static_cast<long long>(ggml_nelements(out)));
  ggml_threadpool_free(pool);
  ggml_free(ctx);
  return std::isfinite(checksum) ? 0 : 1;
}
