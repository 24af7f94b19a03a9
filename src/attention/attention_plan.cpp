// AttentionSpec → AttentionPlan: validation (once), sequences, default positions, the per-group
// transform tables and bias tables, lse I/O and the positional parameters' gradients.
#include "attention/attention_plan.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <string>
#include <variant>

#include "bias_checks.hpp"
#include "kernels/attention/attention_kernels.hpp"
#include "posenc/error.hpp"
#include "rotary_checks.hpp"

namespace posenc::detail {
namespace {

constexpr const char* kWhere = AttentionPlan::kWhere;
// Largest bias table over all heads (entries): beyond it, biases are evaluated per element.
constexpr std::int64_t kMaxBiasTable = std::int64_t{1} << 24;

void require(bool ok, const char* param, const std::string& value, const std::string& expected) {
  if (!ok) throw Error(kWhere, param, value, expected);
}

std::string shape_text(ConstTensorView v) { return v.describe(); }

std::int64_t round_up(std::int64_t x, std::int64_t to) { return (x + to - 1) / to * to; }

// C[m][n] = Σ_t A(m, t)·B[t][n] for large operands (XL's and TUPE's tables and gradients):
// attn_gemm streams all of B for every few rows of A, so the work is cut into tiles of kRows ×
// kCols, run in parallel, each summing its depth panels of kDepth in order — the same bits for
// any thread count. The operands are copied into aligned per-thread buffers with strides off a
// multiple of 4 KiB first: the callers' operands have row strides of H·D or d_model floats (4 KiB
// at 1024), which put every row of a panel in the same few L1 sets.
//   A   a strip of kRows rows over the whole depth, copied once per row block and kept while the
//       thread's tiles stay in that block (the static schedule gives each thread consecutive
//       tiles, row block major). A transposed source (a_row = 1, as XL's dW_R and TUPE's dU read
//       theirs) is kept transposed, [t][m], so that every copy is a contiguous run and attn_gemm
//       reads it with a_row = 1; a row source as rows, [m][t]. A strip holds (kRows + 16) × depth
//       floats per thread: 10 MiB at a depth of 32768, a small part of the operands it is cut
//       from (XL's dW_R reads a [δ span, H·D] matrix: 128 MiB at that span and H·D = 1024).
//   B   a panel of kDepth × kCols per tile and depth step.
// attn_gemm sums every element in depth order whatever A's layout, so the layout does not move a
// bit. Measured by perf on an XL backward (S 2048, H 8, D 128, 2 threads, one run each): with A's
// panel copied per tile and depth step, element by element when transposed, blocked_gemm's own
// samples and memmove's were 5.8% of the run's; with the strip, at most 3.8%.
// cols: a multiple of kAttnAlign.
void blocked_gemm(const float* a, std::int64_t a_row, std::int64_t a_depth, const float* b, std::int64_t ldb, float* c,
                  std::int64_t ldc, std::int64_t rows, std::int64_t cols, std::int64_t depth) {
  constexpr std::int64_t kRows = 64, kCols = 128, kDepth = 256;
  constexpr std::int64_t kLdb = kCols + kernels::kAttnAlign;
  const bool a_transposed = a_depth != 1;
  // The strip's stride: kRows + pad floats per depth step when transposed, else depth + pad per row.
  const std::int64_t lda =
      a_transposed ? kRows + kernels::kAttnAlign : round_up(depth, kernels::kAttnAlign) + kernels::kAttnAlign;
  const std::int64_t row_blocks = (rows + kRows - 1) / kRows, col_blocks = (cols + kCols - 1) / kCols;
  const std::int64_t tiles = row_blocks * col_blocks;
  const int threads =
      std::min<int>(threads_for(rows * cols * depth), static_cast<int>(std::max<std::int64_t>(tiles, 1)));
#pragma omp parallel num_threads(threads)
  {
    thread_local AlignedFloats a_strip, b_panel;
    a_strip.resize(static_cast<std::size_t>(a_transposed ? depth * lda : kRows * lda));
    b_panel.resize(static_cast<std::size_t>(kDepth * kLdb));
    std::int64_t strip_m0 = -1;  // the row block a_strip holds
#pragma omp for schedule(static)
    for (std::int64_t tile = 0; tile < tiles; ++tile) {
      const std::int64_t m0 = tile / col_blocks * kRows, n0 = tile % col_blocks * kCols;
      const std::int64_t m = std::min(kRows, rows - m0), n = std::min(kCols, cols - n0);
      if (m0 != strip_m0) {
        if (a_transposed) {
          for (std::int64_t t = 0; t < depth; ++t) {
            const float* from = a + m0 * a_row + t * a_depth;
            float* to = a_strip.data() + t * lda;
            if (a_row == 1) {
              std::copy(from, from + m, to);
            } else {
              for (std::int64_t i = 0; i < m; ++i) to[i] = from[i * a_row];
            }
          }
        } else {
          for (std::int64_t i = 0; i < m; ++i) {
            const float* from = a + (m0 + i) * a_row;
            std::copy(from, from + depth, a_strip.data() + i * lda);
          }
        }
        strip_m0 = m0;
      }
      for (std::int64_t t0 = 0; t0 < depth; t0 += kDepth) {
        const std::int64_t k = std::min(kDepth, depth - t0);
        for (std::int64_t t = 0; t < k; ++t) {
          const float* from = b + (t0 + t) * ldb + n0;
          std::copy(from, from + n, b_panel.data() + t * kLdb);
        }
        if (a_transposed) {
          kernels::attn_gemm(a_strip.data() + t0 * lda, 1, lda, b_panel.data(), kLdb, c + m0 * ldc + n0, ldc, m, n, k,
                             t0 > 0);
        } else {
          kernels::attn_gemm(a_strip.data() + t0, lda, 1, b_panel.data(), kLdb, c + m0 * ldc + n0, ldc, m, n, k,
                             t0 > 0);
        }
      }
    }
  }
}

// [rows][heads][dp] → [heads][rows][dp]: one head's rows contiguous (see XlTables).
AlignedFloats heads_major(const std::vector<float>& by_row, std::int64_t rows, std::int64_t heads, std::int64_t dp) {
  AlignedFloats out(by_row.size());
  for (std::int64_t h = 0; h < heads; ++h) {
    for (std::int64_t r = 0; r < rows; ++r) {
      const float* from = by_row.data() + (r * heads + h) * dp;
      std::copy(from, from + dp, out.data() + (h * rows + r) * dp);
    }
  }
  return out;
}

void check_cu_seqlens(const char* name, const std::vector<std::int64_t>& cu, std::int64_t tokens) {
  require(cu.size() >= 2, name, "size " + std::to_string(cu.size()), "at least 2 entries (0, …, tokens)");
  require(cu.front() == 0, name, "[0] = " + std::to_string(cu.front()), "0");
  for (std::size_t t = 1; t < cu.size(); ++t) {
    if (cu[t] < cu[t - 1]) {
      throw Error(kWhere, name, "[" + std::to_string(t) + "] = " + std::to_string(cu[t]),
                  "non-decreasing (>= " + std::to_string(cu[t - 1]) + ")");
    }
  }
  require(cu.back() == tokens, name, "last = " + std::to_string(cu.back()),
          "the token count " + std::to_string(tokens));
}

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
  for (const auto* buffer : {&q,
                             &qt,
                             &o,
                             &m,
                             &l,
                             &corr,
                             &st,
                             &dpt,
                             &k,
                             &v,
                             &tmp,
                             &dout,
                             &doutt,
                             &dq,
                             &dk,
                             &dv,
                             &lse,
                             &delta,
                             &shaw_key_dots,
                             &shaw_value_dots,
                             &shaw_probs,
                             &shaw_grads,
                             &xl_dots,
                             &xl_sums,
                             &xl_dp,
                             &tupe_pqt,
                             &tupe_pq,
                             &tupe_pk,
                             &tupe_dpq,
                             &tupe_dpk,
                             &tupe_dpk_positions,
                             &rope_rows}) {
    total += static_cast<std::int64_t>(buffer->capacity() * sizeof(float));
  }
  return total + static_cast<std::int64_t>(kpos.capacity() * sizeof(std::int64_t) + hist.capacity() * sizeof(double));
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

AlignedFloats& zeroed_floats(CallBuffer which, std::size_t n) {
  thread_local std::array<AlignedFloats, static_cast<std::size_t>(CallBuffer::kCount)> buffers;
  AlignedFloats& b = buffers[static_cast<std::size_t>(which)];
  b.resize(n);
  zero_in_parallel(b.data(), n);
  return b;
}

AttentionPlan::AttentionPlan(AttentionSpec spec_in) : spec(std::move(spec_in)), mask(spec.mask) {
  // ── Views.
  packed = !spec.cu_seqlens_q.empty() || !spec.cu_seqlens_k.empty();
  require(spec.q.rank() == 3 || spec.q.rank() == 4, "q", shape_text(spec.q), "[B, Sq, H, D] or packed [Tq, H, D]");
  qg = heads_grid(kWhere, "q", spec.q);
  kg = heads_grid(kWhere, "k", spec.k);
  vg = heads_grid(kWhere, "v", spec.v);
  if (packed) {
    require(spec.q.rank() == 3, "q", shape_text(spec.q), "packed [Tq, H, D] with cu_seqlens");
    require(spec.k.rank() == 3, "k", shape_text(spec.k), "packed [Tk, G, D] with cu_seqlens");
  }
  dtype = spec.q.dtype();
  require(dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16 || dtype == DType::kF64, "q.dtype",
          std::string(dtype_name(dtype)), "f32, bf16, f16 or f64");
  check_dtype(kWhere, "k", spec.k.dtype(), dtype);
  check_dtype(kWhere, "v", spec.v.dtype(), dtype);
  batch = qg.batch;
  q_len = qg.seq;
  k_len = kg.seq;
  heads = qg.heads;
  kv_heads = kg.heads;
  dim = qg.dim;
  require(kg.batch == batch, "k", shape_text(spec.k), "batch " + std::to_string(batch) + " as q");
  require(kg.dim == dim, "k", shape_text(spec.k), "head_dim " + std::to_string(dim) + " as q");
  require(vg.batch == batch && vg.seq == k_len && vg.heads == kv_heads && vg.dim == dim, "v", shape_text(spec.v),
          "the shape of k, " + shape_text(spec.k));
  require(dim >= 1, "q", shape_text(spec.q), "head_dim >= 1");
  require(heads >= 1, "q", shape_text(spec.q), "at least one head");
  require(kv_heads >= 1 && heads % kv_heads == 0, "k", shape_text(spec.k),
          "a KV head count dividing the query heads (" + std::to_string(heads) + ")");
  require(k_len < (std::int64_t{1} << 31), "k", shape_text(spec.k), "fewer than 2^31 keys per sequence");
  group_size = heads / kv_heads;
  dim_padded = (dim + kernels::kAttnAlign - 1) / kernels::kAttnAlign * kernels::kAttnAlign;
  q_data = spec.q.data();
  k_data = spec.k.data();
  v_data = spec.v.data();
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
  zero_copy = dtype == DType::kF32 && kg.dim_stride == 1 && vg.dim_stride == 1 && dim == dim_padded;

  // ── Mask.
  require(mask.window_left >= -1, "mask.window_left", std::to_string(mask.window_left), ">= -1 (-1: unlimited)");
  require(mask.window_right >= -1, "mask.window_right", std::to_string(mask.window_right), ">= -1 (-1: unlimited)");
  require(std::isfinite(mask.softcap) && mask.softcap >= 0, "mask.softcap", to_text(mask.softcap),
          "finite, >= 0 (0: none)");
  window_right = mask.causal ? 0 : mask.window_right;
  if (mask.causal && mask.window_right > 0) {
    throw Error(kWhere, "mask.window_right", std::to_string(mask.window_right),
                "0 or -1 with causal (causal sees no later key)");
  }

  // ── Sequences.
  if (packed) {
    require(!spec.cu_seqlens_q.empty() && !spec.cu_seqlens_k.empty(), "cu_seqlens_k",
            spec.cu_seqlens_k.empty() ? "empty" : "given", "both cu_seqlens_q and cu_seqlens_k, or neither");
    check_cu_seqlens("cu_seqlens_q", spec.cu_seqlens_q, q_len);
    check_cu_seqlens("cu_seqlens_k", spec.cu_seqlens_k, k_len);
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

  // ── Positions.
  if (spec.q_positions) {
    spec.q_positions->check_grid(kWhere, packed ? 1 : batch, q_len);
    q_positions = spec.q_positions;
  } else {
    default_q_ids.resize(static_cast<std::size_t>((packed ? 1 : batch) * q_len));
    for (const Sequence& seq : sequences) {
      const std::int64_t offset = std::max<std::int64_t>(0, seq.lk - seq.lq);
      for (std::int64_t i = 0; i < seq.lq; ++i) {
        default_q_ids[static_cast<std::size_t>(seq.b * q_len + seq.q0 + i)] = offset + i;
      }
    }
    q_positions = Positions::ids(default_q_ids, packed ? 1 : batch, q_len);
  }
  if (spec.k_positions) {
    spec.k_positions->check_grid(kWhere, packed ? 1 : batch, k_len);
    k_positions = spec.k_positions;
  } else {
    default_k_ids.resize(static_cast<std::size_t>((packed ? 1 : batch) * k_len));
    if (packed) {
      for (const Sequence& seq : sequences) {
        for (std::int64_t j = 0; j < seq.lk; ++j) default_k_ids[static_cast<std::size_t>(seq.k0 + j)] = j;
      }
    } else {
      for (std::int64_t b = 0; b < batch; ++b) {
        for (std::int64_t j = 0; j < k_len; ++j) default_k_ids[static_cast<std::size_t>(b * k_len + j)] = j;
      }
    }
    k_positions = Positions::ids(default_k_ids, packed ? 1 : batch, k_len);
  }
  std::int64_t q_min = std::numeric_limits<std::int64_t>::max(), q_max = 0;
  std::int64_t k_min = std::numeric_limits<std::int64_t>::max(), k_max = 0;
  for (const Sequence& seq : sequences) {
    for (std::int64_t i = 0; i < seq.lq; ++i) {
      const std::int64_t p = q_position(seq, i);
      q_min = std::min(q_min, p);
      q_max = std::max(q_max, p);
    }
    for (std::int64_t j = 0; j < seq.lk; ++j) {
      const std::int64_t p = k_position(seq, j);
      k_min = std::min(k_min, p);
      k_max = std::max(k_max, p);
    }
  }
  if (q_min > q_max) q_min = q_max = 0;
  if (k_min > k_max) k_min = k_max = 0;

  // ── Head groups.
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
    if (grp.xl) {
      require(grp.transform.index() == 0 && !grp.bias && !grp.shaw, (name + ".xl").c_str(),
              "with a transform, bias or shaw", "alone: Transformer-XL is the whole positional scheme of its heads");
      require(grp.xl->heads() == grp.heads, (name + ".xl.heads").c_str(), std::to_string(grp.xl->heads()),
              std::to_string(grp.heads) + " (the group's heads)");
      require(grp.xl->head_dim() == dim, (name + ".xl.head_dim").c_str(), std::to_string(grp.xl->head_dim()),
              "the head_dim of q, " + std::to_string(dim));
      const double xl_scale = grp.xl->scale() > 0 ? grp.xl->scale() : 1.0 / std::sqrt(static_cast<double>(dim));
      require(std::abs(xl_scale - scale_f64) <= 1e-12 * scale_f64, (name + ".xl.scale").c_str(), to_text(xl_scale),
              "the attention's scale, " + to_text(scale_f64) + " (one scale multiplies all of XL's terms)");
    }
    ShawTables st;
    if (grp.shaw) {
      if (grp.shaw->head_dim() != dim) {
        throw Error(kWhere, (name + ".shaw.head_dim").c_str(), std::to_string(grp.shaw->head_dim()),
                    "the head_dim of q, " + std::to_string(dim));
      }
      st.max_distance = grp.shaw->max_distance();
      st.width = grp.shaw->rows();
      st.key.assign(static_cast<std::size_t>(st.width * dim), 0.0f);
      st.value.assign(static_cast<std::size_t>(st.width * dim_padded), 0.0f);
      st.key_padded.assign(static_cast<std::size_t>(st.width * dim_padded), 0.0f);
      for (std::int64_t t = 0; t < st.width; ++t) {
        for (std::int64_t e = 0; e < dim; ++e) {
          if (!grp.shaw->key_table().empty()) {
            const auto value = static_cast<float>(grp.shaw->key_table()[static_cast<std::size_t>(t * dim + e)]);
            st.key[static_cast<std::size_t>(t * dim + e)] = value;
            st.key_padded[static_cast<std::size_t>(t * dim_padded + e)] = value;
          }
          if (!grp.shaw->value_table().empty()) {
            st.value[static_cast<std::size_t>(t * dim_padded + e)] =
                static_cast<float>(grp.shaw->value_table()[static_cast<std::size_t>(t * dim + e)]);
          }
        }
      }
      any_shaw = true;
      shaw_width = std::max(shaw_width, st.width);
    }
    shaw_grad_offset.push_back(shaw_grad_offset.empty() ? 0 : shaw_grad_offset.back());
    shaw.push_back(std::move(st));
    group_first_head.push_back(first);
    for (std::int64_t h = first; h < first + grp.heads; ++h)
      head_group[static_cast<std::size_t>(h)] = static_cast<std::int64_t>(gi);
    first += grp.heads;
  }
  if (first != heads) {
    throw Error(kWhere, "groups", std::to_string(first) + " heads",
                "the " + std::to_string(heads) + " heads of q, tiled");
  }
  // Shaw gradients: [key table | value table] per group with Shaw, (2k + 1)·D each.
  shaw_grad_offset.assign(groups.size() + 1, 0);
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    shaw_grad_offset[gi + 1] = shaw_grad_offset[gi] + 2 * shaw[gi].width * dim;
  }

  // ── Transform tables: rows by position (a dense range) or by token.
  const std::int64_t q_tokens = (packed ? 1 : batch) * q_len, k_tokens = (packed ? 1 : batch) * k_len;
  const std::int64_t p_min = std::min(q_min, k_min), p_max = std::max(q_max, k_max);
  position_max = p_max;
  tables_by_position = p_max - p_min + 1 <= 2 * (q_tokens + k_tokens) + 4096;
  table_position_min = p_min;
  std::vector<std::int64_t> table_ids;
  if (tables_by_position) {
    for (std::int64_t p = p_min; p <= p_max; ++p) table_ids.push_back(p);
  } else {
    table_ids.assign(static_cast<std::size_t>(q_tokens + k_tokens), 0);
    for (std::int64_t b = 0; b < (packed ? 1 : batch); ++b) {
      for (std::int64_t i = 0; i < q_len; ++i)
        table_ids[static_cast<std::size_t>(b * q_len + i)] = q_positions->at(b, i);
      for (std::int64_t j = 0; j < k_len; ++j) {
        table_ids[static_cast<std::size_t>(q_tokens + b * k_len + j)] = k_positions->at(b, j);
      }
    }
  }
  const auto rows = static_cast<std::int64_t>(table_ids.size());
  const Positions table_positions = Positions::ids(table_ids);
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    QKTables t;
    const std::string name = "groups[" + std::to_string(gi) + "].transform";
    if (const auto* rope = std::get_if<RotaryQK>(&groups[gi].transform)) {
      const RopeParams& rp = rope->params;
      if (rp.head_dim() != dim) {
        throw Error(kWhere, (name + ".params.head_dim").c_str(), std::to_string(rp.head_dim()),
                    "the head_dim of q, " + std::to_string(dim));
      }
      if (rp.xpos()) {
        check_xpos_range(rp, *q_positions, packed ? 1 : batch, q_len);
        check_xpos_range(rp, *k_positions, packed ? 1 : batch, k_len);
      }
      t.kind = QKTables::kRope;
      t.transform_keys = !rope->keys_rotated;
      t.interleaved = rp.layout() == RopeLayout::kInterleaved;
      t.half = rp.rotary_dim() / 2;
      const std::int64_t half = t.half;
      std::vector<double> c64, s64;
      std::vector<float> c32, s32;
      if (rp.xpos()) {
        c64.resize(static_cast<std::size_t>(rows * half));
        s64.resize(c64.size());
        rope_cos_sin(rp, table_positions, TensorView::of(c64.data(), {rows, half}),
                     TensorView::of(s64.data(), {rows, half}), rope->seq_len > 0 ? rope->seq_len : p_max + 1);
      } else {
        c32.resize(static_cast<std::size_t>(rows * half));
        s32.resize(c32.size());
        rope_cos_sin(rp, table_positions, TensorView::of(c32.data(), {rows, half}),
                     TensorView::of(s32.data(), {rows, half}), rope->seq_len > 0 ? rope->seq_len : p_max + 1);
      }
      t.q_cos_sin.resize(static_cast<std::size_t>(rows * 2 * half));
      if (rp.xpos()) t.k_cos_sin.resize(t.q_cos_sin.size());
      for (std::int64_t row = 0; row < rows; ++row) {
        const double e = rp.xpos_exponent(static_cast<double>(table_ids[static_cast<std::size_t>(row)]));
        for (std::int64_t i = 0; i < half; ++i) {
          const auto at = static_cast<std::size_t>(row * half + i);
          const auto out = static_cast<std::size_t>(row * 2 * half + i);
          if (!rp.xpos()) {
            t.q_cos_sin[out] = c32[at];
            t.q_cos_sin[out + static_cast<std::size_t>(half)] = s32[at];
            continue;
          }
          // xPos (rotary.hpp): ζ_i^(+e) on queries, ζ_i^(−e) on keys.
          const double zeta = rp.xpos_zeta(i);
          const double up = std::pow(zeta, e), down = std::pow(zeta, -e);
          t.q_cos_sin[out] = static_cast<float>(c64[at] * up);
          t.q_cos_sin[out + static_cast<std::size_t>(half)] = static_cast<float>(s64[at] * up);
          t.k_cos_sin[out] = static_cast<float>(c64[at] * down);
          t.k_cos_sin[out + static_cast<std::size_t>(half)] = static_cast<float>(s64[at] * down);
        }
      }
    } else if (const auto* absolute = std::get_if<AbsoluteQK>(&groups[gi].transform)) {
      if (absolute->params.dim() != dim) {
        throw Error(kWhere, (name + ".params.dim").c_str(), std::to_string(absolute->params.dim()),
                    "the head_dim of q, " + std::to_string(dim));
      }
      t.kind = QKTables::kAbsolute;
      t.transform_keys = true;
      t.absolute.resize(static_cast<std::size_t>(rows * dim));
      sinusoidal_table(absolute->params, table_positions, TensorView::of(t.absolute.data(), {rows, dim}));
    }
    tables.push_back(std::move(t));
  }

  // ── Bias tables over δ = q − k, with a lane's worth of margin on the query side (padding
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
    if (std::holds_alternative<NoPE>(scheme) || std::holds_alternative<TupeParams>(scheme)) continue;  // TUPE: below
    any_bias = true;
    // Schemes of the relative position only (scheme.hpp): tabulated, θ's gradient flat.
    const RelativeBias* relative = relative_bias(scheme);
    const bool distance_only = relative != nullptr;
    if (relative != nullptr) flat += relative->parameter_count();
    if (const auto* fire = std::get_if<FireParams>(&scheme)) {
      // [s0 | s1] per piece and head, then ∂L/∂c and ∂L/∂L (FireRows::accumulate_row).
      flat += 2 * static_cast<std::int64_t>(fire->kinks().size() + 1) * hg + 2;
      any_trainable_bias = true;
    }
    if (relative != nullptr && relative->parameter_count() > 0) any_trainable_bias = true;
    const bool tabulate = distance_only && width * hg <= kMaxBiasTable;
    if (tabulate) {
      // table[t] = b(δ_min + t) over δ = q − k, i.e. of r = k − q = −(δ_min + t): a row of r
      // from r_first = −(δ_min + width − 1) read backwards.
      auto& table = bias_tables[gi];
      table.resize(static_cast<std::size_t>(width * hg));
      std::vector<double> rows(table.size());
      relative->tabulate(-(delta_min + width - 1), width, rows.data());
      for (std::int64_t h = 0; h < hg; ++h) {
        for (std::int64_t t = 0; t < width; ++t) {
          // + 0.0: no −0 at r = 0, as bias_value
          table[static_cast<std::size_t>(h * width + t)] =
              static_cast<float>(rows[static_cast<std::size_t>(h * width + width - 1 - t)] + 0.0);
        }
      }
      lowest_table_bias = std::min(lowest_table_bias, *std::min_element(table.begin(), table.end()));
    } else {
      evaluators.push_back(std::make_unique<BiasEvaluator>(scheme, k_min - q_max, k_max - q_min));
      if (const auto* fire = std::get_if<FireParams>(&scheme)) {
        // ψ over every distance the call can meet, when that table is of a sensible size.
        const std::int64_t max_distance = std::max(std::abs(k_max - q_min), std::abs(q_max - k_min));
        if (max_distance < kMaxBiasTable) {
          auto evaluator_rows = std::make_unique<FireRows>();
          // Into the plan's own spec: `groups` is a local copy.
          evaluator_rows->params = &std::get<FireParams>(*spec.groups[gi].bias);
          // kAttnAlign past it: a lane chunk's padding lanes read on past the last real row.
          const std::int64_t entries = max_distance + 1 + kernels::kAttnAlign;
          evaluator_rows->psi.resize(static_cast<std::size_t>(entries));
          evaluator_rows->dpsi_dc.resize(static_cast<std::size_t>(entries));
          for (std::int64_t t = 0; t < entries; ++t) {
            const auto d = static_cast<double>(t);
            evaluator_rows->psi[static_cast<std::size_t>(t)] = std::log1p(fire->c() * d);
            evaluator_rows->dpsi_dc[static_cast<std::size_t>(t)] = d / (1 + fire->c() * d);
          }
          // 1/ψ(max(L, q)) per query position (and the padding lanes past the last one), when
          // that range is of a sensible size too (else add_chunk declines and rows take add_row).
          evaluator_rows->inv_norm_first = q_min;
          if (q_max - q_min < kMaxBiasTable) {
            evaluator_rows->inv_norm.resize(static_cast<std::size_t>(q_max - q_min + 1 + kernels::kAttnAlign));
          }
          for (std::size_t t = 0; t < evaluator_rows->inv_norm.size(); ++t) {
            const auto q = static_cast<double>(q_min + static_cast<std::int64_t>(t));
            evaluator_rows->inv_norm[t] = 1.0 / std::log1p(fire->c() * std::max(fire->threshold(), q));
          }
          fire_rows.push_back(std::move(evaluator_rows));
        }
      }
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
        if (!fire_rows.empty() && std::holds_alternative<FireParams>(scheme)) hb.fire = fire_rows.back().get();
      }
    }
  }
  grad_offset.push_back(flat);
  bool every_head_tabulated = heads > 0;
  for (const HeadBias& hb : head_bias) every_head_tabulated = every_head_tabulated && hb.kind == HeadBias::kTable;
  if (every_head_tabulated && !packed && q_len == 1) {
    bias_by_delta.resize(static_cast<std::size_t>(width * heads));
    for (std::int64_t h = 0; h < heads; ++h) {
      const float* table = head_bias[static_cast<std::size_t>(h)].table;
      for (std::int64_t t = 0; t < width; ++t) bias_by_delta[static_cast<std::size_t>(t * heads + h)] = table[t];
    }
  }
  hist_width = width <= kMaxBiasTable ? width : 0;
  build_xl_tables(groups);
  build_tupe_tables(groups, p_min, p_max);
  // The far-tile skip (attention_plan.hpp): worth its norms and descending order only when some
  // table falls far enough that whole tiles can vanish (ALiBi over long spans, not T5's buckets).
  constexpr float kFarBias = 100.0f;
  bool keys_keep_norms = true;
  for (const QKTables& t : tables)
    keys_keep_norms = keys_keep_norms && (!t.transform_keys || t.kind != QKTables::kAbsolute);
  far_tiles_first =
      lowest_table_bias < -kFarBias && mask.softcap <= 0 && !any_shaw && !any_xl && !any_tupe && keys_keep_norms;
  // Per KV head: only where every query head's table falls below −100 can a block's rows all
  // vanish; the others run their tiles in key order (see far_first_kv).
  far_first_kv.assign(static_cast<std::size_t>(kv_heads), 0);
  for (std::int64_t g = 0; far_tiles_first && g < kv_heads; ++g) {
    bool steep = true;
    for (std::int64_t h = g * group_size; h < (g + 1) * group_size; ++h) {
      const HeadBias& hb = head_bias[static_cast<std::size_t>(h)];
      steep = steep && hb.kind == HeadBias::kTable && *std::min_element(hb.table, hb.table + hb.width) < -kFarBias;
    }
    far_first_kv[static_cast<std::size_t>(g)] = steep ? 1 : 0;
  }
  skip_far_tiles = far_tiles_first && spec.skip_vanishing_tiles;
  if (!skip_far_tiles) return;
  // The tables' running maxima, which bound a tile's biases (HeadBias::max_from / max_to).
  bias_table_max.resize(bias_tables.size());
  for (std::size_t gi = 0; gi < bias_tables.size(); ++gi) {
    if (bias_tables[gi].empty()) continue;
    const std::int64_t hg = groups[gi].heads, h0 = group_first_head[gi];
    auto& maxima = bias_table_max[gi];
    maxima.resize(2 * bias_tables[gi].size());
    for (std::int64_t h = 0; h < hg; ++h) {
      HeadBias& hb = head_bias[static_cast<std::size_t>(h0 + h)];
      const std::int64_t n = hb.width;  // the plan's table width, as every tabulated head's
      float* from = maxima.data() + 2 * h * n;
      float* to = from + n;
      from[n - 1] = hb.table[n - 1];
      for (std::int64_t t = n - 2; t >= 0; --t) from[t] = std::max(from[t + 1], hb.table[t]);
      to[0] = hb.table[0];
      for (std::int64_t t = 1; t < n; ++t) to[t] = std::max(to[t - 1], hb.table[t]);
      hb.max_from = from;
      hb.max_to = to;
    }
  }
}

// ── TUPE: each position's projections for the call's position range, one f32 matrix product
// per table (p·U, blocked_gemm); pq carries 1/sqrt(2D).
void AttentionPlan::build_tupe_tables(const std::vector<HeadGroup>& groups, std::int64_t p_min, std::int64_t p_max) {
  tupe.resize(groups.size());
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    const TupeParams* params = groups[gi].bias ? std::get_if<TupeParams>(&*groups[gi].bias) : nullptr;
    if (params == nullptr) continue;
    check_tupe_positions(kWhere, *params, *q_positions, *k_positions);
    if (params->head_dim() != dim) {
      throw Error(kWhere, ("groups[" + std::to_string(gi) + "].bias (TUPE) head_dim").c_str(),
                  std::to_string(params->head_dim()),
                  "the head_dim of q, " + std::to_string(dim) + " (its projections meet in the score tiles)");
    }
    if (!any_tupe) {
      any_tupe = true;
      tupe_first = p_min;
      tupe_count = p_max - p_min + 1;
      detail::init_dispatch();
    }
    TupeTables& t = tupe[gi];
    const std::int64_t hg = groups[gi].heads, dm = params->d_model(), dmp = round_up(dm, kernels::kAttnAlign);
    const std::int64_t cols = hg * dim_padded, hd = hg * dim;
    t.heads = hg;
    t.cls_reset = params->cls_reset();
    std::vector<float> rows(static_cast<std::size_t>(tupe_count * dmp), 0.0f),
        u(static_cast<std::size_t>(dmp * cols), 0.0f);
    for (std::int64_t n = 0; n < tupe_count; ++n) {
      for (std::int64_t m = 0; m < dm; ++m) {
        rows[static_cast<std::size_t>(n * dmp + m)] =
            static_cast<float>(params->table()[static_cast<std::size_t>((tupe_first + n) * dm + m)]);
      }
    }
    const double pq_scale = 1.0 / std::sqrt(2.0 * static_cast<double>(dim));
    for (const bool is_q : {true, false}) {
      const std::vector<double>& weights = is_q ? params->u_q() : params->u_k();
      for (std::int64_t m = 0; m < dm; ++m) {
        for (std::int64_t h = 0; h < hg; ++h) {
          for (std::int64_t d = 0; d < dim; ++d) {
            const double w = weights[static_cast<std::size_t>(m * hd + h * dim + d)] * (is_q ? pq_scale : 1.0);
            u[static_cast<std::size_t>(m * cols + h * dim_padded + d)] = static_cast<float>(w);
          }
        }
      }
      AlignedFloats& out = is_q ? t.pq : t.pk;
      out.assign(static_cast<std::size_t>(tupe_count * cols), 0.0f);
      std::vector<float> by_position(static_cast<std::size_t>(tupe_count * cols), 0.0f);
      blocked_gemm(rows.data(), dmp, 1, u.data(), cols, by_position.data(), cols, tupe_count, cols, dm);
      if (t.cls_reset && tupe_first == 0) std::fill(by_position.begin(), by_position.begin() + cols, 0.0f);
      out = heads_major(by_position, tupe_count, hg, dim_padded);
    }
    t.theta1.assign(params->theta1().begin(), params->theta1().end());
    t.theta2.assign(params->theta2().begin(), params->theta2().end());
  }
}

// TUPE's parameter gradients from the per-KV-head totals of the units' [dPQ | dPK | θ1 | θ2]
// by position (fp64; dPQ against the scaled pq, so times 1/sqrt(2D) here):
//   dU^Q[m][h·D + d] += Σ_pos p[pos][m]·dPQ_h[pos][d],  dp[pos][m] += Σ_c U^Q[m][c]·dPQ[pos][c]
// and the same for K — f32 matrix products (blocked_gemm) added in fp64.
void AttentionPlan::finish_tupe_gradients(const std::vector<double>& totals, AttentionGradients& grads) const {
  const std::int64_t per_kv = tupe_unit_gradient_size(), dp = dim_padded, g_count = group_size;
  const double pq_scale = 1.0 / std::sqrt(2.0 * static_cast<double>(dim));
  for (std::size_t gi = 0; gi < tupe.size(); ++gi) {
    const TupeTables& t = tupe[gi];
    if (t.heads == 0) continue;
    const TupeParams& params = std::get<TupeParams>(*spec.groups[gi].bias);
    TupeGradients& out = *grads.groups[gi].tupe;
    const std::int64_t hg = t.heads, h_first = group_first_head[gi], cols = hg * dp, hd = hg * dim;
    const std::int64_t dm = params.d_model(), dmp = round_up(dm, kernels::kAttnAlign);
    AlignedFloats& rows = zeroed_floats(CallBuffer::kTupeRows, static_cast<std::size_t>(tupe_count * dmp));
    // Every loop below writes disjoint elements, each from its own inputs: in parallel, the same
    // bits for any thread count.
#pragma omp parallel for schedule(static) num_threads(threads_for(tupe_count* dm))
    for (std::int64_t n = 0; n < tupe_count; ++n) {
      for (std::int64_t m = 0; m < dm; ++m) {
        rows[static_cast<std::size_t>(n * dmp + m)] =
            static_cast<float>(params.table()[static_cast<std::size_t>((tupe_first + n) * dm + m)]);
      }
    }
    for (const bool is_q : {true, false}) {
      // d(projection) [count][hg·Dp] in f32 from the per-KV-head totals.
      AlignedFloats& d_proj = zeroed_floats(CallBuffer::kTupeProjected, static_cast<std::size_t>(tupe_count * cols));
#pragma omp parallel for schedule(static) \
    num_threads(std::min <int>(threads_for(tupe_count * cols), static_cast <int>(hg)))
      for (std::int64_t lh = 0; lh < hg; ++lh) {
        const std::int64_t h = h_first + lh, kvh = h / g_count, g = h % g_count;
        const double* part = totals.data() + kvh * per_kv + (is_q ? 0 : tupe_count * g_count * dp);
        const double factor = is_q ? pq_scale : 1.0;
        for (std::int64_t n = 0; n < tupe_count; ++n) {
          for (std::int64_t d = 0; d < dim; ++d) {
            d_proj[static_cast<std::size_t>(n * cols + lh * dp + d)] =
                static_cast<float>(factor * part[(n * g_count + g) * dp + d]);
          }
        }
        const double* theta = totals.data() + kvh * per_kv + 2 * tupe_count * g_count * dp;
        if (is_q && t.cls_reset) {
          out.theta1[static_cast<std::size_t>(lh)] += theta[g];
          out.theta2[static_cast<std::size_t>(lh)] += theta[g_count + g];
        }
      }
      // dU[m][c] = Σ_n rows[n][m]·d_proj[n][c].
      AlignedFloats& du = zeroed_floats(CallBuffer::kTupeDu, static_cast<std::size_t>(dmp * cols));
      blocked_gemm(rows.data(), 1, dmp, d_proj.data(), cols, du.data(), cols, dm, cols, tupe_count);
      std::vector<double>& u_grad = is_q ? out.u_q : out.u_k;
      const std::vector<double>& weights = is_q ? params.u_q() : params.u_k();
#pragma omp parallel for schedule(static) num_threads(threads_for(dm* cols))
      for (std::int64_t m = 0; m < dm; ++m) {
        for (std::int64_t lh = 0; lh < hg; ++lh) {
          for (std::int64_t d = 0; d < dim; ++d) {
            u_grad[static_cast<std::size_t>(m * hd + lh * dim + d)] +=
                du[static_cast<std::size_t>(m * cols + lh * dp + d)];
          }
        }
      }
      // d table[n][m] = Σ_c d_proj[n][c]·U[m][c]: B = Uᵀ as [cols][dmp].
      AlignedFloats& ut = zeroed_floats(CallBuffer::kTupeUt, static_cast<std::size_t>(cols * dmp));
      AlignedFloats& dtable = zeroed_floats(CallBuffer::kTupeDtable, static_cast<std::size_t>(tupe_count * dmp));
#pragma omp parallel for schedule(static) num_threads(threads_for(dm* cols))
      for (std::int64_t m = 0; m < dm; ++m) {
        for (std::int64_t lh = 0; lh < hg; ++lh) {
          for (std::int64_t d = 0; d < dim; ++d) {
            ut[static_cast<std::size_t>((lh * dp + d) * dmp + m)] =
                static_cast<float>(weights[static_cast<std::size_t>(m * hd + lh * dim + d)]);
          }
        }
      }
      blocked_gemm(d_proj.data(), cols, 1, ut.data(), dmp, dtable.data(), dmp, tupe_count, dmp, cols);
#pragma omp parallel for schedule(static) num_threads(threads_for(tupe_count* dm))
      for (std::int64_t n = 0; n < tupe_count; ++n) {
        for (std::int64_t m = 0; m < dm; ++m) {
          out.table[static_cast<std::size_t>((tupe_first + n) * dm + m)] +=
              dtable[static_cast<std::size_t>(n * dmp + m)];
        }
      }
    }
  }
}

// r(δ) for the table's δ, as XlParams::sinusoid computes it (same frequencies, same fp64 angle
// δ·ω_i), rounded to f32; the frequencies once, not per δ.
std::vector<float> AttentionPlan::xl_sinusoids(const XlParams& params, std::int64_t padded_d_model) const {
  const std::int64_t half = params.d_model() / 2;
  std::vector<double> frequency(static_cast<std::size_t>(half));
  for (std::int64_t i = 0; i < half; ++i) {
    frequency[static_cast<std::size_t>(i)] = sinusoid_inv_frequency(params.base(), params.d_model(), i);
  }
  std::vector<float> r(static_cast<std::size_t>(xl_width * padded_d_model), 0.0f);
  for (std::int64_t u = 0; u < xl_width; ++u) {
    float* row = r.data() + u * padded_d_model;
    for (std::int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(xl_delta_min + u) * frequency[static_cast<std::size_t>(i)];
      row[i] = static_cast<float>(std::sin(angle));
      row[half + i] = static_cast<float>(std::cos(angle));
    }
  }
  return r;
}

// ── Transformer-XL: P_h(δ) = W_R r(δ) for the δ of the pairs the mask lets through (exact per
// query with default key positions; the sequence's key-position range otherwise), as one f32
// matrix product r·W_Rᵀ (blocked_gemm); c_h(δ) from P in fp64.
void AttentionPlan::build_xl_tables(const std::vector<HeadGroup>& groups) {
  xl.resize(groups.size());
  std::int64_t xl_heads = 0;
  for (const HeadGroup& grp : groups) xl_heads += grp.xl ? grp.heads : 0;
  if (xl_heads == 0) return;
  any_xl = true;
  std::int64_t lo = std::numeric_limits<std::int64_t>::max(), hi = std::numeric_limits<std::int64_t>::min();
  const bool default_keys = !spec.k_positions.has_value();
  for (const Sequence& seq : sequences) {
    std::int64_t k_lo = std::numeric_limits<std::int64_t>::max(), k_hi = std::numeric_limits<std::int64_t>::min();
    if (!default_keys) {
      for (std::int64_t j = 0; j < seq.lk; ++j) {
        k_lo = std::min(k_lo, k_position(seq, j));
        k_hi = std::max(k_hi, k_position(seq, j));
      }
    }
    const std::int64_t offset = seq.lk - seq.lq;
    for (std::int64_t i = 0; i < seq.lq; ++i) {
      std::int64_t first = 0, last = seq.lk;  // visible keys [first, last), layout_rows' rule
      if (mask.window_left >= 0) first = std::max<std::int64_t>(0, i + offset - mask.window_left);
      if (window_right >= 0) last = std::min<std::int64_t>(seq.lk, i + offset + window_right + 1);
      if (last <= first) continue;
      const std::int64_t qp = q_position(seq, i);
      lo = std::min(lo, qp - (default_keys ? last - 1 : k_hi));
      hi = std::max(hi, qp - (default_keys ? first : k_lo));
    }
  }
  if (lo > hi) lo = hi = 0;  // nothing visible: a one-row table keeps the code paths uniform
  xl_delta_min = lo;
  xl_width = hi - lo + 1;
  // The table is [δ span, XL heads, Dp] floats; past 2^29 (2 GiB) the positions are too scattered
  // for tabulation: say so rather than allocate it.
  constexpr std::int64_t kMaxXlTable = std::int64_t{1} << 29;
  if (xl_width > kMaxXlTable / (xl_heads * dim_padded)) {
    throw Error(kWhere, "groups[].xl", "a δ = q − k span of " + std::to_string(xl_width) + " positions",
                "at most " + std::to_string(kMaxXlTable / (xl_heads * dim_padded)) +
                    " for fused Transformer-XL (P(δ) is tabulated); use xl_add_position_terms for scattered positions");
  }
  detail::init_dispatch();
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    if (!groups[gi].xl) continue;
    const XlParams& params = *groups[gi].xl;
    XlTables& t = xl[gi];
    const std::int64_t hg = groups[gi].heads, dm = params.d_model(), dmp = round_up(dm, kernels::kAttnAlign);
    const std::int64_t cols = hg * dim_padded;
    t.heads = hg;
    t.sinusoids = xl_sinusoids(params, dmp);
    t.d_model_padded = dmp;
    const std::vector<float>& r = t.sinusoids;
    std::vector<float> wt(static_cast<std::size_t>(dmp * cols), 0.0f);
    for (std::int64_t h = 0; h < hg; ++h) {
      for (std::int64_t d = 0; d < dim; ++d) {
        for (std::int64_t m = 0; m < dm; ++m) {
          wt[static_cast<std::size_t>(m * cols + h * dim_padded + d)] =
              static_cast<float>(params.w_r()[static_cast<std::size_t>((h * dim + d) * dm + m)]);
        }
      }
    }
    std::vector<float> by_delta(static_cast<std::size_t>(xl_width * cols), 0.0f);
    blocked_gemm(r.data(), dmp, 1, wt.data(), cols, by_delta.data(), cols, xl_width, cols, dm);
    t.width = xl_width;
    t.projected = heads_major(by_delta, xl_width, hg, dim_padded);
    t.u.assign(static_cast<std::size_t>(hg * dim), 0.0f);
    t.constant.assign(static_cast<std::size_t>(hg * xl_width), 0.0f);
    for (std::int64_t h = 0; h < hg; ++h) {
      for (std::int64_t d = 0; d < dim; ++d)
        t.u[static_cast<std::size_t>(h * dim + d)] =
            static_cast<float>(params.u()[static_cast<std::size_t>(h * dim + d)]);
      for (std::int64_t u = 0; u < xl_width; ++u) {
        const float* row = t.p_row(u, h, dim_padded);
        double c = 0;
        for (std::int64_t d = 0; d < dim; ++d) {
          const auto at = static_cast<std::size_t>(h * dim + d);
          c += (params.v()[at] - params.u()[at]) * static_cast<double>(row[d]);
        }
        t.constant[static_cast<std::size_t>(h * xl_width + u)] = static_cast<float>(scale_f64 * c);
      }
    }
  }
}

namespace {

// A FIRE lane chunk against keys at or before every lane's query (FireRows::add_chunk,
// accumulate_chunk): lane t's normaliser 1/ψ(max(L, q)), its piece of the MLP and that piece's
// bounds and line. Padding lanes (lane_head < 0) take x = ψ·1, slope 0 and never leave a piece
// spanning every x.
struct FireLanes {
  static constexpr std::int64_t kLanes = kernels::kAttnAlign;
  alignas(64) double inv[kLanes], lo[kLanes], hi[kLanes], slope[kLanes], intercept[kLanes];
  std::int64_t piece[kLanes];
  const FireRows& rows;
  std::int64_t head, q_first, k_first;

  FireLanes(const FireRows& fire, std::int64_t head_, const std::int64_t* lane_head, std::int64_t q_first_,
            std::int64_t k_first_)
      : rows(fire), head(head_), q_first(q_first_), k_first(k_first_) {
    constexpr double kInf = std::numeric_limits<double>::infinity();
    for (std::int64_t t = 0; t < kLanes; ++t) {
      if (lane_head[t] < 0) {
        inv[t] = 1.0, lo[t] = -kInf, hi[t] = kInf, slope[t] = 0.0, intercept[t] = 0.0, piece[t] = -1;
        continue;
      }
      inv[t] = rows.inv_norm[static_cast<std::size_t>(q_first + t - rows.inv_norm_first)];
      enter(t, rows.params->piece_of(x_at(t, 0)));
    }
  }
  // Lane t's x at key j, as the kernels compute it: ψ(d)·(1/ψ(max(L, q))). (The per-element
  // definition divides; the two differ by an fp64 rounding, far below the f32 result's.)
  double x_at(std::int64_t t, std::int64_t j) const {
    return rows.psi[static_cast<std::size_t>(q_first + t - k_first - j)] * inv[t];
  }
  void enter(std::int64_t t, std::int64_t pc) {
    constexpr double kInf = std::numeric_limits<double>::infinity();
    const std::vector<double>& kinks = rows.params->kinks();
    piece[t] = pc;
    lo[t] = pc > 0 ? kinks[static_cast<std::size_t>(pc - 1)] : -kInf;
    hi[t] = pc < static_cast<std::int64_t>(kinks.size()) ? kinks[static_cast<std::size_t>(pc)] : kInf;
    slope[t] = rows.params->slope(pc, head);
    intercept[t] = rows.params->intercept(pc, head);
  }
  // The piece lane t moves to at key j (piece_of's rule: a kink belongs to the piece on its
  // right), or −1 if it stays (or is padding).
  std::int64_t next_piece(std::int64_t t, std::int64_t j) const {
    if (piece[t] < 0) return -1;
    const double x = x_at(t, j);
    if (x >= lo[t] && x < hi[t]) return -1;
    const std::vector<double>& kinks = rows.params->kinks();
    const auto n_kinks = static_cast<std::int64_t>(kinks.size());
    std::int64_t pc = piece[t];
    while (pc > 0 && x < kinks[static_cast<std::size_t>(pc - 1)]) --pc;
    while (pc < n_kinks && x >= kinks[static_cast<std::size_t>(pc)]) ++pc;
    return pc;
  }
};

}  // namespace

// Keys [0, below) of a lane chunk at q_first … q_first + 15 against keys k_first … k_first +
// count − 1 lie at or before every lane's query: distances q_first + t − k fall by one per key and
// rise by one per lane, a contiguous slice of ψ. −1 if a distance or query position is past the
// tables.
std::int64_t FireRows::keys_below(std::int64_t q_first, std::int64_t k_first, std::int64_t count) const {
  const auto table = static_cast<std::int64_t>(psi.size());
  const std::int64_t k_last = k_first + count - 1, q_last = q_first + kernels::kAttnAlign - 1;
  if (std::max(std::abs(q_last - k_first), std::abs(k_last - q_first)) >= table) return -1;
  if (q_first < inv_norm_first || q_last - inv_norm_first >= static_cast<std::int64_t>(inv_norm.size())) return -1;
  return std::clamp<std::int64_t>(q_first - k_first + 1, 0, count);
}

bool FireRows::add_row(std::int64_t head, std::int64_t q_position, std::int64_t k_first, std::int64_t count, float* out,
                       std::int64_t out_stride) const {
  const FireParams& p = *params;
  const auto table = static_cast<std::int64_t>(psi.size());
  if (std::abs(q_position - k_first) >= table || std::abs(q_position - (k_first + count - 1)) >= table) return false;
  // As FireParams::normalized_distance: ψ(d) / ψ(max(L, q)).
  const double norm = std::log1p(p.c() * std::max(p.threshold(), static_cast<double>(q_position)));
  const std::vector<double>& kinks = p.kinks();
  const auto n_kinks = static_cast<std::int64_t>(kinks.size());
  // The current piece as an x interval [lo, hi) with its line: most elements stay on the piece of
  // their neighbour, and then cost a division, two compares and a multiply-add.
  std::int64_t piece = -1;
  double lo = 0, hi = -1, slope = 0, intercept = 0;  // empty: the first element looks its piece up
  for (std::int64_t j = 0; j < count; ++j) {
    const std::int64_t d = std::abs(k_first + j - q_position);
    const double x = psi[static_cast<std::size_t>(d)] / norm;
    if (!(x >= lo && x < hi)) {
      if (piece < 0) {
        piece = p.piece_of(x);
      } else {
        // piece_of's rule (upper bound: a kink belongs to the piece on its right), walked.
        while (piece > 0 && x < kinks[static_cast<std::size_t>(piece - 1)]) --piece;
        while (piece < n_kinks && x >= kinks[static_cast<std::size_t>(piece)]) ++piece;
      }
      lo = piece > 0 ? kinks[static_cast<std::size_t>(piece - 1)] : -std::numeric_limits<double>::infinity();
      hi = piece < n_kinks ? kinks[static_cast<std::size_t>(piece)] : std::numeric_limits<double>::infinity();
      slope = p.slope(piece, head);
      intercept = p.intercept(piece, head);
    }
    out[j * out_stride] += static_cast<float>(slope * x + intercept);
  }
  return true;
}

bool FireRows::add_chunk(std::int64_t head, const std::int64_t* lane_head, const std::int32_t* lane_lo,
                         const std::int32_t* lane_hi, std::int64_t q_first, std::int64_t k_index, std::int64_t k_first,
                         std::int64_t count, float* out, std::int64_t out_stride) const {
  constexpr std::int64_t kLanes = kernels::kAttnAlign;
  if (count <= 0) return true;
  const std::int64_t below = keys_below(q_first, k_first, count);
  if (below < 0) return false;
  if (below > 0) {
    FireLanes lanes(*this, head, lane_head, q_first, k_first);
    const std::int64_t base = q_first - k_first;
    for (std::int64_t j = 0; j < below;) {
      j += kernels::attn_fire_keys(out + j * out_stride, below - j, out_stride, psi.data(), base - j, lanes.inv,
                                   lanes.lo, lanes.hi, lanes.slope, lanes.intercept);
      if (j == below) break;
      // Some lane left its piece at key j: move it and go on.
      for (std::int64_t t = 0; t < kLanes; ++t) {
        if (const std::int64_t pc = lanes.next_piece(t, j); pc >= 0) lanes.enter(t, pc);
      }
    }
  }
  if (below < count) {
    // Keys after some lane's query: element by element, and only those the lane sees (the mask
    // sets the others to −inf after the biases; in causal attention that is all of them).
    for (std::int64_t t = 0; t < kLanes; ++t) {
      if (lane_head[t] < 0) continue;
      const std::int64_t j0 = std::max<std::int64_t>(below, lane_lo[t] - k_index);
      const std::int64_t j1 = std::min<std::int64_t>(count, lane_hi[t] - k_index);
      // add_row cannot decline here: every distance of the chunk was checked against ψ above.
      if (j1 > j0) add_row(head, q_first + t, k_first + j0, j1 - j0, out + j0 * out_stride + t, out_stride);
    }
  }
  return true;
}

bool FireRows::accumulate_chunk(std::int64_t head, std::int64_t heads, const std::int64_t* lane_head,
                                const std::int32_t* lane_lo, const std::int32_t* lane_hi, std::int64_t q_first,
                                std::int64_t k_index, const std::int64_t* kpos, std::int64_t count, const float* ds,
                                std::int64_t ds_stride, double* s0, double* s1, double* d_c,
                                double* d_threshold) const {
  constexpr std::int64_t kLanes = kernels::kAttnAlign;
  const FireParams& p = *params;
  if (count <= 0) return true;
  const std::int64_t below = keys_below(q_first, kpos[0], count);
  if (below < 0) return false;
  if (below > 0) {
    FireLanes lanes(*this, head, lane_head, q_first, kpos[0]);
    alignas(64) double moments[4 * kLanes] = {};  // per lane: Σ g, Σ g·x (this piece); Σ g·f'·dψ/dc, Σ g·f'·x
    // Moves lane t's sums of its current piece into the piece's slots.
    const auto flush = [&](std::int64_t t) {
      if (lanes.piece[t] < 0) return;
      const auto slot = static_cast<std::size_t>(lanes.piece[t] * heads + head);
      s0[slot] += moments[t];
      s1[slot] += moments[kLanes + t];
      moments[t] = moments[kLanes + t] = 0.0;
    };
    const std::int64_t base = q_first - kpos[0];
    for (std::int64_t j = 0; j < below;) {
      j += kernels::attn_fire_moments(ds + j * ds_stride, below - j, ds_stride, psi.data(), dpsi_dc.data(), base - j,
                                      lanes.inv, lanes.lo, lanes.hi, lanes.slope, moments);
      if (j == below) break;
      for (std::int64_t t = 0; t < kLanes; ++t) {
        if (const std::int64_t pc = lanes.next_piece(t, j); pc >= 0) {
          flush(t);
          lanes.enter(t, pc);
        }
      }
    }
    // Per lane, the c and L terms as accumulate_row forms them.
    const double c = p.c();
    for (std::int64_t t = 0; t < kLanes; ++t) {
      if (lanes.piece[t] < 0) continue;
      flush(t);
      const double q = static_cast<double>(q_first + t);
      const bool threshold_active = p.threshold() > q;
      const double n = threshold_active ? p.threshold() : q;
      const double psi_n = std::log1p(c * n);
      const double dc_from_x = n / (1 + c * n) / psi_n, dl_from_x = threshold_active ? -(c / (1 + c * n)) / psi_n : 0.0;
      *d_c += moments[2 * kLanes + t] / psi_n - dc_from_x * moments[3 * kLanes + t];
      *d_threshold += dl_from_x * moments[3 * kLanes + t];
    }
  }
  if (below < count) {
    // Keys after some lane's query: row by row, only those the lane sees (the others have dS = 0).
    for (std::int64_t t = 0; t < kLanes; ++t) {
      if (lane_head[t] < 0) continue;
      const std::int64_t j0 = std::max<std::int64_t>(below, lane_lo[t] - k_index);
      const std::int64_t j1 = std::min<std::int64_t>(count, lane_hi[t] - k_index);
      if (j1 > j0) {
        accumulate_row(head, heads, q_first + t, kpos + j0, j1 - j0, ds + j0 * ds_stride + t, ds_stride, s0, s1, d_c,
                       d_threshold);
      }
    }
  }
  return true;
}

void FireRows::accumulate_row(std::int64_t head, std::int64_t heads, std::int64_t q_position, const std::int64_t* kpos,
                              std::int64_t count, const float* ds, std::int64_t ds_stride, double* s0, double* s1,
                              double* d_c, double* d_threshold) const {
  const FireParams& p = *params;
  const double c = p.c();
  const bool threshold_active = p.threshold() > static_cast<double>(q_position);
  const double n = threshold_active ? p.threshold() : static_cast<double>(q_position);
  const double psi_n = std::log1p(c * n);
  // ∂x/∂c = (dψ(d)/dc − x·n/(1 + c·n))/ψ(n);  ∂x/∂L = −x·c/((1 + c·n)·ψ(n)) below L (as fire_backward).
  const double dc_from_x = n / (1 + c * n) / psi_n, dl_from_x = threshold_active ? -(c / (1 + c * n)) / psi_n : 0.0;
  const std::vector<double>& kinks = p.kinks();
  const auto n_kinks = static_cast<std::int64_t>(kinks.size());
  const auto table = static_cast<std::int64_t>(psi.size());
  std::int64_t piece = -1;
  double t1 = 0, t2 = 0;  // Σ g·dψ/dc, Σ g·x with g = ds·f'(x)
  for (std::int64_t j = 0; j < count; ++j) {
    const double g_ds = ds[j * ds_stride];
    const std::int64_t d = std::abs(kpos[j] - q_position);
    const double psi_d = d < table ? psi[static_cast<std::size_t>(d)] : std::log1p(c * static_cast<double>(d));
    const double dpsi =
        d < table ? dpsi_dc[static_cast<std::size_t>(d)] : static_cast<double>(d) / (1 + c * static_cast<double>(d));
    const double x = psi_d / psi_n;
    if (piece < 0) {
      piece = p.piece_of(x);
    } else {
      while (piece > 0 && x < kinks[static_cast<std::size_t>(piece - 1)]) --piece;
      while (piece < n_kinks && x >= kinks[static_cast<std::size_t>(piece)]) ++piece;
    }
    if (g_ds == 0.0f) continue;
    const std::size_t slot = static_cast<std::size_t>(piece * heads + head);
    s0[slot] += g_ds;
    s1[slot] += g_ds * x;
    const double g = g_ds * p.slope(piece, head);
    t1 += g * dpsi;
    t2 += g * x;
  }
  *d_c += t1 / psi_n - dc_from_x * t2;
  *d_threshold += dl_from_x * t2;
}

std::int64_t AttentionPlan::table_bytes() const {
  std::int64_t total = 0;
  for (const auto& t : tables) total += t.bytes();
  for (const auto& t : bias_tables) total += static_cast<std::int64_t>(t.size() * sizeof(float));
  total += static_cast<std::int64_t>(bias_by_delta.size() * sizeof(float));
  for (const auto& t : bias_table_max) total += static_cast<std::int64_t>(t.size() * sizeof(float));
  for (const auto& t : tupe) total += static_cast<std::int64_t>((t.pq.size() + t.pk.size()) * sizeof(float));
  for (const auto& t : xl)
    total += static_cast<std::int64_t>((t.projected.size() + t.constant.size() + t.u.size() + t.sinusoids.size()) *
                                       sizeof(float));
  return total;
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

// ─── Positional gradients ────────────────────────────────────────────────────────────────────

AttentionGradients AttentionPlan::zero_gradients() const {
  AttentionGradients grads;
  const std::vector<HeadGroup> groups =
      spec.groups.empty() ? std::vector<HeadGroup>{HeadGroup{heads, {}, {}}} : spec.groups;
  for (const HeadGroup& grp : groups) {
    GroupGradients g;
    if (grp.bias) {
      const std::int64_t hg = grp.heads;
      if (std::holds_alternative<AlibiParams>(*grp.bias)) g.alibi_slopes.assign(static_cast<std::size_t>(hg), 0.0);
      if (const auto* t5 = std::get_if<T5BiasParams>(&*grp.bias))
        g.t5_table.assign(static_cast<std::size_t>(t5->num_buckets() * hg), 0.0);
      if (std::holds_alternative<KerpleParams>(*grp.bias)) {
        g.kerple_r1.assign(static_cast<std::size_t>(hg), 0.0);
        g.kerple_r2.assign(static_cast<std::size_t>(hg), 0.0);
      }
      if (const auto* fire = std::get_if<FireParams>(&*grp.bias)) g.fire.emplace(*fire);
      if (const auto* tupe_params = std::get_if<TupeParams>(&*grp.bias)) g.tupe.emplace(*tupe_params);
      if (std::holds_alternative<RelativeBiasRef>(*grp.bias))
        g.bias_parameters.assign(static_cast<std::size_t>(relative_bias(*grp.bias)->parameter_count()), 0.0);
    }
    if (grp.shaw) {
      g.shaw_key_table.assign(static_cast<std::size_t>(grp.shaw->rows() * grp.shaw->head_dim()), 0.0);
      g.shaw_value_table.assign(g.shaw_key_table.size(), 0.0);
    }
    if (grp.xl) g.xl.emplace(*grp.xl);
    grads.groups.push_back(std::move(g));
  }
  return grads;
}

void AttentionPlan::check_gradients(const AttentionGradients& grads) const {
  const AttentionGradients like = zero_gradients();
  require(grads.groups.size() == like.groups.size(), "grads.groups", "size " + std::to_string(grads.groups.size()),
          std::to_string(like.groups.size()) + " (one per head group; Attention::zero_gradients() makes them)");
  for (std::size_t g = 0; g < like.groups.size(); ++g) {
    const auto& a = grads.groups[g];
    const auto& b = like.groups[g];
    const std::string name = "grads.groups[" + std::to_string(g) + "]";
    check_gradient_size(kWhere, (name + ".alibi_slopes").c_str(), a.alibi_slopes.size(),
                        static_cast<std::int64_t>(b.alibi_slopes.size()));
    check_gradient_size(kWhere, (name + ".t5_table").c_str(), a.t5_table.size(),
                        static_cast<std::int64_t>(b.t5_table.size()));
    check_gradient_size(kWhere, (name + ".kerple_r1").c_str(), a.kerple_r1.size(),
                        static_cast<std::int64_t>(b.kerple_r1.size()));
    check_gradient_size(kWhere, (name + ".kerple_r2").c_str(), a.kerple_r2.size(),
                        static_cast<std::int64_t>(b.kerple_r2.size()));
    check_gradient_size(kWhere, (name + ".bias_parameters").c_str(), a.bias_parameters.size(),
                        static_cast<std::int64_t>(b.bias_parameters.size()));
    check_gradient_size(kWhere, (name + ".shaw_key_table").c_str(), a.shaw_key_table.size(),
                        static_cast<std::int64_t>(b.shaw_key_table.size()));
    check_gradient_size(kWhere, (name + ".shaw_value_table").c_str(), a.shaw_value_table.size(),
                        static_cast<std::int64_t>(b.shaw_value_table.size()));
    if (b.fire) {
      require(a.fire.has_value(), (name + ".fire").c_str(), "empty", "FireGradients sized for the group's FIRE");
      check_gradient_size(kWhere, (name + ".fire.w1").c_str(), a.fire->w1.size(),
                          static_cast<std::int64_t>(b.fire->w1.size()));
      check_gradient_size(kWhere, (name + ".fire.b1").c_str(), a.fire->b1.size(),
                          static_cast<std::int64_t>(b.fire->b1.size()));
      check_gradient_size(kWhere, (name + ".fire.w2").c_str(), a.fire->w2.size(),
                          static_cast<std::int64_t>(b.fire->w2.size()));
      check_gradient_size(kWhere, (name + ".fire.b2").c_str(), a.fire->b2.size(),
                          static_cast<std::int64_t>(b.fire->b2.size()));
    }
    if (b.xl) {
      require(a.xl.has_value(), (name + ".xl").c_str(), "empty", "XlGradients sized for the group's XL");
      check_gradient_size(kWhere, (name + ".xl.u").c_str(), a.xl->u.size(), static_cast<std::int64_t>(b.xl->u.size()));
      check_gradient_size(kWhere, (name + ".xl.v").c_str(), a.xl->v.size(), static_cast<std::int64_t>(b.xl->v.size()));
      check_gradient_size(kWhere, (name + ".xl.w_r").c_str(), a.xl->w_r.size(),
                          static_cast<std::int64_t>(b.xl->w_r.size()));
    }
    if (b.tupe) {
      require(a.tupe.has_value(), (name + ".tupe").c_str(), "empty", "TupeGradients sized for the group's TUPE");
      check_gradient_size(kWhere, (name + ".tupe.table").c_str(), a.tupe->table.size(),
                          static_cast<std::int64_t>(b.tupe->table.size()));
      check_gradient_size(kWhere, (name + ".tupe.u_q").c_str(), a.tupe->u_q.size(),
                          static_cast<std::int64_t>(b.tupe->u_q.size()));
      check_gradient_size(kWhere, (name + ".tupe.u_k").c_str(), a.tupe->u_k.size(),
                          static_cast<std::int64_t>(b.tupe->u_k.size()));
      check_gradient_size(kWhere, (name + ".tupe.theta1").c_str(), a.tupe->theta1.size(),
                          static_cast<std::int64_t>(b.tupe->theta1.size()));
      check_gradient_size(kWhere, (name + ".tupe.theta2").c_str(), a.tupe->theta2.size(),
                          static_cast<std::int64_t>(b.tupe->theta2.size()));
    }
  }
}

std::int64_t AttentionPlan::bias_gradient_size() const { return grad_offset.back(); }

void AttentionPlan::add_bias_derivative(std::int64_t h, std::int64_t r, double sum, double* flat) const {
  const auto g = static_cast<std::size_t>(head_group[static_cast<std::size_t>(h)]);
  const std::int64_t local = h - group_first_head[g];
  const RelativeBias* relative = relative_bias(*spec.groups[g].bias);
  if (relative == nullptr) return;
  const std::span<double> at(flat + grad_offset[g], static_cast<std::size_t>(relative->parameter_count()));
  relative->accumulate_gradient(local, r, sum, at);
}

void AttentionPlan::accumulate_bias_gradients(const Sequence& /* seq */, const RowBlock& rb, std::int64_t k_first,
                                              std::int64_t keys, const std::int64_t* kpos, const float* dst,
                                              AttentionUnitScratch& s, std::int64_t kvh, double* unit_grads) const {
  // FIRE's lane chunks (one head, consecutive positions, consecutive keys) take the vector path;
  // `done` marks them for the row loop below.
  std::uint64_t done = 0;  // bit c: chunk c done (row blocks hold at most 64 chunks here)
  bool keys_consecutive = true;
  for (std::int64_t j = 1; j < keys && keys_consecutive; ++j) keys_consecutive = kpos[j] == kpos[0] + j;
  const std::int64_t chunks = rb.width / kernels::kAttnAlign;
  for (std::int64_t c = 0; c < chunks && c < 64 && keys_consecutive; ++c) {
    const std::int64_t r0 = c * kernels::kAttnAlign;
    const std::int64_t h0 = rb.head[static_cast<std::size_t>(r0)];
    if (h0 < 0 || !rb.chunk_uniform[static_cast<std::size_t>(c)]) continue;
    const HeadBias& hb = head_bias[static_cast<std::size_t>(h0)];
    if (hb.fire == nullptr) continue;
    const HeadGroup& grp = spec.groups[static_cast<std::size_t>(hb.group)];
    const std::int64_t hg = grp.heads, pieces = static_cast<std::int64_t>(hb.fire->params->kinks().size()) + 1;
    double* at = unit_grads + grad_offset[static_cast<std::size_t>(hb.group)];
    if (hb.fire->accumulate_chunk(hb.local_head, hg, rb.head.data() + r0, rb.lo.data() + r0, rb.hi.data() + r0,
                                  rb.position[static_cast<std::size_t>(r0)], k_first, kpos, keys, dst + r0, rb.width,
                                  at, at + pieces * hg, at + 2 * pieces * hg, at + 2 * pieces * hg + 1)) {
      done |= std::uint64_t{1} << c;
    }
  }
  for (std::int64_t r = 0; r < rb.width; ++r) {
    const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
    if (h < 0) continue;
    if (r / kernels::kAttnAlign < 64 && (done >> (r / kernels::kAttnAlign) & 1) != 0) continue;
    const HeadBias& hb = head_bias[static_cast<std::size_t>(h)];
    if (hb.kind != HeadBias::kTable && hb.kind != HeadBias::kDirect) continue;
    const HeadGroup& grp = spec.groups[static_cast<std::size_t>(hb.group)];
    const std::int64_t qp = rb.position[static_cast<std::size_t>(r)];
    if (const auto* fire = std::get_if<FireParams>(&*grp.bias)) {
      const std::int64_t hg = grp.heads, pieces = static_cast<std::int64_t>(fire->kinks().size()) + 1;
      double* at = unit_grads + grad_offset[static_cast<std::size_t>(hb.group)];
      FireRows fallback;
      fallback.params = fire;
      (hb.fire != nullptr ? *hb.fire : fallback)
          .accumulate_row(hb.local_head, hg, qp, kpos, keys, dst + r, rb.width, at, at + pieces * hg,
                          at + 2 * pieces * hg, at + 2 * pieces * hg + 1);
      continue;
    }
    const RelativeBias* relative = relative_bias(*grp.bias);
    if (relative == nullptr || relative->parameter_count() == 0) continue;
    if (hist_width > 0) {
      double* hist = s.hist.data() + (h - kvh * group_size) * hist_width - delta_min;
      for (std::int64_t j = 0; j < keys; ++j) hist[qp - kpos[j]] += static_cast<double>(dst[j * rb.width + r]);
    } else {
      for (std::int64_t j = 0; j < keys; ++j) {
        add_bias_derivative(h, kpos[j] - qp, static_cast<double>(dst[j * rb.width + r]), unit_grads);
      }
    }
  }
}

void AttentionPlan::finish_bias_gradients(AttentionUnitScratch& s, std::int64_t kvh, double* unit_grads) const {
  if (hist_width == 0) return;
  for (std::int64_t g = 0; g < group_size; ++g) {
    const std::int64_t h = kvh * group_size + g;
    const HeadBias& hb = head_bias[static_cast<std::size_t>(h)];
    if (hb.kind != HeadBias::kTable && hb.kind != HeadBias::kDirect) continue;
    if (std::holds_alternative<FireParams>(*spec.groups[static_cast<std::size_t>(hb.group)].bias)) continue;
    const double* hist = s.hist.data() + g * hist_width;
    for (std::int64_t t = 0; t < hist_width; ++t) {
      if (hist[t] != 0.0) add_bias_derivative(h, -(delta_min + t), hist[t], unit_grads);
    }
  }
}

void AttentionPlan::scatter_bias_gradients(const std::vector<double>& total, AttentionGradients& grads) const {
  for (std::size_t g = 0; g < spec.groups.size(); ++g) {
    const double* at = total.data() + grad_offset[g];
    GroupGradients& gg = grads.groups[g];
    for (std::size_t t = 0; t < gg.alibi_slopes.size(); ++t) gg.alibi_slopes[t] += at[t];
    for (std::size_t t = 0; t < gg.t5_table.size(); ++t) gg.t5_table[t] += at[t];
    for (std::size_t t = 0; t < gg.kerple_r1.size(); ++t) {
      gg.kerple_r1[t] += at[t];
      gg.kerple_r2[t] += at[gg.kerple_r1.size() + t];
    }
    for (std::size_t t = 0; t < gg.bias_parameters.size(); ++t) gg.bias_parameters[t] += at[t];
    if (gg.fire) {
      const FireParams& fire = std::get<FireParams>(*spec.groups[g].bias);
      const std::int64_t moments = static_cast<std::int64_t>(fire.kinks().size() + 1) * fire.heads();
      fire_contract_moments(fire, at, at + moments, *gg.fire);
      gg.fire->c += at[2 * moments];
      gg.fire->threshold += at[2 * moments + 1];
    }
  }
}

// XL's parameter gradients from the per-KV-head totals of the units' [dP | Σ dS | Σ dQs] (fp64):
//   dP_h(δ) = Σ dS·Qs + scale·(v_h − u_h)·Σ dS      (the second part through c_h(δ))
//   dv_h = scale·Σ_δ (Σ dS)·P_h(δ),   du_h = Σ_i d(q + u)_i − dv_h,
//   dW_R[h·D + d][m] = Σ_δ dP_h(δ)[d]·r(δ)[m]  (an f32 matrix product, blocked_gemm).
void AttentionPlan::finish_xl_gradients(const std::vector<double>& totals, AttentionGradients& grads) const {
  const std::int64_t per_kv = xl_unit_gradient_size(), dp = dim_padded, g_count = group_size;
  for (std::size_t gi = 0; gi < xl.size(); ++gi) {
    const XlTables& t = xl[gi];
    if (t.heads == 0) continue;
    const XlParams& params = *spec.groups[gi].xl;
    XlGradients& out = *grads.groups[gi].xl;
    const std::int64_t hg = t.heads, h_first = group_first_head[gi], cols = hg * dp;
    AlignedFloats& d_projected = zeroed_floats(CallBuffer::kXlProjected, static_cast<std::size_t>(xl_width * cols));
    // Heads are independent (their own columns of d_projected, their own u and v): in parallel.
#pragma omp parallel for schedule(static) \
    num_threads(std::min <int>(threads_for(xl_width * cols), static_cast <int>(hg)))
    for (std::int64_t lh = 0; lh < hg; ++lh) {
      const std::int64_t h = h_first + lh, kvh = h / g_count, g = h % g_count;
      const double* dp_total = totals.data() + kvh * per_kv;
      const double* hist = dp_total + xl_width * g_count * dp + g * xl_width;
      const double* dqs = dp_total + xl_width * g_count * (dp + 1) + g * dim;
      // δ outer, so that every row walks in memory order; each dv[d] still sums over δ in order.
      std::vector<double> dv(static_cast<std::size_t>(dim), 0.0);
      for (std::int64_t u = 0; u < xl_width; ++u) {
        const double sum = hist[u];
        const float* p_row = t.p_row(u, lh, dp);
        const double* dp_row = dp_total + (u * g_count + g) * dp;
        float* to = d_projected.data() + u * cols + lh * dp;
        for (std::int64_t d = 0; d < dim; ++d) {
          const auto at = static_cast<std::size_t>(lh * dim + d);
          dv[static_cast<std::size_t>(d)] += sum * static_cast<double>(p_row[d]);
          to[d] = static_cast<float>(dp_row[d] + scale_f64 * (params.v()[at] - params.u()[at]) * sum);
        }
      }
      for (std::int64_t d = 0; d < dim; ++d) {
        const auto at = static_cast<std::size_t>(lh * dim + d);
        const double dv_d = dv[static_cast<std::size_t>(d)] * scale_f64;
        out.v[at] += dv_d;
        out.u[at] += dqs[d] - dv_d;
      }
    }
    const std::int64_t dm = params.d_model(), dmp = t.d_model_padded;
    const std::vector<float>& r = t.sinusoids;
    AlignedFloats& dw = zeroed_floats(CallBuffer::kXlDw, static_cast<std::size_t>(cols * dmp));
    blocked_gemm(d_projected.data(), 1, cols, r.data(), dmp, dw.data(), dmp, cols, dmp, xl_width);
#pragma omp parallel for schedule(static) num_threads(threads_for(cols* dm))
    for (std::int64_t row = 0; row < hg * dim; ++row) {
      const std::int64_t lh = row / dim, d = row % dim;
      for (std::int64_t m = 0; m < dm; ++m) {
        out.w_r[static_cast<std::size_t>((lh * dim + d) * dm + m)] +=
            dw[static_cast<std::size_t>((lh * dp + d) * dmp + m)];
      }
    }
  }
}

}  // namespace posenc::detail
