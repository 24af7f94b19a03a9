// The non-finite policy of the fused attention (docs/attention.md, "Non-finite inputs"): an inf
// or NaN in q, k, v or d_out gives NaN (or ±inf) in exactly the outputs and gradients where the
// fp64 reference — softmax over each row's visible keys, sums over visible pairs only — gives
// them, on every target: in the first tile, the diagonal tile (partly masked, where 0 · NaN
// would otherwise leak to rows that do not see the key), later tiles, decode, windows and packed
// sequences. Finite outputs stay within the usual tolerance of the reference.
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "attention_testing.hpp"
#include "testing.hpp"

namespace posenc {
namespace {

using namespace attention_testing;

// 0 finite, 1 NaN, 2 +inf, 3 −inf.
int kind(double x) { return std::isnan(x) ? 1 : std::isinf(x) ? (x > 0 ? 2 : 3) : 0; }

// The same kind everywhere, and finite values within expect_close's tolerance of the reference
// (2^-13 of the largest finite value: f32 kernels against fp64). Returns how many elements are
// not finite, so that a placement both sides swallow is caught by the caller.
std::size_t expect_same_pattern(const std::vector<double>& got, const std::vector<double>& want, const char* name) {
  EXPECT_EQ(got.size(), want.size()) << name;
  if (got.size() != want.size()) return 0;
  std::size_t wrong = 0, first = 0, non_finite = 0;
  double scale = 1e-3, worst = 0;
  for (const double x : want) scale = std::isfinite(x) ? std::max(scale, std::abs(x)) : scale;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (kind(got[i]) != kind(want[i])) {
      if (wrong++ == 0) first = i;
    } else if (kind(want[i]) != 0) {
      ++non_finite;
    } else {
      worst = std::max(worst, std::abs(got[i] - want[i]));
    }
  }
  EXPECT_EQ(wrong, 0u) << name << ": " << wrong << " elements differ in kind from the reference, first at " << first
                       << " (" << got[first] << " against " << want[first] << ")";
  EXPECT_LE(worst, std::ldexp(1.0, -13) * scale) << name;
  return non_finite;
}

class AttentionNonFiniteTargets : public testing::EveryTarget {};

TEST_P(AttentionNonFiniteTargets, PropagateExactlyAsTheReference) {
  struct Case {
    const char* what;
    std::int64_t q_len, k_len, heads, kv_heads, dim;
    bool causal;
    std::int64_t window_left;
    bool alibi, packed;
    double softcap = 0.0;
  };
  // Lengths past one key tile and one query block, so that the values land in first, diagonal and
  // later tiles; gentle ALiBi slopes, so that no tile vanishes (the documented exception).
  const Case cases[] = {
      {"causal, tiles", 300, 300, 2, 1, 16, true, -1, false, false},
      {"full, GQA", 150, 150, 4, 2, 8, false, -1, false, false},
      {"causal window, ALiBi", 200, 200, 2, 2, 16, true, 20, true, false},
      {"decode of 3 queries", 3, 300, 4, 2, 16, true, -1, false, false},
      {"decode of one query", 1, 300, 4, 1, 16, true, -1, false, false},
      {"packed sequences", 0, 0, 2, 1, 8, true, -1, false, true},
      // Three heads on a KV head leave padding rows in the backward's blocks, whose zero query
      // meets an infinite key as NaN; a soft-cap turns an infinite logit into ±cap.
      {"GQA of 3", 40, 40, 3, 1, 8, false, -1, false, false},
      {"soft-cap 41, GQA of 3", 40, 40, 3, 1, 8, true, -1, false, false, 41.0},
      {"soft-cap 30, tiles", 150, 150, 2, 1, 16, true, 70, false, false, 30.0},
  };
  const double values[] = {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
                           -std::numeric_limits<double>::infinity()};
  for (const Case& c : cases) {
    for (int where = 0; where < 4; ++where) {  // q, k, v, d_out
      for (int trial = 0; trial < 3; ++trial) {
        const double bad = values[trial];
        const std::string what = std::string(c.what) + ", " + "qkvd"[where] + " = " + std::to_string(bad);
        SCOPED_TRACE(what);
        Problem p = c.packed ? make_packed({{70, 70}, {90, 90}}, c.heads, c.kv_heads, c.dim)
                             : make_problem(1, c.q_len, c.k_len, c.heads, c.kv_heads, c.dim);
        std::vector<double> d_out = random_values(static_cast<std::size_t>(p.q_count()));
        std::vector<double>& target = where == 0 ? p.q : where == 1 ? p.k : where == 2 ? p.v : d_out;
        const auto at = static_cast<std::size_t>(testing::uniform_int(0, static_cast<std::int64_t>(target.size()) - 1));
        target[at] = bad;
        p.qb = testing::to_dtype(p.q, p.dtype);
        p.kb = testing::to_dtype(p.k, p.dtype);
        p.vb = testing::to_dtype(p.v, p.dtype);
        AttentionSpec spec = spec_of(p);
        spec.mask.causal = c.causal;
        spec.mask.window_left = c.window_left;
        spec.mask.softcap = c.softcap;
        HeadGroup group{c.heads, {}, {}};
        if (c.alibi) group.bias = AlibiParams(std::vector<double>(static_cast<std::size_t>(c.heads), 0.01));
        spec.groups = {group};
        const Attention att(spec);
        std::size_t non_finite = 0;
        if (where < 3) {
          const Outputs fused = run_forward(p, att, 0), exact = run_forward(p, att, 1);
          non_finite += expect_same_pattern(fused.out, exact.out, "out");
        }
        const Grads fused = run_backward(p, att, d_out, false), exact = run_backward(p, att, d_out, true);
        non_finite += expect_same_pattern(fused.dq, exact.dq, "dq");
        non_finite += expect_same_pattern(fused.dk, exact.dk, "dk");
        non_finite += expect_same_pattern(fused.dv, exact.dv, "dv");
        EXPECT_GT(non_finite, 0u) << "the value vanished on both sides";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, AttentionNonFiniteTargets, ::testing::ValuesIn(testing::all_targets()));

}  // namespace
}  // namespace posenc
