// AttentionSpec → AttentionPlan: validation (once), sequences, default positions, the per-group
// transform tables and bias tables, lse I/O and the positional parameters' gradients.
#include "attention/attention_plan.hpp"
#include "attention/transforms.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <deque>
#include <limits>
#include <string>
#include <tuple>
#include <variant>

#include "absolute_checks.hpp"  // check_disjoint
#include "bias_checks.hpp"
#include "kernels/attention/attention_kernels.hpp"
#include "posenc/error.hpp"
#include "rotary_checks.hpp"

namespace posenc::detail {
namespace {

constexpr const char* kWhere = AttentionPlan::kWhere;

void require(bool ok, const char* param, const std::string& value, const std::string& expected) {
  if (!ok) throw Error(kWhere, param, value, expected);
}

std::string shape_text(ConstTensorView v) { return v.describe(); }

}  // namespace

void RowBlock::slice(std::int64_t r0, std::int64_t n, RowBlock& out) const {
  out.i0 = i0;
  out.count = count;
  out.compact = compact;
  out.width = n;
  out.valid_rows = 0;
  const auto b = head.begin() + r0, e = head.begin() + r0 + n;
  out.head.assign(b, e);
  out.query.assign(query.begin() + r0, query.begin() + r0 + n);
  out.position.assign(position.begin() + r0, position.begin() + r0 + n);
  out.lo.assign(lo.begin() + r0, lo.begin() + r0 + n);
  out.hi.assign(hi.begin() + r0, hi.begin() + r0 + n);
  out.chunk_uniform.assign(chunk_uniform.begin() + r0 / kernels::kAttnAlign,
                           chunk_uniform.begin() + (r0 + n) / kernels::kAttnAlign);
  for (std::int64_t r = 0; r < n; ++r) out.valid_rows += out.head[static_cast<std::size_t>(r)] >= 0 ? 1 : 0;
  out.key_lo = key_lo;
  out.key_hi = key_hi;
}

std::int64_t AttentionUnitScratch::bytes() const {
  std::int64_t total = 0;
  for (const auto* buffer :
       {&q, &qt, &o, &m, &l, &corr, &st, &dpt, &k, &v, &tmp, &dout, &doutt, &dq, &dk, &dv, &lse, &delta, &rope_rows}) {
    total += static_cast<std::int64_t>(buffer->capacity() * sizeof(float));
  }
  for (const auto* buffer : {&qt_pairs, &p_pairs, &v_pairs, &k_pairs, &v_own_pairs, &doutt_pairs, &q_row_pairs,
                             &dout_row_pairs, &v_dim_pairs, &k_key_pairs, &pt_pairs, &dst_pairs, &ds_pairs})
    total += static_cast<std::int64_t>(buffer->capacity() * sizeof(std::uint32_t));
  for (const TermState& t : terms) total += t.bytes();
  return total +
         static_cast<std::int64_t>((kpos.capacity() + exact_rows.capacity()) * sizeof(std::int64_t) +
                                   (hist.capacity() + row_norm.capacity() + exact_delta.capacity()) * sizeof(double));
}

AttentionUnitScratch& unit_scratch() {
  thread_local AttentionUnitScratch s;
  return s;
}

namespace {
// b[0, n) = 0, by the cores when large: the units' gradient slots of XL and TUPE are tens of MiB.
template <class T>
void zero_in_parallel(T* b, std::size_t n) {
  constexpr std::size_t kBlock = std::size_t{1} << 16;
  const auto blocks = static_cast<std::int64_t>((n + kBlock - 1) / kBlock);
#pragma omp parallel for schedule(static) num_threads(threads_for(static_cast <std::int64_t>(n) / 8))
  for (std::int64_t i = 0; i < blocks; ++i) {
    const std::size_t from = static_cast<std::size_t>(i) * kBlock;
    std::fill(b + from, b + std::min(n, from + kBlock), T(0));
  }
}
}  // namespace

std::vector<double>& zeroed_doubles(CallBuffer which, std::size_t n) {
  thread_local std::array<std::vector<double>, static_cast<std::size_t>(CallBuffer::kCount)> buffers;
  std::vector<double>& b = buffers[static_cast<std::size_t>(which)];
  b.resize(n);
  zero_in_parallel(b.data(), n);
  return b;
}

std::vector<double>& zeroed_term_slots(std::size_t term, std::size_t n) {
  thread_local std::deque<std::vector<double>> buffers;  // growing keeps the other terms' slots in place
  if (buffers.size() <= term) buffers.resize(term + 1);
  buffers[term].resize(n);
  zero_in_parallel(buffers[term].data(), n);
  return buffers[term];
}

AlignedFloats& zeroed_floats(CallBuffer which, std::size_t n) {
  thread_local std::array<AlignedFloats, static_cast<std::size_t>(CallBuffer::kCount)> buffers;
  AlignedFloats& b = buffers[static_cast<std::size_t>(which)];
  b.resize(n);
  zero_in_parallel(b.data(), n);
  return b;
}

AttentionPlan::AttentionPlan(AttentionSpec spec_in) : spec(std::move(spec_in)) {
  mask = spec.mask;
  check_views();
  check_mask();
  plan_sequences();
  if (check_normaliser()) return;
  const PositionRange range = plan_positions();
  position_range = range;
  check_f32_multipliers(range);
  const std::vector<HeadGroup> groups = plan_head_groups();
  plan_transform_tables(groups, range);
  const float lowest_table_bias = plan_bias_tables(groups, range);
  plan_terms(groups);
  plan_far_tiles(lowest_table_bias);
}

bool AttentionPlan::check_normaliser() {
  const auto with =
      std::find_if(spec.groups.begin(), spec.groups.end(), [](const HeadGroup& g) { return g.normaliser != nullptr; });
  if (with == spec.groups.end()) return false;
  const HeadGroup& g = *with;
  const std::string name(g.normaliser->name());
  const auto refuse = [&](const char* param, const std::string& value, const std::string& expected) {
    throw Error(kWhere, param, value, expected + " (" + name + " replaces the softmax and runs the call alone)");
  };
  if (spec.groups.size() != 1) refuse("groups", std::to_string(spec.groups.size()) + " groups", "one group");
  if (g.heads != heads)
    refuse("groups[0].heads", std::to_string(g.heads), "the " + std::to_string(heads) + " heads of q");
  if (g.transform.index() != 0) refuse("groups[0].transform", "set", "none");
  if (g.bias) refuse("groups[0].bias", "set", "none");
  if (!g.terms.empty()) refuse("groups[0].terms", std::to_string(g.terms.size()) + " terms", "none (sinks included)");
  // Its weights walk the keys at or before the query (stick-breaking's from the one before it):
  // a causal mask, or one query per sequence, which sees no later key under any mask.
  const bool single_queries =
      std::all_of(sequences.begin(), sequences.end(), [](const Sequence& seq) { return seq.lq <= 1; });
  if (!spec.mask.causal && !single_queries) refuse("mask.causal", "false", "a causal mask");
  if (spec.mask.window_left >= 0) refuse("mask.window_left", std::to_string(spec.mask.window_left), "-1");
  if (spec.mask.window_right > 0) refuse("mask.window_right", std::to_string(spec.mask.window_right), "-1 or 0");
  if (spec.mask.chunk_size) refuse("mask.chunk_size", std::to_string(*spec.mask.chunk_size), "unset");
  if (spec.mask.softcap != 0.0) refuse("mask.softcap", std::to_string(spec.mask.softcap), "0");
  if (!spec.mask.key_lengths.empty()) refuse("mask.key_lengths", "given", "empty (every key)");
  // Positions play no part but the order of the tokens: given ones must be that order (a cache's
  // keys 0, 1, … and its queries the last of them), as the defaults are.
  const std::int64_t rows = packed ? 1 : batch;
  if (spec.q_positions) spec.q_positions->check_grid(kWhere, rows, q_len);
  if (spec.k_positions) spec.k_positions->check_grid(kWhere, rows, k_len);
  for (const Sequence& seq : sequences) {
    const std::int64_t offset = std::max<std::int64_t>(0, seq.lk - seq.lq);
    for (std::int64_t i = 0; spec.q_positions && i < seq.lq; ++i) {
      const std::int64_t p = spec.q_positions->at(packed ? 0 : seq.b, seq.q0 + i);
      if (p != offset + i) {
        refuse("q_positions", std::to_string(p) + " at query " + std::to_string(i) + " of a sequence",
               std::to_string(offset + i) + ", the tokens' order (query i of Lq is key token Lk − Lq + i)");
      }
    }
    for (std::int64_t j = 0; spec.k_positions && j < seq.lk; ++j) {
      const std::int64_t p = spec.k_positions->at(packed ? 0 : seq.b, seq.k0 + j);
      if (p != j) {
        refuse("k_positions", std::to_string(p) + " at key " + std::to_string(j) + " of a sequence",
               std::to_string(j) + ", the tokens' order");
      }
    }
  }
  if (spec.temperature) refuse("temperature", "set", "unset");
  if (spec.cache) refuse("cache", std::string(cache_format_name(spec.cache->format)), "k and v tensors");
  normaliser = g.normaliser.get();
  normaliser->check(spec);
  return true;
}

// The views: ranks, shapes, dtypes and strides of q, k, v; the block and tile sizes.
void AttentionPlan::check_views() {
  packed = !spec.cu_seqlens_q.empty() || !spec.cu_seqlens_k.empty();
  require(spec.q.rank() == 3 || spec.q.rank() == 4, "q", shape_text(spec.q), "[B, Sq, H, D] or packed [Tq, H, D]");
  qg = heads_grid(kWhere, "q", spec.q);
  if (spec.cache) {
    check_cache();
  } else {
    kg = heads_grid(kWhere, "k", spec.k);
    vg = heads_grid(kWhere, "v", spec.v);
  }
  if (packed) {
    require(spec.q.rank() == 3, "q", shape_text(spec.q), "packed [Tq, H, D] with cu_seqlens");
    require(spec.k.rank() == 3, "k", shape_text(spec.k), "packed [Tk, G, D] with cu_seqlens");
  }
  dtype = spec.q.dtype();
  require(dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16 || dtype == DType::kF64, "q.dtype",
          std::string(dtype_name(dtype)), "f32, bf16, f16 or f64");
  if (!spec.cache) {
    check_dtype(kWhere, "k", spec.k.dtype(), dtype);
    check_dtype(kWhere, "v", spec.v.dtype(), dtype);
  }
  kv_unit = spec.cache ? 1 : static_cast<std::int64_t>(dtype_size(dtype));
  // Shapes in messages: k and v, or the cache's K and V.
  const auto cache_text = [&](const HeadsGrid& g) {
    return "[" + std::to_string(g.batch) + ", " + std::to_string(g.seq) + ", " + std::to_string(g.heads) + ", " +
           std::to_string(g.dim) + "] " + std::string(cache_format_name(spec.cache->format));
  };
  const std::string k_text = spec.cache ? cache_text(kg) : shape_text(spec.k);
  const std::string v_text = spec.cache ? cache_text(vg) : shape_text(spec.v);
  const char* k_name = spec.cache ? "cache.k" : "k";
  const char* v_name = spec.cache ? "cache.v" : "v";
  batch = qg.batch;
  q_len = qg.seq;
  k_len = kg.seq;
  heads = qg.heads;
  kv_heads = kg.heads;
  dim = qg.dim;
  require(kg.batch == batch, k_name, k_text, "batch " + std::to_string(batch) + " as q");
  require(kg.dim == dim, k_name, k_text, "head_dim " + std::to_string(dim) + " as q");
  require(vg.batch == batch && vg.seq == k_len && vg.heads == kv_heads && vg.dim >= 1 && vg.dim <= dim, v_name, v_text,
          "the shape of k, " + k_text + ", with a head_dim of 1 to k's");
  dim_v = vg.dim;
  require(dim >= 1, "q", shape_text(spec.q), "head_dim >= 1");
  require(heads >= 1, "q", shape_text(spec.q), "at least one head");
  require(kv_heads >= 1 && heads % kv_heads == 0, k_name, k_text,
          "a KV head count dividing the query heads (" + std::to_string(heads) + ")");
  require(k_len < (std::int64_t{1} << 31), k_name, k_text, "fewer than 2^31 keys per sequence");
  group_size = heads / kv_heads;
  dim_padded = (dim + kernels::kAttnAlign - 1) / kernels::kAttnAlign * kernels::kAttnAlign;
  q_data = spec.q.data();
  k_data = spec.cache ? spec.cache->k.data : spec.k.data();
  v_data = spec.cache ? spec.cache->v.data : spec.v.data();
  require(std::isfinite(spec.scale) && spec.scale >= 0, "scale", to_text(spec.scale), "finite, >= 0 (0: 1/sqrt(D))");
  scale_f64 = spec.scale > 0 ? spec.scale : 1.0 / std::sqrt(static_cast<double>(dim));
  scale = static_cast<float>(scale_f64);
  // A forward block holds about kBlockRows rows (queries × the KV head's G heads): measured at
  // S = 2048, D = 128, causal, 1 thread, rows 64 / 128 / 256 ran at 64 / 84 / 71 GFLOP/s (key
  // tiles of 64; 128 keys were slower at every row count). Each head keeps >= kAttnAlign
  // queries so that its lanes fill.
  constexpr std::int64_t kBlockRows = 128;
  query_block = std::max<std::int64_t>(kernels::kAttnAlign, kBlockRows / group_size);
  key_tile = 64;
  zero_copy = !spec.cache && dtype == DType::kF32 && kg.dim_stride == 1 && vg.dim_stride == 1 && dim == dim_padded &&
              dim_v == dim;
}

// spec.cache: k and v empty, the cache's K and V as grids of bytes (every row of the format's
// bytes, offsets within int64), not with packed sequences.
void AttentionPlan::check_cache() {
  const QuantizedCache& c = *spec.cache;
  const std::string format(cache_format_name(c.format));
  require(spec.k.rank() == 0 && spec.v.rank() == 0, "k", shape_text(spec.k) + ", v " + shape_text(spec.v),
          "empty views with spec.cache (the cache holds the keys and values)");
  require(!packed, "cu_seqlens_k", std::to_string(spec.cu_seqlens_k.size()) + " entries",
          "none with spec.cache (a quantized cache is [B, Sk, G, D])");
  require(parse_cache_format(format).has_value(), "cache.format", std::to_string(static_cast<int>(c.format)),
          "q8_0, q4_0 or fp8_e4m3");
  cache_format = c.format;
  const auto grid = [&](const char* name, const QuantizedRows& r) {
    const std::string param_name = std::string("cache.") + name;
    const char* param = param_name.c_str();
    const std::string text = "[" + std::to_string(r.batch) + ", " + std::to_string(r.seq) + ", " +
                             std::to_string(r.heads) + ", " + std::to_string(r.dim) + "] byte strides [" +
                             std::to_string(r.batch_stride) + ", " + std::to_string(r.seq_stride) + ", " +
                             std::to_string(r.head_stride) + "] " + format;
    require(r.batch >= 0 && r.seq >= 0 && r.heads >= 0, param, text, "extents >= 0");
    require(r.batch_stride >= 0 && r.seq_stride >= 0 && r.head_stride >= 0, param, text, "strides >= 0");
    std::int64_t row_bytes = 0;
    try {
      row_bytes = cache_row_bytes(c.format, r.dim);
    } catch (const Error& e) {
      require(false, param, text, std::string("a dim the format holds: ") + e.expected());
    }
    const bool empty = r.batch == 0 || r.seq == 0 || r.heads == 0;
    if (!empty) {
      require(r.data != nullptr, param, text, "a non-null data pointer");
      std::int64_t end = row_bytes;
      end = checked_add(end, checked_mul(r.batch - 1, r.batch_stride, "cache offset"), "cache offset");
      end = checked_add(end, checked_mul(r.seq - 1, r.seq_stride, "cache offset"), "cache offset");
      checked_add(end, checked_mul(r.heads - 1, r.head_stride, "cache offset"), "cache offset");
    }
    HeadsGrid g;
    g.batch = r.batch;
    g.seq = r.seq;
    g.heads = r.heads;
    g.dim = r.dim;
    g.batch_stride = r.batch_stride;
    g.seq_stride = r.seq_stride;
    g.head_stride = r.head_stride;
    g.dim_stride = 1;
    return g;
  };
  kg = grid("k", c.k);
  vg = grid("v", c.v);
}

// f32 math (f32, bf16 and f16 inputs) multiplies the scores by the scale and each query row by its
// temperature factor, both rounded to f32: a factor past FLT_MAX would turn every score of its row
// into ±inf and the row into NaN. The largest factor is at the largest query position (s(p) does
// not decrease). fp64 inputs take any finite value.
void AttentionPlan::check_f32_multipliers(const PositionRange& range) const {
  if (dtype == DType::kF64) return;
  constexpr double kLargest = std::numeric_limits<float>::max();
  require(scale_f64 <= kLargest, "scale", to_text(scale_f64),
          "at most " + to_text(kLargest) + " (f32's largest: " + std::string(dtype_name(dtype)) +
              " inputs are computed in f32)");
  if (!spec.temperature) return;
  const double factor = spec.temperature->factor(range.q_max);
  if (!(factor <= kLargest && factor * scale_f64 <= kLargest)) {
    throw Error(kWhere, "temperature", to_text(factor) + " at query position " + std::to_string(range.q_max),
                "a factor s(p) with s(p) and s(p) · scale (" + to_text(scale_f64) + ") at most " + to_text(kLargest) +
                    " (f32's largest: " + std::string(dtype_name(dtype)) +
                    " inputs are computed in f32; a smaller attn_scale or beta)");
  }
}

// The mask's fields (attention.hpp: Masks).
void AttentionPlan::check_mask() {
  require(mask.window_left >= -1, "mask.window_left", std::to_string(mask.window_left), ">= -1 (-1: unlimited)");
  require(mask.window_right >= -1, "mask.window_right", std::to_string(mask.window_right), ">= -1 (-1: unlimited)");
  require(std::isfinite(mask.softcap) && mask.softcap >= 0, "mask.softcap", to_text(mask.softcap),
          "finite, >= 0 (0: none)");
  if (mask.chunk_size) {
    require(*mask.chunk_size >= 1, "mask.chunk_size", std::to_string(*mask.chunk_size), ">= 1 (absent: no chunks)");
  }
  window_right = mask.causal ? 0 : mask.window_right;
  if (mask.causal && mask.window_right > 0) {
    throw Error(kWhere, "mask.window_right", std::to_string(mask.window_right),
                "0 or -1 with causal (causal sees no later key)");
  }
}

// The sequences: packed (cu_seqlens) or one per batch row, keys cut at key_lengths.
void AttentionPlan::plan_sequences() {
  if (packed) {
    require(!spec.cu_seqlens_q.empty() && !spec.cu_seqlens_k.empty(), "cu_seqlens_k",
            spec.cu_seqlens_k.empty() ? "empty" : "given", "both cu_seqlens_q and cu_seqlens_k, or neither");
    check_cu_seqlens(kWhere, "cu_seqlens_q", spec.cu_seqlens_q, q_len);
    check_cu_seqlens(kWhere, "cu_seqlens_k", spec.cu_seqlens_k, k_len);
    require(spec.cu_seqlens_q.size() == spec.cu_seqlens_k.size(), "cu_seqlens_k",
            "size " + std::to_string(spec.cu_seqlens_k.size()),
            "size of cu_seqlens_q, " + std::to_string(spec.cu_seqlens_q.size()));
    require(mask.key_lengths.empty(), "mask.key_lengths", "given",
            "empty with packed sequences (cu_seqlens_k says it)");
    for (std::size_t s = 0; s + 1 < spec.cu_seqlens_q.size(); ++s) {
      sequences.push_back({0, spec.cu_seqlens_q[s], spec.cu_seqlens_q[s + 1] - spec.cu_seqlens_q[s],
                           spec.cu_seqlens_k[s], spec.cu_seqlens_k[s + 1] - spec.cu_seqlens_k[s],
                           static_cast<std::int64_t>(s)});
    }
  } else {
    if (!mask.key_lengths.empty()) {
      require(static_cast<std::int64_t>(mask.key_lengths.size()) == batch, "mask.key_lengths",
              "size " + std::to_string(mask.key_lengths.size()), "one per batch row (" + std::to_string(batch) + ")");
      for (std::size_t b = 0; b < mask.key_lengths.size(); ++b) {
        const std::int64_t len = mask.key_lengths[b];
        if (len < 0 || len > k_len) {
          throw Error(kWhere, "mask.key_lengths", "[" + std::to_string(b) + "] = " + std::to_string(len),
                      "in [0, " + std::to_string(k_len) + "]");
        }
      }
    }
    for (std::int64_t b = 0; b < batch; ++b) {
      const std::int64_t lk = mask.key_lengths.empty() ? k_len : mask.key_lengths[static_cast<std::size_t>(b)];
      sequences.push_back({b, 0, q_len, 0, lk, b});
    }
  }
}

// The tokens' positions (explicit, or the defaults of attention.hpp) and their range.
AttentionPlan::PositionRange AttentionPlan::plan_positions() {
  // Rows of default ids: one for packed sequences, else one per batch row — and one for a batch of
  // 0 (no sequences read them; the call returns its empty outputs, as torch's SDPA does).
  const std::int64_t id_rows = packed ? 1 : std::max<std::int64_t>(batch, 1);
  if (spec.q_positions) {
    spec.q_positions->check_grid(kWhere, packed ? 1 : batch, q_len);
    q_positions = spec.q_positions;
  } else {
    default_q_ids.resize(static_cast<std::size_t>(id_rows * q_len));
    for (const Sequence& seq : sequences) {
      const std::int64_t offset = std::max<std::int64_t>(0, seq.lk - seq.lq);
      for (std::int64_t i = 0; i < seq.lq; ++i) {
        default_q_ids[static_cast<std::size_t>(seq.b * q_len + seq.q0 + i)] = offset + i;
      }
    }
    q_positions = Positions::ids(default_q_ids, id_rows, q_len);
  }
  if (spec.k_positions) {
    spec.k_positions->check_grid(kWhere, packed ? 1 : batch, k_len);
    k_positions = spec.k_positions;
  } else {
    default_k_ids.resize(static_cast<std::size_t>(id_rows * k_len));
    if (packed) {
      for (const Sequence& seq : sequences) {
        for (std::int64_t j = 0; j < seq.lk; ++j) default_k_ids[static_cast<std::size_t>(seq.k0 + j)] = j;
      }
    } else {
      for (std::int64_t b = 0; b < batch; ++b) {
        for (std::int64_t j = 0; j < k_len; ++j) default_k_ids[static_cast<std::size_t>(b * k_len + j)] = j;
      }
    }
    k_positions = Positions::ids(default_k_ids, id_rows, k_len);
  }
  PositionRange r{std::numeric_limits<std::int64_t>::max(), 0, std::numeric_limits<std::int64_t>::max(), 0};
  std::int64_t &q_min = r.q_min, &q_max = r.q_max, &k_min = r.k_min, &k_max = r.k_max;
  // Positions [0, n) of a sequence into [lo, hi]: default ones increase, so only their ends.
  const auto widen = [](std::int64_t n, bool increasing, auto&& at, std::int64_t& lo, std::int64_t& hi) {
    for (std::int64_t i = 0; i < n; ++i) {
      if (increasing && i > 0 && i < n - 1) i = n - 1;
      lo = std::min(lo, at(i));
      hi = std::max(hi, at(i));
    }
  };
  for (const Sequence& seq : sequences) {
    widen(
        seq.lq, !spec.q_positions, [&](std::int64_t i) { return q_position(seq, i); }, q_min, q_max);
    widen(
        seq.lk, !spec.k_positions, [&](std::int64_t j) { return k_position(seq, j); }, k_min, k_max);
  }
  if (q_min > q_max) q_min = q_max = 0;
  if (k_min > k_max) k_min = k_max = 0;
  if (mask.chunk_size) {
    // A query's chunk must be one run of keys (chunk_keys searches it).
    for (const Sequence& seq : sequences) {
      for (std::int64_t j = 1; j < seq.lk; ++j) {
        if (k_position(seq, j) < k_position(seq, j - 1)) {
          throw Error(kWhere, "k_positions",
                      "[" + std::to_string(seq.k0 + j) + "] = " + std::to_string(k_position(seq, j)) + " after " +
                          std::to_string(k_position(seq, j - 1)) + " in sequence " + std::to_string(seq.index),
                      "non-decreasing within each sequence with mask.chunk_size");
        }
      }
    }
  }
  return r;
}

// The keys [lo, hi) of `seq` in the chunk of position q_position: ⌊p'_j / C⌋ = ⌊q_position / C⌋.
std::pair<std::int64_t, std::int64_t> AttentionPlan::chunk_keys(const Sequence& seq, std::int64_t q_position) const {
  const std::int64_t c = *mask.chunk_size;
  const auto chunk_of = [c](std::int64_t p) { return p / c - (p % c < 0 ? 1 : 0); };  // floor division
  const std::int64_t chunk = chunk_of(q_position);
  // The first key whose chunk is >= `at` (key positions do not decrease: plan_positions).
  const auto first_from = [&](std::int64_t at) {
    std::int64_t a = 0, b = seq.lk;
    while (a < b) {
      const std::int64_t m = a + (b - a) / 2;
      if (chunk_of(k_position(seq, m)) < at) {
        a = m + 1;
      } else {
        b = m;
      }
    }
    return a;
  };
  return {first_from(chunk), chunk == std::numeric_limits<std::int64_t>::max() ? seq.lk : first_from(chunk + 1)};
}

// The head groups (the spec's, or one group without a scheme) checked against the heads and the
// KV groups; head_group and group_first_head.
std::vector<HeadGroup> AttentionPlan::plan_head_groups() {
  std::vector<HeadGroup> groups = spec.groups;
  if (groups.empty()) groups.push_back(HeadGroup{heads, {}, {}});
  head_group.assign(static_cast<std::size_t>(heads), -1);
  head_bias.assign(static_cast<std::size_t>(heads), HeadBias{});
  std::int64_t first = 0;
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    const HeadGroup& grp = groups[gi];
    const std::string name = "groups[" + std::to_string(gi) + "]";
    if (grp.heads < 1 || first + grp.heads > heads) {
      throw Error(
          kWhere, (name + ".heads").c_str(), std::to_string(grp.heads),
          "in [1, " + std::to_string(heads - first) + "] (the groups tile the " + std::to_string(heads) + " heads)");
    }
    const bool transforms = grp.transform.index() != 0;
    if (transforms && (first % group_size != 0 || grp.heads % group_size != 0)) {
      throw Error(kWhere, (name + ".heads").c_str(), std::to_string(grp.heads) + " from head " + std::to_string(first),
                  "whole KV groups of " + std::to_string(group_size) + " heads: its keys are transformed");
    }
    if (grp.bias) {
      const std::int64_t bh = bias_heads(*grp.bias);
      if (bh != grp.heads) {
        throw Error(kWhere, (name + ".bias").c_str(), std::to_string(bh) + " heads",
                    std::to_string(grp.heads) + " (the group's heads)");
      }
    }
    group_first_head.push_back(first);
    for (std::int64_t h = first; h < first + grp.heads; ++h)
      head_group[static_cast<std::size_t>(h)] = static_cast<std::int64_t>(gi);
    first += grp.heads;
  }
  if (first != heads) {
    throw Error(kWhere, "groups", std::to_string(first) + " heads",
                "the " + std::to_string(heads) + " heads of q, tiled");
  }
  return groups;
}

// The score terms of the groups (score_term.hpp), in the order they add to a tile. A group's
// tabulated bias is added before them; a bias of both positions (PositionBias) is a term of its
// own and comes first, so that a row's logit is summed in the same order whichever form its bias
// takes. The plan's own spec holds the groups (a term may keep a pointer to its scheme).
void AttentionPlan::plan_terms(const std::vector<HeadGroup>& groups) {
  // The biases' terms first, so that the call's checks of the biases come before the terms'.
  std::vector<std::unique_ptr<ScoreTerm>> bias_terms(groups.size());
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const std::optional<BiasScheme>& bias = spec.groups.empty() ? groups[g].bias : spec.groups[g].bias;
    if (const PositionBias* position = bias ? position_bias(*bias) : nullptr) {
      bias_terms[g] = fused_bias(*position, *this, static_cast<std::int64_t>(g));
    }
  }
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (bias_terms[g]) terms.push_back(std::move(bias_terms[g]));
    for (std::size_t t = 0; t < groups[g].terms.size(); ++t) {
      const std::string name = "groups[" + std::to_string(g) + "].terms[" + std::to_string(t) + "]";
      const AttentionTermRef& term = groups[g].terms[t];
      require(term != nullptr, name.c_str(), "null", "an AttentionTerm");
      require(term->heads() == groups[g].heads, (name + ".heads").c_str(), std::to_string(term->heads()),
              std::to_string(groups[g].heads) + " (the group's heads)");
      terms.push_back(fused_term(*term, *this, static_cast<std::int64_t>(g), static_cast<std::int64_t>(t)));
    }
  }
}

bool AttentionPlan::decode_merges_heads() const {
  return std::all_of(terms.begin(), terms.end(), [](const auto& t) { return t->merges_decode_heads(); });
}

// The query/key transforms' tables: rows by position (a dense range) or by token.
void AttentionPlan::plan_transform_tables(const std::vector<HeadGroup>& groups, const PositionRange& range) {
  const std::int64_t q_min = range.q_min, q_max = range.q_max, k_min = range.k_min, k_max = range.k_max;
  // Where no group changes the keys (none, or RoPE over a cache of rotated keys), the rows cover the
  // queries alone: a decode step tabulates its one position, not the cache's.
  const bool keys = std::any_of(groups.begin(), groups.end(), [](const HeadGroup& g) {
    return std::visit([](const auto& transform) { return transforms_keys(transform); }, g.transform);
  });
  const std::int64_t q_tokens = (packed ? 1 : batch) * q_len, k_tokens = keys ? (packed ? 1 : batch) * k_len : 0;
  const std::int64_t p_max = std::max(q_max, k_max);
  const std::int64_t first = keys ? std::min(q_min, k_min) : q_min, last = keys ? p_max : q_max;
  position_max = p_max;
  tables_by_position = last - first + 1 <= 2 * (q_tokens + k_tokens) + 4096;
  table_position_min = first;
  std::vector<std::int64_t> table_ids;
  if (tables_by_position) {
    for (std::int64_t p = first; p <= last; ++p) table_ids.push_back(p);
  } else {
    table_ids.assign(static_cast<std::size_t>(q_tokens + k_tokens), 0);
    for (std::int64_t b = 0; b < (packed ? 1 : batch); ++b) {
      for (std::int64_t i = 0; i < q_len; ++i)
        table_ids[static_cast<std::size_t>(b * q_len + i)] = q_positions->at(b, i);
      for (std::int64_t j = 0; keys && j < k_len; ++j) {
        table_ids[static_cast<std::size_t>(q_tokens + b * k_len + j)] = k_positions->at(b, j);
      }
    }
  }
  const Positions table_positions = Positions::ids(table_ids);
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    // Each transform tabulates itself (attention/transforms.hpp; its scheme's file).
    const TransformRows rows{kWhere,
                             "groups[" + std::to_string(gi) + "].transform",
                             table_ids,
                             table_positions,
                             p_max,
                             dim,
                             *q_positions,
                             *k_positions,
                             packed ? 1 : batch,
                             q_len,
                             k_len};
    tables.push_back(
        std::visit([&](const auto& transform) { return qk_tables(transform, rows); }, groups[gi].transform));
  }
}

// Bias tables over δ = q − k, with a lane's worth of margin on the query side (padding lanes
// continue their chunk's positions); the gradients' flat layout. Returns the lowest
// tabulated bias (for the far-tile skip).
float AttentionPlan::plan_bias_tables(const std::vector<HeadGroup>& groups, const PositionRange& range) {
  const std::int64_t q_min = range.q_min, q_max = range.q_max, k_min = range.k_min, k_max = range.k_max;
  // lanes continue their chunk's positions).
  delta_min = q_min - k_max;
  const std::int64_t delta_max = q_max + kernels::kAttnAlign - k_min;
  const std::int64_t width = delta_max - delta_min + 1;
  bias_tables.resize(groups.size());
  float lowest_table_bias = 0.0f;
  std::int64_t flat = 0;
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    grad_offset.push_back(flat);
    if (!groups[gi].bias) continue;
    const BiasScheme& scheme = *groups[gi].bias;
    const std::int64_t hg = groups[gi].heads, h0 = group_first_head[gi];
    // Schemes of the relative position only (scheme.hpp): tabulated, θ's gradient flat. NoPE
    // adds nothing; the others are score terms of their own (plan_terms).
    const RelativeBias* relative = relative_bias(scheme);
    if (relative == nullptr) continue;
    any_bias = true;
    flat += relative->parameter_count();
    if (relative->parameter_count() > 0) any_trainable_bias = true;
    const bool tabulate = width * hg <= kMaxBiasTable;
    if (tabulate) {
      // table[t] = b(δ_min + t) over δ = q − k, i.e. of r = k − q = −(δ_min + t): a row of r
      // from r_first = −(δ_min + width − 1) read backwards.
      auto& table = bias_tables[gi];
      table.resize(static_cast<std::size_t>(width * hg));
      detail::tabulate_f32(*relative, -(delta_min + width - 1), width, table.data(), true);
    } else {
      evaluators.push_back(std::make_unique<BiasEvaluator>(scheme, k_min - q_max, k_max - q_min));
    }
    for (std::int64_t h = 0; h < hg; ++h) {
      HeadBias& hb = head_bias[static_cast<std::size_t>(h0 + h)];
      hb.group = static_cast<std::int64_t>(gi);
      hb.local_head = h;
      if (tabulate) {
        hb.kind = HeadBias::kTable;
        hb.table = bias_tables[gi].data() + h * width;
        hb.delta_min = delta_min;
        hb.width = width;
      } else {
        hb.kind = HeadBias::kDirect;
        hb.evaluator = evaluators.back().get();
      }
    }
  }
  grad_offset.push_back(flat);
  // Each table's least entry (std::min_element's, NaN included), a head per thread.
  std::int64_t entries = 0;
  for (const TableFloats& t : bias_tables) entries += static_cast<std::int64_t>(t.size());
#pragma omp parallel for schedule(static) num_threads(threads_for(entries))
  for (std::int64_t h = 0; h < heads; ++h) {
    HeadBias& hb = head_bias[static_cast<std::size_t>(h)];
    if (hb.kind == HeadBias::kTable) hb.table_min = *std::min_element(hb.table, hb.table + hb.width);
  }
  // In group order, as over each group's whole table.
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    if (bias_tables[gi].empty()) continue;
    const std::int64_t h0 = group_first_head[gi], hg = groups[gi].heads;
    const auto first = head_bias.begin() + h0;
    const float least = std::min_element(first, first + hg, [](const HeadBias& a, const HeadBias& b) {
                          return a.table_min < b.table_min;
                        })->table_min;
    lowest_table_bias = std::min(lowest_table_bias, least);
  }
  bool every_head_tabulated = heads > 0;
  for (const HeadBias& hb : head_bias) every_head_tabulated = every_head_tabulated && hb.kind == HeadBias::kTable;
  if (every_head_tabulated && !packed && q_len == 1) {
    bias_by_delta.resize(static_cast<std::size_t>(width * heads));
    // Transposed in blocks of δ, on the threads.
    constexpr std::int64_t kBlock = 256;
    const std::int64_t blocks = (width + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) num_threads(threads_for(width* heads))
    for (std::int64_t b = 0; b < blocks; ++b) {
      const std::int64_t t0 = b * kBlock, t1 = std::min(width, t0 + kBlock);
      for (std::int64_t h = 0; h < heads; ++h) {
        const float* table = head_bias[static_cast<std::size_t>(h)].table;
        for (std::int64_t t = t0; t < t1; ++t) bias_by_delta[static_cast<std::size_t>(t * heads + h)] = table[t];
      }
    }
  }
  hist_width = width <= kMaxBiasTable ? width : 0;
  return lowest_table_bias;
}

// The far-tile skip (attention_plan.hpp): whether tiles run from the diagonal down, per KV head,
// and the tables' running maxima that bound a tile's biases.
void AttentionPlan::plan_far_tiles(float lowest_table_bias) {
  constexpr float kFarBias = 100.0f;
  bool keys_keep_norms = true;
  for (const QKTables& t : tables)
    keys_keep_norms = keys_keep_norms && (!t.transform_keys || t.kind != QKTables::kAbsolute);
  // A head can vanish far away through its bias table or a term (a forget gate's decay).
  const auto steep_head = [&](std::int64_t h) {
    const HeadBias& hb = head_bias[static_cast<std::size_t>(h)];
    const bool table = hb.kind == HeadBias::kTable && hb.table_min < -kFarBias;
    return table || std::any_of(terms.begin(), terms.end(), [h](const auto& t) { return t->steep(h); });
  };
  bool any_steep_term = false;
  for (std::int64_t h = 0; h < heads; ++h)
    for (const auto& t : terms) any_steep_term = any_steep_term || t->steep(h);
  far_tiles_first = (lowest_table_bias < -kFarBias || any_steep_term) && mask.softcap <= 0 && keys_keep_norms &&
                    std::all_of(terms.begin(), terms.end(), [](const auto& t) { return t->keeps_tile_bound(); });
  // Per KV head: only where every query head falls below −100 can a block's rows all vanish; the
  // others run their tiles in key order (see far_first_kv).
  far_first_kv.assign(static_cast<std::size_t>(kv_heads), 0);
  for (std::int64_t g = 0; far_tiles_first && g < kv_heads; ++g) {
    bool steep = true;
    for (std::int64_t h = g * group_size; h < (g + 1) * group_size; ++h) steep = steep && steep_head(h);
    far_first_kv[static_cast<std::size_t>(g)] = steep ? 1 : 0;
  }
  skip_far_tiles = far_tiles_first && spec.skip_vanishing_tiles;
}

void AttentionPlan::build_tile_maxima() const {
  if (!skip_far_tiles) return;
  std::call_once(tile_maxima_once, [this] {
    bias_table_max.resize(bias_tables.size());
    for (std::size_t gi = 0; gi < bias_tables.size(); ++gi) {
      if (bias_tables[gi].empty()) continue;
      bias_table_max[gi].resize(2 * bias_tables[gi].size());
    }
    std::int64_t entries = 0;
    for (const TableFloats& t : bias_tables) entries += static_cast<std::int64_t>(t.size());
    const auto count = static_cast<std::int64_t>(head_bias.size());
#pragma omp parallel for schedule(static) num_threads(threads_for(entries))
    for (std::int64_t h = 0; h < count; ++h) {
      const HeadBias& hb = head_bias[static_cast<std::size_t>(h)];
      if (hb.kind != HeadBias::kTable) continue;
      const std::int64_t n = hb.width;  // the plan's table width, as every tabulated head's
      float* from = bias_table_max[static_cast<std::size_t>(hb.group)].data() + 2 * hb.local_head * n;
      float* to = from + n;
      from[n - 1] = hb.table[n - 1];
      for (std::int64_t t = n - 2; t >= 0; --t) from[t] = std::max(from[t + 1], hb.table[t]);
      to[0] = hb.table[0];
      for (std::int64_t t = 1; t < n; ++t) to[t] = std::max(to[t - 1], hb.table[t]);
    }
  });
}

std::int64_t AttentionPlan::table_bytes() const {
  std::int64_t total = 0;
  for (const auto& t : tables) total += t.bytes();
  for (const auto& t : bias_tables) total += static_cast<std::int64_t>(t.size() * sizeof(float));
  total += static_cast<std::int64_t>(bias_by_delta.size() * sizeof(float));
  for (const auto& t : bias_table_max) total += static_cast<std::int64_t>(t.size() * sizeof(float));
  for (const auto& t : terms) total += t->bytes();
  return total;
}

void AttentionPlan::check_disjoint(std::initializer_list<NamedView> outputs,
                                   std::initializer_list<NamedView> inputs) const {
  detail::check_disjoint(kWhere, outputs, inputs);
  if (!cache_format) return;
  // The cache's bytes against each output's span of bytes.
  const auto span = [](const void* data, std::int64_t end) {
    const auto lo = reinterpret_cast<std::uintptr_t>(data);
    return std::pair<std::uintptr_t, std::uintptr_t>(lo, lo + static_cast<std::uintptr_t>(end));
  };
  const auto grid_end = [&](const HeadsGrid& g) {
    return kv_row_bytes(g) + (g.batch - 1) * g.batch_stride + (g.seq - 1) * g.seq_stride +
           (g.heads - 1) * g.head_stride;
  };
  for (const NamedView& o : outputs) {
    if (o.second.rank() == 0 || o.second.data() == nullptr || o.second.numel() == 0) continue;
    std::int64_t last = 0;
    for (int a = 0; a < o.second.rank(); ++a) last += (o.second.size(a) - 1) * o.second.stride(a);
    const auto out = span(o.second.data(), (last + 1) * static_cast<std::int64_t>(dtype_size(o.second.dtype())));
    for (const auto& [name, g, data] : {std::tuple{"cache.k", kg, k_data}, std::tuple{"cache.v", vg, v_data}}) {
      if (g.batch == 0 || g.seq == 0 || g.heads == 0) continue;
      const auto in = span(data, grid_end(g));
      require(out.second <= in.first || in.second <= out.first, o.first, o.second.describe(),
              std::string("memory apart from ") + name + "'s bytes");
    }
  }
}

// ─── lse ─────────────────────────────────────────────────────────────────────────────────────

void AttentionPlan::check_lse(ConstTensorView lse, bool writable) const {
  check_dtype(kWhere, "lse", lse.dtype(), DType::kF32);
  if (packed) {
    require(lse.rank() == 2 && lse.size(0) == heads && lse.size(1) == q_len, "lse", lse.describe(),
            "[H, Tq] = [" + std::to_string(heads) + ", " + std::to_string(q_len) + "]");
  } else {
    require(
        lse.rank() == 3 && lse.size(0) == batch && lse.size(1) == heads && lse.size(2) == q_len, "lse", lse.describe(),
        "[B, H, Sq] = [" + std::to_string(batch) + ", " + std::to_string(heads) + ", " + std::to_string(q_len) + "]");
  }
  if (writable) check_writable(kWhere, "lse", lse);
}

void AttentionPlan::write_lse(TensorView lse, const Sequence& seq, std::int64_t h, std::int64_t i, float value) const {
  const std::int64_t at = packed ? h * lse.stride(0) + (seq.q0 + i) * lse.stride(1)
                                 : seq.b * lse.stride(0) + h * lse.stride(1) + (seq.q0 + i) * lse.stride(2);
  static_cast<float*>(lse.data())[at] = value;
}

float AttentionPlan::read_lse(ConstTensorView lse, const Sequence& seq, std::int64_t h, std::int64_t i) const {
  const std::int64_t at = packed ? h * lse.stride(0) + (seq.q0 + i) * lse.stride(1)
                                 : seq.b * lse.stride(0) + h * lse.stride(1) + (seq.q0 + i) * lse.stride(2);
  return static_cast<const float*>(lse.data())[at];
}

}  // namespace posenc::detail
