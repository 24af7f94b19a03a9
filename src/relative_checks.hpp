// Argument validation and per-element helpers of Shaw's and Transformer-XL's terms, used by the
// fast paths (shaw.cpp, xl.cpp) and the fp64 references (ref/shaw_ref.cpp, ref/xl_ref.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "bias_checks.hpp"
#include "posenc/relative.hpp"

namespace posenc::detail {

inline bool empty_view(ConstTensorView v) { return v.rank() == 0 && v.data() == nullptr; }

// The checked shapes of one Shaw call: the [B, S, H, D] tensor and the [B, H, Sq, Sk] one.
struct ShawGrids {
  HeadsGrid tokens;
  ScoreGrid scores;
};
ShawGrids check_shaw(const char* where, const ShawParams& p, const char* tokens_name, ConstTensorView tokens,
                     const char* scores_name, ConstTensorView scores, const Positions& q_positions,
                     const Positions& k_positions);

// The checked shapes of one Transformer-XL call: q, k [B, S, H, D] and the [B, H, Sq, Sk] scores.
struct XlGrids {
  HeadsGrid q, k;
  ScoreGrid scores;
};
XlGrids check_xl(const char* where, const XlParams& p, ConstTensorView q, ConstTensorView k, const char* scores_name,
                 ConstTensorView scores, const Positions& q_positions, const Positions& k_positions);

double load_token(ConstTensorView v, const HeadsGrid& g, std::int64_t b, std::int64_t s, std::int64_t h,
                  std::int64_t d);
void add_token(TensorView v, const HeadsGrid& g, std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t d,
               double value);
// P_h(δ) = W_R r(δ) restricted to head h, by the definition (fp64).
std::vector<double> projected_head(const XlParams& p, std::int64_t h, std::int64_t delta);

}  // namespace posenc::detail
