// posenc/sandwich.hpp — Sandwich (Chi, Fan, Rudnicky and Ramadge 2023, "Dissecting Transformer
// Length Extrapolation via the Lens of Receptive Field Analysis", ACL), a parameter-free bias of
// the relative position r = key − query:
//
//   b_h(r) = (p_i·p_j − d'/2) · H / (8·(h + 1)),   p_i·p_j = Σ_{k=0}^{d'/2−1} cos(r·ω_k),
//   ω_k = base^(−2k/d'),  h = 0 … H − 1
//
// p is the sinusoidal encoding of width d' (Vaswani et al.), so p_i·p_j depends on r only; the
// paper keeps this term of (x + p)·(x + p) as the bias and drops the cross terms. b is 0 at r = 0
// and below 0 elsewhere (each cosine is at most 1); it falls roughly logarithmically with |r|
// before it levels off, the pattern the paper shares with KERPLE and T5. The paper's scaling by
// 8h/H, h = 1 … H, is ALiBi's: head 0 has the steepest bias, head H − 1 the flattest. d' = 128 is
// the paper's best. Symmetric in r (bidirectional models may use it as is).
//
//   heads h:       0      1     …   H − 1
//   factor:      H/8    H/16    …   1/8        (the paper's 8h/H in the denominator)
//
// Error contract: parameters are validated at construction (dim even in [2, 65536], base > 1 and
// finite, heads >= 1). value() is fp64 with libm's cos; each angle r·ω_k carries fp64's rounding
// of the product, |r|·2^-52 at most, as every angle in posenc does (absolute.hpp), so
// |error| <= (d'/2)·|r|·2^-52·H/8 (1.5e-9 at d' = 128, |r| = 2^20, H = 8). tabulate() rotates each
// frequency's (cos, sin) from r to r + 1 and starts afresh from libm every 64 keys: it agrees with
// value() to within (d'/2)·(|r|·2^-51 + 1e-14)·H/8.
#pragma once

#include <cstdint>
#include <vector>

#include "posenc/scheme.hpp"

namespace posenc {

class SandwichBias : public RelativeBias {
 public:
  explicit SandwichBias(std::int64_t heads, std::int64_t dim = 128, double base = 10000.0);

  std::int64_t dim() const { return dim_; }
  double base() const { return base_; }
  // The frequencies ω_k, k < dim/2, and the factor H/(8·(h + 1)) of each head.
  const std::vector<double>& frequencies() const { return frequencies_; }
  double head_factor(std::int64_t head) const;

  std::string_view scheme_name() const override { return "sandwich"; }
  std::int64_t heads() const override { return heads_; }
  double value(std::int64_t head, std::int64_t relative_position) const override;
  void tabulate(std::int64_t r_first, std::int64_t count, double* out) const override;

 private:
  std::int64_t heads_, dim_;
  double base_;
  std::vector<double> frequencies_;
};

}  // namespace posenc
