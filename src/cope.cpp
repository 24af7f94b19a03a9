// CoPE (cope.hpp): validation, and the fused forward and backward over blocks of query rows whose
// key tiles run from the diagonal leftwards (row_blocks.hpp), with an online softmax.
#include "posenc/cope.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absolute_checks.hpp"
#include "cope_checks.hpp"
#include "internal.hpp"
#include "kernels/attention/attention_kernels.hpp"
#include "kernels/attention/cope_kernels.hpp"
#include "posenc/error.hpp"
#include "posenc/reference.hpp"

namespace posenc {

namespace detail {
namespace {

void require(bool ok, const char* param, const std::string& value, const std::string& expected) {
  if (!ok) throw Error(kCope, param, value, expected);
}

TableGrid table_grid(const CopeShape& shape, const char* name, ConstTensorView table) {
  require(table.rank() == 2 && table.size(0) >= 1 && table.size(0) <= kCopeMaxPositions && table.size(1) == shape.dim,
          name, table.describe(),
          "[npos, D] with 1 <= npos <= " + std::to_string(kCopeMaxPositions) + " and D = " + std::to_string(shape.dim));
  if (table.dtype() != shape.dtype && table.dtype() != DType::kF32) {
    throw Error(
        kCope, std::string(name) + ".dtype", std::string(dtype_name(table.dtype())),
        shape.dtype == DType::kF32 ? std::string("f32") : std::string(dtype_name(shape.dtype)) + " (as q) or f32");
  }
  return {table.stride(0), table.stride(1), table.dtype()};
}

}  // namespace

CopeShape check_cope(const CopeSpec& spec) {
  CopeShape s;
  static_cast<QkvShape&>(s) =
      check_qkv(kCope, spec.q, spec.k, spec.v, spec.scale, spec.cu_seqlens_q, spec.cu_seqlens_k);
  s.table = table_grid(s, "table", spec.table);
  s.npos = spec.table.size(0);
  return s;
}

HeadsGrid check_cope_forward_outputs(const CopeSpec& spec, const CopeShape& shape, ConstTensorView out,
                                     ConstTensorView lse) {
  const HeadsGrid og = check_output_tokens(kCope, "out", out, shape.out_grid());
  check_out_dtype(kCope, shape, out);
  check_writable(kCope, "out", out);
  if (given(lse)) check_row_stat(kCope, shape, "lse", lse, true);
  check_disjoint(kCope, {{"out", out}, {"lse", lse}},
                 {{"q", spec.q}, {"k", spec.k}, {"v", spec.v}, {"table", spec.table}});
  return og;
}

CopeBackwardGrids check_cope_backward(const CopeSpec& spec, const CopeShape& shape, ConstTensorView out,
                                      ConstTensorView lse, ConstTensorView d_out, ConstTensorView dq,
                                      ConstTensorView dk, ConstTensorView dv, ConstTensorView d_table) {
  CopeBackwardGrids g;
  static_cast<QkvBackwardGrids&>(g) = check_qkv_backward(kCope, shape, out, d_out, dq, dk, dv);
  require(lse.rank() > 0, "lse", "empty", "the forward's lse");
  g.lse = check_row_stat(kCope, shape, "lse", lse, false);
  if (given(d_table)) {
    g.d_table = table_grid(shape, "d_table", d_table);
    require(d_table.size(0) == shape.npos && d_table.dtype() == shape.table.dtype, "d_table", d_table.describe(),
            "the shape and dtype of table, " + spec.table.describe());
    check_writable(kCope, "d_table", d_table);
  }
  check_disjoint(kCope, {{"dq", dq}, {"dk", dk}, {"dv", dv}, {"d_table", d_table}},
                 {{"q", spec.q},
                  {"k", spec.k},
                  {"v", spec.v},
                  {"table", spec.table},
                  {"out", out},
                  {"lse", lse},
                  {"d_out", d_out}});
  return g;
}

}  // namespace detail

// ─── The fused passes ────────────────────────────────────────────────────────────────────────

namespace {

using detail::CopeShape;
using detail::rows::Block;
using detail::rows::BlockWalk;
using detail::rows::Floats;
using detail::rows::grow;
using detail::rows::kKeyTile;
using detail::rows::Unit;
using detail::rows::WalkScratch;
static_assert(kKeyTile <= kernels::kAttnGemmAddDepth);

constexpr float kInf = std::numeric_limits<float>::infinity();

// A thread's buffers beside the walk's, kept between calls.
struct Scratch {
  Floats qe, dqe, qs, dpp, gg;
  std::vector<float> carry, m, l, corr, lse, delta, left, sums;
  std::int64_t bytes() const {
    std::int64_t n = 0;
    for (const Floats* f : {&qe, &dqe, &qs, &dpp, &gg}) n += static_cast<std::int64_t>(f->capacity());
    for (const std::vector<float>* f : {&carry, &m, &l, &corr, &lse, &delta, &left, &sums})
      n += static_cast<std::int64_t>(f->capacity());
    return n * static_cast<std::int64_t>(sizeof(float));
  }
};

Scratch& thread_scratch() {
  thread_local Scratch s;
  return s;
}

// Each row's gate sum before its first key: 0, and +inf for padding rows (clamped: they never
// hold a block back from the gate-free path, and they see no key).
// The compensations (carry[width + r]) start at 0.
void start_carries(const Block& blk, std::vector<float>& carry) {
  grow(carry, 2 * blk.width);
  for (std::int64_t r = 0; r < blk.width; ++r) {
    carry[static_cast<std::size_t>(r)] = blk.head[static_cast<std::size_t>(r)] < 0 ? kInf : 0.0f;
    carry[static_cast<std::size_t>(blk.width + r)] = 0.0f;
  }
}

// Whether every row has counted cap (a NaN sum has not).
bool all_clamped(const Block& blk, const std::vector<float>& carry, float cap) {
  for (std::int64_t r = 0; r < blk.width; ++r) {
    if (!(carry[static_cast<std::size_t>(r)] >= cap)) return false;
  }
  return true;
}

}  // namespace

struct CopeAttention::Plan {
  CopeSpec spec;
  detail::rows::Geometry geo;
  std::int64_t npos = 0, npp = 0;  // positions, padded to lane chunks
  detail::CopeShape shape;         // validated once, by the constructor

  // The table as f32: transposed [D][npp] (for ⟨q, e[n]⟩) and as rows [npos][dp] (for dq).
  void load_table(Floats& et, Floats& rows) const {
    const std::int64_t d = geo.shape.dim, dp = geo.dp;
    et.assign(static_cast<std::size_t>(d * npp), 0.0f);
    rows.assign(static_cast<std::size_t>(npos * dp), 0.0f);
    for (std::int64_t n = 0; n < npos; ++n) {
      for (std::int64_t t = 0; t < d; ++t) {
        const auto x = static_cast<float>(detail::load(spec.table.data(), shape.table.dtype, shape.table.offset(n, t)));
        et[static_cast<std::size_t>(t * npp + n)] = x;
        rows[static_cast<std::size_t>(n * dp + t)] = x;
      }
    }
  }

  // The block's queries (raw rows in w.qrows, scaled and transposed in w.qt) and qe = ⟨q, e[n]⟩.
  bool load_block(const Unit& un, const Block& blk, const Floats& et, WalkScratch& w, Scratch& s) const {
    const auto scale = static_cast<float>(geo.shape.scale);
    const bool finite = geo.load_q(geo.sequences[static_cast<std::size_t>(un.seq)], blk, 1.0f, scale, w.qrows, w.qt);
    grow(s.qe, blk.width * npp);
    kernels::attn_gemm(w.qrows.data(), geo.dp, 1, et.data(), npp, s.qe.data(), npp, blk.width, npp, geo.shape.dim,
                       false);
    return finite;
  }

  AttentionStats forward(TensorView out, TensorView lse) const;
  AttentionStats backward(ConstTensorView out, ConstTensorView lse, ConstTensorView d_out, TensorView dq, TensorView dk,
                          TensorView dv, TensorView d_table) const;
  class Forward;
  class Backward;
};

// The forward's rows: gate sums counted from the diagonal, then an online softmax.
class CopeAttention::Plan::Forward final : public detail::rows::ForwardRows {
 public:
  Forward(const Plan& plan, const Floats& et)
      : plan_(plan), et_(et), cap_(static_cast<float>(plan.npos - 1)), s_(thread_scratch()) {}
  void start(const Unit& un, const Block& blk, WalkScratch& w) override {
    plan_.load_block(un, blk, et_, w, s_);
    start_carries(blk, s_.carry);
    s_.m.assign(static_cast<std::size_t>(blk.width), -kInf);
    s_.l.assign(static_cast<std::size_t>(blk.width), 0.0f);
    grow(s_.corr, blk.width);
  }
  void weigh(const Block& blk, std::int64_t k0, std::int64_t keys, bool masked, WalkScratch& w) override {
    const std::int64_t width = blk.width, dvp = plan_.geo.dvp;
    kernels::cope_forward_tile(w.st.data(), keys, width, k0, blk.hi.data(), masked, s_.qe.data(), plan_.npp, cap_,
                               s_.carry.data());
    kernels::attn_softmax_tile(w.st.data(), keys, width, s_.m.data(), s_.l.data(), s_.corr.data());
    kernels::attn_scale_rows(w.o.data(), dvp, width, dvp, s_.corr.data());
  }
  float finish(std::int64_t r, float* o) override {
    const auto at = static_cast<std::size_t>(r);
    // l == 0 (every logit −inf): a row of 0 and lse −inf, as the softmax engine's.
    const float l = s_.l[at], inv = l == 0 ? 0.0f : 1.0f / l;
    for (std::int64_t c = 0; c < plan_.geo.shape.dim_v; ++c) o[c] *= inv;
    return l == 0 ? -kInf : s_.m[at] + std::log(l);
  }
  std::int64_t bytes() const override { return s_.bytes(); }

 private:
  const Plan& plan_;
  const Floats& et_;
  float cap_;
  Scratch& s_;
};

// The backward's rows: a pass for each tile's Σ dp per row, then the gradients; d_table's sums
// per run of units (`bins`, run after run).
class CopeAttention::Plan::Backward final : public detail::rows::BackwardRows {
 public:
  Backward(const Plan& plan, const detail::CopeBackwardGrids& g, ConstTensorView lse, const Floats& et,
           const Floats& erows, float* bins)
      : plan_(plan),
        g_(g),
        lse_(lse),
        et_(et),
        erows_(erows),
        bins_(bins),
        cap_(static_cast<float>(plan.npos - 1)),
        s_(thread_scratch()) {}
  void start_run(std::int64_t run) override {
    const std::int64_t n = plan_.npos * plan_.geo.dp;
    de_ = bins_ == nullptr ? nullptr : bins_ + run * n;
    if (de_ != nullptr) std::fill(de_, de_ + n, 0.0f);
  }
  bool start(const Unit& un, const Block& blk, WalkScratch& w) override {
    const std::int64_t width = blk.width, dp = plan_.geo.dp, npp = plan_.npp;
    const bool finite = plan_.load_block(un, blk, et_, w, s_);
    const auto scale = static_cast<float>(plan_.shape.scale);
    grow(s_.qs, width * dp);
    for (std::size_t x = 0; x < static_cast<std::size_t>(width * dp); ++x) s_.qs[x] = w.qrows[x] * scale;
    grow(s_.dqe, width * npp);
    for (Floats* f : {&s_.dpp, &s_.gg}) grow(*f, kKeyTile * width);
    for (auto* v : {&s_.lse, &s_.delta, &s_.left}) grow(*v, width);
    std::fill(s_.dqe.begin(), s_.dqe.begin() + width * npp, 0.0f);
    return finite;
  }
  void pad_row(std::int64_t r) override {
    s_.lse[static_cast<std::size_t>(r)] = -kInf;
    s_.delta[static_cast<std::size_t>(r)] = 0.0f;
  }
  bool row(std::int64_t r, std::int64_t b, std::int64_t token, std::int64_t h, double dot) override {
    s_.delta[static_cast<std::size_t>(r)] = static_cast<float>(dot);
    s_.lse[static_cast<std::size_t>(r)] = static_cast<const float*>(lse_.data())[g_.lse.offset(b, token, h)];
    return true;
  }
  // Each tile's Σ dp per row, over the tiles before every row has counted cap (dp is 0 from there
  // on); then sums[t] = Σ over the tiles left of tile t.
  void prepare(BlockWalk& walk) override {
    const Block& blk = walk.blk;
    const std::int64_t w = blk.width, n_tiles = walk.n_tiles();
    s_.sums.assign(static_cast<std::size_t>((n_tiles + 1) * w), 0.0f);
    start_carries(blk, s_.carry);
    for (std::int64_t t = n_tiles - 1; t >= 0 && !all_clamped(blk, s_.carry, cap_); --t) {
      const std::int64_t k0 = walk.k0(t), keys = walk.keys(t);
      ++walk.tiles;
      walk.scores(k0, keys);
      kernels::cope_backward_tile(walk.s.st.data(), walk.s.dpt.data(), s_.dpp.data(), s_.gg.data(), keys, w, k0,
                                  blk.hi.data(), blk.any_masked(k0 + keys), s_.qe.data(), plan_.npp, cap_,
                                  s_.lse.data(), s_.delta.data(), s_.carry.data(), nullptr,
                                  s_.sums.data() + (t + 1) * w);
    }
    for (std::int64_t t = 1; t <= n_tiles; ++t) {
      for (std::int64_t r = 0; r < w; ++r)
        s_.sums[static_cast<std::size_t>(t * w + r)] += s_.sums[static_cast<std::size_t>((t - 1) * w + r)];
    }
    start_carries(blk, s_.carry);
  }
  void tile(const BlockWalk& walk, std::int64_t t, bool masked) override {
    const Block& blk = walk.blk;
    const std::int64_t w = blk.width, k0 = walk.k0(t), keys = walk.keys(t);
    kernels::cope_backward_tile(walk.s.st.data(), walk.s.dpt.data(), s_.dpp.data(), s_.gg.data(), keys, w, k0,
                                blk.hi.data(), masked, s_.qe.data(), plan_.npp, cap_, s_.lse.data(), s_.delta.data(),
                                s_.carry.data(), s_.dqe.data(), nullptr);
    std::copy(s_.sums.begin() + t * w, s_.sums.begin() + (t + 1) * w, s_.left.begin());
    kernels::cope_backward_finish(walk.s.dpt.data(), s_.dpp.data(), s_.gg.data(), keys, w, k0, blk.hi.data(), masked,
                                  s_.left.data());
  }
  const float* scaled_q(const WalkScratch& /*w*/) const override { return s_.qs.data(); }
  // de[n] += Σ_r dqe[r][n]·q_r;  dq_r = scale·dQ_r + Σ_n dqe[r][n]·e[n].
  void finish(const Block& blk, WalkScratch& w, bool want_dq) override {
    const std::int64_t width = blk.width, dp = plan_.geo.dp, npp = plan_.npp, npos = plan_.npos;
    if (de_ != nullptr) kernels::attn_gemm(s_.dqe.data(), 1, npp, w.qrows.data(), dp, de_, dp, npos, dp, width, true);
    if (!want_dq) return;
    const auto scale = static_cast<float>(plan_.shape.scale);
    for (std::int64_t x = 0; x < width * dp; ++x) w.dq[static_cast<std::size_t>(x)] *= scale;
    kernels::attn_gemm(s_.dqe.data(), npp, 1, erows_.data(), dp, w.dq.data(), dp, width, dp, npos, true);
  }
  std::int64_t bytes() const override { return s_.bytes(); }

 private:
  const Plan& plan_;
  const detail::CopeBackwardGrids& g_;
  ConstTensorView lse_;
  const Floats &et_, &erows_;
  float* bins_;
  float* de_ = nullptr;
  float cap_;
  Scratch& s_;
};

AttentionStats CopeAttention::Plan::forward(TensorView out, TensorView lse) const {
  const detail::HeadsGrid og =
      detail::check_cope_forward_outputs(spec, shape, ConstTensorView(out), ConstTensorView(lse));
  const detail::RowStatGrid lg = detail::given(ConstTensorView(lse))
                                     ? detail::check_row_stat(detail::kCope, shape, "lse", ConstTensorView(lse), true)
                                     : detail::RowStatGrid{};
  Floats et, erows;
  load_table(et, erows);
  AttentionStats stats = detail::rows::walk_forward(
      geo, [&] { return std::make_unique<Forward>(*this, et); }, out, og, lse, lg);
  stats.workspace_bytes += static_cast<std::int64_t>((et.size() + erows.size()) * sizeof(float));
  return stats;
}

AttentionStats CopeAttention::Plan::backward(ConstTensorView out, ConstTensorView lse, ConstTensorView d_out,
                                             TensorView dq, TensorView dk, TensorView dv, TensorView d_table) const {
  const detail::CopeBackwardGrids g = detail::check_cope_backward(spec, shape, out, lse, d_out, dq, dk, dv, d_table);
  const std::int64_t dp = geo.dp, d = shape.dim;
  const detail::rows::Split split = geo.backward_split();
  // d_table sums per bin, a fixed run of units taken in order by one thread: the bins depend on
  // the shapes only, and are added in bin order.
  const bool want_de = d_table.rank() > 0;
  const std::int64_t bins = std::min<std::int64_t>(static_cast<std::int64_t>(split.units.size()), 16),
                     bin_floats = npos * dp;
  thread_local Floats bin_store;  // the calling thread's, kept between calls
  grow(bin_store, want_de ? bins * bin_floats : 0);
  float* const bin_sums = want_de ? bin_store.data() : nullptr;
  Floats et, erows;
  load_table(et, erows);
  AttentionStats stats = detail::rows::walk_backward(
      geo, split, bins, [&] { return std::make_unique<Backward>(*this, g, lse, et, erows, bin_sums); }, g, out, d_out,
      dq, dk, dv);
  if (want_de) {
    Floats row(static_cast<std::size_t>(dp));
    for (std::int64_t n = 0; n < npos; ++n) {
      std::fill(row.begin(), row.end(), 0.0f);
      for (std::int64_t b = 0; b < bins; ++b) {
        const float* src = bin_sums + b * bin_floats + n * dp;
        for (std::int64_t t = 0; t < d; ++t) row[static_cast<std::size_t>(t)] += src[t];
      }
      for (std::int64_t t = 0; t < d; ++t) {
        const std::int64_t o = g.d_table.offset(n, t);
        detail::store(d_table.data(), g.d_table.dtype, o,
                      detail::load(d_table.data(), g.d_table.dtype, o) + row[static_cast<std::size_t>(t)]);
      }
    }
  }
  stats.workspace_bytes += (want_de ? bins * bin_floats : 0) * static_cast<std::int64_t>(sizeof(float));
  return stats;
}

// ─── The public object ───────────────────────────────────────────────────────────────────────

CopeAttention::CopeAttention(CopeSpec spec) : plan_(std::make_unique<Plan>()) {
  detail::init_dispatch();
  const CopeShape shape = detail::check_cope(spec);
  set_sizes(detail::sizes_of(shape));
  plan_->spec = std::move(spec);
  const CopeSpec& sp = plan_->spec;
  plan_->geo = detail::rows::Geometry(sp.q, sp.k, sp.v, shape, sp.cu_seqlens_q, sp.cu_seqlens_k, 1);
  plan_->npos = shape.npos;
  plan_->npp = detail::rows::round_up(shape.npos, kernels::kAttnAlign);
  plan_->shape = shape;
}

CopeAttention::~CopeAttention() = default;
CopeAttention::CopeAttention(CopeAttention&&) noexcept = default;
CopeAttention& CopeAttention::operator=(CopeAttention&&) noexcept = default;

const CopeSpec& CopeAttention::spec() const { return plan_->spec; }
std::int64_t CopeAttention::positions() const { return plan_->npos; }

AttentionStats CopeAttention::forward(TensorView out, TensorView lse) const {
  if (plan_->geo.shape.dtype == DType::kF64 || detail::use_reference()) {
    ref::cope_forward(*this, out, lse);
    return {};
  }
  return plan_->forward(out, lse);
}

AttentionStats CopeAttention::backward(ConstTensorView out, ConstTensorView lse, ConstTensorView d_out, TensorView dq,
                                       TensorView dk, TensorView dv, TensorView d_table) const {
  if (plan_->geo.shape.dtype == DType::kF64 || detail::use_reference()) {
    ref::cope_backward(*this, out, lse, d_out, dq, dk, dv, d_table);
    return {};
  }
  return plan_->backward(out, lse, d_out, dq, dk, dv, d_table);
}

}  // namespace posenc
