#include "kernels.hpp"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <string_view>

#include <algorithm>
#include <vector>

#include "limits.hpp"
#include "posenc/posenc.hpp"

namespace posenc::perf {
namespace {

using Buffer = BenchArray<float>;
struct Buffers {
  Buffer a, b, c;
};

// Copies of a case's buffers, used in turn.
struct BufferSets {
  std::vector<Buffers> sets;
  std::size_t next = 0;
  Buffers& advance() {
    Buffers& current = sets[next];
    next = (next + 1) % sets.size();
    return current;
  }
};

// How many copies of `bytes` of buffers exceed twice the last-level cache (at least 2).
std::size_t copies_for(double bytes) {
  const double cache = 2.0 * static_cast<double>(last_level_cache_bytes());
  return static_cast<std::size_t>(std::max(2.0, std::ceil(cache / std::max(bytes, 1.0))));
}

void require_positive(const char* name, std::int64_t value) {
  if (value < 1) throw Error("bench", name, std::to_string(value), ">= 1");
}

std::string shape(const CaseOptions& o) {
  return "[" + std::to_string(o.batch) + ", " + std::to_string(o.length) + ", " + std::to_string(o.dim) + "] f32";
}

// Whether a registered scheme takes an option of that name (false for any other name).
bool takes_option(const SchemeEntry& entry, std::string_view option) {
  return std::any_of(entry.options.begin(), entry.options.end(),
                     [&](const SchemeOption& o) { return o.name == option; });
}
bool takes_option(std::string_view scheme, std::string_view option) {
  const auto& all = schemes();
  const auto it = std::find_if(all.begin(), all.end(), [&](const SchemeEntry& e) { return e.name == scheme; });
  return it != all.end() && takes_option(*it, option);
}

// The registered scheme of --scheme, by name or alias; an unknown one is refused as the flag, with
// the registry's list.
const SchemeEntry& bench_scheme(const std::string& name) {
  try {
    return find_scheme(name);
  } catch (const Error& unknown) {
    throw Error("bench", "--scheme", name, unknown.expected());
  }
}

// A registered scheme as the attention benchmark runs it: the registry's defaults and the entry's
// bench_preset (a model's sizes where they exceed the defaults), seed 1 for every
// initialisation, and --interleaved for a scheme with that option.
SchemeArgs bench_scheme_args(const CaseOptions& o, std::int64_t heads, std::int64_t dim, std::int64_t k_len) {
  SchemeArgs args{.heads = heads, .head_dim = dim};
  const SchemeEntry& entry = find_scheme(o.scheme);
  if (takes_option(entry, "seed")) args.options["seed"] = 1;
  if (o.interleaved && takes_option(entry, "interleaved")) args.options["interleaved"] = 1;
  if (entry.bench_preset) entry.bench_preset(args, k_len);
  return args;
}

// Fused attention at a model shape. Inputs hold a deterministic pseudo-random pattern in
// [−1, 1] (constant inputs would make every score equal). Forward and backward count the
// matrix products' flops as flash-attention does: 4·B·Sq·Sk·H·D forward (2 products), halved
// when causal, 2.5× that backward (5 products); decode moves the K and V cache once.
Case make_attention_case(const CaseOptions& o) {
  require_positive("heads", o.heads);
  require_positive("kv_heads", o.kv_heads);
  if (o.pass != "forward" && o.pass != "backward" && o.pass != "decode") {
    throw Error("bench", "--pass", o.pass, "forward, backward or decode");
  }
  if (o.dtype != "f32" && o.dtype != "bf16" && o.dtype != "f16")
    throw Error("bench", "--dtype", o.dtype, "f32, bf16 or f16");
  const DType dtype = o.dtype == "bf16" ? DType::kBF16 : o.dtype == "f16" ? DType::kF16 : DType::kF32;
  std::optional<CacheFormat> kv_format;
  if (!o.kv_dtype.empty()) {
    kv_format = parse_cache_format(o.kv_dtype);
    if (!kv_format) throw Error("bench", "--kv-dtype", o.kv_dtype, "q8_0, q4_0 or fp8_e4m3");
    if (o.pass == "backward") throw Error("bench", "--kv-dtype", o.kv_dtype, "none with --pass backward");
    if (o.values_in_keys) throw Error("bench", "--kv-dtype", o.kv_dtype, "none with --values-in-keys");
  }
  const std::int64_t heads = o.heads, dim = o.dim, kv = o.kv_heads, dim_v = o.value_dim.value_or(o.dim);
  if (dim_v < 1 || dim_v > dim) throw Error("bench", "--value-dim", std::to_string(dim_v), "1 to --head-dim");
  const std::int64_t q_len = o.pass == "decode" ? 1 : o.length, k_len = o.length;
  std::vector<HeadGroup> groups;
  // The registry's name for a scheme given by an alias (fox: forgetting).
  CaseOptions named = o;
  // A registered scheme's per-token inputs [B, Sk, H], each spread over a trained model's values
  // (forgetting's: gates of 0.73–0.99), viewed by the attention.
  auto inputs = std::make_shared<std::vector<std::vector<float>>>();
  const SchemeEntry* entry = &bench_scheme(o.scheme);
  // The family none is the call without groups, the baseline of every other.
  if (entry->family != "none") {
    named.scheme = entry->name;
    SchemeArgs args = bench_scheme_args(named, heads, dim, k_len);
    for (const SchemeInput& in : find_scheme(named.scheme).inputs) {
      std::vector<float>& values = inputs->emplace_back(
          static_cast<std::size_t>(checked_mul(checked_mul(o.batch, k_len, in.name.c_str()), heads, in.name.c_str())));
      for (std::size_t i = 0; i < values.size(); ++i)
        values[i] = static_cast<float>(in.typical(static_cast<double>((i * 2654435761u) % 1000) / 1000.0));
      args.inputs[in.name] = ConstTensorView::of(static_cast<const float*>(values.data()), {o.batch, k_len, heads});
    }
    groups.push_back(make_head_group(named.scheme, args));
  }
  struct State {
    BenchArray<std::uint16_t> q16, k16, v16, out16, dout16, dq16, dk16, dv16;
    BenchArray<float> q, k, v, out, dout, dq, dk, dv;
    BenchArray<unsigned char> kq, vq;  // a quantized cache (--kv-dtype)
    std::vector<float> lse;
    std::shared_ptr<std::vector<std::vector<float>>> inputs;  // the scheme's per-token inputs, viewed
    std::unique_ptr<Attention> attention;
    AttentionStats stats;  // the last timed call's
  };
  auto st = std::make_shared<State>();
  st->inputs = inputs;
  const std::int64_t q_count = checked_mul(checked_mul(o.batch, q_len, "q"), heads * dim, "q");
  const std::int64_t k_count = checked_mul(checked_mul(o.batch, k_len, "k"), kv * dim, "k");
  const std::int64_t o_count = checked_mul(checked_mul(o.batch, q_len, "out"), heads * dim_v, "out");
  const std::int64_t v_count = o.values_in_keys ? 0 : checked_mul(checked_mul(o.batch, k_len, "v"), kv * dim_v, "v");
  std::uint64_t state = 99;
  const auto pattern = [&state] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(static_cast<double>(state >> 40) / static_cast<double>(1ull << 24) * 2.0 - 1.0);
  };
  const auto make = [&](BenchArray<float>& f, BenchArray<std::uint16_t>& h, std::int64_t n, bool random) {
    if (n == 0) return;  // v inside k's rows
    f.assign(static_cast<std::size_t>(n), 0.0f, o.huge_pages);
    if (random) {
      for (auto& x : f) x = pattern();
    }
    if (dtype != DType::kF32) {
      h.assign(f.size(), 0, o.huge_pages);
      for (std::size_t i = 0; i < f.size(); ++i) {
        h.data()[i] = dtype == DType::kBF16 ? to_bf16(f.data()[i]).bits : to_f16(f.data()[i]).bits;
      }
      f.clear();
    }
  };
  const bool backward = o.pass == "backward";
  make(st->q, st->q16, q_count, true);
  std::int64_t cache_bytes = 0;
  if (kv_format) {
    // The same values as an f32 cache, quantized row by row.
    const auto quantize = [&](BenchArray<unsigned char>& bytes, std::int64_t count, std::int64_t width) {
      const std::int64_t rows = count / width, rb = cache_row_bytes(*kv_format, width);
      bytes.assign(static_cast<std::size_t>(checked_mul(rows, rb, "cache bytes")), 0, o.huge_pages);
      std::vector<float> row(static_cast<std::size_t>(width));
      for (std::int64_t r = 0; r < rows; ++r) {
        for (auto& x : row) x = pattern();
        quantize_rows(*kv_format, row.data(), 1, width, bytes.data() + r * rb, rb);
      }
      cache_bytes += rows * rb;
    };
    quantize(st->kq, k_count, dim);
    quantize(st->vq, v_count, dim_v);
  } else {
    make(st->k, st->k16, k_count, true);
    make(st->v, st->v16, v_count, true);
  }
  make(st->out, st->out16, o_count, false);
  if (backward) {
    make(st->dout, st->dout16, o_count, true);
    make(st->dq, st->dq16, q_count, false);
    make(st->dk, st->dk16, k_count, false);
    make(st->dv, st->dv16, checked_mul(checked_mul(o.batch, k_len, "v"), kv * dim_v, "v"), false);
  }
  st->lse.assign(static_cast<std::size_t>(o.batch * heads * q_len), 0.0f);
  const auto data = [dtype](BenchArray<float>& f, BenchArray<std::uint16_t>& h) -> void* {
    return dtype == DType::kF32 ? static_cast<void*>(f.data()) : static_cast<void*>(h.data());
  };
  const std::vector<std::int64_t> q_shape = {o.batch, q_len, heads, dim}, k_shape = {o.batch, k_len, kv, dim};
  const std::vector<std::int64_t> o_shape = {o.batch, q_len, heads, dim_v}, v_shape = {o.batch, k_len, kv, dim_v};
  const std::vector<std::int64_t> k_strides = {k_len * kv * dim, kv * dim, dim, 1};
  AttentionSpec spec;
  spec.q = ConstTensorView::contiguous(data(st->q, st->q16), dtype, q_shape);
  if (!kv_format) {
    spec.k = ConstTensorView::contiguous(data(st->k, st->k16), dtype, k_shape);
    spec.v = o.values_in_keys ? ConstTensorView(data(st->k, st->k16), dtype, v_shape, k_strides)
                              : ConstTensorView::contiguous(data(st->v, st->v16), dtype, v_shape);
  } else {
    const std::int64_t kb = cache_row_bytes(*kv_format, dim), vb = cache_row_bytes(*kv_format, dim_v);
    spec.cache = QuantizedCache{*kv_format,
                                {st->kq.data(), o.batch, k_len, kv, dim, k_len * kv * kb, kv * kb, kb},
                                {st->vq.data(), o.batch, k_len, kv, dim_v, k_len * kv * vb, kv * vb, vb}};
  }
  spec.groups = groups;
  spec.mask.causal = o.causal;
  spec.mask.chunk_size = o.chunk_size;
  spec.skip_vanishing_tiles = o.skip_vanishing_tiles;
  st->attention = std::make_unique<Attention>(spec);
  const TensorView out = TensorView::contiguous(data(st->out, st->out16), dtype, o_shape);
  const TensorView lse = TensorView::of(st->lse.data(), {o.batch, heads, q_len});
  Case c;
  c.name = "attention";
  c.description =
      "q [" + std::to_string(o.batch) + ", " + std::to_string(q_len) + ", " + std::to_string(heads) + ", " +
      std::to_string(dim) + "], k, v [" + std::to_string(o.batch) + ", " + std::to_string(k_len) + ", " +
      std::to_string(kv) + ", " + std::to_string(dim) + "] " +
      (dim_v != dim ? "v " + std::to_string(dim_v) + (o.values_in_keys ? " wide, k's rows, " : " wide, ") : "") +
      (kv_format ? o.dtype + " q, " + o.kv_dtype + " cache" : o.dtype) + ", " + o.scheme +
      (o.interleaved && takes_option(named.scheme, "interleaved") ? " (interleaved)" : "") + ", " +
      (o.causal ? "causal" : "full") + (o.chunk_size ? ", chunks of " + std::to_string(*o.chunk_size) : "") + ", " +
      o.pass;
  const double width = static_cast<double>(dtype_size(dtype));
  double pairs = static_cast<double>(o.batch) * static_cast<double>(q_len) * static_cast<double>(k_len) *
                 static_cast<double>(heads) * static_cast<double>(dim);
  double visible_keys = static_cast<double>(k_len);  // decode: the keys its query reads
  if (o.chunk_size) {
    // Chunks: the pairs the mask lets through, counted (query i at position k_len − q_len + i).
    const std::int64_t size = *o.chunk_size;
    double seen = 0;
    for (std::int64_t i = 0; i < q_len; ++i) {
      const std::int64_t p = k_len - q_len + i, first = p / size * size;
      seen += static_cast<double>((o.causal ? p + 1 : std::min(k_len, first + size)) - first);
    }
    pairs = seen * static_cast<double>(o.batch * heads * dim);
    visible_keys = seen / static_cast<double>(q_len);
  }
  // Two products per pair, D and Dv deep.
  const double forward_flops = 2.0 * pairs * (1.0 + static_cast<double>(dim_v) / static_cast<double>(dim)) *
                               (o.causal && !o.chunk_size ? 0.5 : 1.0);
  c.elements_per_run = static_cast<double>(o.batch * heads) * static_cast<double>(q_len) * static_cast<double>(k_len);
  if (o.pass == "decode") {
    // The cache read once: keys and (unless they lie in the keys' rows) values.
    const double cache = kv_format ? static_cast<double>(cache_bytes)
                                   : (static_cast<double>(k_count) + static_cast<double>(v_count)) * width;
    c.bytes_per_run = cache * visible_keys / static_cast<double>(k_len);
    c.limit_name = "copy";
    c.run = [st, out, lse] { st->stats = st->attention->forward(out, lse); };
  } else if (o.pass == "forward") {
    c.flops_per_run = forward_flops;
    c.limit_name = "fma";
    c.run = [st, out, lse] { st->stats = st->attention->forward(out, lse); };
  } else {
    c.flops_per_run = 2.5 * forward_flops;
    c.limit_name = "fma";
    st->attention->forward(out, lse);
    const ConstTensorView dout = ConstTensorView::contiguous(data(st->dout, st->dout16), dtype, o_shape);
    const TensorView dq = TensorView::contiguous(data(st->dq, st->dq16), dtype, q_shape);
    const TensorView dk = TensorView::contiguous(data(st->dk, st->dk16), dtype, k_shape);
    const TensorView dv = TensorView::contiguous(data(st->dv, st->dv16), dtype, v_shape);
    // A scheme is trained when it has parameters or per-token inputs (FoX's gates: their gradients
    // are part of the backward's work).
    const bool trainable =
        !groups.empty() && (!find_scheme(named.scheme).inputs.empty() ||
                            !scheme_parameters(find_scheme(named.scheme), st->attention->spec().groups[0]).empty());
    auto grads = std::make_shared<AttentionGradients>(st->attention->zero_gradients());
    c.run = [st, out, lse, dout, dq, dk, dv, grads, trainable] {
      st->stats = st->attention->backward(out, lse, dout, dq, dk, dv, trainable ? grads.get() : nullptr);
    };
  }
  c.workspace_bytes = [st] { return static_cast<double>(st->stats.workspace_bytes); };
  if (o.pass != "decode") {
    const bool forward = o.pass == "forward";
    c.remark = [st, forward] {
      const AttentionStats& n = st->stats;
      return "skipped " + std::to_string(n.skipped) + " of " + std::to_string(n.tiles) +
             (forward ? " key tiles" : " (key tile, row block) steps") +
             " (every weight below FLT_MIN; the flops count them all)";
    };
  } else {
    // Each new token is a new call (the cache one key longer), planned anew: its tables over the
    // positions the step meets. Timed apart, best of five.
    double plan = std::numeric_limits<double>::infinity();
    for (int round = 0; round < 5; ++round) {
      const auto start = std::chrono::steady_clock::now();
      const Attention step(spec);
      plan = std::min(plan, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    c.remark = [plan] {
      char text[96];
      std::snprintf(text, sizeof(text), "planning a step takes %.3f ms more (its tables; not in the time above)",
                    plan * 1e3);
      return std::string(text);
    };
  }
  c.state = st;
  return c;
}

}  // namespace

std::vector<std::string> case_names() {
  return {"sinusoidal", "sinusoidal-add", "learned-forward", "learned-backward", "rope", "bias", "attention"};
}

Case make_case(const std::string& name, const CaseOptions& o) {
  require_positive("length", o.length);
  require_positive("dim", o.dim);
  require_positive("batch", o.batch);
  const auto tokens = static_cast<std::size_t>(checked_mul(o.batch, o.length, "tokens"));
  const auto elems = static_cast<std::size_t>(checked_mul(static_cast<std::int64_t>(tokens), o.dim, "elements"));
  const auto table = static_cast<std::size_t>(checked_mul(o.length, o.dim, "table elements"));
  const double bytes = static_cast<double>(elems) * sizeof(float);
  Case c;
  c.name = name;
  // Sizes (in floats) of the buffers a, b, c of one set, and the kernel call on one set.
  std::size_t size_a = 0, size_b = 0, size_c = 0;
  float fill_a = 1.0f, fill_b = 0.0f;
  std::function<void(Buffers&)> call;
  if (name == "sinusoidal") {
    const SinusoidalParams params(o.dim);
    size_a = table;
    c.description = "table [" + std::to_string(o.length) + ", " + std::to_string(o.dim) + "] f32";
    c.bytes_per_run = static_cast<double>(table) * sizeof(float);  // written
    c.elements_per_run = static_cast<double>(table);
    c.limit_name = "copy_nt";
    call = [params, o](Buffers& bs) {
      sinusoidal_table(params, Positions::range(o.length), TensorView::of(bs.a.get(), {o.length, o.dim}));
    };
  } else if (name == "sinusoidal-add") {
    const SinusoidalParams params(o.dim);
    size_a = size_b = elems;
    c.description = "x, out " + shape(o);
    c.bytes_per_run = 2 * bytes;  // read x, write out
    c.elements_per_run = static_cast<double>(elems);
    c.limit_name = "copy_nt";  // large outputs are written with non-temporal stores (src/absolute.cpp)
    call = [params, o](Buffers& bs) {
      sinusoidal_add(params, ConstTensorView::of(bs.a.get(), {o.batch, o.length, o.dim}), Positions::range(o.length),
                     TensorView::of(bs.b.get(), {o.batch, o.length, o.dim}));
    };
  } else if (name == "learned-forward") {
    // A GPT-2-like table of max_len = length rows; positions 0 … length-1 per batch row.
    size_a = size_c = elems;  // x, y
    size_b = table;
    fill_b = 0.5f;
    c.description = "x, y " + shape(o) + ", table [" + std::to_string(o.length) + ", " + std::to_string(o.dim) + "]";
    c.bytes_per_run = 2 * bytes + static_cast<double>(table) * sizeof(float);  // read x, table; write y
    c.elements_per_run = static_cast<double>(elems);
    c.limit_name = "copy_nt";  // large outputs are written with non-temporal stores (src/absolute.cpp)
    call = [o](Buffers& bs) {
      learned_forward(ConstTensorView::of(bs.b.get(), {o.length, o.dim}),
                      ConstTensorView::of(bs.a.get(), {o.batch, o.length, o.dim}), Positions::range(o.length),
                      TensorView::of(bs.c.get(), {o.batch, o.length, o.dim}));
    };
  } else if (name == "learned-backward") {
    size_a = elems;  // dy
    size_b = table;  // d_table
    c.description =
        "dy " + shape(o) + " scattered into d_table [" + std::to_string(o.length) + ", " + std::to_string(o.dim) + "]";
    // read dy; read and write each d_table row (every row is touched; a row's repeats across the
    // batch stay in cache)
    c.bytes_per_run = bytes + 2 * static_cast<double>(table) * sizeof(float);
    c.elements_per_run = static_cast<double>(elems);
    c.limit_name = "rmw";
    call = [o](Buffers& bs) {
      learned_backward(ConstTensorView::of(bs.a.get(), {o.batch, o.length, o.dim}), Positions::range(o.length),
                       TensorView::of(bs.b.get(), {o.length, o.dim}));
    };
  } else if (name == "rope") {
    require_positive("heads", o.heads);
    require_positive("kv_heads", o.kv_heads);
    if (o.dtype != "f32" && o.dtype != "bf16" && o.dtype != "f16")
      throw Error("bench", "--dtype", o.dtype, "f32, bf16 or f16");
    const DType dtype = o.dtype == "bf16" ? DType::kBF16 : o.dtype == "f16" ? DType::kF16 : DType::kF32;
    const std::size_t width = dtype_size(dtype);
    const RopeParams params(o.dim, o.dim, 10000.0, o.interleaved ? RopeLayout::kInterleaved : RopeLayout::kHalfSplit);
    const std::int64_t q_count = checked_mul(static_cast<std::int64_t>(tokens), o.heads * o.dim, "q elements");
    const std::int64_t k_count = checked_mul(static_cast<std::int64_t>(tokens), o.kv_heads * o.dim, "k elements");
    // Buffers are float arrays; a bf16 or f16 case uses the first half of each (2 bytes per element).
    const auto floats = static_cast<std::size_t>((q_count + k_count) * static_cast<std::int64_t>(width) / 4 + 1);
    size_a = floats;
    size_b = o.in_place ? 0 : floats;
    fill_a = 0.5f;  // as bf16 or f16 pairs: two small normal numbers
    // Positions: 0 … S-1 per batch row; random ids; or packed sequences of 64 to 1024 tokens.
    auto ids = std::make_shared<std::vector<std::int64_t>>();
    if (o.positions == "arbitrary") {
      std::uint64_t state = 12345;
      for (std::size_t t = 0; t < tokens; ++t) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        ids->push_back(static_cast<std::int64_t>((state >> 33) % (1u << 20)));
      }
    } else if (o.positions == "packed") {
      if (o.batch != 1) throw Error("bench", "--batch", std::to_string(o.batch), "1 with --positions packed");
      ids->push_back(0);
      std::uint64_t state = 777;
      while (ids->back() < o.length) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        ids->push_back(
            std::min<std::int64_t>(o.length, ids->back() + 64 + static_cast<std::int64_t>((state >> 33) % 961)));
      }
    } else if (o.positions != "contiguous") {
      throw Error("bench", "--positions", o.positions, "contiguous, arbitrary or packed");
    }
    c.description = "q [" + std::to_string(o.batch) + ", " + std::to_string(o.length) + ", " + std::to_string(o.heads) +
                    ", " + std::to_string(o.dim) + "], k with " + std::to_string(o.kv_heads) + " heads, " + o.dtype +
                    ", " + (o.interleaved ? "interleaved" : "half-split") + ", " + o.positions + " positions, " +
                    (o.in_place ? "in place" : "out of place");
    c.bytes_per_run =
        2.0 * static_cast<double>((q_count + k_count) * static_cast<std::int64_t>(width));  // read + write
    c.elements_per_run = static_cast<double>(q_count + k_count);
    c.limit_name = o.in_place ? "rmw" : "copy_nt";
    call = [params, o, q_count, dtype, width, ids](Buffers& bs) {
      const Positions positions = o.positions == "contiguous" ? Positions::range(o.length)
                                  : o.positions == "packed"   ? Positions::packed(*ids)
                                                              : Positions::ids(*ids, o.batch, o.length);
      auto* in = reinterpret_cast<unsigned char*>(bs.a.get());
      auto* out = o.in_place ? in : reinterpret_cast<unsigned char*>(bs.b.get());
      const std::vector<std::int64_t> q_shape = {o.batch, o.length, o.heads, o.dim};
      const std::vector<std::int64_t> k_shape = {o.batch, o.length, o.kv_heads, o.dim};
      const std::size_t k_offset = static_cast<std::size_t>(q_count) * width;
      rope_apply(params, positions, ConstTensorView::contiguous(in, dtype, q_shape),
                 ConstTensorView::contiguous(in + k_offset, dtype, k_shape),
                 TensorView::contiguous(out, dtype, q_shape), TensorView::contiguous(out + k_offset, dtype, k_shape));
    };
  } else if (name == "bias") {
    require_positive("heads", o.heads);
    const std::int64_t heads = o.heads;
    // Every registered score bias of positions (posenc schemes) with its defaults, seed 1 for every
    // initialisation, a position table over every position where there is one, and the entry's
    // bench_preset.
    BiasScheme scheme = NoPE(heads);
    const SchemeEntry& entry = bench_scheme(o.scheme);
    if (entry.family != "relative-bias" && entry.family != "bias" && entry.family != "none")
      throw Error("bench", "--scheme", o.scheme, "a score bias (family relative-bias or bias, posenc schemes) or none");
    // The family none is NoPE's zeros, the baseline of every other.
    if (entry.family != "none") {
      SchemeArgs args{.heads = heads, .head_dim = 1};
      if (takes_option(entry, "seed")) args.options["seed"] = 1;
      if (takes_option(entry, "max_len")) args.options["max_len"] = static_cast<double>(o.length);
      if (entry.bench_preset) entry.bench_preset(args, o.length);
      scheme = *make_head_group(entry.name, args).bias;
    }
    if (o.pass != "forward" && o.pass != "backward") throw Error("bench", "--pass", o.pass, "forward or backward");
    if (o.pass == "backward" && bias_parameter_count(scheme) == 0)
      throw Error("bench", "--scheme", o.scheme, "a scheme with parameters for --pass backward");
    const std::int64_t scores =
        checked_mul(checked_mul(o.batch, heads, "scores"), checked_mul(o.length, o.length, "scores"), "scores");
    size_a = static_cast<std::size_t>(scores);
    fill_a = 1e-3f;
    c.description = "scores [" + std::to_string(o.batch) + ", " + std::to_string(heads) + ", " +
                    std::to_string(o.length) + ", " + std::to_string(o.length) + "] f32, " + o.scheme + ", " + o.pass;
    c.bytes_per_run = static_cast<double>(scores) * sizeof(float);  // written (forward) or read (backward)
    c.limit_name = o.pass == "forward" ? "write_nt" : "read";
    c.elements_per_run = static_cast<double>(scores);
    auto grads = std::make_shared<std::vector<double>>(
        static_cast<std::size_t>(std::max<std::int64_t>(64 * heads, bias_parameter_count(scheme))));
    call = [scheme, o, heads, grads](Buffers& bs) {
      const Positions positions = Positions::range(o.length);
      const std::vector<std::int64_t> shape = {o.batch, heads, o.length, o.length};
      if (o.pass == "forward") {
        bias_materialize(scheme, positions, positions, TensorView::contiguous(bs.a.get(), DType::kF32, shape));
        return;
      }
      const ConstTensorView ds = ConstTensorView::contiguous(bs.a.get(), DType::kF32, shape);
      std::span<double> g(*grads);
      bias_backward(scheme, positions, positions, ds, g.first(static_cast<std::size_t>(bias_parameter_count(scheme))));
    };
  } else if (name == "attention") {
    return make_attention_case(o);
  } else {
    std::string names;
    for (const auto& n : case_names()) names += (names.empty() ? "" : ", ") + n;
    throw Error("bench", "kernel", name, "one of: " + names);
  }
  auto sets = std::make_shared<BufferSets>();
  const double set_bytes = static_cast<double>(size_a + size_b + size_c) * sizeof(float);
  sets->sets.resize(copies_for(set_bytes));
  for (Buffers& bs : sets->sets) {
    if (size_a > 0) bs.a.assign(size_a, fill_a, o.huge_pages);
    if (size_b > 0) bs.b.assign(size_b, fill_b, o.huge_pages);
    if (size_c > 0) bs.c.assign(size_c, 0.0f, o.huge_pages);
  }
  c.state = sets;
  c.run = [sets, call] { call(sets->advance()); };
  return c;
}

}  // namespace posenc::perf
