// Benchmarks of posenc's kernels at real model shapes, beside this machine's measured limits
// (STREAM-like copy, non-temporal copy, in-place read-modify-write; perf/limits.hpp), measured at
// the start of the same run. Each case cycles through copies of its buffers larger than the
// last-level cache (perf/kernels.hpp), so kernel and limit both stream from memory.
//
//   build/posenc_bench                          all cases
//   build/posenc_bench --benchmark_filter=sinusoidal/32768/1024
//
// Each case reports bytes/s (bytes the kernel must move) and `ratio` = bytes/s ÷ its limit
// (copy_nt for the kernels that write their large outputs with non-temporal stores: table builds,
// sinusoidal-add, learned-forward and RoPE; rmw for the learned backward and in-place RoPE, which
// update their buffer in place).
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "kernels.hpp"
#include "limits.hpp"
#include "posenc/posenc.hpp"

namespace {

posenc::perf::Limits g_limits;

void run_case(benchmark::State& state, const std::string& name, posenc::perf::CaseOptions shape) {
  posenc::perf::Case c = posenc::perf::make_case(name, shape);
  c.run();  // warm-up and first touch
  double seconds = 0;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    c.run();
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    state.SetIterationTime(elapsed);
    seconds += elapsed;
  }
  const double bytes = c.bytes_per_run * static_cast<double>(state.iterations());
  // A plain number: GB/s (GFLOP/s for compute-bound cases) of this case over its limit, measured
  // at the start of this run.
  const double limit = g_limits.get(c.limit_name);
  if (c.flops_per_run > 0) {
    const double flops = c.flops_per_run * static_cast<double>(state.iterations());
    state.counters["GFLOPps"] = flops / seconds / 1e9;
    state.counters["limit_GFLOPps"] = limit;
    state.counters["ratio"] = flops / seconds / 1e9 / limit;
  } else {
    state.SetBytesProcessed(static_cast<std::int64_t>(bytes));
    state.counters["limit_GBps"] = limit;
    state.counters["ratio"] = bytes / seconds / 1e9 / limit;
  }
  state.counters["elements_per_s"] =
      benchmark::Counter(c.elements_per_run * static_cast<double>(state.iterations()) / seconds);
  state.SetLabel(c.description + ", ratio vs " + c.limit_name);
}

// Shapes: d = 768 (GPT-2 small, BERT base), 1024 (GPT-2 medium, the table), 4096
// (Llama-2 7B width); S from 2048 to 32768.
void register_all() {
  struct Shape {
    std::int64_t batch, length, dim;
  };
  const Shape tables[] = {{1, 2048, 768}, {1, 8192, 1024}, {1, 32768, 1024}, {1, 32768, 4096}};
  const Shape embeddings[] = {{8, 1024, 768}, {4, 2048, 1024}, {1, 32768, 1024}, {1, 4096, 4096}};
  auto add = [](const std::string& name, const Shape& s) {
    const std::string label =
        name + "/" + std::to_string(s.batch) + "x" + std::to_string(s.length) + "/" + std::to_string(s.dim);
    benchmark::RegisterBenchmark(label.c_str(),
                                 [name, s](benchmark::State& st) {
                                   run_case(st, name, {s.length, s.dim, s.batch});
                                 })
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  };
  for (const Shape& s : tables) add("sinusoidal", s);
  // RoPE at Llama-3 8B's attention shape: q [1, 4096, 32, 128], k [1, 4096, 8, 128]; both layouts,
  // every kind of positions, the three storage types, in place.
  struct RopeCase {
    const char* layout;
    const char* positions;
    const char* dtype;
    bool in_place;
  };
  const RopeCase ropes[] = {{"half-split", "contiguous", "f32", false},  {"interleaved", "contiguous", "f32", false},
                            {"half-split", "arbitrary", "f32", false},   {"half-split", "packed", "f32", false},
                            {"half-split", "contiguous", "f32", true},   {"interleaved", "contiguous", "f32", true},
                            {"half-split", "contiguous", "bf16", false}, {"interleaved", "contiguous", "bf16", false},
                            {"half-split", "contiguous", "f16", false}};
  for (const RopeCase& r : ropes) {
    const std::string label = std::string("rope/1x4096/32+8x128/") + r.layout + "/" + r.positions + "/" + r.dtype +
                              (r.in_place ? "/in-place" : "");
    benchmark::RegisterBenchmark(label.c_str(),
                                 [r](benchmark::State& st) {
                                   posenc::perf::CaseOptions o;
                                   o.length = 4096;
                                   o.dim = 128;
                                   o.interleaved = std::string(r.layout) == "interleaved";
                                   o.positions = r.positions;
                                   o.dtype = r.dtype;
                                   o.in_place = r.in_place;
                                   run_case(st, "rope", o);
                                 })
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
  // Every registered score bias of positions (posenc schemes), and nope, at S = 4096, H = 32
  // (scores [1, 32, 4096, 4096] f32, 2 GiB): materialisation and the parameters' backward.
  std::vector<std::string> biases = {"nope"};
  for (const posenc::SchemeEntry& e : posenc::schemes()) {
    if (e.family == "relative-bias" || e.family == "bias") biases.push_back(e.name);
  }
  for (const char* pass : {"forward", "backward"}) {
    for (const std::string& scheme : biases) {
      if (std::string(pass) == "backward" && (scheme == "nope" || posenc::find_scheme(scheme).parameters.empty()))
        continue;
      const std::string label = "bias/32x4096x4096/" + scheme + "/" + pass;
      benchmark::RegisterBenchmark(label.c_str(),
                                   [scheme, pass](benchmark::State& st) {
                                     posenc::perf::CaseOptions o;
                                     o.length = 4096;
                                     o.heads = 32;
                                     o.scheme = scheme;
                                     o.pass = pass;
                                     run_case(st, "bias", o);
                                   })
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  // Fused attention: causal f32 S = 2048, H = 8, D = 128 forward and backward per registered
  // scheme (ratio vs the FMA peak), and decode: 1 query × 32 heads over a 32768-token cache of 8
  // KV heads (ratio vs copy).
  std::vector<std::string> all;
  for (const posenc::SchemeEntry& e : posenc::schemes()) all.push_back(e.name);
  for (const char* pass : {"forward", "backward"}) {
    for (const std::string& scheme : all) {
      const std::string label = "attention/1x2048/8x128/causal/" + scheme + "/" + pass;
      benchmark::RegisterBenchmark(label.c_str(),
                                   [scheme, pass](benchmark::State& st) {
                                     posenc::perf::CaseOptions o;
                                     o.length = 2048;
                                     o.heads = 8;
                                     o.kv_heads = 8;
                                     o.dim = 128;
                                     o.causal = true;
                                     o.scheme = scheme;
                                     o.pass = pass;
                                     run_case(st, "attention", o);
                                   })
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  for (const char* scheme : {"none", "alibi"}) {
    const std::string label = std::string("attention/decode/32768/32+8x128/") + scheme;
    benchmark::RegisterBenchmark(label.c_str(),
                                 [scheme](benchmark::State& st) {
                                   posenc::perf::CaseOptions o;
                                   o.length = 32768;
                                   o.heads = 32;
                                   o.kv_heads = 8;
                                   o.dim = 128;
                                   o.causal = true;
                                   o.scheme = scheme;
                                   o.pass = "decode";
                                   run_case(st, "attention", o);
                                 })
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
  for (const Shape& s : embeddings) {
    add("sinusoidal-add", s);
    add("learned-forward", s);
    add("learned-backward", s);
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  g_limits = posenc::perf::measure_limits(posenc::num_threads());
  std::printf("posenc %s, target %s, %d thread(s)\n", std::string(posenc::version()).c_str(),
              posenc::active_target().c_str(), posenc::num_threads());
  std::printf(
      "limits measured now: copy %.2f GB/s, copy_nt %.2f GB/s, rmw %.2f GB/s (read + write bytes, "
      "buffers of 4x the last-level cache), read %.2f GB/s, write_nt %.2f GB/s, fma %.1f GFLOP/s\n",
      g_limits.copy_gbs, g_limits.copy_nt_gbs, g_limits.rmw_gbs, g_limits.read_gbs, g_limits.write_nt_gbs,
      g_limits.fma_gflops);
  register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
