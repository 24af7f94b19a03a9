// posenc bench KERNEL [--length N] [--dim D] [--batch B] [--threads N] [--format text|json]
// Times one kernel and, in the same run, the machine limit it is judged against (perf/limits.hpp).
#include <fmt/core.h>

#include <nlohmann/json.hpp>
#include <algorithm>
#include <fstream>
#include <optional>
#include <string>

#include "commands.hpp"
#include "kernels.hpp"
#include "limits.hpp"
#include "posenc/posenc.hpp"

namespace posenc::cli {
namespace {

struct BenchOptions {
  std::string kernel;
  perf::CaseOptions shape;
  std::optional<int> threads;
  int rounds = 3;
  std::string format = "text";
};

// Peak resident memory of this process so far (VmHWM), in bytes; 0 where /proc is unavailable.
double peak_resident_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) * 1024.0;  // "VmHWM:  1234 kB"
  }
  return 0;
}

void run_bench(const BenchOptions& o) {
  if (o.format != "text" && o.format != "json") {
    throw Error("bench", "--format", o.format, "text or json");
  }
  // 0 is refused too: without the flag the default (OpenMP's) applies; an explicit 0 is no count.
  if (o.threads && (*o.threads < 1 || *o.threads > 4096))
    throw Error("bench", "--threads", std::to_string(*o.threads), "1 to 4096");
  if (o.threads) set_num_threads(*o.threads);
  if (o.rounds < 1) throw Error("bench", "--rounds", std::to_string(o.rounds), ">= 1");
  const int threads = num_threads();
  perf::Case c = perf::make_case(o.kernel, o.shape);
  // The machine's limit does not depend on the target forced for the kernel: measure it with
  // the best one.
  // Limit and kernel are timed in alternating rounds and each keeps its best: the host is shared,
  // and its bandwidth drifts over seconds, so a single limit followed by a single kernel timing
  // can land in different regimes.
  const std::string target = active_target();
  perf::Limits limits;
  double seconds = 1e300;
  for (int round = 0; round < o.rounds; ++round) {
    set_target("auto");
    const perf::Limits now = perf::measure_limits(threads, 5, o.shape.huge_pages);
    set_target(target);
    limits.copy_gbs = std::max(limits.copy_gbs, now.copy_gbs);
    limits.copy_nt_gbs = std::max(limits.copy_nt_gbs, now.copy_nt_gbs);
    limits.rmw_gbs = std::max(limits.rmw_gbs, now.rmw_gbs);
    limits.read_gbs = std::max(limits.read_gbs, now.read_gbs);
    limits.write_nt_gbs = std::max(limits.write_nt_gbs, now.write_nt_gbs);
    limits.fma_gflops = std::max(limits.fma_gflops, now.fma_gflops);
    seconds = std::min(seconds, perf::time_best(c.run, 5, 0.3));
  }
  const bool compute = c.flops_per_run > 0;
  const double throughput = (compute ? c.flops_per_run : c.bytes_per_run) / seconds / 1e9;
  const std::string unit = compute ? "GFLOP/s" : "GB/s";
  const double limit = limits.get(c.limit_name);
  const double workspace = c.workspace_bytes ? c.workspace_bytes() : -1.0;
  // The kernel's own peak: reset the high-water mark (the limits' buffers are freed by now), run
  // once more, read it. It includes the case's inputs and outputs.
  { std::ofstream("/proc/self/clear_refs") << "5"; }
  c.run();
  const double peak_rss = peak_resident_bytes();
  if (o.format == "json") {
    const nlohmann::json doc = {{"kernel", c.name},
                                {"shape", c.description},
                                {"target", active_target()},
                                {"threads", threads},
                                {"seconds", seconds},
                                {"bytes", c.bytes_per_run},
                                {"flops", c.flops_per_run},
                                {"rounds", o.rounds},
                                {"throughput", throughput},
                                {"unit", unit},
                                {"peak_resident_bytes", peak_rss},
                                {"workspace_bytes", workspace},
                                {"limit", limit},
                                {"limit_name", c.limit_name},
                                {"ratio", throughput / limit},
                                {"huge_pages", o.shape.huge_pages},
                                {"elements_per_second", c.elements_per_run / seconds},
                                {"limits",
                                 {{"copy", limits.copy_gbs},
                                  {"copy_nt", limits.copy_nt_gbs},
                                  {"rmw", limits.rmw_gbs},
                                  {"read", limits.read_gbs},
                                  {"write_nt", limits.write_nt_gbs},
                                  {"fma_gflops", limits.fma_gflops}}}};
    nlohmann::json out = doc;
    if (c.remark) out["remark"] = c.remark();
    fmt::print("{}\n", out.dump(2));
  } else {
    fmt::print("{} {} on {} with {} thread(s){}\n", c.name, c.description, active_target(), threads,
               o.shape.huge_pages ? ", buffers and limits on 2 MiB pages" : "");
    fmt::print("  time        {:.3f} ms (best of repeated runs in {} rounds)\n", seconds * 1e3, o.rounds);
    fmt::print("  throughput  {:.2f} {} ({:.3g} elements/s)\n", throughput, unit, c.elements_per_run / seconds);
    fmt::print(
        "  limit       {:.2f} {} ({}, measured now; copy {:.2f}, copy_nt {:.2f}, rmw {:.2f}, read {:.2f}, "
        "write_nt {:.2f} GB/s; fma {:.1f} GFLOP/s)\n",
        limit, unit, c.limit_name, limits.copy_gbs, limits.copy_nt_gbs, limits.rmw_gbs, limits.read_gbs,
        limits.write_nt_gbs, limits.fma_gflops);
    fmt::print("  ratio       {:.2f}\n", throughput / limit);
    if (workspace >= 0)
      fmt::print("  workspace   {:.1f} MiB (scratch and tables of the last call, all threads)\n",
                 workspace / 1048576.0);
    fmt::print("  peak RSS    {:.1f} MiB (whole process, one call: inputs, outputs, scratch)\n", peak_rss / 1048576.0);
    if (c.remark) fmt::print("  note        {}\n", c.remark());
  }
}

}  // namespace

Runner add_bench(CLI::App& app) {
  auto o = std::make_shared<BenchOptions>();
  CLI::App* sub = app.add_subcommand("bench", "Benchmark one kernel against this machine's measured limit");
  std::string names;
  for (const auto& n : perf::case_names()) names += (names.empty() ? "" : ", ") + n;
  sub->add_option("kernel", o->kernel, "Kernel: " + names)->required();
  sub->add_option("--length,-n,--seq", o->shape.length, "Tokens (table rows)")->capture_default_str();
  sub->add_option("--dim,-d,--head-dim", o->shape.dim, "Width (rope: head_dim)")->capture_default_str();
  sub->add_option("--batch,-b", o->shape.batch, "Batch rows")->capture_default_str();
  sub->add_option("--heads", o->shape.heads, "rope: query heads")->capture_default_str();
  sub->add_option("--kv-heads", o->shape.kv_heads, "rope: key heads")->capture_default_str();
  sub->add_flag("--interleaved", o->shape.interleaved,
                "rope, and attention with --scheme rope: interleaved pairs (default half-split)");
  sub->add_option_function<std::string>(
      "--layout",
      [o](const std::string& layout) {
        if (layout != "interleaved" && layout != "half-split")
          throw Error("bench", "--layout", layout, "interleaved or half-split");
        o->shape.interleaved = layout == "interleaved";
      },
      "rope: interleaved or half-split");
  sub->add_option("--positions", o->shape.positions, "rope: contiguous, arbitrary or packed")->capture_default_str();
  sub->add_option("--dtype", o->shape.dtype, "rope: f32, bf16 or f16")->capture_default_str();
  sub->add_option("--scheme", o->shape.scheme,
                  "bias: nope or any registered score bias of positions (posenc schemes: families relative-bias and "
                  "bias); attention: any registered scheme, with its defaults but for model sizes (Shaw k = 64, "
                  "XL d_model = H·D, TUPE d_model 256 over every position; a causal T5 table of varied values; "
                  "sinks of logit 1; seed 1; forgetting's gates of 0.73–0.99; fox is forgetting); the normalisers "
                  "stickbreaking and cope need --causal")
      ->capture_default_str();
  sub->add_option(
         "--pass", o->shape.pass,
         "bias: forward (materialise) or backward (parameter gradients); attention: forward, backward or decode")
      ->capture_default_str();
  sub->add_flag("--causal", o->shape.causal, "attention: causal mask");
  sub->add_option_function<std::int64_t>(
      "--chunk-size", [o](std::int64_t c) { o->shape.chunk_size = c; },
      "attention: chunked mask (Llama 4's attention_chunk_size), chunks of this many positions");
  sub->add_option_function<std::int64_t>(
      "--value-dim", [o](std::int64_t d) { o->shape.value_dim = d; },
      "attention: the values' head size, at most --head-dim (MLA: 128 of 192; absorbed: 512 of 576)");
  sub->add_option("--kv-dtype", o->shape.kv_dtype,
                  "attention forward and decode: keys and values from a quantized cache: q8_0, q4_0 (ggml's blocks) "
                  "or fp8_e4m3 (a scale per row); default: k and v in --dtype");
  sub->add_flag("--values-in-keys", o->shape.values_in_keys,
                "attention: v is a view of the first --value-dim columns of k's rows (MLA's absorbed decode)");
  sub->add_flag(
      "--no-skip", [o](std::int64_t) { o->shape.skip_vanishing_tiles = false; },
      "attention: run every tile of the mask (no vanishing-tile skip), so that the flops count is the work done");
  sub->add_flag("--in-place", o->shape.in_place, "rope: rotate in place (judged against rmw)");
  sub->add_flag("--huge-pages", o->shape.huge_pages,
                "Put the kernel's buffers and the limits' buffers on 2 MiB pages (posenc::HugePageBuffer)");
  add_optional(sub, "--threads,-t", o->threads, "Threads, 1 to 4096 (default: OpenMP's default)");
  sub->add_option("--rounds", o->rounds, "Alternating rounds of limit and kernel timing (best of each)")
      ->capture_default_str();
  sub->add_option("--format", o->format, "text or json")->capture_default_str();
  return [o] { run_bench(*o); };
}

}  // namespace posenc::cli
