// The validated, pre-tabulated form of an AttentionSpec that the engine (attention.cpp) runs,
// and the reference (ref/attention_ref.cpp) reads. Internal.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "attention/score_term.hpp"
#include "internal.hpp"
#include "kernels/attention/attention_kernels.hpp"
#include "posenc/attention.hpp"

namespace posenc::detail {

// A sequence: batch row b (0 when packed), its queries at seq index q0 … q0 + lq − 1 and keys at
// k0 … k0 + lk − 1 of the views (packed: token offsets; else 0), lk after key_lengths.
struct Sequence {
  std::int64_t b = 0, q0 = 0, lq = 0, k0 = 0, lk = 0;
  std::int64_t index = 0;  // which sequence (for position tables by token)
};

// The query/key transform of a head group, tabulated per table row (see AttentionPlan's
// q_table_row / k_table_row): RoPE as [cos(half) | sin(half)] per row (α and xPos included; q
// and k tables differ only with xPos), Shortformer's sinusoid as [D] per row.
struct QKTables {
  enum Kind { kNone, kRope, kAbsolute } kind = kNone;
  bool transform_keys = false;
  bool interleaved = false;
  std::int64_t half = 0;    // rotary pairs
  std::int64_t offset = 0;  // the first rotated entry (RopeParams::rotary_offset)
  TableFloats q_cos_sin, k_cos_sin, absolute;
  // RoPE's rows kept across calls (rope_transform.cpp): when set, the [cos | sin] rows of the
  // table start at shared_rows, inside *shared, in place of q_cos_sin.
  std::shared_ptr<const TableFloats> shared;
  const float* shared_rows = nullptr;
  // The [cos | sin] rows of the queries, or of the keys (their own where scaled, as xPos).
  const float* cos_sin(bool keys) const {
    if (keys && !k_cos_sin.empty()) return k_cos_sin.data();
    return shared_rows != nullptr ? shared_rows : q_cos_sin.data();
  }
  std::int64_t bytes() const {
    const std::size_t held = shared ? shared->size() : 0;
    return static_cast<std::int64_t>((q_cos_sin.size() + k_cos_sin.size() + absolute.size() + held) * sizeof(float));
  }
};

// The bias of one head: tabulated over δ = q − k (distance-only schemes) or evaluated directly
// (tables too wide). A bias of both positions is a score term of its own (PositionBias::score_term).
struct HeadBias {
  enum Kind { kNone, kTable, kDirect } kind = kNone;
  std::int64_t group = -1, local_head = 0;
  const float* table = nullptr;  // b(δ_min + t), t < width
  float table_min = 0.0f;        // its least entry (std::min_element's)
  std::int64_t delta_min = 0, width = 0;
  const BiasEvaluator* evaluator = nullptr;
};

// Row metadata of a block of (head, query) rows; see AttentionPlan::layout_rows.
struct RowBlock {
  std::int64_t i0 = 0, count = 0, valid_rows = 0, width = 0;
  bool compact = false;
  std::vector<std::int64_t> head, query, position;  // head −1: padding
  std::vector<std::int32_t> lo, hi;                 // visible keys [lo, hi) of the sequence
  std::vector<unsigned char> chunk_uniform;
  std::int64_t key_lo = 0, key_hi = 0;  // union of the rows' visible keys
  void slice(std::int64_t r0, std::int64_t n, RowBlock& out) const;
  // Whether row r is a real row that sees key `key` of the sequence.
  bool sees(std::int64_t r, std::int64_t key) const {
    const auto at = static_cast<std::size_t>(r);
    return head[at] >= 0 && key >= lo[at] && key < hi[at];
  }
};

// Per-thread scratch, reused across calls (first-touch of fresh pages is expensive).
struct AttentionUnitScratch {
  // Every buffer starts on a cache line (AlignedFloats): the matrix kernel's vector loads and
  // stores then never straddle two lines.
  AlignedFloats q, qt, o, m, l, corr, st, dpt, k, v, tmp, dout, doutt, dq, dk, dv, lse, delta;
  // Decode with interleaved RoPE over an un-rotated cache: the tile's expanded [C | S] rows.
  AlignedFloats rope_rows;
  // Native bf16 prefill (AttentionPlan::native_bf16): Qᵀ, P, V paired along their sums' index and
  // the keys' rows, as kernels::attn_gemm_bf16 reads them.
  AlignedPairs qt_pairs, p_pairs, v_pairs, k_pairs, v_own_pairs;
  // Backward's: dOᵀ along the head dim; Q and dO rows paired along the rows (dK's and dV's B);
  // the tile's values along the head dim and keys along the keys (dQ's B); the step's Pᵀ and dSᵀ
  // along the rows and dS along the keys.
  AlignedPairs doutt_pairs, q_row_pairs, dout_row_pairs, v_dim_pairs, k_key_pairs, pt_pairs, dst_pairs, ds_pairs;
  std::vector<std::int64_t> kpos;
  std::vector<double> hist;
  std::vector<double> row_norm;  // the far-tile skip: |scale·q| per row
  // Backward: the unit's rows whose dO is not finite, and their δ as the softmax backward sums
  // it, Σ_j P_ij·dP_ij over the visible keys.
  std::vector<double> exact_delta;
  std::vector<std::int64_t> exact_rows;
  std::int64_t steps = 0, skipped_steps = 0;  // backward's (tile, row block) steps in the current call
  std::vector<TermState> terms;               // one per AttentionPlan::terms entry
  std::int64_t bytes() const;
};
AttentionUnitScratch& unit_scratch();

// Per-call buffers kept by the calling thread between calls and handed out zeroed: fresh memory
// costs ~2.7 µs per 4 KiB page on first touch, and the units' gradient slots and the terms'
// parameter products reach tens of MiB at S = 2048. kTerm0… serve one term's reduce() at a time.
enum class CallBuffer { kUnitBias, kTermTotals, kTerm0, kTerm1, kTerm2, kTerm3, kTerm4, kCount };
std::vector<double>& zeroed_doubles(CallBuffer which, std::size_t n);
AlignedFloats& zeroed_floats(CallBuffer which, std::size_t n);
// The units' slots of term `term` (AttentionPlan::terms), zeroed, likewise kept.
std::vector<double>& zeroed_term_slots(std::size_t term, std::size_t n);
// Per-KV-head sums of the backward units' slots of one term (units in order), in `buffer`.
const std::vector<double>& sum_slots_per_kv_head(std::span<const TermUnit> units, std::int64_t size,
                                                 std::int64_t kv_heads, CallBuffer buffer);

// The plan's state, in parts that the constructor's steps fill in turn; the engine reads them
// through AttentionPlan, which derives from each.

// The call: shapes, dtypes, the views' grids and data, the mask and the scale (check_views,
// check_cache, check_mask).
struct CallGeometry {
  AttentionMask mask;
  std::int64_t window_right = -1;
  DType dtype = DType::kF32;
  std::int64_t batch = 1, q_len = 0, k_len = 0, heads = 0, kv_heads = 0, group_size = 1, dim = 0, dim_padded = 0;
  // The values' head size (out, d_out and dv have it): 1 … dim (MLA: 128 of 192; absorbed decode
  // 512 of 576). Value rows are zero-padded to dim_padded like the others.
  std::int64_t dim_v = 0;
  bool packed = false;
  HeadsGrid qg, kg, vg;
  const void *q_data = nullptr, *k_data = nullptr, *v_data = nullptr;
  // Keys and values from a quantized cache (spec.cache): kg and vg then count bytes (kv_unit 1),
  // else elements of dtype (kv_unit its size).
  std::optional<CacheFormat> cache_format;
  std::int64_t kv_unit = 4;
  float scale = 1.0f;
  double scale_f64 = 1.0;
  bool zero_copy = false;

  // out's and d_out's grid: q's tokens and heads, dim_v wide.
  HeadsGrid out_grid() const {
    HeadsGrid g = qg;
    g.dim = dim_v;
    return g;
  }
  // Bytes from the first to the last byte + 1 of a row of kg or vg (prefetch extents).
  std::int64_t kv_row_bytes(const HeadsGrid& g) const {
    return cache_format ? cache_row_bytes(*cache_format, g.dim) : ((g.dim - 1) * g.dim_stride + 1) * kv_unit;
  }
};

// The smallest and largest query and key positions of a call.
struct PositionRange {
  std::int64_t q_min = 0, q_max = 0, k_min = 0, k_max = 0;
};

// The sequences and their positions, and the query/key transform tables indexed by them
// (plan_sequences, plan_positions, plan_transform_tables).
struct PositionTables {
  std::vector<Sequence> sequences;
  // Positions: explicit (spec) or the defaults, owned here.
  std::vector<std::int64_t> default_q_ids, default_k_ids;
  std::int64_t position_max = 0;  // over queries and keys (RoPE's default seq_len is this + 1)
  std::optional<Positions> q_positions, k_positions;
  PositionRange position_range;
  // Per group: transform tables; per head: its group.
  std::vector<QKTables> tables;
  std::vector<std::int64_t> head_group, group_first_head;
  // Table rows by position (from table_position_min) or, with per-token positions too wide to
  // tabulate, by token (q's, then k's).
  bool tables_by_position = true;
  std::int64_t table_position_min = 0;

  std::int64_t q_position(const Sequence& seq, std::int64_t i) const { return q_positions->at(seq.b, seq.q0 + i); }
  std::int64_t k_position(const Sequence& seq, std::int64_t j) const { return k_positions->at(seq.b, seq.k0 + j); }
  const QKTables& tables_of_head(std::int64_t h) const {
    return tables[static_cast<std::size_t>(head_group[static_cast<std::size_t>(h)])];
  }
};

// The heads' score biases: tables over δ = q − k or evaluators, their running maxima, and where
// their gradients go (plan_bias_tables).
struct BiasTables {
  std::vector<HeadBias> head_bias;
  std::vector<TableFloats> bias_tables;  // per group: [heads][width]
  // Every head's table transposed, [width][heads], when every head is tabulated and each
  // sequence has one query: decode's merged rows (lane r = head r) then add a key's biases as
  // one contiguous row (add_bias) instead of lane by lane.
  TableFloats bias_by_delta;
  // Running maxima of each tabulated head's table, per group [heads][max_from | max_to][width]:
  // max_from[t] = max b over [t, width), max_to[t] over [0, t]; so min(max_from[a], max_to[b])
  // bounds b over [a, b] (tight for tables monotone on either side of δ = 0, as ALiBi's). For the
  // far-tile skip (skip_far_tiles), which decode does not take: built by the first pass that can
  // skip (build_tile_maxima), not by the plan, so that a decode step does not pay for them.
  mutable std::vector<TableFloats> bias_table_max;
  mutable std::once_flag tile_maxima_once;
  std::vector<std::unique_ptr<BiasEvaluator>> evaluators;
  bool any_bias = false, any_trainable_bias = false;
  std::int64_t delta_min = 0, hist_width = 0;  // the δ range of the bias tables and histograms
  std::vector<std::int64_t> grad_offset;       // per group, into the flat unit gradients
};

// How the passes walk the call: block and tile sizes, and the order of forward's key tiles
// (plan_far_tiles).
struct PassPlan {
  std::int64_t query_block = 64, key_tile = 64;
  // Backward's key tiles are larger: every tile streams all of the unit's query-side rows (Q, dO,
  // dQ, …: 5 MiB for 2048 queries of D 128, beyond L2), so fewer tiles move fewer bytes. Measured
  // at S 2048, H 8, D 128, causal, 2 threads, alternating runs: no bias 0.45 / 0.57 / 0.61 of the
  // FMA peak with 128 keys against 0.39 / 0.38 / 0.56 with 64.
  std::int64_t backward_key_tile = 128;
  // Forward skips a key tile when no probability in it can reach FLT_MIN (each would be flushed to
  // 0, so skipping it changes no bit): scale·|q|·max|k| + the tile's largest bias < m − 89 for
  // every row, m the row's running max. With ALiBi that drops a head's keys beyond about 100 /
  // slope. far_tiles_first: plans whose biases are tables that reach below −100 and that have no
  // soft-cap, Shaw, XL or TUPE terms, and whose key transform, if any, is a rotation (norms
  // kept); their key tiles run from the diagonal down, so that m is known early, and with
  // skip_far_tiles (the spec's skip_vanishing_tiles) the vanishing ones are skipped.
  bool far_tiles_first = false, skip_far_tiles = false;
  // Forward runs a KV head's tiles from the diagonal down (and tries the skip) only where every
  // query head of it has such a table: a head whose bias decays slowly (Kerple, T5, no bias) never
  // lets its block's rows all vanish, and summing its largest terms into O first would cost
  // accuracy — at 4096 causal keys a Kerple head sharing a call with ALiBi would lose 3.6× the
  // naive f32 error (tests AccurateAtFourThousandTokens).
  std::vector<char> far_first_kv;
};

// The plan: the spec it was built from, its parts, its score terms, and the passes over them.
struct AttentionPlan : CallGeometry, PositionTables, BiasTables, PassPlan {
  static constexpr const char* kWhere = "Attention";
  // Entries at most in one bias table (beyond: evaluated per element).
  static constexpr std::int64_t kMaxBiasTable = std::int64_t{1} << 24;
  static constexpr std::int64_t kDecodeRows = 8;  // rows (queries × G) at most for dot-product scores
  static constexpr std::int64_t kDecodeTileBytes = std::int64_t{256} << 10;  // see decode_tiles
  // Bytes of one key's rows over every KV head, as decode's tile and chunk sizes count them: in
  // f32 whatever the cache's dtype, so that a 16-bit cache runs the tiles and chunks of the f32
  // cache of its values and gives its bits.
  std::int64_t decode_key_row_bytes() const {
    return std::max<std::int64_t>(kv_heads * dim, 1) * std::int64_t{sizeof(float)};
  }
  // A decode block's cache splits into chunks of about kDecodeChunkBytes of keys and values (at
  // least kDecodeMinChunkKeys keys) that run in parallel: a rule on the shapes only, so the merge
  // order and every bit are the same for any thread count. 4 MiB keeps mid-size caches parallel:
  // at 8 KV heads, 8192 keys take 1.7–1.8 ms against 3.6 on one thread, and 1024 keys 0.14 ms
  // against 0.24 as one (8 MiB) chunk. The serial merge costs O(chunks · rows · D).
  static constexpr std::int64_t kDecodeChunkBytes = std::int64_t{4} << 20;
  static constexpr std::int64_t kDecodeMinChunkKeys = 64;
  // At most this many chunks per sequence (longer chunks beyond): each chunk's first tile has no
  // earlier tile to prefetch it. At 32768 keys of 8 KV heads in f32, alternating with 8 chunks:
  // 64 chunks 10.1–13.2 ms against 9.7–10.5, 32 chunks 9.5–11.2 against 10.0–11.1 (within noise).
  static constexpr std::int64_t kDecodeMaxChunks = 32;

  explicit AttentionPlan(AttentionSpec spec);

  // The constructor's steps, in order (attention_plan.cpp).
  using PositionRange = detail::PositionRange;
  void check_views();
  void check_cache();
  void check_mask();
  void plan_sequences();
  void check_f32_multipliers(const PositionRange& range) const;
  PositionRange plan_positions();
  std::vector<HeadGroup> plan_head_groups();
  void plan_transform_tables(const std::vector<HeadGroup>& groups, const PositionRange& range);
  float plan_bias_tables(const std::vector<HeadGroup>& groups, const PositionRange& range);
  // bias_table_max, once (thread-safe); before a pass's threads start.
  void build_tile_maxima() const;
  // Head h's running maxima (bias_table_max), or nullptr before build_tile_maxima or for a head
  // without a table.
  const float* tile_maxima(const HeadBias& hb) const {
    if (hb.kind != HeadBias::kTable || static_cast<std::size_t>(hb.group) >= bias_table_max.size()) return nullptr;
    const TableFloats& m = bias_table_max[static_cast<std::size_t>(hb.group)];
    return m.empty() ? nullptr : m.data() + 2 * hb.local_head * hb.width;
  }
  void plan_far_tiles(float lowest_table_bias);
  // A group with a RowNormaliser: it is the call's only group and the call one it can run.
  bool check_normaliser();

  AttentionSpec spec;
  // The spec's RowNormaliser, which runs the whole call, or null.
  const RowNormaliser* normaliser = nullptr;
  // Row (b, s, h) of the keys or values as f32, zero-padded to dim_padded (dequantised from a
  // quantized cache).
  void load_key_row(std::int64_t b, std::int64_t s, std::int64_t h, float* out) const {
    load_kv_row(k_data, kg, b, s, h, out);
  }
  void load_value_row(std::int64_t b, std::int64_t s, std::int64_t h, float* out) const {
    load_kv_row(v_data, vg, b, s, h, out);
  }
  void load_kv_row(const void* base, const HeadsGrid& g, std::int64_t b, std::int64_t s, std::int64_t h,
                   float* out) const;
  // row[0..dim) times the spec's temperature of a query at `position` (rounded once to f32); a
  // call without one leaves the row as it is.
  void temper_row(float* row, std::int64_t position) const {
    if (!spec.temperature) return;
    const auto f = static_cast<float>(spec.temperature->factor(position));
    for (std::int64_t t = 0; t < dim; ++t) row[t] *= f;
  }
  // mask.chunk_size: the keys [lo, hi) of seq in the chunk of a query at q_position.
  std::pair<std::int64_t, std::int64_t> chunk_keys(const Sequence& seq, std::int64_t q_position) const;
  // The keys [lo, hi) query i of seq sees under the mask (window, causal, chunk); lo == hi: none.
  std::pair<std::int64_t, std::int64_t> visible_keys(const Sequence& seq, std::int64_t i) const;

  // Rows of the transform tables of query i / key j of seq.
  std::int64_t q_table_row(const Sequence& seq, std::int64_t i) const {
    return tables_by_position ? q_position(seq, i) - table_position_min : (seq.b * q_len + seq.q0 + i);
  }
  std::int64_t k_table_row(const Sequence& seq, std::int64_t j) const {
    return tables_by_position ? k_position(seq, j) - table_position_min : (batch * q_len + seq.b * k_len + seq.k0 + j);
  }

  // The query-dependent and per-token score terms (score_term.hpp), in the order they add.
  std::vector<std::unique_ptr<ScoreTerm>> terms;
  void plan_terms(const std::vector<HeadGroup>& groups);
  bool decode_merges_heads() const;

  std::int64_t table_bytes() const;

  AttentionStats forward(TensorView out, TensorView lse) const;
  AttentionStats backward(ConstTensorView out, ConstTensorView lse, ConstTensorView d_out, TensorView dq, TensorView dk,
                          TensorView dv, AttentionGradients* grads) const;
  // backward's checks of its arguments, and what its units share (dq, dk, dv point at the views).
  struct BackwardCall;
  BackwardCall check_backward(ConstTensorView out, ConstTensorView lse, ConstTensorView d_out, TensorView& dq,
                              TensorView& dk, TensorView& dv, AttentionGradients* grads) const;
  AttentionGradients zero_gradients() const;

  // Engine pieces (attention.cpp).
  void transform_row(const QKTables& t, bool is_q, std::int64_t table_row, float* x, float sine_sign) const;
  void load_row(const void* base, const HeadsGrid& g, std::int64_t b, std::int64_t s, std::int64_t h, float* out) const;
  // Keys [k_first, k_first + keys) of a sequence, every KV head of `base`, as rows to prefetch
  // (kernels::RowPrefetch); an empty plan when keys <= 0 or the dim stride is not 1.
  kernels::RowPrefetch rows_ahead(const void* base, const HeadsGrid& g, const Sequence& seq, std::int64_t k_first,
                                  std::int64_t keys) const;
  void load_row_as(ConstTensorView view, const HeadsGrid& g, std::int64_t b, std::int64_t s, std::int64_t h,
                   float* out) const {
    load_row(view.data(), g, b, s, h, out);
  }
  void store_row(const float* row, void* base, const HeadsGrid& g, std::int64_t b, std::int64_t s, std::int64_t h,
                 bool accumulate) const;
  void store_row_to(const float* row, TensorView& view, const HeadsGrid& g, std::int64_t b, std::int64_t s,
                    std::int64_t h) const {
    store_row(row, view.data(), g, b, s, h, true);
  }
  void layout_rows(const Sequence& seq, std::int64_t kvh, std::int64_t i0, std::int64_t count, bool compact,
                   RowBlock& rb) const;
  void layout_decode_rows(const Sequence& seq, std::int64_t i0, std::int64_t count, RowBlock& scratch,
                          RowBlock& rb) const;
  static void summarize_rows(const Sequence& seq, RowBlock& rb);
  void decode_tiles(const Sequence& seq, std::int64_t k_begin, std::int64_t k_end, std::span<const RowBlock> rows,
                    std::span<AttentionUnitScratch> blocks_scratch, AttentionUnitScratch& s) const;
  bool tile_unmasked(const RowBlock& rb, std::int64_t k_first, std::int64_t keys) const;
  void add_bias(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, float* st) const;
  // What every unit of one backward call shares: the tensors and their grids (dq, dk, dv null when
  // not wanted).
  struct BackwardCall {
    ConstTensorView out, lse, d_out;
    HeadsGrid og, dog;
    TensorView *dq = nullptr, *dk = nullptr, *dv = nullptr;
    HeadsGrid dqg, dkg, dvg;
    bool rows_outer = false;   // some term walks row blocks outer (ScoreTerm::rows_outer)
    bool native_bf16 = false;  // the products on bf16 dot products (AttentionSpec::bf16_products)
  };
  // One unit: queries [i0, i0 + count) of a sequence's KV head, its slots for the parameter
  // gradients (null: not wanted), and for a split unit its dK, dV rows of keys [part_key_lo,
  // part_key_hi) (kv_part null: stored directly).
  struct BackwardUnit {
    const Sequence* seq = nullptr;
    std::int64_t kvh = 0, i0 = 0, count = 0;
    double* bias_grads = nullptr;
    std::vector<double*> term_grads;  // per term, its slot (null: not wanted)
    float* kv_part = nullptr;
    std::int64_t part_key_lo = 0, part_key_hi = 0;
  };
  void backward_unit(const BackwardCall& call, const BackwardUnit& unit, AttentionUnitScratch& s, RowBlock& rb) const;

  // Every output disjoint from every input and from the other outputs (empty views skipped):
  // attention reads its inputs after it has started writing (+= for the gradients).
  using NamedView = std::pair<const char*, ConstTensorView>;
  void check_disjoint(std::initializer_list<NamedView> outputs, std::initializer_list<NamedView> inputs) const;

  // lse I/O ([B, H, Sq] or [H, Tq]).
  void check_lse(ConstTensorView lse, bool writable) const;
  void write_lse(TensorView lse, const Sequence& seq, std::int64_t h, std::int64_t i, float value) const;
  float read_lse(ConstTensorView lse, const Sequence& seq, std::int64_t h, std::int64_t i) const;

  // Positional parameter gradients (attention_plan.cpp).
  std::int64_t bias_gradient_size() const;
  void check_gradients(const AttentionGradients& grads) const;
  void accumulate_bias_gradients(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, const float* dst,
                                 AttentionUnitScratch& s, std::int64_t kvh, double* unit_grads) const;
  void finish_bias_gradients(AttentionUnitScratch& s, std::int64_t kvh, double* unit_grads) const;
  void scatter_bias_gradients(const std::vector<double>& total, AttentionGradients& grads) const;
  // d b(h, r)/dθ contributions of `sum` at relative position r = k − q for head h, into the flat
  // gradient vector.
  void add_bias_derivative(std::int64_t h, std::int64_t r, double sum, double* flat) const;
};

}  // namespace posenc::detail

namespace posenc {
struct Attention::Plan : detail::AttentionPlan {
  using AttentionPlan::AttentionPlan;
};
}  // namespace posenc
