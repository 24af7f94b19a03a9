// posenc/temperature.hpp — position-dependent attention temperature: each query is multiplied by
// a factor of its position before the dot product (keys and values are not).
//
// ─── Math ──────────────────────────────────────────────────────────────────────────────────────
//   llama4    s(p) = 1 + attn_scale·ln(⌊(p + 1)/floor_scale⌋ + 1)
//             Llama 4's NoPE layers (transformers' Llama4TextAttention with attn_temperature_tuning;
//             Llama-4-Scout: floor_scale 8192, attn_scale 0.1): 1 below position floor_scale − 1,
//             1 + 0.1·ln 2 from there to 2·floor_scale − 2, …
//   mistral   s(p) = 1 + beta·ln(1 + ⌊p / original_max_position_embeddings⌋)
//             Ministral 3 / Mistral Small 4 (transformers' get_llama_4_attn_scale, its
//             rope_parameters' llama_4_scaling_beta and original_max_position_embeddings), applied
//             after RoPE on every layer.
// p is the query's position (attention.hpp: explicit or default), so the factor follows a KV
// cache's offset. Inside attention the query row becomes s(p)·T_q(q) (T_q its RoPE or other
// transform; s commutes with a rotation), and the gradient of q is s(p) times that of the row.
// s is computed in fp64 and rounded once to f32 per query row.
//
// Errors: posenc::Error for a non-finite or non-positive floor_scale, an attn_scale or beta that is
// not finite or below 0, original_max_position_embeddings < 1, and factor() of a position below 0.
#pragma once

#include <cstdint>
#include <string_view>

namespace posenc {

class PositionTemperature {
 public:
  enum class Kind : std::uint8_t { kLlama4, kMistral };

  static PositionTemperature llama4(double floor_scale = 8192.0, double attn_scale = 0.1);
  static PositionTemperature mistral(double beta, std::int64_t original_max_position_embeddings);

  Kind kind() const { return kind_; }
  std::string_view name() const;  // "llama4" or "mistral"
  // llama4: floor_scale and attn_scale; mistral: original_max_position_embeddings and beta.
  double length() const { return length_; }
  double strength() const { return strength_; }

  // s(p) in fp64; p >= 0.
  double factor(std::int64_t position) const;

 private:
  PositionTemperature(Kind kind, double length, double strength) : kind_(kind), length_(length), strength_(strength) {}
  Kind kind_;
  double length_;
  double strength_;
};

}  // namespace posenc
