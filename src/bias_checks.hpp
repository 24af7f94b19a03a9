// Argument validation and shared math of the score biases, used by the SIMD entry points
// (bias.cpp) and the fp64 reference (ref/bias_ref.cpp).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "internal.hpp"
#include "posenc/bias.hpp"

namespace posenc::detail {

// A [B, H, Sq, Sk] view of scores (or [H, Sq, Sk], B = 1).
struct ScoreGrid {
  std::int64_t batch = 1, heads = 0, q_len = 0, k_len = 0;
  std::int64_t batch_stride = 0, head_stride = 0, q_stride = 0, k_stride = 1;
  std::int64_t offset(std::int64_t b, std::int64_t h, std::int64_t i) const {
    return b * batch_stride + h * head_stride + i * q_stride;
  }
};

// Checks the view's rank, its head count against the scheme's and the positions' grids.
ScoreGrid check_scores(const char* where, const char* name, ConstTensorView scores, std::int64_t heads,
                       const Positions& q_positions, const Positions& k_positions);

// The f32 table of every head: out[h·count + t] = b_h(r_first + t) (reversed: b_h(r_first + count − 1 − t)),
// with no −0. Tabulated in slices through a small fp64 buffer, so no call takes fresh pages.
void tabulate_f32(const RelativeBias& bias, std::int64_t r_first, std::int64_t count, float* out, bool reversed);

// grads[t] += flat[t]: a scheme's gradients in their own form, added in its registered order
// (grads checked to have flat.size() entries).
inline void add_flat(const std::vector<double>& flat, std::span<double> grads) {
  for (std::size_t t = 0; t < flat.size(); ++t) grads[t] += flat[t];
}

// A PositionBias's backward into flat grads (checked to hold parameter_count() values) through
// its own gradients struct G (FireGradients, TupeGradients): backward(parts) accumulates into a
// zeroed G, added flat.
template <class G, class Params, class Backward>
void add_gradients(const char* where, const Params& params, std::span<double> grads, Backward&& backward) {
  check_gradient_size(where, "grads", grads.size(), params.parameter_count());
  G parts(params);
  backward(parts);
  add_flat(parts.flat(), grads);
}

// The positions of one batch row, gathered (positions.at(b, s) for s < len).
std::vector<std::int64_t> row_positions(const Positions& positions, std::int64_t b, std::int64_t len);

// ∂b/∂θ of the schemes with per-head parameters, at relative position r (fp64).
inline double alibi_derivative(AlibiForm form, std::int64_t r) {
  return form == AlibiForm::kCausal ? static_cast<double>(r) : -static_cast<double>(r < 0 ? -r : r);
}
// {∂b/∂r1, ∂b/∂r2} of Kerple for head h at relative position r.
void kerple_derivatives(const KerpleParams& params, std::int64_t head, std::int64_t r, double* d_r1, double* d_r2);

// FIRE's x and piece for a query against `count` keys (fire.cpp).
void fire_rows(const FireParams& params, std::int64_t q_position, const std::int64_t* keys, std::int64_t count,
               double* x, std::int64_t* piece);

// FIRE's backward pieces (fire.cpp): ∂x/∂c and ∂x/∂L of one pair, and the contraction of the
// moments s0[piece·H + h] = Σ dS, s1 = Σ dS·x with the pieces' active units into grads.
void fire_x_derivatives(const FireParams& p, std::int64_t q, std::int64_t k, double x, double* dx_dc, double* dx_dl);
void fire_contract_moments(const FireParams& params, const double* s0, const double* s1, FireGradients& grads);

// TUPE's b(h, i, j) by the definition (tupe.cpp), and its materialisation; the check that every
// position indexes TUPE's table.
void check_tupe_positions(const char* where, const TupeParams& params, const Positions& q_positions,
                          const Positions& k_positions);
double tupe_value(const TupeParams& params, std::int64_t head, std::int64_t q_position, std::int64_t k_position);
void materialize_tupe(const TupeParams& params, const Positions& q_positions, const Positions& k_positions,
                      const ScoreGrid& grid, TensorView out);

}  // namespace posenc::detail
