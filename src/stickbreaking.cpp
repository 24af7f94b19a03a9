// Stick-breaking attention (stickbreaking.hpp): validation, and the fused forward and backward
// over blocks of query rows whose key tiles run from the diagonal leftwards.
#include "posenc/stickbreaking.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absolute_checks.hpp"
#include "internal.hpp"
#include "kernels/attention/attention_kernels.hpp"
#include "kernels/attention/stickbreaking_kernels.hpp"
#include "posenc/error.hpp"
#include "posenc/reference.hpp"
#include "stickbreaking_checks.hpp"

namespace posenc {

namespace detail {
namespace {

void require(bool ok, const char* param, const std::string& value, const std::string& expected) {
  if (!ok) throw Error(kStickBreaking, param, value, expected);
}

}  // namespace

SbShape check_stickbreaking(const StickBreakingSpec& spec) {
  return check_qkv(kStickBreaking, spec.q, spec.k, spec.v, spec.scale, spec.cu_seqlens_q, spec.cu_seqlens_k);
}

RemGrid check_rem(const SbShape& shape, const char* name, ConstTensorView rem, bool writable) {
  return check_row_stat(kStickBreaking, shape, name, rem, writable);
}

HeadsGrid check_sb_forward_outputs(const StickBreakingSpec& spec, const SbShape& shape, ConstTensorView out,
                                   ConstTensorView rem) {
  const HeadsGrid og = check_output_tokens(kStickBreaking, "out", out, shape.out_grid());
  check_out_dtype(kStickBreaking, shape, out);
  check_writable(kStickBreaking, "out", out);
  if (given(rem)) check_rem(shape, "rem", rem, true);
  check_disjoint(kStickBreaking, {{"out", out}, {"rem", rem}}, {{"q", spec.q}, {"k", spec.k}, {"v", spec.v}});
  return og;
}

SbBackwardGrids check_sb_backward(const StickBreakingSpec& spec, const SbShape& shape, ConstTensorView out,
                                  ConstTensorView rem, ConstTensorView d_out, ConstTensorView d_rem, ConstTensorView dq,
                                  ConstTensorView dk, ConstTensorView dv) {
  SbBackwardGrids g;
  static_cast<QkvBackwardGrids&>(g) = check_qkv_backward(kStickBreaking, shape, out, d_out, dq, dk, dv);
  if (given(d_rem)) {
    require(given(rem), "rem", "empty", "the forward's rem when d_rem is given");
    g.d_rem = check_rem(shape, "d_rem", d_rem, false);
  }
  if (given(rem)) g.rem = check_rem(shape, "rem", rem, false);
  check_disjoint(
      kStickBreaking, {{"dq", dq}, {"dk", dk}, {"dv", dv}},
      {{"q", spec.q}, {"k", spec.k}, {"v", spec.v}, {"out", out}, {"rem", rem}, {"d_out", d_out}, {"d_rem", d_rem}});
  return g;
}

}  // namespace detail

// ─── The fused passes ────────────────────────────────────────────────────────────────────────

namespace {

using detail::SbShape;
using detail::rows::Block;
using detail::rows::BlockWalk;
using detail::rows::Floats;
using detail::rows::grow;
using detail::rows::kKeyTile;
using detail::rows::Unit;
using detail::rows::WalkScratch;
using kernels::kSbDead;
static_assert(kKeyTile <= kernels::kAttnGemmAddDepth);

// A thread's buffers beside the walk's, kept between calls.
struct Scratch {
  Floats sig;
  std::vector<float> carry, suffix, total, d_rem;
  std::vector<double> sums;  // backward's exact path: per tile and row, Σ g
  std::int64_t bytes() const {
    std::int64_t n = static_cast<std::int64_t>(sig.capacity());
    for (const std::vector<float>* f : {&carry, &suffix, &total, &d_rem}) n += static_cast<std::int64_t>(f->capacity());
    return n * static_cast<std::int64_t>(sizeof(float)) + static_cast<std::int64_t>(sums.capacity() * sizeof(double));
  }
};

Scratch& thread_scratch() {
  thread_local Scratch s;
  return s;
}

// Each row's carry before its first key: 0, and −inf for padding rows (no weight, ever dead).
void start_carries(const Block& blk, std::vector<float>& carry) {
  grow(carry, blk.width);
  for (std::int64_t r = 0; r < blk.width; ++r)
    carry[static_cast<std::size_t>(r)] =
        blk.head[static_cast<std::size_t>(r)] < 0 ? -std::numeric_limits<float>::infinity() : 0.0f;
}

// Whether the block may stop before the tile ending at `tile_end`: every row's carry is below
// kSbDead (or it sees no key) and nothing non-finite lies in keys [0, tile_end).
bool vanished(const Block& blk, const float* carry, std::int64_t tile_end, std::int64_t bad_from) {
  if (bad_from < tile_end) return false;
  for (std::int64_t r = 0; r < blk.width; ++r) {
    const auto at = static_cast<std::size_t>(r);
    if (blk.head[at] >= 0 && blk.hi[at] > 0 && !(carry[r] < kSbDead)) return false;
  }
  return true;
}

// The exact path of backward (a block whose inputs hold an inf or NaN): the tile's leftward walk
// in scalar code, leaving A in st, g = A·(dP − d_rem) in dpt and z in sig, and adding each
// row's Σ g over the tile to tile_sum (fp64; null: not wanted). Masked pairs get 0 everywhere.
void exact_walk(const Block& blk, std::int64_t k0, std::int64_t keys, float* st, float* dpt, float* sig,
                const float* d_rem, float* carry, double* tile_sum) {
  const std::int64_t w = blk.width;
  for (std::int64_t r = 0; r < w; ++r) {
    const std::int64_t hi = blk.head[static_cast<std::size_t>(r)] < 0 ? 0 : blk.hi[static_cast<std::size_t>(r)];
    float c = carry[r];
    for (std::int64_t j = keys - 1; j >= 0; --j) {
      const std::int64_t at = j * w + r;
      if (k0 + j >= hi) {
        st[at] = dpt[at] = sig[at] = 0.0f;
        continue;
      }
      const float z = st[at];
      const float e = std::exp(-std::fabs(z));
      const float t = std::isnan(z) ? z : std::log1p(e);
      const float sp = std::max(z, 0.0f) + t, sp_neg = std::max(-z, 0.0f) + t;
      const float log_a = c - sp_neg;
      const float a = std::isnan(log_a) ? log_a : (log_a < kSbDead ? 0.0f : std::exp(log_a));
      const float g = a * (dpt[at] - d_rem[r]);
      c -= sp;
      st[at] = a;
      dpt[at] = g;
      sig[at] = z;
      if (tile_sum != nullptr) tile_sum[r] += static_cast<double>(g);
    }
    carry[r] = c;
  }
}

// Then dz = g·σ(−z) − σ(z)·R (σ as the reference flushes it) with R = Σ_{m<j} g summed from the
// left: `left` holds each row's sum over the keys left of the tile; an inf there stays an inf
// (G − suffix would make it NaN).
void exact_finish(const Block& blk, std::int64_t k0, std::int64_t keys, float* dpt, const float* sig,
                  const double* left) {
  const std::int64_t w = blk.width;
  for (std::int64_t r = 0; r < w; ++r) {
    const std::int64_t hi = blk.head[static_cast<std::size_t>(r)] < 0 ? 0 : blk.hi[static_cast<std::size_t>(r)];
    double run = left[r];
    for (std::int64_t j = 0; j < keys && k0 + j < hi; ++j) {
      const std::int64_t at = j * w + r;
      const double g = dpt[at], z = sig[at];
      dpt[at] = static_cast<float>(g * detail::sb_sigmoid(-z) - detail::sb_sigmoid(z) * run);
      run += g;
    }
  }
}

}  // namespace

struct StickBreakingAttention::Plan {
  StickBreakingSpec spec;
  detail::rows::Geometry geo;

  // Per (sequence, KV head): the first non-finite key (backward always asks; forward only to
  // skip), or −1 everywhere.
  std::vector<std::int64_t> scan_non_finite(int threads, bool always = false) const {
    if (!spec.skip_vanishing_tiles && !always)
      return std::vector<std::int64_t>(geo.sequences.size() * static_cast<std::size_t>(geo.shape.kv_heads), -1);
    return geo.scan_non_finite(threads);
  }
  std::int64_t first_bad(const std::vector<std::int64_t>& bad, const Unit& un) const {
    return bad[static_cast<std::size_t>(un.seq * geo.shape.kv_heads + un.kvh)];
  }

  AttentionStats forward(TensorView out, TensorView rem) const;
  AttentionStats backward(ConstTensorView out, ConstTensorView rem, ConstTensorView d_out, ConstTensorView d_rem,
                          TensorView dq, TensorView dk, TensorView dv) const;
  class Forward;
  class Backward;
};

// The forward's rows: each row's stick, broken key by key from the diagonal.
class StickBreakingAttention::Plan::Forward final : public detail::rows::ForwardRows {
 public:
  Forward(const Plan& plan, const std::vector<std::int64_t>& bad) : plan_(plan), bad_(bad), s_(thread_scratch()) {}
  void start(const Unit& un, const Block& blk, WalkScratch& w) override {
    const auto scale = static_cast<float>(plan_.geo.shape.scale);
    const bool q_finite =
        plan_.geo.load_q(plan_.geo.sequences[static_cast<std::size_t>(un.seq)], blk, scale, scale, w.qrows, w.qt);
    start_carries(blk, s_.carry);
    bad_from_ = q_finite && plan_.spec.skip_vanishing_tiles ? plan_.first_bad(bad_, un) : -1;
  }
  bool vanished(const Block& blk, std::int64_t tile_end) const override {
    return ::posenc::vanished(blk, s_.carry.data(), tile_end, bad_from_);
  }
  void weigh(const Block& blk, std::int64_t k0, std::int64_t keys, bool masked, WalkScratch& w) override {
    kernels::sb_forward_tile(w.st.data(), keys, blk.width, k0, blk.hi.data(), masked, s_.carry.data());
  }
  float finish(std::int64_t r, float* /*o*/) override {
    const float c = s_.carry[static_cast<std::size_t>(r)];
    return std::isnan(c) ? c : (c < kSbDead ? 0.0f : std::exp(c));
  }
  std::int64_t bytes() const override { return s_.bytes(); }

 private:
  const Plan& plan_;
  const std::vector<std::int64_t>& bad_;
  std::int64_t bad_from_ = -1;
  Scratch& s_;
};

// The backward's rows: R = G − Σ_{m>=j} g from the diagonal; a block that meets an inf or NaN
// (its queries, d_out, d_rem, G, or a key or value row it sees) takes R = Σ_{m<j} g from the left
// in two passes (exact_walk): G − suffix would turn an infinite G into NaN where the composition
// has ±inf.
class StickBreakingAttention::Plan::Backward final : public detail::rows::BackwardRows {
 public:
  Backward(const Plan& plan, const detail::SbBackwardGrids& g, ConstTensorView rem, ConstTensorView d_rem,
           const std::vector<std::int64_t>& bad)
      : plan_(plan),
        g_(g),
        rem_(rem),
        d_rem_(d_rem),
        has_d_rem_(detail::given(d_rem)),
        bad_(bad),
        s_(thread_scratch()) {}
  bool start(const Unit& un, const Block& blk, WalkScratch& w) override {
    const auto scale = static_cast<float>(plan_.geo.shape.scale);
    un_ = &un;
    const bool q_finite =
        plan_.geo.load_q(plan_.geo.sequences[static_cast<std::size_t>(un.seq)], blk, scale, scale, w.qrows, w.qt);
    for (auto* v : {&s_.suffix, &s_.total, &s_.d_rem}) grow(*v, blk.width);
    start_carries(blk, s_.carry);
    totals_finite_ = true;
    return q_finite;
  }
  void pad_row(std::int64_t r) override {
    const auto at = static_cast<std::size_t>(r);
    s_.suffix[at] = s_.total[at] = s_.d_rem[at] = 0.0f;
  }
  bool row(std::int64_t r, std::int64_t b, std::int64_t token, std::int64_t h, double dot) override {
    const auto at = static_cast<std::size_t>(r);
    float dr = 0.0f;
    if (has_d_rem_) {
      dr = static_cast<const float*>(d_rem_.data())[g_.d_rem.offset(b, token, h)];
      const float rm = static_cast<const float*>(rem_.data())[g_.rem.offset(b, token, h)];
      dot -= static_cast<double>(dr) * (1.0 - static_cast<double>(rm));
    }
    s_.suffix[at] = 0.0f;
    s_.total[at] = static_cast<float>(dot);
    s_.d_rem[at] = dr;
    totals_finite_ = totals_finite_ && std::isfinite(s_.total[at]);
    return std::isfinite(dr);
  }
  void prepare(BlockWalk& walk) override {
    const Block& blk = walk.blk;
    const std::int64_t w = blk.width, first_bad = plan_.first_bad(bad_, *un_);
    exact_ = !(walk.q_finite && walk.do_finite && totals_finite_ && first_bad >= blk.key_end);
    bad_from_ = exact_ ? -1 : (plan_.spec.skip_vanishing_tiles ? first_bad : -1);
    if (!exact_) return;
    // Each tile's Σ g per row; then the sums of the tiles left of each tile.
    const std::int64_t n_tiles = walk.n_tiles();
    grow(s_.sig, kKeyTile * w);
    s_.sums.assign(static_cast<std::size_t>((n_tiles + 1) * w), 0.0);
    for (std::int64_t t = n_tiles - 1; t >= 0; --t) {
      walk.scores(walk.k0(t), walk.keys(t));
      exact_walk(blk, walk.k0(t), walk.keys(t), walk.s.st.data(), walk.s.dpt.data(), s_.sig.data(), s_.d_rem.data(),
                 s_.carry.data(), s_.sums.data() + (t + 1) * w);
    }
    for (std::int64_t t = 1; t <= n_tiles; ++t) {
      for (std::int64_t r = 0; r < w; ++r)
        s_.sums[static_cast<std::size_t>(t * w + r)] += s_.sums[static_cast<std::size_t>((t - 1) * w + r)];
    }
    start_carries(blk, s_.carry);
  }
  bool vanished(const Block& blk, std::int64_t tile_end) const override {
    return ::posenc::vanished(blk, s_.carry.data(), tile_end, bad_from_);
  }
  void tile(const BlockWalk& walk, std::int64_t t, bool masked) override {
    const Block& blk = walk.blk;
    const std::int64_t k0 = walk.k0(t), keys = walk.keys(t);
    float *st = walk.s.st.data(), *dpt = walk.s.dpt.data();
    if (exact_) {
      exact_walk(blk, k0, keys, st, dpt, s_.sig.data(), s_.d_rem.data(), s_.carry.data(), nullptr);
      exact_finish(blk, k0, keys, dpt, s_.sig.data(), s_.sums.data() + t * blk.width);
    } else {
      kernels::sb_backward_tile(st, dpt, keys, blk.width, k0, blk.hi.data(), masked, s_.total.data(), s_.d_rem.data(),
                                s_.carry.data(), s_.suffix.data());
    }
  }
  const float* scaled_q(const WalkScratch& w) const override { return w.qrows.data(); }
  void finish(const Block& blk, WalkScratch& w, bool want_dq) override {
    if (!want_dq) return;
    const auto scale = static_cast<float>(plan_.geo.shape.scale);
    for (std::int64_t r = 0; r < blk.width; ++r) {
      float* row = w.dq.data() + r * plan_.geo.dp;
      for (std::int64_t c = 0; c < plan_.geo.shape.dim; ++c) row[c] *= scale;
    }
  }
  std::int64_t bytes() const override { return s_.bytes(); }

 private:
  const Plan& plan_;
  const detail::SbBackwardGrids& g_;
  ConstTensorView rem_, d_rem_;
  bool has_d_rem_;
  const std::vector<std::int64_t>& bad_;
  const Unit* un_ = nullptr;
  bool totals_finite_ = true, exact_ = false;
  std::int64_t bad_from_ = -1;
  Scratch& s_;
};

AttentionStats StickBreakingAttention::Plan::forward(TensorView out, TensorView rem) const {
  const SbShape& shape = geo.shape;
  const detail::HeadsGrid og =
      detail::check_sb_forward_outputs(spec, shape, ConstTensorView(out), ConstTensorView(rem));
  const detail::RemGrid rg = detail::given(ConstTensorView(rem))
                                 ? detail::check_rem(shape, "rem", ConstTensorView(rem), true)
                                 : detail::RemGrid{};
  const std::vector<std::int64_t> bad = scan_non_finite(geo.threads_for(geo.forward_units().size(), 1));
  return detail::rows::walk_forward(
      geo, [&] { return std::make_unique<Forward>(*this, bad); }, out, og, rem, rg);
}

AttentionStats StickBreakingAttention::Plan::backward(ConstTensorView out, ConstTensorView rem, ConstTensorView d_out,
                                                      ConstTensorView d_rem, TensorView dq, TensorView dk,
                                                      TensorView dv) const {
  const detail::SbBackwardGrids g = detail::check_sb_backward(spec, geo.shape, out, rem, d_out, d_rem, dq, dk, dv);
  const detail::rows::Split split = geo.backward_split();
  const auto runs = static_cast<std::int64_t>(split.units.size());
  const std::vector<std::int64_t> bad = scan_non_finite(geo.threads_for(split.units.size(), 2), true);
  return detail::rows::walk_backward(
      geo, split, runs, [&] { return std::make_unique<Backward>(*this, g, rem, d_rem, bad); }, g, out, d_out, dq, dk,
      dv);
}

// ─── The public object ───────────────────────────────────────────────────────────────────────

StickBreakingAttention::StickBreakingAttention(StickBreakingSpec spec) : plan_(std::make_unique<Plan>()) {
  detail::init_dispatch();
  const SbShape shape = detail::check_stickbreaking(spec);
  set_sizes(detail::sizes_of(shape));
  plan_->spec = std::move(spec);
  const StickBreakingSpec& sp = plan_->spec;
  plan_->geo =
      detail::rows::Geometry(sp.q, sp.k, sp.v, shape, sp.cu_seqlens_q, sp.cu_seqlens_k, sp.attend_current ? 1 : 0);
}

StickBreakingAttention::~StickBreakingAttention() = default;
StickBreakingAttention::StickBreakingAttention(StickBreakingAttention&&) noexcept = default;
StickBreakingAttention& StickBreakingAttention::operator=(StickBreakingAttention&&) noexcept = default;

const StickBreakingSpec& StickBreakingAttention::spec() const { return plan_->spec; }

AttentionStats StickBreakingAttention::forward(TensorView out, TensorView rem) const {
  if (plan_->geo.shape.dtype == DType::kF64 || detail::use_reference()) {
    ref::stickbreaking_forward(*this, out, rem);
    return {};
  }
  return plan_->forward(out, rem);
}

AttentionStats StickBreakingAttention::backward(ConstTensorView out, ConstTensorView rem, ConstTensorView d_out,
                                                ConstTensorView d_rem, TensorView dq, TensorView dk,
                                                TensorView dv) const {
  if (plan_->geo.shape.dtype == DType::kF64 || detail::use_reference()) {
    ref::stickbreaking_backward(*this, out, rem, d_out, d_rem, dq, dk, dv);
    return {};
  }
  return plan_->backward(out, rem, d_out, d_rem, dq, dk, dv);
}

}  // namespace posenc
