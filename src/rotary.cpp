// Rotary position embedding: parameters and frequencies (Hugging Face semantics, in fp64; see
// docs/hf-rope-semantics.md), and the entry points around the SIMD kernels.
#include "posenc/rotary.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numbers>
#include <string>

#include "absolute_checks.hpp"
#include "internal.hpp"
#include "kernels/common/row_kernels.hpp"
#include "kernels/rotary/rotary_kernels.hpp"
#include "posenc/reference.hpp"
#include "rotary_checks.hpp"

namespace posenc {
namespace {

constexpr const char* kWhere = "rope";

void require(bool ok, const char* param, const std::string& value, const std::string& expected) {
  if (!ok) throw Error(kWhere, param, value, expected);
}

// Hugging Face's yarn_get_mscale: 1 for factor <= 1, else 0.1·m·ln(factor) + 1.
double yarn_mscale(double factor, double m) { return factor <= 1.0 ? 1.0 : 0.1 * m * std::log(factor) + 1.0; }

// The pair index whose wavelength spans M0 / rotations (YaRN, Peng et al. 2023, eq. 19).
double yarn_correction_dim(double rotations, double dim, double base, double m0) {
  return dim * std::log(m0 / (rotations * 2.0 * std::numbers::pi)) / (2.0 * std::log(base));
}

}  // namespace

std::string_view rope_type_name(RopeType type) noexcept {
  switch (type) {
    case RopeType::kDefault:
      return "default";
    case RopeType::kLinear:
      return "linear";
    case RopeType::kNtk:
      return "ntk";
    case RopeType::kDynamic:
      return "dynamic";
    case RopeType::kYarn:
      return "yarn";
    case RopeType::kLongRope:
      return "longrope";
    case RopeType::kLlama3:
      return "llama3";
    case RopeType::kProportional:
      return "proportional";
  }
  return "?";
}

RopeType rope_type_from_name(std::string_view name) {
  for (RopeType t : {RopeType::kDefault, RopeType::kLinear, RopeType::kNtk, RopeType::kDynamic, RopeType::kYarn,
                     RopeType::kLongRope, RopeType::kLlama3, RopeType::kProportional}) {
    if (name == rope_type_name(t)) return t;
  }
  throw Error(kWhere, "rope_type", std::string(name),
              "one of default, linear, ntk, dynamic, yarn, longrope, llama3, proportional");
}

RopeParams::RopeParams(std::int64_t head_dim, std::int64_t rotary_dim, double base, RopeLayout layout,
                       RopeScaling scaling, std::int64_t max_position_embeddings, std::vector<double> freq_factors)
    : head_dim_(head_dim),
      rotary_dim_(rotary_dim),
      base_(base),
      layout_(layout),
      scaling_(std::move(scaling)),
      max_position_embeddings_(max_position_embeddings),
      freq_factors_(std::move(freq_factors)) {
  using detail::to_text;
  require(head_dim >= 2 && head_dim <= (1 << 16), "head_dim", std::to_string(head_dim), "2 to 65536");
  require(rotary_dim >= 2 && rotary_dim % 2 == 0, "rotary_dim", std::to_string(rotary_dim), "an even number >= 2");
  require(rotary_dim <= head_dim, "rotary_dim", std::to_string(rotary_dim),
          "<= head_dim = " + std::to_string(head_dim));
  require(base > 1.0 && std::isfinite(base), "base", to_text(base), "a finite number > 1");
  require(layout == RopeLayout::kInterleaved || layout == RopeLayout::kHalfSplit, "layout",
          std::to_string(static_cast<int>(layout)), "kInterleaved or kHalfSplit");
  require(max_position_embeddings >= 1, "max_position_embeddings", std::to_string(max_position_embeddings), ">= 1");
  const RopeScaling& s = scaling_;
  require(s.original_max_position_embeddings >= 0, "original_max_position_embeddings",
          std::to_string(s.original_max_position_embeddings), ">= 0 (0: max_position_embeddings)");
  const std::size_t pairs = static_cast<std::size_t>(rotary_dim / 2);
  switch (s.type) {
    case RopeType::kDefault:
      break;
    case RopeType::kLinear:
    case RopeType::kNtk:
    case RopeType::kDynamic:
    case RopeType::kYarn:
    case RopeType::kLlama3:
    case RopeType::kProportional:
      require(s.factor >= 1.0 && std::isfinite(s.factor), "factor", to_text(s.factor),
              std::string("a finite number >= 1 for rope_type ") + std::string(rope_type_name(s.type)));
      break;
    case RopeType::kLongRope:
      require(s.factor > 0.0 && std::isfinite(s.factor), "factor", to_text(s.factor), "a finite number > 0");
      require(s.short_factor.size() == pairs, "short_factor.size()", std::to_string(s.short_factor.size()),
              "rotary_dim / 2 = " + std::to_string(pairs));
      require(s.long_factor.size() == pairs, "long_factor.size()", std::to_string(s.long_factor.size()),
              "rotary_dim / 2 = " + std::to_string(pairs));
      for (std::size_t i = 0; i < pairs; ++i) {
        require(s.short_factor[i] > 0 && std::isfinite(s.short_factor[i]), "short_factor[i]",
                to_text(s.short_factor[i]) + " at i = " + std::to_string(i), "a finite number > 0");
        require(s.long_factor[i] > 0 && std::isfinite(s.long_factor[i]), "long_factor[i]",
                to_text(s.long_factor[i]) + " at i = " + std::to_string(i), "a finite number > 0");
      }
      break;
  }
  if (s.type == RopeType::kYarn) {
    require(s.beta_fast >= s.beta_slow, "beta_fast", to_text(s.beta_fast), ">= beta_slow = " + to_text(s.beta_slow));
    require(s.beta_slow > 0, "beta_slow", to_text(s.beta_slow), "> 0");
  }
  require(s.type != RopeType::kProportional || (s.partial_rotary_factor >= 0 && s.partial_rotary_factor <= 1),
          "partial_rotary_factor", to_text(s.partial_rotary_factor), "in [0, 1] for rope_type proportional");
  if (s.type == RopeType::kLlama3) {
    require(s.low_freq_factor > 0, "low_freq_factor", to_text(s.low_freq_factor), "> 0");
    // Equal factors leave no band to blend (Llama 4 Scout: both 1); transformers only warns there.
    require(s.high_freq_factor >= s.low_freq_factor, "high_freq_factor", to_text(s.high_freq_factor),
            ">= low_freq_factor = " + to_text(s.low_freq_factor));
  }
  require(std::isnan(s.attention_factor) || (s.attention_factor > 0 && std::isfinite(s.attention_factor)),
          "attention_factor", to_text(s.attention_factor), "a finite number > 0, or NaN to derive it");
  require(freq_factors_.empty() || freq_factors_.size() == pairs, "freq_factors.size()",
          std::to_string(freq_factors_.size()), "0 or rotary_dim / 2 = " + std::to_string(pairs));
  for (std::size_t i = 0; i < freq_factors_.size(); ++i) {
    require(freq_factors_[i] > 0 && std::isfinite(freq_factors_[i]), "freq_factors[i]",
            to_text(freq_factors_[i]) + " at i = " + std::to_string(i), "a finite number > 0");
  }
  // The exact angle reduction needs p·ω < 2^51 for every position p <= 2^40: ω < 2^11. Only
  // factors below 1 (longrope lists, freq_factors) can raise ω past 1.
  for (const std::int64_t seq_len : {std::int64_t{0}, std::numeric_limits<std::int64_t>::max()}) {
    for (const double w : inv_frequencies(seq_len)) {
      require(w < 2048.0 && std::isfinite(w), "frequency", to_text(w),
              "< 2^11 (a factor below 2^-11 would push angles past the exact range)");
    }
  }
  // The kernels scale cos and sin by α (and 1/α for the inverse) in f32: both must be normal f32
  // numbers, else every rotated value overflows or flushes and inf·0 makes NaN of finite inputs.
  const double alpha = attention_factor();
  require(alpha >= std::ldexp(1.0, -126) && alpha <= std::ldexp(1.0, 126), "attention_factor()", to_text(alpha),
          "a number in [2^-126, 2^126], normal in f32 with its inverse (check attention_factor, mscale, "
          "mscale_all_dim and original_max_position_embeddings)");
}

std::int64_t RopeParams::original_max_position_embeddings() const {
  return scaling_.original_max_position_embeddings > 0 ? scaling_.original_max_position_embeddings
                                                       : max_position_embeddings_;
}

std::vector<double> RopeParams::inv_frequencies(std::int64_t seq_len) const {
  const RopeScaling& s = scaling_;
  const auto r = static_cast<long double>(rotary_dim_);
  const std::int64_t pairs = rotary_dim_ / 2;
  // ω_i = base'^(−2i/r) in extended precision, rounded once to fp64.
  auto default_frequencies = [&](long double base) {
    std::vector<double> w(static_cast<std::size_t>(pairs));
    for (std::int64_t i = 0; i < pairs; ++i) {
      w[static_cast<std::size_t>(i)] = static_cast<double>(std::pow(base, -2.0L * static_cast<long double>(i) / r));
    }
    return w;
  };
  const auto base = static_cast<long double>(base_);
  const double m = static_cast<double>(max_position_embeddings_);
  const double m0 = static_cast<double>(original_max_position_embeddings());
  std::vector<double> w;
  switch (s.type) {
    case RopeType::kDefault:
      w = default_frequencies(base);
      break;
    case RopeType::kLinear:
      w = default_frequencies(base);
      for (double& x : w) x /= s.factor;
      break;
    case RopeType::kNtk:  // "NTK-aware scaled RoPE" (bloc97, 2023): base·factor^(r/(r−2))
      w = default_frequencies(base * std::pow(static_cast<long double>(s.factor), r / (r - 2)));
      break;
    case RopeType::kDynamic: {
      // Hugging Face's dynamic NTK: L = max(seq_len, M); at L = M the base is unchanged.
      const long double l = static_cast<long double>(std::max<double>(static_cast<double>(seq_len), m));
      const long double f = s.factor;
      const long double scaled = f * l / static_cast<long double>(m) - (f - 1.0L);
      w = default_frequencies(base * std::pow(scaled, r / (r - 2)));
      break;
    }
    case RopeType::kYarn: {
      const std::vector<double> extrapolation = default_frequencies(base);
      double low = yarn_correction_dim(s.beta_fast, static_cast<double>(rotary_dim_), base_, m0);
      double high = yarn_correction_dim(s.beta_slow, static_cast<double>(rotary_dim_), base_, m0);
      if (s.truncate) {
        low = std::floor(low);
        high = std::ceil(high);
      }
      low = std::max(low, 0.0);
      high = std::min(high, static_cast<double>(rotary_dim_ - 1));
      if (low == high) high += 0.001;  // Hugging Face's guard against a zero-width ramp
      w.resize(extrapolation.size());
      for (std::size_t i = 0; i < w.size(); ++i) {
        const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
        const double extrapolate = 1.0 - ramp;  // weight of the unscaled frequency
        w[i] = extrapolation[i] / s.factor * ramp + extrapolation[i] * extrapolate;
      }
      break;
    }
    case RopeType::kLongRope: {
      w = default_frequencies(base);
      const bool use_long = seq_len > original_max_position_embeddings();
      const std::vector<double>& factors = use_long ? s.long_factor : s.short_factor;
      for (std::size_t i = 0; i < w.size(); ++i) w[i] /= factors[i];
      break;
    }
    case RopeType::kLlama3: {
      // Llama 3.1 (Meta, 2024): wavelengths above M0/low_freq_factor are scaled by 1/factor, below
      // M0/high_freq_factor kept, in between blended by the position of M0/wavelength.
      w = default_frequencies(base);
      const double low_wavelength = m0 / s.low_freq_factor;
      const double high_wavelength = m0 / s.high_freq_factor;
      for (double& x : w) {
        const double wavelength = 2.0 * std::numbers::pi / x;
        if (wavelength > low_wavelength) {
          x /= s.factor;
        } else if (wavelength >= high_wavelength && s.high_freq_factor > s.low_freq_factor) {  // inclusive band
          const double smooth = (m0 / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
          x = (1.0 - smooth) * x / s.factor + smooth * x;
        }
      }
      break;
    }
    case RopeType::kProportional: {
      // Pairs past ⌊p·r/2⌋ do not turn (transformers: int(partial_rotary_factor * head_dim // 2)).
      w = default_frequencies(base);
      const double turning = std::floor(s.partial_rotary_factor * static_cast<double>(rotary_dim_) / 2.0);
      for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<double>(i) < turning ? w[i] / s.factor : 0.0;
      break;
    }
  }
  for (std::size_t i = 0; i < freq_factors_.size(); ++i) w[i] /= freq_factors_[i];
  return w;
}

double RopeParams::attention_factor() const {
  const RopeScaling& s = scaling_;
  if (!std::isnan(s.attention_factor)) return s.attention_factor;
  if (s.type == RopeType::kYarn) {
    if (s.mscale != 0.0 && s.mscale_all_dim != 0.0) {
      return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim);
    }
    return yarn_mscale(s.factor, 1.0);
  }
  if (s.type == RopeType::kLongRope) {
    const double m0 = static_cast<double>(original_max_position_embeddings());
    return s.factor <= 1.0 ? 1.0 : std::sqrt(1.0 + std::log(s.factor) / std::log(m0));
  }
  return 1.0;
}

RopeParams rope_params_from_hf(const HfRopeConfig& c, RopeLayout layout) {
  const char* where = "rope_params_from_hf";
  using detail::to_text;
  std::int64_t head_dim = c.head_dim;
  if (head_dim <= 0) {
    if (c.hidden_size <= 0 || c.num_attention_heads <= 0) {
      throw Error(where, "head_dim", "missing", "head_dim, or hidden_size and num_attention_heads");
    }
    head_dim = c.hidden_size / c.num_attention_heads;
  }
  if (!(c.partial_rotary_factor > 0.0 && c.partial_rotary_factor <= 1.0)) {
    throw Error(where, "partial_rotary_factor", to_text(c.partial_rotary_factor), "a number in (0, 1]");
  }
  RopeScaling s;
  // Legacy names Hugging Face renames: Phi-3's "su" is longrope; Qwen2-VL's "mrope" is default
  // frequencies (its sections are a property of the call: rope_apply_multi).
  s.type = rope_type_from_name(c.rope_type == "su" ? "longrope" : c.rope_type == "mrope" ? "default" : c.rope_type);
  // Hugging Face: int(head_dim * partial_rotary_factor), the float product truncated; proportional
  // spreads its frequencies over the whole head and turns only a share of the pairs.
  const bool proportional = s.type == RopeType::kProportional;
  const auto rotary_dim =
      proportional ? head_dim : static_cast<std::int64_t>(static_cast<double>(head_dim) * c.partial_rotary_factor);
  if (proportional) s.partial_rotary_factor = c.partial_rotary_factor;
  const bool needs_factor = s.type != RopeType::kDefault && s.type != RopeType::kLongRope && !proportional;
  if (needs_factor && std::isnan(c.factor)) {
    throw Error(where, "rope_scaling.factor", "missing", "a number for rope_type " + c.rope_type);
  }
  s.original_max_position_embeddings = c.top_level_original_max_position_embeddings > 0
                                           ? c.top_level_original_max_position_embeddings
                                           : c.original_max_position_embeddings;
  s.factor = std::isnan(c.factor) ? 1.0 : c.factor;
  if (s.type == RopeType::kLongRope && std::isnan(c.factor) && s.original_max_position_embeddings > 0) {
    s.factor = static_cast<double>(c.max_position_embeddings) / static_cast<double>(s.original_max_position_embeddings);
  }
  // Hugging Face treats 0 (falsy) like unset for the yarn betas.
  s.beta_fast = std::isnan(c.beta_fast) || c.beta_fast == 0.0 ? 32.0 : c.beta_fast;
  s.beta_slow = std::isnan(c.beta_slow) || c.beta_slow == 0.0 ? 1.0 : c.beta_slow;
  s.mscale = c.mscale;
  s.mscale_all_dim = c.mscale_all_dim;
  s.truncate = c.truncate;
  // Hugging Face reads attention_factor for yarn and longrope only.
  if (s.type == RopeType::kYarn || s.type == RopeType::kLongRope) s.attention_factor = c.attention_factor;
  if (s.type == RopeType::kLlama3) {
    if (std::isnan(c.low_freq_factor) || std::isnan(c.high_freq_factor) || s.original_max_position_embeddings <= 0) {
      throw Error(where, "rope_scaling",
                  "llama3 without low_freq_factor, high_freq_factor or original_max_position_embeddings",
                  "all three (Hugging Face requires them)");
    }
    s.low_freq_factor = c.low_freq_factor;
    s.high_freq_factor = c.high_freq_factor;
  }
  s.short_factor = c.short_factor;
  s.long_factor = c.long_factor;
  // M-RoPE's sections split the rotary pairs among the axes (transformers splits cos and sin by
  // them, and fails when they do not add up).
  if (!c.mrope_section.empty()) {
    std::int64_t pairs = 0;
    std::string text;
    for (const std::int64_t n : c.mrope_section) {
      pairs = n < 0 ? -1 : pairs < 0 ? -1 : checked_add(pairs, n, "mrope_section");
      text += (text.empty() ? "[" : ", ") + std::to_string(n);
    }
    if (pairs != rotary_dim / 2) {
      throw Error(where, "mrope_section", text + "]",
                  "sections >= 0 that sum to rotary_dim / 2 = " + std::to_string(rotary_dim / 2));
    }
  }
  return RopeParams(head_dim, rotary_dim, c.rope_theta, layout, std::move(s), c.max_position_embeddings);
}

RopeParams RopeParams::with_rotary_offset(std::int64_t offset) const {
  require(offset >= 0 && offset <= head_dim_ - rotary_dim_, "rotary_offset", std::to_string(offset),
          "0 to head_dim − rotary_dim = " + std::to_string(head_dim_ - rotary_dim_));
  RopeParams copy = *this;
  copy.rotary_offset_ = offset;
  return copy;
}

RopeParams RopeParams::with_xpos(double scale_base, double center) const {
  require(scale_base > 0 && std::isfinite(scale_base), "xpos scale_base", detail::to_text(scale_base),
          "a finite number > 0");
  require(std::isfinite(center), "xpos center", detail::to_text(center), "a finite number");
  RopeParams copy = *this;
  copy.xpos_ = true;
  copy.xpos_scale_base_ = scale_base;
  copy.xpos_center_ = center;
  return copy;
}

// ─── Application ───────────────────────────────────────────────────────────────────────────────

namespace {

// The kernels' per-call column tables (kernels::RopeColumns), expanded to the layout.
class RopeTables {
 public:
  RopeTables(const RopeParams& params, std::int64_t seq_len, RopeLayout layout, bool negate_sine)
      : RopeTables(params.inv_frequencies(seq_len), params.rotary_dim(), layout, negate_sine) {}

  // From explicit per-pair frequencies w (r/2 of them).
  RopeTables(const std::vector<double>& w, std::int64_t r, RopeLayout layout, bool negate_sine) {
    const std::int64_t half = r / 2;
    const auto stride = static_cast<std::size_t>(r + kernels::kRopePadding);
    values_.assign(5 * stride, 0.0);
    double* freq = values_.data();
    double* step_cos = freq + stride;
    double* step_sin = freq + 2 * stride;
    double* sign = freq + 3 * stride;
    double* pair_freq = freq + 4 * stride;
    for (std::int64_t i = 0; i < half; ++i) pair_freq[i] = w[static_cast<std::size_t>(i)];
    for (std::int64_t j = 0; j < r; ++j) {
      const std::int64_t pair = pair_of(j, r, layout);
      const bool first = layout == RopeLayout::kInterleaved ? j % 2 == 0 : j < half;
      const auto at = static_cast<std::size_t>(j);
      freq[at] = w[static_cast<std::size_t>(pair)];
      step_cos[at] = std::cos(freq[at]);
      step_sin[at] = std::sin(freq[at]);
      sign[at] = (first != negate_sine) ? -1.0 : 1.0;
    }
    columns_ = {freq, step_cos, step_sin, sign, pair_freq, r, layout == RopeLayout::kInterleaved};
  }
  // The pair that entry j of a head vector belongs to.
  static std::int64_t pair_of(std::int64_t j, std::int64_t r, RopeLayout layout) {
    return layout == RopeLayout::kInterleaved ? j / 2 : j % (r / 2);
  }
  const kernels::RopeColumns& columns() const { return columns_; }

 private:
  std::vector<double> values_;
  kernels::RopeColumns columns_;
};

// Per-thread scratch, grown on demand: the run state, the f32 coefficients, one head row.
struct RopeScratch {
  std::vector<double> state, xpos_cos, xpos_sin;
  std::vector<float> cos_e, sin_e, row;
};
RopeScratch& rope_scratch(std::int64_t rotary_dim, std::int64_t head_dim) {
  thread_local RopeScratch s;
  const auto padded = static_cast<std::size_t>(rotary_dim + kernels::kRopePadding);
  if (s.cos_e.size() < padded) {
    s.state.resize(2 * padded);
    s.cos_e.resize(padded);
    s.sin_e.resize(padded);
  }
  if (s.row.size() < static_cast<std::size_t>(head_dim)) s.row.resize(static_cast<std::size_t>(head_dim));
  return s;
}

// Rotates every head of one token of one tensor (in → out, f32 math).
void rotate_token(const detail::HeadsGrid& in_g, const void* in, const detail::HeadsGrid& out_g, void* out, DType dtype,
                  std::int64_t b, std::int64_t s, const RopeParams& params, RopeScratch& buf, bool interleaved,
                  bool stream) {
  // The kernels rotate the entries from `off` on (with_rotary_offset); the ones before pass.
  const std::int64_t off = params.rotary_offset(), d = params.head_dim() - off, r = params.rotary_dim();
  const std::int64_t in_off = in_g.offset(b, s), out_off = out_g.offset(b, s);
  if (in_g.dim_stride == 1 && out_g.dim_stride == 1) {
    const auto width = static_cast<std::int64_t>(dtype_size(dtype));
    const char* src = static_cast<const char*>(in) + in_off * width;
    char* dst = static_cast<char*>(out) + out_off * width;
    if (off > 0 && src != dst) {
      for (std::int64_t h = 0; h < in_g.heads; ++h) {
        std::memcpy(dst + h * out_g.head_stride * width, src + h * in_g.head_stride * width,
                    static_cast<std::size_t>(off * width));
      }
    }
    kernels::rope_rotate(buf.cos_e.data(), buf.sin_e.data(), r, interleaved, d, in_g.heads, dtype, src + off * width,
                         in_g.head_stride, dst + off * width, out_g.head_stride, stream);
    return;
  }
  for (std::int64_t h = 0; h < in_g.heads; ++h) {
    for (std::int64_t j = 0; j < off + d; ++j) {
      buf.row[static_cast<std::size_t>(j)] =
          static_cast<float>(detail::load(in, dtype, in_off + h * in_g.head_stride + j * in_g.dim_stride));
    }
    kernels::rope_rotate(buf.cos_e.data(), buf.sin_e.data(), r, interleaved, d, 1, DType::kF32, buf.row.data() + off, 0,
                         buf.row.data() + off, 0, false);
    for (std::int64_t j = 0; j < off + d; ++j) {
      detail::store(out, dtype, out_off + h * out_g.head_stride + j * out_g.dim_stride,
                    buf.row[static_cast<std::size_t>(j)]);
    }
  }
}

// Non-temporal stores pay off once the output is much larger than the caches.
constexpr std::int64_t kStreamBytes = std::int64_t{8} << 20;

}  // namespace

void rope_apply(const RopeParams& params, const Positions& positions, ConstTensorView q, ConstTensorView k,
                TensorView q_out, TensorView k_out, RopeDirection direction, std::int64_t seq_len) {
  detail::init_dispatch();
  const detail::RopeGrids g = detail::check_rope(params, positions, q, k, q_out, k_out);
  if (detail::use_reference() || q.dtype() == DType::kF64) {
    ref::rope_apply(params, positions, q, k, q_out, k_out, direction, seq_len);
    return;
  }
  const std::int64_t len = seq_len > 0 ? seq_len : positions.max_position() + 1;
  const bool interleaved = params.layout() == RopeLayout::kInterleaved;
  const RopeTables tables(params, len, params.layout(), direction != RopeDirection::kForward);
  const double alpha =
      direction == RopeDirection::kInverse ? 1.0 / params.attention_factor() : params.attention_factor();
  if (params.xpos()) detail::check_xpos_range(params, positions, g.q.batch, g.q.seq);
  // xPos: per-entry log ζ of each entry's pair, and the sign of the exponent for q (k uses the
  // opposite one); the inverse divides where forward multiplies.
  std::vector<double> log_zeta;
  double xpos_sign = direction == RopeDirection::kInverse ? -1.0 : 1.0;
  if (params.xpos()) {
    const std::int64_t r = params.rotary_dim(), half = r / 2;
    log_zeta.resize(static_cast<std::size_t>(r));
    for (std::int64_t j = 0; j < r; ++j) {
      const std::int64_t pair = interleaved ? j / 2 : j % half;
      log_zeta[static_cast<std::size_t>(j)] = std::log(params.xpos_zeta(pair));
    }
  }
  const bool in_place = q.data() == q_out.data();
  const auto width = static_cast<std::int64_t>(dtype_size(q.dtype()));
  const bool stream =
      !in_place && (g.q.batch * g.q.seq * (g.q.heads + g.k.heads) * params.head_dim() * width) >= kStreamBytes;
  // Blocks of kRopeMaxRun tokens at fixed offsets in each batch row, and runs of consecutive
  // positions inside them: where a run restarts never depends on the thread count, so results
  // are bitwise identical for any thread count.
  const std::int64_t blocks_per_row = (g.q.seq + kernels::kRopeMaxRun - 1) / kernels::kRopeMaxRun;
  const int threads = detail::threads_for(g.q.batch * g.q.seq * (g.q.heads + g.k.heads) * params.head_dim() * 4);
#pragma omp parallel num_threads(threads)
  {
    RopeScratch& buf = rope_scratch(params.rotary_dim(), params.head_dim());
#pragma omp for schedule(static)
    for (std::int64_t block = 0; block < g.q.batch * blocks_per_row; ++block) {
      const std::int64_t b = block / blocks_per_row;
      const std::int64_t begin = (block % blocks_per_row) * kernels::kRopeMaxRun;
      const std::int64_t end = std::min(g.q.seq, begin + kernels::kRopeMaxRun);
      for (std::int64_t s = begin; s < end; ++s) {
        const std::int64_t p = positions.at(b, s);
        if (s > begin && p == positions.at(b, s - 1) + 1) {
          kernels::rope_state_step(tables.columns(), buf.state.data());
        } else {
          kernels::rope_state_start(tables.columns(), static_cast<double>(p), buf.state.data());
        }
        kernels::rope_state_emit(tables.columns(), buf.state.data(), alpha, buf.cos_e.data(), buf.sin_e.data());
        if (!params.xpos()) {
          rotate_token(g.q, q.data(), g.q_out, q_out.data(), q.dtype(), b, s, params, buf, interleaved, stream);
          if (g.has_k) {
            rotate_token(g.k, k.data(), g.k_out, k_out.data(), k.dtype(), b, s, params, buf, interleaved, stream);
          }
          continue;
        }
        // xPos: q's coefficients times ζ^(±e), then k's times ζ^(∓e), from the same cos/sin.
        const double e = params.xpos_exponent(static_cast<double>(p));
        const std::int64_t r = params.rotary_dim();
        buf.xpos_cos.assign(buf.cos_e.begin(), buf.cos_e.begin() + r);
        buf.xpos_sin.assign(buf.sin_e.begin(), buf.sin_e.begin() + r);
        for (const double side : {1.0, -1.0}) {  // q, then k
          if (side < 0 && !g.has_k) break;
          for (std::int64_t j = 0; j < r; ++j) {
            const auto at = static_cast<std::size_t>(j);
            const double scale = std::exp(side * xpos_sign * e * log_zeta[at]);
            buf.cos_e[at] = static_cast<float>(buf.xpos_cos[at] * scale);
            buf.sin_e[at] = static_cast<float>(buf.xpos_sin[at] * scale);
          }
          if (side > 0) {
            rotate_token(g.q, q.data(), g.q_out, q_out.data(), q.dtype(), b, s, params, buf, interleaved, stream);
          } else {
            rotate_token(g.k, k.data(), g.k_out, k_out.data(), k.dtype(), b, s, params, buf, interleaved, stream);
          }
        }
      }
    }
    if (stream) kernels::flush_streams();
  }
}

void rope_apply(const RopeParams& params, const Positions& positions, TensorView q, TensorView k,
                RopeDirection direction, std::int64_t seq_len) {
  rope_apply(params, positions, ConstTensorView(q), ConstTensorView(k), q, k, direction, seq_len);
}

std::vector<std::int64_t> mrope_axis_of_pair(std::span<const std::int64_t> sections, MropeLayout layout) {
  return detail::sections_to_axes("mrope_axis_of_pair", sections, layout, 0);
}

void rope_apply_multi(const RopeParams& params, std::span<const std::int64_t> sections,
                      std::span<const Positions> axis_positions, ConstTensorView q, ConstTensorView k, TensorView q_out,
                      TensorView k_out, RopeDirection direction, bool restart_frequencies, std::int64_t seq_len) {
  if (axis_positions.empty() || axis_positions.size() != sections.size()) {
    throw Error("rope_apply_multi", "axis_positions.size()", std::to_string(axis_positions.size()),
                "one Positions per section (" + std::to_string(sections.size()) + "), at least one");
  }
  const std::vector<std::int64_t> axes =
      detail::sections_to_axes("rope_apply_multi", sections, MropeLayout::kSections, params.rotary_dim() / 2);
  rope_apply_axes(params, axes, axis_positions, q, k, q_out, k_out, direction, restart_frequencies, seq_len);
}

void rope_apply_axes(const RopeParams& params, std::span<const std::int64_t> axis_of_pair,
                     std::span<const Positions> axis_positions, ConstTensorView q, ConstTensorView k, TensorView q_out,
                     TensorView k_out, RopeDirection direction, bool restart_frequencies, std::int64_t seq_len) {
  detail::init_dispatch();
  const detail::MultiAxis m =
      detail::check_rope_multi(params, axis_of_pair, axis_positions, q, k, q_out, k_out, restart_frequencies, seq_len);
  if (detail::use_reference() || q.dtype() == DType::kF64) {
    ref::rope_apply_axes(params, axis_of_pair, axis_positions, q, k, q_out, k_out, direction, restart_frequencies,
                         seq_len);
    return;
  }
  const detail::RopeGrids& g = m.grids;
  const std::int64_t r = params.rotary_dim();
  const RopeTables tables(m.pair_freq, r, params.layout(), direction != RopeDirection::kForward);
  const double alpha =
      direction == RopeDirection::kInverse ? 1.0 / params.attention_factor() : params.attention_factor();
  const bool interleaved = params.layout() == RopeLayout::kInterleaved;
  std::vector<std::int64_t> entry_axis(static_cast<std::size_t>(r));
  for (std::int64_t j = 0; j < r; ++j) {
    entry_axis[static_cast<std::size_t>(j)] =
        m.pair_axis[static_cast<std::size_t>(RopeTables::pair_of(j, r, params.layout()))];
  }
  const std::size_t axes = axis_positions.size();
  const std::int64_t tokens = g.q.batch * g.q.seq;
  const int threads = detail::threads_for(tokens * (g.q.heads + g.k.heads) * params.head_dim() * 4);
#pragma omp parallel num_threads(threads)
  {
    RopeScratch& buf = rope_scratch(r, params.head_dim());
    thread_local std::vector<double> axis_states;
    const std::size_t state_size = buf.state.size();
    axis_states.resize(axes * state_size);
    const std::size_t stride = static_cast<std::size_t>(r + kernels::kRopePadding);
#pragma omp for schedule(static)
    for (std::int64_t t = 0; t < tokens; ++t) {
      const std::int64_t b = t / g.q.seq, s = t % g.q.seq;
      // Exact (cos, sin) of every entry for each axis' position, then each entry takes its axis'.
      for (std::size_t a = 0; a < axes; ++a) {
        kernels::rope_state_start(tables.columns(), static_cast<double>(axis_positions[a].at(b, s)),
                                  axis_states.data() + a * state_size);
      }
      for (std::int64_t j = 0; j < r; ++j) {
        const auto at = static_cast<std::size_t>(j);
        const double* source = axis_states.data() + static_cast<std::size_t>(entry_axis[at]) * state_size;
        buf.state[at] = source[at];
        buf.state[stride + at] = source[stride + at];
      }
      kernels::rope_state_emit(tables.columns(), buf.state.data(), alpha, buf.cos_e.data(), buf.sin_e.data());
      rotate_token(g.q, q.data(), g.q_out, q_out.data(), q.dtype(), b, s, params, buf, interleaved, false);
      if (g.has_k) rotate_token(g.k, k.data(), g.k_out, k_out.data(), k.dtype(), b, s, params, buf, interleaved, false);
    }
  }
}

void rope_rerotate(const RopeParams& from, const Positions& from_positions, std::int64_t from_seq_len,
                   const RopeParams& to, const Positions& to_positions, std::int64_t to_seq_len, ConstTensorView k,
                   TensorView k_out) {
  detail::init_dispatch();
  const char* where = "rope_rerotate";
  if (from.rotary_offset() != to.rotary_offset()) {
    throw Error("rope_rerotate", "to.rotary_offset()", std::to_string(to.rotary_offset()),
                "from's, " + std::to_string(from.rotary_offset()));
  }
  if (from.head_dim() != to.head_dim() || from.rotary_dim() != to.rotary_dim() || from.layout() != to.layout()) {
    const auto describe = [](const RopeParams& p) {
      return "head_dim " + std::to_string(p.head_dim()) + ", rotary_dim " + std::to_string(p.rotary_dim()) +
             ", layout " + (p.layout() == RopeLayout::kInterleaved ? "interleaved" : "half-split");
    };
    throw Error(where, "to", describe(to), "from's " + describe(from) + " (a re-rotation keeps the keys' layout)");
  }
  // Both position sets must fit the keys' token grid: checked as two "q" views of one grid.
  const detail::RopeGrids g = detail::check_rope(to, to_positions, k, {}, k_out, {});
  from_positions.check_grid(where, g.q.batch, g.q.seq);
  if (detail::use_reference() || k.dtype() == DType::kF64) {
    ref::rope_rerotate(from, from_positions, from_seq_len, to, to_positions, to_seq_len, k, k_out);
    return;
  }
  const bool interleaved = to.layout() == RopeLayout::kInterleaved;
  const RopeTables from_tables(from, from_seq_len > 0 ? from_seq_len : from_positions.max_position() + 1, from.layout(),
                               false);
  const RopeTables to_tables(to, to_seq_len > 0 ? to_seq_len : to_positions.max_position() + 1, to.layout(), false);
  const std::int64_t r = to.rotary_dim(), half = r / 2;
  // Keys carry ζ^(−e) under xPos: undoing `from` multiplies by ζ^(e_from), `to` by ζ^(−e_to).
  auto log_zeta = [&](std::int64_t j) { return std::log(to.xpos_zeta(interleaved ? j / 2 : j % half)); };
  if (from.xpos()) detail::check_xpos_range(from, from_positions, g.q.batch, g.q.seq);
  if (to.xpos()) detail::check_xpos_range(to, to_positions, g.q.batch, g.q.seq);
  const double alpha_ratio = to.attention_factor() / from.attention_factor();
  const std::int64_t tokens = g.q.batch * g.q.seq;
  const int threads = detail::threads_for(tokens * g.q.heads * to.head_dim() * 4);
#pragma omp parallel num_threads(threads)
  {
    RopeScratch& buf = rope_scratch(r, to.head_dim());
    thread_local std::vector<double> from_state;
    from_state.resize(buf.state.size());
#pragma omp for schedule(static)
    for (std::int64_t t = 0; t < tokens; ++t) {
      const std::int64_t b = t / g.q.seq, s = t % g.q.seq;
      const std::int64_t p_from = from_positions.at(b, s), p_to = to_positions.at(b, s);
      kernels::rope_state_start(from_tables.columns(), static_cast<double>(p_from), from_state.data());
      kernels::rope_state_start(to_tables.columns(), static_cast<double>(p_to), buf.state.data());
      const std::size_t stride = static_cast<std::size_t>(r + kernels::kRopePadding);
      const double e_from = from.xpos() ? from.xpos_exponent(static_cast<double>(p_from)) : 0.0;
      const double e_to = to.xpos() ? to.xpos_exponent(static_cast<double>(p_to)) : 0.0;
      for (std::int64_t j = 0; j < r; ++j) {
        const auto at = static_cast<std::size_t>(j);
        const double ca = from_state[at], sa = from_state[stride + at];
        const double cb = buf.state[at], sb = buf.state[stride + at];
        // cos(θb − θa), sin(θb − θa)
        const double c = cb * ca + sb * sa, sn = sb * ca - cb * sa;
        double scale = alpha_ratio;
        if (from.xpos() || to.xpos()) scale *= std::exp((e_from - e_to) * log_zeta(j));
        const bool first = interleaved ? j % 2 == 0 : j < half;
        buf.cos_e[at] = static_cast<float>(scale * c);
        buf.sin_e[at] = static_cast<float>((first ? -scale : scale) * sn);
      }
      rotate_token(g.q, k.data(), g.q_out, k_out.data(), k.dtype(), b, s, to, buf, interleaved, false);
    }
  }
}

void rope_cos_sin(const RopeParams& params, const Positions& positions, TensorView cos, TensorView sin,
                  std::int64_t seq_len) {
  detail::init_dispatch();
  const detail::Grid g = detail::check_rope_cos_sin(params, positions, cos, sin);
  if (detail::use_reference() || cos.dtype() == DType::kF64) {
    ref::rope_cos_sin(params, positions, cos, sin, seq_len);
    return;
  }
  const std::int64_t len = seq_len > 0 ? seq_len : positions.max_position() + 1;
  // Half-split tables, forward: cos_e[i] = α·cos θ_i and sin_e[i + r/2] = +α·sin θ_i.
  const RopeTables tables(params, len, RopeLayout::kHalfSplit, false);
  const double alpha = params.attention_factor();
  const std::int64_t pairs = params.rotary_dim() / 2;
  const int threads = detail::threads_for(g.seq * pairs * 16);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (std::int64_t n = 0; n < g.seq; ++n) {
    RopeScratch& buf = rope_scratch(params.rotary_dim(), params.head_dim());
    kernels::rope_state_start(tables.columns(), static_cast<double>(positions.at(0, n)), buf.state.data());
    kernels::rope_state_emit(tables.columns(), buf.state.data(), alpha, buf.cos_e.data(), buf.sin_e.data());
    if (cos.dtype() == DType::kF32 && g.dim_stride == 1 && sin.stride(1) == 1) {  // what attention's tables take
      std::copy_n(buf.cos_e.data(), pairs, static_cast<float*>(cos.data()) + g.offset(0, n));
      std::copy_n(buf.sin_e.data() + pairs, pairs, static_cast<float*>(sin.data()) + n * sin.stride(0));
      continue;
    }
    for (std::int64_t i = 0; i < pairs; ++i) {
      detail::store(cos.data(), cos.dtype(), g.offset(0, n) + i * g.dim_stride, buf.cos_e[static_cast<std::size_t>(i)]);
      detail::store(sin.data(), sin.dtype(), n * sin.stride(0) + i * sin.stride(1),
                    buf.sin_e[static_cast<std::size_t>(pairs + i)]);
    }
  }
}

}  // namespace posenc
