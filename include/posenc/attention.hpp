// posenc/attention.hpp — fused attention with a positional scheme inside: forward, backward, decode.
//
// ─── Math ──────────────────────────────────────────────────────────────────────────────────────
// For query token i of head h and key token j of its KV head g(h) = h / (H / G):
//
//   x_ij = scale·s(p_i)·⟨T_q(q_i), T_k(k_j)⟩ + b_h(p_i, p'_j)      the logit (s: the spec's
//                                                                   temperature, else 1)
//   z_ij = c·tanh(x_ij / c)            (with a soft-cap c > 0; else z = x)
//   out_i = Σ_j softmax_j(z_ij + mask_ij)·v_j,   lse_i = log Σ_j exp(z_ij + mask_ij)
//
// T_q, T_k: the group's query/key transform (RoPE from the positions, or Shortformer's absolute
// sinusoid added to q and k but not v), b: the group's score bias (ALiBi, T5, Kerple, FIRE, TUPE;
// bias.hpp), p_i / p'_j the query / key positions; then the group's terms (term.hpp: Shaw's
// relative key and value terms, Transformer-XL's, a forget gate, sinks; HeadGroup, below). Computed flash-style: tiles
// of keys against blocks of queries with an online softmax; no Sq×Sk matrix is ever stored. Workspace per thread is
// O(tile·D) in forward; backward keeps a [G·Sq, D] gradient accumulator per thread as well, and,
// when it splits queries (below), [keys seen, 2·D] of dK, dV per query range.
// Transformer-XL tabulates P(δ) for the δ the mask lets through ([δ span, H·D] floats, like q),
// and its backward keeps that table's gradient per (sequence, KV head), and per thread the
// sequence's keys and values and their gradients ([Sk, 4·D] floats: its row blocks run outer).
//
// ─── Layout ────────────────────────────────────────────────────────────────────────────────────
//   q, dq               [B, Sq, H, D]   (or packed [Tq, H, D] with cu_seqlens_q)
//   out, d_out          [B, Sq, H, Dv]
//   k, dk               [B, Sk, G, D]   (or packed [Tk, G, D] with cu_seqlens_k)
//   v, dv               [B, Sk, G, Dv]  Dv <= D: MLA's value heads (DeepSeek: D 192, Dv 128; absorbed
//                                       decode: D 576 and v the first 512 columns of k's rows — a view)
//   lse                 [B, H, Sq]      (or [H, Tq]) f32, natural log; −inf for a fully masked row
// Any strides (a [B, H, S, D] tensor is a [B, S, H, D] view with permuted strides); q, k, v in
// f32, bf16 or f16 (all three the same), outputs in the same dtype, math in f32. f64 inputs run
// the fp64 reference. k and v may instead be a quantized cache (AttentionSpec::cache, quantized.hpp).
//
//   heads   h:  0 1 2 3 | 4 5 6 7        H = 8, G = 2: heads 0–3 read KV head 0, 4–7 KV head 1
//   groups      [ RoPE  ] [ ALiBi ]      a scheme per head group; a group that transforms q and k
//                                        must cover whole KV groups (the keys are shared)
//
// ─── Masks (by token index, per sequence, bottom-right aligned as flash-attention) ─────────────
// With Lq queries and Lk keys in a sequence (Lk = key_lengths[b] when given), query i sees key j iff
//   j < Lk  and  j >= i + (Lk − Lq) − window_left  (window_left >= 0)  and
//   j <= i + (Lk − Lq) + window_right (window_right >= 0; causal means window_right = 0),
// and, with chunk_size = C (Llama 4's attention_chunk_size), by position: ⌊p'_j / C⌋ = ⌊p_i / C⌋
// (floor division; the key positions must not decrease within a sequence, so that a query's chunk
// is a run of keys). Key tiles outside every row's chunk are never visited (decode included).
// Packed sequences (cu_seqlens) attend only within themselves (block-diagonal).
//
// ─── Positions ─────────────────────────────────────────────────────────────────────────────────
// Default: key j at position j, query i at max(0, Lk − Lq) + i, Lk after key_lengths (a query block
// at the end of its sequence's keys, as in decode from a ragged batch of KV caches); packed
// sequences restart at 0. Explicit Positions override them
// (q_positions over the query grid, k_positions over the key grid; packed: over Tq / Tk tokens).
//
// ─── Backward ──────────────────────────────────────────────────────────────────────────────────
// From out, lse and d_out: dq, dk, dv += their gradients; the positional parameters' gradients
// (ALiBi slopes, T5 table, Kerple r1 r2, FIRE's MLP, c and L, Shaw's tables, XL's u, v, W_R,
// TUPE's table, U^Q, U^K, θ1, θ2, and the HeadGroup::terms' inputs: forget gates, sinks) += into
// AttentionGradients (fp64 sums; the large contractions of XL and TUPE — through W_R, U^Q, U^K
// and the table — are f32 matrix products). Work is split
// by (sequence, KV head) — and, when a call has fewer than 8 of those, by ranges of at least 256
// queries, whose dK, dV are summed per key in range order (not Transformer-XL) — and every sum
// runs in a fixed order that depends on the shapes only: results are bitwise identical for any
// thread count, forward and backward.
// TUPE's projections must have head_dim == D (they meet in the score tiles as a second product).
//
// Decode (few queries, long KV cache): the keys split into fixed chunks (about 4 MiB of keys and
// values each, at most 32 per sequence) that run in parallel and merge by their log-sum-exps in
// chunk order — exact, and independent of the thread count. It is bound by reading the cache,
// which it reads where it lies: f32, bf16 and f16 (widened exactly in registers; half the bytes of
// f32; the same bits as the f32 cache of the same values), q8_0, q4_0 and fp8_e4m3 (dequantised
// in registers, the same way), and an un-rotated cache with RoPE, half-split or interleaved
// (rotated in registers; a quantized one tile by tile in scratch). It
// is fastest with the cache [B, Sk, G, D] (every KV head of a key together) on 2 MiB pages
// (posenc::HugePageBuffer, memory.hpp: at G·D·4 = 4 KiB per key, each head's row otherwise lies
// on its own 4 KiB page).
//
// Errors: posenc::Error naming the parameter for shapes or dtypes that do not match, head counts
// that do not divide, groups that do not tile the heads or split a KV group's transform, window
// < −1, soft-cap < 0 or non-finite, chunk_size < 1 or key positions that decrease with it,
// key_lengths out of [0, Sk], cu_seqlens that do not start at 0, decrease or end elsewhere than the
// token count, positions of the wrong grid, and outputs (out, lse, dq, dk, dv) that share memory
// with an input or with each other.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <variant>
#include <vector>

#include "posenc/absolute.hpp"
#include "posenc/bias.hpp"
#include "posenc/positions.hpp"
#include "posenc/quantized.hpp"
#include "posenc/relative.hpp"
#include "posenc/rotary.hpp"
#include "posenc/temperature.hpp"
#include "posenc/term.hpp"
#include "posenc/tensor.hpp"

namespace posenc {

// RoPE applied inside attention from the tokens' positions.
struct RotaryQK {
  RopeParams params;
  bool keys_rotated = false;  // the K cache already holds rotated keys: only queries are rotated
  std::int64_t seq_len = 0;   // seq_len for dynamic / longrope frequencies (0: max position + 1)
};
// Shortformer's position-infused attention (Press et al. 2021): the sinusoid of the position is
// added to queries and keys (not values) before the dot product. params.dim() == head_dim.
struct AbsoluteQK {
  SinusoidalParams params;
};
// Any other transform of q and k by their positions before the product, in one of the two forms the
// kernels run (pairs rotated by per-position angles, or per-position rows added), given by its
// fp64 definition (scheme.hpp): the open end of QKTransform.
using QKTransformRef = std::shared_ptr<const QKTransformScheme>;

using QKTransform = std::variant<std::monostate, RotaryQK, AbsoluteQK, QKTransformRef>;

struct AttentionSpec;
struct AttentionStats;
struct GroupGradients;

// A normaliser of the rows in place of the softmax, for the schemes whose weights walk each
// query's keys from the nearest leftwards: stick-breaking (stickbreaking.hpp; its row statistic is
// the stick left over, rem) and CoPE (cope.hpp: a softmax whose positions count gates; its
// statistic is the log-sum-exp). The registry's "stickbreaking" and "cope" make them. Attention
// hands the whole call to it: its group is the call's only one, with no transform, bias or terms,
// and the call is causal (or has one query per sequence) with no window, chunks, soft-cap,
// temperature or quantized cache, and positions, if given, in the tokens' order (query i of a
// sequence is its key token Lk − Lq + i, as by default).
class RowNormaliser {
 public:
  virtual ~RowNormaliser() = default;
  virtual std::string_view name() const = 0;
  // The size of GroupGradients::normaliser: its learned parameters (CoPE: the position table).
  virtual std::int64_t gradient_size() const { return 0; }
  // What Attention's constructor asks once it has checked its own part: whether the normaliser
  // takes this call (posenc::Error naming what it refuses).
  virtual void check(const AttentionSpec& spec) const = 0;
  // Attention::forward and backward of a validated spec (stat: their lse argument, [B, H, Sq] f32
  // or [H, Tq], or empty; d_stat its gradient, or empty), on the fused kernels or (`reference`)
  // the fp64 definition. A normaliser whose statistic takes no gradient refuses a d_stat by name.
  virtual AttentionStats forward(const AttentionSpec& spec, TensorView out, TensorView stat, bool reference) const = 0;
  virtual AttentionStats backward(const AttentionSpec& spec, ConstTensorView out, ConstTensorView stat,
                                  ConstTensorView d_stat, ConstTensorView d_out, TensorView dq, TensorView dk,
                                  TensorView dv, GroupGradients* grads, bool reference) const = 0;
};
using RowNormaliserRef = std::shared_ptr<const RowNormaliser>;

// The sizes of a validated call of an attention object with an engine of its own (CopeAttention,
// StickBreakingAttention), as Attention's accessors name them.
class AttentionSizes {
 public:
  struct Sizes {
    std::int64_t batch = 0, heads = 0, kv_heads = 0, head_dim = 0, value_dim = 0, q_len = 0, k_len = 0;
    double scale = 0.0;
  };
  std::int64_t batch() const { return sizes_.batch; }
  std::int64_t heads() const { return sizes_.heads; }
  std::int64_t kv_heads() const { return sizes_.kv_heads; }
  std::int64_t head_dim() const { return sizes_.head_dim; }    // D of q and k
  std::int64_t value_dim() const { return sizes_.value_dim; }  // Dv of v, out and d_out
  std::int64_t q_len() const { return sizes_.q_len; }          // Sq (or Tq)
  std::int64_t k_len() const { return sizes_.k_len; }          // Sk (or Tk)
  double scale() const { return sizes_.scale; }                // the resolved scale

 protected:
  void set_sizes(const Sizes& sizes) { sizes_ = sizes; }

 private:
  Sizes sizes_;
};

// A run of consecutive heads sharing a scheme. `bias`, when set, has bias_heads == heads (its
// head 0 is the group's first head). `terms` (term.hpp) add their own parts to the logit after
// the bias, in order, each with heads == the group's heads: Shaw's key and value terms and
// Transformer-XL's (ShawTerm, XlTerm: relative.hpp), a forget gate (ForgetGate, forgetting.hpp),
// sinks (AttentionSinks, sinks.hpp). `normaliser`, when set, replaces the softmax (RowNormaliser).
struct HeadGroup {
  std::int64_t heads = 0;
  QKTransform transform{};
  std::optional<BiasScheme> bias{};
  std::vector<AttentionTermRef> terms{};
  RowNormaliserRef normaliser{};
};

struct AttentionMask {
  bool causal = false;
  std::int64_t window_left = -1;           // −1: unlimited
  std::int64_t window_right = -1;          // −1: unlimited (causal forces 0)
  double softcap = 0.0;                    // 0: none; else z = c·tanh(x/c)
  std::vector<std::int64_t> key_lengths;   // per batch row, valid keys (empty: all); not with packed
  std::optional<std::int64_t> chunk_size;  // C >= 1: only keys of the query's chunk of positions
};

struct AttentionSpec {
  ConstTensorView q, k, v;
  std::vector<HeadGroup> groups;  // empty: no positional scheme on any head (NoPE)
  AttentionMask mask{};
  double scale = 0.0;  // 0: 1/sqrt(D)
  std::optional<Positions> q_positions, k_positions;
  std::vector<std::int64_t> cu_seqlens_q, cu_seqlens_k;  // packed sequences (both or neither)
  // Position-dependent temperature (temperature.hpp): every query row becomes s(p_i)·T_q(q_i)
  // before the terms and the scale.
  std::optional<PositionTemperature> temperature;
  // Forward and backward may skip key tiles whose probabilities all vanish (see
  // AttentionStats). false runs every tile, in the same order, with the same bits for
  // finite inputs (a tile with a non-finite key always runs); only a non-finite value in a
  // vanishing tile's values tells the two apart (it then spreads NaN through 0·∞, as in the
  // unfused composition).
  bool skip_vanishing_tiles = true;
  // Keys and values read from a quantized cache (quantized.hpp: q8_0, q4_0, fp8_e4m3) instead of
  // k and v, which then stay empty: cache.k [B, Sk, G, D] and cache.v [B, Sk, G, Dv], dequantised
  // tile by tile inside the kernels (no f32 copy of the cache). The result is that of k and v
  // holding the dequantised values, to the bit on the fused path. Not with packed sequences;
  // forward only (backward: posenc::Error).
  std::optional<QuantizedCache> cache{};
  // bf16 q, k and v, where bf16_dot_products() (runtime.hpp) holds: the prefill's two products
  // and backward's five run on the host's bf16 dot-product units, each sum over exact products of
  // bf16 pairs in f32, with the scaled and transformed queries, the transformed keys, and P and
  // dS where they enter a product rounded to bf16 (the softmax stays in f32). The error this adds
  // is bounded in docs/attention.md ("Native bf16 products"). false, or other hosts: every product
  // in f32 from the exactly widened inputs. Decode, and backward with Transformer-XL, widen in
  // either case.
  bool bf16_products = true;
};

// Gradients of the groups' positional parameters, fp64, accumulated (+=). One entry per group,
// sized for its scheme (empty vectors where the scheme has no such parameter).
struct GroupGradients {
  // The score bias's parameters, flat in its registered order (bias_parameter_count in bias.hpp;
  // `posenc schemes` lists each layout): ALiBi's slopes [heads], T5's table [buckets·heads],
  // Kerple's [r1 | r2], FIRE's [W1 | B1 | W2 | B2 | c | L], TUPE's [table | U^Q | U^K | θ1 | θ2],
  // a RelativeBiasRef's or PositionBiasRef's θ.
  std::vector<double> bias;
  // Per HeadGroup::terms entry, its gradient_size() values in its layout (ShawTerm: [key table |
  // value table]; XlTerm: [u | v | W_R]; ForgetGate: the gate's elements; sinks: one per head).
  std::vector<std::vector<double>> terms;
  // The row normaliser's parameters (RowNormaliser::gradient_size values; CoPE: its table [npos, D]).
  std::vector<double> normaliser;
};
struct AttentionGradients {
  std::vector<GroupGradients> groups;
};

// What one forward or backward call did, returned by the call (an Attention holds no state that
// a call changes but Transformer-XL's sinusoids, built once by the first backward under a
// std::call_once, so one object serves several threads at once).
struct AttentionStats {
  std::int64_t workspace_bytes = 0;  // scratch the call used, all threads, for memory reports
  // Key tiles of query blocks the forward met (backward: its (key tile, row block) steps), and
  // how many it skipped because no probability in them could reach FLT_MIN: with ALiBi-like
  // biases (a table below −100, no soft-cap, Shaw, XL or TUPE) the tiles run from the diagonal
  // down, and a tile is dropped when scale·|q|·max|k| + its largest bias stays 89 below every
  // row's running max (backward: against each row's lse). Those tiles' probabilities would all
  // be flushed to 0, so for finite inputs the result is the same to the bit. Decode does not
  // skip; decode rows and the fp64 / "ref" path count nothing.
  std::int64_t tiles = 0, skipped = 0;
  // Whether the call ran products on the host's bf16 dot products (AttentionSpec::bf16_products;
  // forward: its prefill blocks).
  bool bf16_products = false;
};

class Attention {
 public:
  // Validates everything once and prepares the positional tables (RoPE coefficients, bias tables).
  explicit Attention(AttentionSpec spec);
  ~Attention();
  Attention(Attention&&) noexcept;
  Attention& operator=(Attention&&) noexcept;

  std::int64_t batch() const;
  std::int64_t q_len() const;  // Sq (or Tq)
  std::int64_t k_len() const;  // Sk (or Tk)
  std::int64_t heads() const;
  std::int64_t kv_heads() const;
  std::int64_t head_dim() const;   // D of q and k
  std::int64_t value_dim() const;  // Dv of v, out, d_out and dv
  const AttentionSpec& spec() const;

  // Zeroed gradients shaped for this attention's groups.
  AttentionGradients zero_gradients() const;

  // out: like q; lse: [B, H, Sq] f32 (or [H, Tq]), or an empty view to skip it (a RowNormaliser writes
  // its own statistic there).
  AttentionStats forward(TensorView out, TensorView lse = {}) const;
  // out and lse from forward; dq, dk, dv (+=) like q, k, v (empty views skip them); grads may be
  // null (then positional gradients are not computed). d_lse, like lse: the gradient of a
  // RowNormaliser's statistic where it takes one (stick-breaking's rem); the softmax's lse takes
  // none here (posenc::Error when given).
  AttentionStats backward(ConstTensorView out, ConstTensorView lse, ConstTensorView d_out, TensorView dq, TensorView dk,
                          TensorView dv, AttentionGradients* grads = nullptr, ConstTensorView d_lse = {}) const;

 private:
  struct Plan;  // the validated, tabulated form the engine runs (src/attention/)
  std::unique_ptr<Plan> plan_;
};

}  // namespace posenc
