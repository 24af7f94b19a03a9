// posenc/rotary.hpp — rotary position embedding (RoPE; Su et al. 2021, RoFormer).
//
// ─── Math ──────────────────────────────────────────────────────────────────────────────────────
// For a head vector x of width D (head_dim) at position p, the first r = rotary_dim entries form
// r/2 pairs (a_i, b_i); pair i turns by the angle θ_i = p·ω_i:
//
//     a'_i = a_i·cos θ_i − b_i·sin θ_i          b'_i = b_i·cos θ_i + a_i·sin θ_i
//
// with ω_i = base^(−2i/r) before scaling (RopeScaling below). Entries r … D−1 pass through
// unchanged (partial rotary; with_rotary_offset moves the rotated entries to offset … offset + r − 1).
// Then <R(m) q, R(n) k> depends on m − n only. An attention factor α
// (yarn, longrope) multiplies cos and sin, as Hugging Face does, so q·k scales by α².
//
// xPos (Sun et al. 2022, "A Length-Extrapolatable Transformer"), when enabled, also scales pair i
// by ζ_i^(+e) in queries and ζ_i^(−e) in keys, ζ_i = (2i + 0.4·r)/(1.4·r), e = (p − c)/scale_base
// (scale_base 512 in the paper): q·k then decays as ζ^((m−n)/scale_base). The centre c cancels in
// q·k; it only keeps ζ^e near 1 (torchscale centres each call's positions on their middle — pass
// that middle as c to match it; with a KV cache, keep one c for the whole sequence).
//
// Directions: forward y = α·S·R(θ)·x; backward (the gradient, i.e. the transpose)
// dx = α·S·R(−θ)·dy — forward with the sine negated; inverse x = R(−θ)·y/(α·S), which undoes
// forward. Without α and xPos (S = 1) backward and inverse coincide.
//
// ─── Layouts (where a pair's two members sit; r = 8 shown, D = 10, "·" passes through) ──────────
//
//   kInterleaved   [a0 b0 a1 b1 a2 b2 a3 b3 · ·]   RoFormer, GPT-J, Meta's original Llama code
//   kHalfSplit     [a0 a1 a2 a3 b0 b1 b2 b3 · ·]   GPT-NeoX, Hugging Face `rotate_half`
//
// ─── Frequencies (Hugging Face transformers' `rope_type` semantics; docs/hf-rope-semantics.md) ──
//   default    ω_i = base^(−2i/r)
//   linear     ω_i / factor                                          (position interpolation)
//   ntk        base' = base·factor^(r/(r−2)), then default            (static NTK-aware)
//   dynamic    base' = base·(factor·L/M − (factor − 1))^(r/(r−2)), L = max(seq_len, M),
//              M = max_position_embeddings; seq_len <= M gives the default frequencies. posenc is
//              stateless: the caller passes seq_len (Hugging Face keeps the largest length seen and
//              resets below M; keys cached under an older base move with rope_rerotate)
//   yarn       blend of ω_i (high frequencies) and ω_i/factor (low) over a linear ramp between
//              the correction dims of beta_fast and beta_slow for M0 = original_max_position_
//              embeddings; α = mscale(factor, mscale)/mscale(factor, mscale_all_dim) when both are
//              set (DeepSeek), else 0.1·ln(factor) + 1, unless attention_factor is given
//   longrope   ω_i / long_factor[i] when seq_len > M0, else ω_i / short_factor[i];
//              α = sqrt(1 + ln(factor)/ln(M0)) (factor = M/M0 unless given), unless given
//   llama3     wavelength 2π/ω_i above M0/low_freq_factor: ω_i/factor; below M0/high_freq_factor:
//              ω_i; between: a smooth blend (none when the two factors are equal, as in Llama 4)
//   proportional  (Gemma 4's p-RoPE; transformers' _compute_proportional_rope_parameters) the first
//              k = ⌊partial_rotary_factor·r/2⌋ pairs turn with ω_i = base^(−2i/r)/factor, the
//              others have ω_i = 0 (they pass unchanged). r spans the whole head (Hugging Face sets
//              rotary_dim = head_dim), so a half-split pair is (x_i, x_{i+D/2}) — unlike partial
//              rotary, whose r = D·partial_rotary_factor gives ω_i = base^(−2i/r) and pairs (x_i, x_{i+r/2})
// Per-dim frequency factors (llama.cpp's freq_factors) divide ω_i after the scaling.
// All of this is computed in fp64 (Hugging Face computes in fp32: its ω differ from posenc's by
// up to an fp32 ulp or two; posenc's are the more exact ones).
//
// ─── Views, positions, dtypes ──────────────────────────────────────────────────────────────────
// q and k are [B, S, H, D] or packed [T, H, D] views with any non-negative strides, so
// [B, H, S, D] memory is passed as a [B, S, H, D] view with permuted strides — no copy. q and k
// may have different head counts (GQA/MQA); k may be an empty view (then only q is rotated). Positions
// are per token (positions.hpp). f32, bf16 and f16 compute in f32; f64 runs the fp64 reference.
//
// ─── Numerics ──────────────────────────────────────────────────────────────────────────────────
// cos θ and sin θ are computed from the fp64 angle p·ω_i with an exact reduction (as the
// sinusoidal encoding), then rounded to f32: within 2^-25 + p·2^-52 of the true values, so the
// relative-position property survives to p = 2^24 and beyond, where fp32 angles lose it. The
// rotation itself is f32 (one multiply and one fused multiply-add per output).
//
// Errors: posenc::Error for odd rotary_dim, rotary_dim > head_dim, base <= 1, factor < 1 where
// the type needs >= 1, beta_fast < beta_slow, factor lists of the wrong length, shape or dtype
// mismatches, and positions out of range.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "posenc/positions.hpp"
#include "posenc/tensor.hpp"

namespace posenc {

enum class RopeLayout : std::uint8_t {
  kInterleaved,  // pairs (x[2i], x[2i+1])
  kHalfSplit,    // pairs (x[i], x[i + r/2])
};

enum class RopeType : std::uint8_t { kDefault, kLinear, kNtk, kDynamic, kYarn, kLongRope, kLlama3, kProportional };

// "default", "linear", "ntk", "dynamic", "yarn", "longrope", "llama3", "proportional" (Hugging
// Face's names).
std::string_view rope_type_name(RopeType type) noexcept;
// Throws posenc::Error naming the unknown type and the known ones.
RopeType rope_type_from_name(std::string_view name);

struct RopeScaling {
  RopeType type = RopeType::kDefault;
  double factor = 1.0;
  // M0, the pre-training context (yarn, longrope, llama3); 0 means max_position_embeddings.
  std::int64_t original_max_position_embeddings = 0;
  // yarn
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 0.0;          // 0: unset
  double mscale_all_dim = 0.0;  // 0: unset
  bool truncate = true;         // floor/ceil the correction range
  // α: NaN means "derive it" (yarn, longrope; 1 for the others); a number sets it for any type.
  // Set or derived, α must lie in [2^-126, 2^126]: the kernels scale by α and 1/α in f32.
  double attention_factor = std::numeric_limits<double>::quiet_NaN();
  // llama3
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  // longrope: r/2 factors each
  std::vector<double> short_factor, long_factor;
  // proportional: the share of the r/2 pairs that turn, in [0, 1]
  double partial_rotary_factor = 1.0;
};

// Validated at construction: throws posenc::Error naming the field.
class RopeParams {
 public:
  RopeParams(std::int64_t head_dim, std::int64_t rotary_dim, double base = 10000.0,
             RopeLayout layout = RopeLayout::kHalfSplit, RopeScaling scaling = {},
             std::int64_t max_position_embeddings = 2048, std::vector<double> freq_factors = {});

  std::int64_t head_dim() const { return head_dim_; }
  std::int64_t rotary_dim() const { return rotary_dim_; }
  double base() const { return base_; }
  RopeLayout layout() const { return layout_; }
  const RopeScaling& scaling() const { return scaling_; }
  std::int64_t max_position_embeddings() const { return max_position_embeddings_; }
  const std::vector<double>& freq_factors() const { return freq_factors_; }
  // M0: original_max_position_embeddings, or max_position_embeddings when that is 0.
  std::int64_t original_max_position_embeddings() const;

  // ω_i, i < rotary_dim/2, in fp64, for a sequence of `seq_len` tokens (dynamic and longrope
  // depend on it; 0 means "at initialisation": default frequencies for dynamic, short factors
  // for longrope).
  std::vector<double> inv_frequencies(std::int64_t seq_len = 0) const;
  // α, the factor that multiplies cos and sin.
  double attention_factor() const;

  // A copy whose rotated entries start at `offset` of the head: entries offset … offset + r − 1
  // hold the pairs (in the layout's order), the others pass unchanged. MLA (DeepSeek-V2/V3, Kimi
  // K2) rotates the trailing 64 of 192 dims: RopeParams(192, 64, …).with_rotary_offset(128).
  // 0 <= offset <= head_dim − rotary_dim.
  RopeParams with_rotary_offset(std::int64_t offset) const;
  std::int64_t rotary_offset() const { return rotary_offset_; }

  // A copy with xPos enabled (see above). scale_base > 0 and finite; center finite.
  RopeParams with_xpos(double scale_base = 512.0, double center = 0.0) const;
  bool xpos() const { return xpos_; }
  double xpos_scale_base() const { return xpos_scale_base_; }
  double xpos_center() const { return xpos_center_; }
  // xPos's decay base of rotary pair i, ζ_i = (2i + 0.4·r)/(1.4·r) with r = rotary_dim, and the
  // exponent of a position, e = (p − center)/scale_base: q is scaled by ζ_i^e, k by ζ_i^(−e).
  double xpos_zeta(std::int64_t pair) const {
    const auto r = static_cast<double>(rotary_dim());
    return (2.0 * static_cast<double>(pair) + 0.4 * r) / (1.4 * r);
  }
  double xpos_exponent(double position) const { return (position - xpos_center_) / xpos_scale_base_; }

 private:
  std::int64_t head_dim_;
  std::int64_t rotary_dim_;
  double base_;
  RopeLayout layout_;
  RopeScaling scaling_;
  std::int64_t max_position_embeddings_;
  std::vector<double> freq_factors_;
  std::int64_t rotary_offset_ = 0;
  bool xpos_ = false;
  double xpos_scale_base_ = 512.0;
  double xpos_center_ = 0.0;
};

// The RoPE fields of a Hugging Face config.json, as plain values (the JSON itself is parsed by
// the caller: the CLI, or Python). `rope_scaling` and the newer `rope_parameters` carry the same
// keys; a `rope_theta` inside them wins over the top-level one. Unset numbers are NaN (or 0 for
// integers), unset lists empty.
struct HfRopeConfig {
  std::string rope_type = "default";  // rope_type, or the legacy "type"; "su" means longrope
  double rope_theta = 10000.0;
  std::int64_t hidden_size = 0;
  std::int64_t num_attention_heads = 0;
  std::int64_t head_dim = 0;  // 0: hidden_size / num_attention_heads
  double partial_rotary_factor = 1.0;
  std::int64_t max_position_embeddings = 2048;
  // Phi-3 keeps original_max_position_embeddings at the top level; it then sets M0 (and, for
  // longrope without an explicit factor, factor = max_position_embeddings / M0).
  std::int64_t top_level_original_max_position_embeddings = 0;
  // Inside rope_scaling / rope_parameters:
  std::int64_t original_max_position_embeddings = 0;
  double factor = std::numeric_limits<double>::quiet_NaN();
  double beta_fast = std::numeric_limits<double>::quiet_NaN();
  double beta_slow = std::numeric_limits<double>::quiet_NaN();
  double mscale = 0.0;
  double mscale_all_dim = 0.0;
  bool truncate = true;
  double attention_factor = std::numeric_limits<double>::quiet_NaN();
  double low_freq_factor = std::numeric_limits<double>::quiet_NaN();
  double high_freq_factor = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> short_factor, long_factor;
  // The layer's type when the config varies by layer ("sliding_attention", "full_attention"), else empty.
  std::string layer_type;
  // MLA (DeepSeek-V2/V3, Kimi K2): qk_nope_head_dim + qk_rope_head_dim, the query/key head size
  // (head_dim is then qk_rope_head_dim, the rotated part); 0 otherwise.
  std::int64_t qk_head_dim = 0;
  // M-RoPE (Qwen2-VL, Qwen3-VL): rope_scaling's mrope_section (pairs per time, height, width axis)
  // and mrope_interleaved (Qwen3-VL: MropeLayout::kInterleaved); empty and false otherwise.
  std::vector<std::int64_t> mrope_section;
  bool mrope_interleaved = false;
};

// DeepSeek's softmax scale for an MLA config (transformers' DeepseekV3Attention):
// qk_head_dim^−½ · mscale(factor, mscale_all_dim)², mscale(s, m) = 0.1·m·ln s + 1 for s > 1 (else
// 1), the square applying only to yarn with mscale_all_dim set. DeepSeek-V3: 192^−½·(0.1·ln 40 + 1)².
// Throws posenc::Error unless the config is MLA's (qk_head_dim > 0).
double mla_softmax_scale(const HfRopeConfig& config);

// RopeParams as Hugging Face transformers builds them from such a config: head_dim =
// config.head_dim or hidden_size / num_attention_heads, rotary_dim = int(head_dim ·
// partial_rotary_factor) (proportional: head_dim, partial_rotary_factor choosing the pairs that
// turn), defaults beta_fast 32, beta_slow 1, low/high_freq_factor required for llama3, factor
// required where the type needs one. The layout is Hugging Face's rotate_half (half-split) unless
// given. Throws posenc::Error naming the missing or invalid key.
RopeParams rope_params_from_hf(const HfRopeConfig& config, RopeLayout layout = RopeLayout::kHalfSplit);

// A config.json's text (or any JSON object with its keys; a multimodal config's text_config is
// read) as HfRopeConfig for `layer`. Per-layer RoPE, as transformers reads it:
//   - v5's rope_parameters keyed by layer type ({"sliding_attention": {...}, "full_attention":
//     {...}}) with `layer_types` naming each layer's type: the layer's entry (a top-level
//     partial_rotary_factor unless the entry has its own);
//   - Gemma 3's older form: rope_scaling (and rope_theta) for the full layers, default RoPE at
//     rope_local_base_freq for the sliding ones, layer i full when (i + 1) % sliding_window_pattern
//     == 0 unless layer_types says otherwise (Gemma3TextConfig's defaults for the keys its configs
//     omit: rope_theta 1e6, rope_local_base_freq 1e4, pattern 6, head_dim 256);
//   - Gemma 4's full layers use global_head_dim when the config has it.
// Without per-layer keys every layer is the same and `layer` is only range-checked. Throws
// posenc::Error naming the key: a per-layer config without a layer, a layer type with no entry,
// an entry for a type layer_types does not name, layer_types of the wrong length, a layer out of
// range, keys of the wrong kind, integers out of range.
HfRopeConfig hf_rope_config_from_json(std::string_view json, std::optional<std::int64_t> layer = std::nullopt);
RopeParams rope_params_from_hf(std::string_view json, std::optional<std::int64_t> layer = std::nullopt,
                               RopeLayout layout = RopeLayout::kHalfSplit);

enum class RopeDirection : std::uint8_t {
  kForward,   // y = α·S·R(θ)·x
  kBackward,  // dx = α·S·R(−θ)·dy: the gradient of forward
  kInverse,   // x = R(−θ)·y / (α·S): undoes forward
};

// In place: q and k rotated for their tokens' positions. q: [B, S, Hq, D] or [T, Hq, D];
// k: [B, S, Hk, D] or [T, Hk, D] with the same tokens, or an empty view. `seq_len` selects the
// frequencies of dynamic and longrope scaling (0: positions.max_position() + 1).
void rope_apply(const RopeParams& params, const Positions& positions, TensorView q, TensorView k,
                RopeDirection direction = RopeDirection::kForward, std::int64_t seq_len = 0);

// Out of place: q_out = R q, k_out = R k (the entries past rotary_dim copied). Outputs may be the
// inputs themselves (in place) but must not otherwise overlap them.
void rope_apply(const RopeParams& params, const Positions& positions, ConstTensorView q, ConstTensorView k,
                TensorView q_out, TensorView k_out, RopeDirection direction = RopeDirection::kForward,
                std::int64_t seq_len = 0);

// Multi-axis RoPE: the r/2 rotary pairs split into consecutive sections, the pairs of section a
// turning by the positions of axis a. M-RoPE (Qwen2-VL, Wang et al. 2024): sections such as
// [16, 24, 24] pairs for (time, height, width) ids — with equal ids on all axes (text tokens) it
// is plain RoPE. 2-D axial RoPE for images (Heo et al. 2024, "RoPE-Axial"): two sections, (x, y),
// with `restart_frequencies`, so that each axis spans the full frequency range:
// ω^(a)_i = base^(−2i/(2·n_a)) for i < n_a, n_a the section's pairs (the params' scaling must then
// be `default`). Pairs follow the params' layout (a half-split pair i is entries i and i + r/2).
// One Positions per axis, each over the same token grid. xPos is not defined for several axes:
// an error.
void rope_apply_multi(const RopeParams& params, std::span<const std::int64_t> sections,
                      std::span<const Positions> axis_positions, ConstTensorView q, ConstTensorView k, TensorView q_out,
                      TensorView k_out, RopeDirection direction = RopeDirection::kForward,
                      bool restart_frequencies = false, std::int64_t seq_len = 0);

// How M-RoPE's sections (pairs per axis) assign the r/2 rotary pairs to axes (pair i → axis):
//   kSections     consecutive blocks: [0, s0) → axis 0, [s0, s0 + s1) → axis 1, …   (Qwen2-VL)
//   kInterleaved  Qwen3-VL's interleaved M-RoPE (transformers' apply_interleaved_mrope, vLLM's
//                 mrope_interleaved, ggml's GGML_ROPE_TYPE_IMROPE): three axes (t, h, w); pair i
//                 follows h when i % 3 == 1 and i < 3·s_h, w when i % 3 == 2 and i < 3·s_w, else t.
//                 Sections [24, 20, 20]: t 0 3 … 57 60 61 62 63, h 1 4 … 58, w 2 5 … 59.
enum class MropeLayout : std::uint8_t { kSections, kInterleaved };
// The axis of each of the Σ sections pairs. Throws posenc::Error for a section < 1, kInterleaved
// with other than 3 sections, or sections whose interleaving gives an axis another count of pairs.
std::vector<std::int64_t> mrope_axis_of_pair(std::span<const std::int64_t> sections, MropeLayout layout);

// Multi-axis RoPE with any pair → axis map (rope_apply_multi is this with consecutive sections):
// pair i turns by the positions of axis axis_of_pair[i] (r/2 entries, each in [0, axes)), at its
// own frequency ω_i — or, with restart_frequencies, at base^(−2k/(2·n_a)) for the k-th pair of
// axis a (n_a its pairs).
void rope_apply_axes(const RopeParams& params, std::span<const std::int64_t> axis_of_pair,
                     std::span<const Positions> axis_positions, ConstTensorView q, ConstTensorView k, TensorView q_out,
                     TensorView k_out, RopeDirection direction = RopeDirection::kForward,
                     bool restart_frequencies = false, std::int64_t seq_len = 0);

// KV-cache re-rotation: keys rotated under (from, from_positions) become keys rotated under
// (to, to_positions), in one pass — k_out = R_to(p_to) · R_from(p_from)^-1 · k — for a context
// shift (StreamingLLM-style eviction), a dynamic-NTK base change as the sequence grows, or
// LongRoPE's switch from short to long factors. Each side uses its own frequencies (for its
// seq_len, 0: its positions' max + 1), attention factor and xPos. Both must share head_dim,
// rotary_dim and layout. k, k_out: [B, S, H, D] or [T, H, D]; k_out may be k (in place).
// Equals un-rotating and rotating again to within the exactness bound: the combined angle
// θ_to − θ_from is formed from the two exact fp64 (cos, sin) pairs.
void rope_rerotate(const RopeParams& from, const Positions& from_positions, std::int64_t from_seq_len,
                   const RopeParams& to, const Positions& to_positions, std::int64_t to_seq_len, ConstTensorView k,
                   TensorView k_out);

// cos and sin tables [N, r/2] (N = positions.seq_len(), batch() must be 0 or 1), α included:
// one column per frequency, as `posenc table rope` prints them.
void rope_cos_sin(const RopeParams& params, const Positions& positions, TensorView cos, TensorView sin,
                  std::int64_t seq_len = 0);

}  // namespace posenc
