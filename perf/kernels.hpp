// Benchmark cases of posenc's kernels, shared by `posenc bench` and the Google Benchmark binary
// (bench/), so that both measure exactly the same work. Internal, not installed.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace posenc::perf {

struct CaseOptions {
  std::int64_t length = 32768;  // tokens (or table rows)
  std::int64_t dim = 1024;      // width (head_dim for rope)
  std::int64_t batch = 1;
  // rope: [batch, length, heads, dim] q and [batch, length, kv_heads, dim] k
  std::int64_t heads = 32;
  std::int64_t kv_heads = 8;
  bool interleaved = false;
  std::string positions = "contiguous";  // rope: contiguous, arbitrary, packed
  std::string dtype = "f32";             // rope: f32, bf16, f16
  bool in_place = false;                 // rope
  // bias: scores [batch, heads, length, length] f32 of a scheme, forward (materialise) or
  // backward (the learned parameters' gradients from dL/dscores)
  std::string scheme = "alibi";
  std::string pass = "forward";
  // attention: q [batch, length, heads, dim], k, v [batch, length, kv_heads, dim]; pass forward,
  // backward or decode (one query against a cache of `length` keys); scheme none, rope, alibi,
  // t5, kerple, fire, tupe, shaw, xl, sinks, forgetting, stickbreaking, cope or any other
  // registered scheme (fox is forgetting), through posenc::Attention
  bool causal = false;
  // attention: Llama 4's chunked mask (attention.hpp), chunks of this many positions; absent: none
  std::optional<std::int64_t> chunk_size{};
  // attention: MLA's values, value_dim wide (default: dim); values_in_keys makes v a view of the
  // first value_dim columns of k's rows (absorbed decode: one cache read for both)
  std::optional<std::int64_t> value_dim{};
  bool values_in_keys = false;
  // attention forward and decode: keys and values from a quantized cache (q8_0, q4_0 or
  // fp8_e4m3, quantized.hpp) instead of k and v in dtype; empty: k and v in dtype
  std::string kv_dtype{};
  // attention: the vanishing-tile skip (AttentionSpec / StickBreakingSpec::skip_vanishing_tiles);
  // off, every tile of the mask runs and the flops count is the work done
  bool skip_vanishing_tiles = true;
  // Every buffer on 2 MiB pages (posenc::HugePageBuffer) instead of ordinary ones; the limits
  // must then be measured with measure_limits(…, huge_pages = true).
  bool huge_pages = false;
};

// One prepared case: buffers allocated and touched, `run` does one call of the kernel. A case
// holds enough copies of its buffers to exceed twice the last-level cache and each call uses the
// next copy, so that every call streams its data from memory — as a model step does with fresh
// activations, and as the memory limits it is compared with are measured.
struct Case {
  std::string name;
  std::string description;      // shapes, for reports
  double bytes_per_run = 0;     // bytes the kernel must move at least (reads + writes)
  double elements_per_run = 0;  // elements produced (or consumed, for reductions) per call
  std::string limit_name;       // "copy", "copy_nt", "rmw", "read", "write_nt" or "fma": the limit it is compared with
  double flops_per_run = 0;     // compute-bound cases (limit "fma"): the flops counted per call
  std::function<double()> workspace_bytes;  // scratch the kernel used (attention), when known
  std::function<std::string()> remark;      // what else the last call did (attention: skipped tiles)
  std::function<void()> run;
  std::shared_ptr<void> state;  // owns the buffers
};

// Kernel names: sinusoidal (table build), sinusoidal-add, learned-forward, learned-backward,
// rope (q and k together; layout, positions, dtype and in-place from the options), bias (scheme
// and pass from the options), attention (scheme, pass, causal, dtype from the options).
std::vector<std::string> case_names();
// Throws posenc::Error for an unknown name or bad options.
Case make_case(const std::string& name, const CaseOptions& options);

}  // namespace posenc::perf
