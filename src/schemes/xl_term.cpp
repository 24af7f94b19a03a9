// Transformer-XL's position terms inside the fused attention (XlTerm, relative.hpp), as a
// ScoreTerm: with δ = p_i − p'_j,
//   x_ij += scale·(u_h·k_j + (q_i + v_h)·P_h(δ)),   P(δ) = W_R r(δ)
// u is folded into the query row (adjust_query), so scale·(q + u)·k is the content and global
// content term; the rest is Qs·P_h(δ) + c_h(δ) with c_h(δ) = scale·(v_h − u_h)·P_h(δ), over a
// table of the δ the mask lets through.
//
// Qs·P_h(δ) for a window of δ is one matrix product per head's run of rows (P's rows are
// consecutive δ); a tile then picks dots[δ(r, j) − lo][r] for every (row, key), and backward sums
// dS the same way before two more products (dQs += sumsᵀ·P, dP += sums·Qs).
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <limits>
#include <mutex>
#include <string>

#include "attention/engine.hpp"
#include "attention/score_term.hpp"
#include "schemes/fused_terms.hpp"
#include "kernels/attention/attention_kernels.hpp"
#include "posenc/error.hpp"
#include "relative_checks.hpp"

namespace posenc::detail {
namespace {

// A group's tables in f32 over δ in [delta_min, delta_min + width) (shared by the groups):
// projected P as [heads][width][Dp] (zero-padded), constant c as [heads][width], u as [heads][D].
// Head-major, so that one head's rows are contiguous: interleaved, they would sit heads·Dp floats
// apart (4 KiB for 8 heads of 128: every row of a product in the same L1 set).
struct XlTables {
  std::int64_t heads = 0;
  std::int64_t width = 0;
  AlignedFloats projected, constant, u;
  // r(δ)'s frequencies ω_i (d_model / 2). P is built from r by blocks of kSinusoidRows; the whole
  // of r, as large as P at d_model = H·D, is kept only once a backward needs it (for dW_R).
  std::vector<double> frequency;
  std::int64_t d_model_padded = 0;
  const float* p_row(std::int64_t t, std::int64_t local_head, std::int64_t dp) const {
    return projected.data() + (local_head * width + t) * dp;
  }
};

// r(δ) rows per block of P's product (1 MiB at d_model 1024); the rows of P do not depend on how
// they are blocked.
constexpr std::int64_t kSinusoidRows = 256;

// Window length: the matrix product over a window re-does the rows' dots for the δ where two
// windows overlap (at most a tile plus a block of rows), so a window of 1024 δ wastes at most
// ~20% over computing each dot once, for 1024 × rows floats (512 KiB at 128 rows) of scratch.
constexpr std::int64_t kWindow = 1024;

// The term state's buffers: the window's dots [u][rows] (decode: a row's dots over the tile's
// keys, [keys]) and dS sums [u][rows] (lo, span: the window), and the unit's dP table
// [width][G][Dp]. s.lo, s.span: the window; s.span 0: none yet.
enum Buffer { kDots, kSums, kDp };

class XlScore final : public GroupTerm<XlTables> {
 public:
  XlScore(const AttentionPlan& p, std::int64_t group, std::int64_t index, const XlParams& params);

  bool merges_decode_heads() const override { return false; }
  bool rows_outer() const override { return true; }
  std::int64_t bytes() const override {
    const XlTables& t = table_;
    std::int64_t total =
        static_cast<std::int64_t>((t.projected.size() + t.constant.size() + t.u.size()) * sizeof(float));
    if (sinusoids_built_.load(std::memory_order_acquire)) {
      total += static_cast<std::int64_t>(sinusoids_.size() * sizeof(float));
    }
    return total;
  }
  void adjust_query(std::int64_t h, float* row) const override {
    const XlTables* t = of_head(h);
    if (t == nullptr) return;
    const float* u = t->u.data() + local_head(h) * p_.dim;
    for (std::int64_t d = 0; d < p_.dim; ++d) row[d] += u[d];
  }

  void begin(const TermRows& rows, TermState& s) const override {
    s.rows = rows;
    s.unit_grads = nullptr;
    s.span = 0;
  }
  void add_scores(const TermTile& tile, float* st, TermState& s) const override;
  std::int64_t unit_gradient_size() const override {
    return width_ * p_.group_size * (p_.dim_padded + 1) + p_.group_size * p_.dim;
  }
  void begin_backward(const TermRows& rows, double* unit_grads, TermState& s) const override {
    s.rows = rows;
    s.unit_grads = unit_grads;
    s.span = 0;
    const std::int64_t n = width_ * p_.group_size * p_.dim_padded;
    if (unit_grads != nullptr) {
      grow(s.buffers[kDp], n);
      std::fill(s.buffers[kDp].begin(), s.buffers[kDp].begin() + n, 0.0f);
    }
  }
  void backward_tile(const TermTile& tile, const float* /* pt */, const float* dst, TermState& s) const override {
    collect(*tile.rows, tile.keys, tile.kpos, s.lo, s.span, dst, s.buffers[kSums].data(), tile.rows->width);
  }
  void end_rows(const RowBlock& rows, std::int64_t r0, TermState& s) const override {
    if (s.span > 0) backward_window(rows, r0, s);
    s.span = 0;
  }
  void finish_backward(TermState& s) const override;
  void reduce(std::span<const TermUnit> units, AttentionGradients& grads) const override;

 private:
  void plan_range();
  void sinusoid_rows(const XlTables& t, std::int64_t u0, std::int64_t count, std::vector<float>& r) const;
  const std::vector<float>& sinusoids() const;
  bool tile_range(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, std::int64_t* lo,
                  std::int64_t* hi) const;
  void window(const RowBlock& rb, const float* rows_t, std::int64_t ld_t, std::int64_t lo, std::int64_t span,
              float* dots, std::int64_t ld) const;
  template <class Fn>
  void for_each_pair(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, std::int64_t lo,
                     std::int64_t span, std::int64_t ld, Fn&& fn) const;
  template <class Fn>
  bool for_each_chunk(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, std::int64_t lo,
                      std::int64_t span, std::int64_t ld, Fn&& fn) const;
  void add_rows(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, std::int64_t lo, std::int64_t span,
                const float* dots, std::int64_t ld, float* st) const;
  void collect(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, std::int64_t lo, std::int64_t span,
               const float* dst, float* sums, std::int64_t ld) const;
  void add_direct(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, const float* q_rows, float* st,
                  TermState& s) const;
  void backward_window(const RowBlock& sub, std::int64_t r0, TermState& s) const;

  const XlParams& params_;  // the XlTerm's, which outlives the call's plan
  std::int64_t index_;      // the term's entry in its group's terms
  std::int64_t delta_min_ = 0, width_ = 0;
  // r(δ), [width][d_model_padded]: built by the first backward that needs dW_R (calls
  // may share the Attention from several threads), kept for the next ones.
  mutable std::once_flag sinusoids_once_;
  mutable std::vector<float> sinusoids_;
  mutable std::atomic<bool> sinusoids_built_{false};
};

// The δ range of the pairs the mask lets through (exact per query with default key positions;
// the sequence's key-position range otherwise).
void XlScore::plan_range() {
  std::int64_t lo = std::numeric_limits<std::int64_t>::max(), hi = std::numeric_limits<std::int64_t>::min();
  const bool default_keys = !p_.spec.k_positions.has_value();
  for (const Sequence& seq : p_.sequences) {
    std::int64_t k_lo = std::numeric_limits<std::int64_t>::max(), k_hi = std::numeric_limits<std::int64_t>::min();
    if (!default_keys) {
      for (std::int64_t j = 0; j < seq.lk; ++j) {
        k_lo = std::min(k_lo, p_.k_position(seq, j));
        k_hi = std::max(k_hi, p_.k_position(seq, j));
      }
    }
    const std::int64_t offset = seq.lk - seq.lq;
    for (std::int64_t i = 0; i < seq.lq; ++i) {
      std::int64_t first = 0, last = seq.lk;  // visible keys [first, last), layout_rows' rule
      if (p_.mask.window_left >= 0) first = std::max<std::int64_t>(0, i + offset - p_.mask.window_left);
      if (p_.window_right >= 0) last = std::min<std::int64_t>(seq.lk, i + offset + p_.window_right + 1);
      if (last <= first) continue;
      const std::int64_t qp = p_.q_position(seq, i);
      lo = std::min(lo, qp - (default_keys ? last - 1 : k_hi));
      hi = std::max(hi, qp - (default_keys ? first : k_lo));
    }
  }
  if (lo > hi) lo = hi = 0;  // nothing visible: a one-row table keeps the code paths uniform
  delta_min_ = lo;
  width_ = hi - lo + 1;
}

// r(δ) of the table's rows u0 … u0 + count − 1 into r ([count][d_model_padded], zero-padded), as
// XlParams::sinusoid computes it (same frequencies, same fp64 angle δ·ω_i), rounded to f32.
void XlScore::sinusoid_rows(const XlTables& t, std::int64_t u0, std::int64_t count, std::vector<float>& r) const {
  const auto half = static_cast<std::int64_t>(t.frequency.size());
  r.assign(static_cast<std::size_t>(count * t.d_model_padded), 0.0f);
  for (std::int64_t u = 0; u < count; ++u) {
    float* row = r.data() + u * t.d_model_padded;
    for (std::int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(delta_min_ + u0 + u) * t.frequency[static_cast<std::size_t>(i)];
      row[i] = static_cast<float>(std::sin(angle));
      row[half + i] = static_cast<float>(std::cos(angle));
    }
  }
}

const std::vector<float>& XlScore::sinusoids() const {
  std::call_once(sinusoids_once_, [this] {
    sinusoid_rows(table_, 0, width_, sinusoids_);
    sinusoids_built_.store(true, std::memory_order_release);
  });
  return sinusoids_;
}

// P_h(δ) = W_R r(δ) as f32 matrix products r·W_Rᵀ over blocks of δ (blocked_gemm); c_h(δ) from P
// in fp64.
XlScore::XlScore(const AttentionPlan& p, std::int64_t group, std::int64_t index, const XlParams& params)
    : GroupTerm(p, group), params_(params), index_(index) {
  const std::int64_t dim = p.dim, dp = p.dim_padded;
  const HeadGroup& grp = p.spec.groups[static_cast<std::size_t>(group)];
  const std::string name = "groups[" + std::to_string(group) + "].terms[" + std::to_string(index) + "]";
  const auto require = [](bool ok, const std::string& param, const std::string& value, const std::string& expected) {
    if (!ok) throw Error(AttentionPlan::kWhere, param.c_str(), value, expected);
  };
  // XL folds u into the query rows, which a Shaw term or another XL term would then read.
  bool relative_beside = false;
  for (std::size_t t = 0; t < grp.terms.size(); ++t) {
    const AttentionTerm* other = grp.terms[t].get();
    relative_beside = relative_beside || dynamic_cast<const ShawTerm*>(other) != nullptr ||
                      (dynamic_cast<const XlTerm*>(other) != nullptr && static_cast<std::int64_t>(t) != index);
  }
  require(grp.transform.index() == 0 && !grp.bias && !relative_beside, name,
          "xl with a transform, a bias or another Shaw or XL term",
          "alone: Transformer-XL is the whole positional scheme of its heads");
  require(params.head_dim() == dim, name + ".params.head_dim", std::to_string(params.head_dim()),
          "the head_dim of q, " + std::to_string(dim));
  const double xl_scale = params.scale() > 0 ? params.scale() : 1.0 / std::sqrt(static_cast<double>(dim));
  require(std::abs(xl_scale - p.scale_f64) <= 1e-12 * p.scale_f64, name + ".params.scale", to_text(xl_scale),
          "the attention's scale, " + to_text(p.scale_f64) + " (one scale multiplies all of XL's terms)");
  plan_range();
  // The call's XL tables are [δ span, XL heads, Dp] floats together; past 2^29 (2 GiB) the
  // positions are too scattered for tabulation: say so rather than allocate them.
  std::int64_t xl_heads = 0;
  for (const HeadGroup& g : p.spec.groups) {
    for (const AttentionTermRef& t : g.terms) xl_heads += dynamic_cast<const XlTerm*>(t.get()) != nullptr ? g.heads : 0;
  }
  constexpr std::int64_t kMaxXlTable = std::int64_t{1} << 29;
  if (width_ > kMaxXlTable / (xl_heads * dp)) {
    throw Error(AttentionPlan::kWhere, name.c_str(), "a δ = q − k span of " + std::to_string(width_) + " positions",
                "at most " + std::to_string(kMaxXlTable / (xl_heads * dp)) +
                    " for fused Transformer-XL (P(δ) is tabulated); use xl_add_position_terms for scattered positions");
  }
  init_dispatch();
  XlTables& t = table_;
  const std::int64_t hg = grp.heads, dm = params.d_model(), dmp = round_up(dm, kAttnAlign);
  const std::int64_t cols = hg * dp;
  t.heads = hg;
  t.d_model_padded = dmp;
  t.frequency.resize(static_cast<std::size_t>(dm / 2));
  for (std::int64_t i = 0; i < dm / 2; ++i)
    t.frequency[static_cast<std::size_t>(i)] = sinusoid_inv_frequency(params.base(), dm, i);
  std::vector<float> wt(static_cast<std::size_t>(dmp * cols), 0.0f);
  for (std::int64_t h = 0; h < hg; ++h) {
    for (std::int64_t d = 0; d < dim; ++d) {
      for (std::int64_t m = 0; m < dm; ++m) {
        wt[static_cast<std::size_t>(m * cols + h * dp + d)] =
            static_cast<float>(params.w_r()[static_cast<std::size_t>((h * dim + d) * dm + m)]);
      }
    }
  }
  // P by blocks of δ: r's rows, their product with W_Rᵀ, stored head-major.
  t.width = width_;
  t.projected.assign(static_cast<std::size_t>(width_ * cols), 0.0f);
  std::vector<float> r, by_delta(static_cast<std::size_t>(std::min(width_, kSinusoidRows) * cols));
  for (std::int64_t u0 = 0; u0 < width_; u0 += kSinusoidRows) {
    const std::int64_t n = std::min(kSinusoidRows, width_ - u0);
    sinusoid_rows(t, u0, n, r);
    blocked_gemm(r.data(), dmp, 1, wt.data(), cols, by_delta.data(), cols, n, cols, dm);
    for (std::int64_t h = 0; h < hg; ++h) {
      for (std::int64_t u = 0; u < n; ++u) {
        const float* from = by_delta.data() + u * cols + h * dp;
        std::copy(from, from + dp, t.projected.data() + (h * width_ + u0 + u) * dp);
      }
    }
  }
  t.u.assign(static_cast<std::size_t>(hg * dim), 0.0f);
  t.constant.assign(static_cast<std::size_t>(hg * width_), 0.0f);
  for (std::int64_t h = 0; h < hg; ++h) {
    for (std::int64_t d = 0; d < dim; ++d)
      t.u[static_cast<std::size_t>(h * dim + d)] =
          static_cast<float>(params.u()[static_cast<std::size_t>(h * dim + d)]);
    for (std::int64_t u = 0; u < width_; ++u) {
      const float* row = t.p_row(u, h, dp);
      double c = 0;
      for (std::int64_t d = 0; d < dim; ++d) {
        const auto at = static_cast<std::size_t>(h * dim + d);
        c += (params.v()[at] - params.u()[at]) * static_cast<double>(row[d]);
      }
      t.constant[static_cast<std::size_t>(h * width_ + u)] = static_cast<float>(p.scale_f64 * c);
    }
  }
}

// The δ range the XL rows of the block meet against keys kpos[0..keys), within the table.
bool XlScore::tile_range(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, std::int64_t* lo,
                         std::int64_t* hi) const {
  std::int64_t q_lo = std::numeric_limits<std::int64_t>::max(), q_hi = std::numeric_limits<std::int64_t>::min();
  for (std::int64_t r = 0; r < rb.width; ++r) {
    const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
    if (h < 0 || of_head(h) == nullptr) continue;
    q_lo = std::min(q_lo, rb.position[static_cast<std::size_t>(r)]);
    q_hi = std::max(q_hi, rb.position[static_cast<std::size_t>(r)]);
  }
  if (q_lo > q_hi || keys == 0) return false;
  const auto [k_lo, k_hi] = std::minmax_element(kpos, kpos + keys);
  *lo = std::max(q_lo - *k_hi, delta_min_);
  *hi = std::min(q_hi - *k_lo, delta_min_ + width_ - 1);
  return *lo <= *hi;
}

// dots[u][r] = Qs_r·P_h(lo + u) + c_h(lo + u) for u < span; rows_t: Qs transposed, [d][r].
void XlScore::window(const RowBlock& rb, const float* rows_t, std::int64_t ld_t, std::int64_t lo, std::int64_t span,
                     float* dots, std::int64_t ld) const {
  for_each_run(rb, [&](std::int64_t r0, std::int64_t n, std::int64_t h) {
    const XlTables& t = *of_head(h);
    const std::int64_t lh = local_head(h), t0 = lo - delta_min_;
    kernels::attn_gemm(t.p_row(t0, lh, p_.dim_padded), p_.dim_padded, 1, rows_t + r0, ld_t, dots + r0, ld, span, n,
                       p_.dim, false);
    const float* c = t.constant.data() + lh * width_ + t0;
    for (std::int64_t u = 0; u < span; ++u) {
      float* row = dots + u * ld + r0;
      for (std::int64_t r = 0; r < n; ++r) row[r] += c[u];
    }
  });
}

// Calls fn(tile index j·w + r, window index u·ld + r) for every pair of an XL row r and key j
// whose δ falls in the window [lo, lo + span) (pairs outside it are masked ones).
template <class Fn>
void XlScore::for_each_pair(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, std::int64_t lo,
                            std::int64_t span, std::int64_t ld, Fn&& fn) const {
  const std::int64_t w = rb.width;
  for (std::int64_t r = 0; r < w; ++r) {
    const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
    if (h < 0 || of_head(h) == nullptr) continue;
    const std::int64_t base = rb.position[static_cast<std::size_t>(r)] - lo;
    for (std::int64_t j = 0; j < keys; ++j) {
      const std::int64_t u = base - kpos[j];
      if (u >= 0 && u < span) fn(j * w + r, u * ld + r);
    }
  }
}

// The XL pairs of a block by lane chunks, through the gather kernels: fn(chunk's first row, its
// lanes' bases, the keys' offsets), u = base[t] − offset[j], both relative to the tile's first key
// position, in int32. Returns false before running any chunk when a value would not fit; the caller
// then takes the scalar walk. Bases and offsets stay within the table's δ span (< 2^26 under its
// 2 GiB cap) plus a row block and a key tile, so in practice only a window·row-block product past
// 2^30 — small D, G = 1 and a table near the cap, which no test builds — takes the walk.
template <class Fn>
bool XlScore::for_each_chunk(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, std::int64_t lo,
                             std::int64_t span, std::int64_t ld, Fn&& fn) const {
  constexpr std::int64_t kLimit = std::int64_t{1} << 30, kMaxKeys = 256;
  constexpr std::int32_t kNever = -(std::int32_t{1} << 30);  // u = kNever − offset < 0 for every key
  if (keys == 0) return true;
  if (keys > kMaxKeys || span * ld + kAttnAlign >= kLimit) return false;
  const std::int64_t k_ref = *std::min_element(kpos, kpos + keys);
  std::array<std::int32_t, kMaxKeys> offset{};
  for (std::int64_t j = 0; j < keys; ++j) {
    if (kpos[j] - k_ref >= kLimit) return false;
    offset[static_cast<std::size_t>(j)] = static_cast<std::int32_t>(kpos[j] - k_ref);
  }
  const auto base_of = [&](std::int64_t r) -> std::int64_t {
    const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
    if (h < 0 || of_head(h) == nullptr) return kNever;
    return rb.position[static_cast<std::size_t>(r)] - lo - k_ref;
  };
  for (std::int64_t r = 0; r < rb.width; ++r) {
    const std::int64_t b = base_of(r);
    if (b != kNever && (b <= kNever || b >= kLimit)) return false;
  }
  std::array<std::int32_t, kAttnAlign> base{};
  for (std::int64_t c = 0; c < rb.width; c += kAttnAlign) {
    bool any = false;
    for (std::int64_t t = 0; t < kAttnAlign; ++t) {
      const std::int64_t b = base_of(c + t);
      base[static_cast<std::size_t>(t)] = static_cast<std::int32_t>(b);
      any = any || b != kNever;
    }
    if (any) fn(c, base.data(), offset.data());
  }
  return true;
}

// st[j][r] += dots[δ(r, j) − lo][r] for the XL rows.
void XlScore::add_rows(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, std::int64_t lo,
                       std::int64_t span, const float* dots, std::int64_t ld, float* st) const {
  const std::int64_t w = rb.width;
  if (for_each_chunk(rb, keys, kpos, lo, span, ld,
                     [&](std::int64_t c, const std::int32_t* base, const std::int32_t* offset) {
                       kernels::attn_xl_add(st + c, keys, w, dots + c, ld, span, base, offset);
                     })) {
    return;
  }
  for_each_pair(rb, keys, kpos, lo, span, ld, [&](std::int64_t at, std::int64_t from) { st[at] += dots[from]; });
}

// sums[δ(r, j) − lo][r] += dst[j][r] (the transpose of add_rows).
void XlScore::collect(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, std::int64_t lo,
                      std::int64_t span, const float* dst, float* sums, std::int64_t ld) const {
  const std::int64_t w = rb.width;
  if (for_each_chunk(rb, keys, kpos, lo, span, ld,
                     [&](std::int64_t c, const std::int32_t* base, const std::int32_t* offset) {
                       kernels::attn_xl_collect(dst + c, keys, w, sums + c, ld, span, base, offset);
                     })) {
    return;
  }
  for_each_pair(rb, keys, kpos, lo, span, ld, [&](std::int64_t from, std::int64_t at) { sums[at] += dst[from]; });
}

// Decode rows (few): st[j][r] += Qs_r·P_h(δ) + c_h(δ). Keys at consecutive positions meet
// consecutive rows of P (δ falls by one per key): the decode score kernel reads them as a block
// of rows −Dp apart, in vectors; scattered positions take a dot product per pair.
void XlScore::add_direct(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, const float* q_rows,
                         float* st, TermState& s) const {
  const std::int64_t w = rb.width, dp = p_.dim_padded;
  const bool consecutive = keys > 0 && positions_consecutive(kpos, keys);
  if (consecutive) grow(s.buffers[kDots], keys);
  for (std::int64_t r = 0; r < w; ++r) {
    const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
    const XlTables* t = h < 0 ? nullptr : of_head(h);
    if (t == nullptr) continue;
    const std::int64_t lh = local_head(h), qp = rb.position[static_cast<std::size_t>(r)];
    const float* q = q_rows + r * dp;
    const float* c = t->constant.data() + lh * width_;
    if (consecutive) {
      // Key j at table row base − j; the rows outside [0, width) are masked pairs.
      const std::int64_t base = qp - kpos[0] - delta_min_;
      const std::int64_t j_lo = std::max<std::int64_t>(0, base - width_ + 1), j_hi = std::min(keys - 1, base);
      if (j_lo > j_hi) continue;
      float* dots = s.buffers[kDots].data() + j_lo;
      kernels::attn_decode_scores(t->p_row(base - j_lo, lh, dp), DType::kF32, -dp, 0, j_hi - j_lo + 1, 1, &q, dp, 1,
                                  p_.dim, &dots, 1, kernels::RowPrefetch{}, false);
      for (std::int64_t j = j_lo; j <= j_hi; ++j)
        st[j * w + r] += s.buffers[kDots][static_cast<std::size_t>(j)] + c[base - j];
      continue;
    }
    for (std::int64_t j = 0; j < keys; ++j) {
      const std::int64_t u = qp - kpos[j] - delta_min_;
      if (u < 0 || u >= width_) continue;  // outside every visible pair's δ: masked
      const float* pr = t->p_row(u, lh, dp);
      float sum = c[u];
      for (std::int64_t e = 0; e < p_.dim; ++e) sum += q[e] * pr[e];
      st[j * w + r] += sum;
    }
  }
}

// Prefill blocks keep a window of their rows' dots over kWindow δ values, moved down as the tiles
// advance (δ = q − k falls); backward flushes a window's dS sums (backward_window) when it moves.
void XlScore::add_scores(const TermTile& tile, float* st, TermState& s) const {
  const RowBlock& sub = *tile.rows;
  if (tile.decode) {
    add_direct(sub, tile.keys, tile.kpos, s.rows.q, st, s);
    return;
  }
  const bool backward = s.rows.dout != nullptr;
  const std::int64_t bw = sub.width;
  std::int64_t lo = 0, hi = 0;
  if (!tile_range(sub, tile.keys, tile.kpos, &lo, &hi)) {
    if (!backward) return;
    lo = hi = delta_min_;  // no XL row: an idle one-entry window
  }
  if (s.span == 0 || lo < s.lo || hi >= s.lo + s.span) {
    if (backward && s.span > 0) backward_window(sub, tile.r0, s);
    s.lo = std::max(delta_min_, std::min(lo, hi - kWindow + 1));
    s.span = hi - s.lo + 1;
    grow(s.buffers[kDots], s.span * bw);
    if (backward) {
      grow(s.buffers[kSums], s.span * bw);
      std::fill(s.buffers[kSums].begin(), s.buffers[kSums].begin() + s.span * bw, 0.0f);
    }
    window(sub, s.rows.qt + tile.r0, s.rows.ldt, s.lo, s.span, s.buffers[kDots].data(), bw);
  }
  add_rows(sub, tile.keys, tile.kpos, s.lo, s.span, s.buffers[kDots].data(), bw, st);
}

// A row block's window of dS sums over δ: dQs += sumsᵀ·P_h (into the unit's dq rows, which get
// the scale at the end), dP_h += sums·Qs (the unit's table) and Σ dS per δ (for c_h).
void XlScore::backward_window(const RowBlock& sub, std::int64_t r0, TermState& s) const {
  const std::int64_t bw = sub.width, dp = p_.dim_padded, g_count = p_.group_size;
  const std::int64_t kvh = s.rows.kvh;
  for_each_run(sub, [&](std::int64_t ra, std::int64_t n, std::int64_t h) {
    const XlTables& t = *of_head(h);
    const std::int64_t lh = local_head(h), t0 = s.lo - delta_min_, g = h - kvh * g_count;
    const float* sums = s.buffers[kSums].data() + ra;
    kernels::attn_gemm(sums, 1, bw, t.p_row(t0, lh, dp), dp, s.rows.dq + (r0 + ra) * dp, dp, n, dp, s.span, true);
    if (s.unit_grads == nullptr) return;
    kernels::attn_gemm(sums, bw, 1, s.rows.q + (r0 + ra) * dp, dp, s.buffers[kDp].data() + (t0 * g_count + g) * dp,
                       g_count * dp, s.span, dp, n, true);
    double* hist = s.unit_grads + width_ * g_count * dp + g * width_ + t0;
    for (std::int64_t u = 0; u < s.span; ++u) {
      const float* row = sums + u * bw;
      double sum = 0;
      for (std::int64_t r = 0; r < n; ++r) sum += static_cast<double>(row[r]);
      hist[u] += sum;
    }
  });
}

// The unit's slot: [dP [width][G][Dp] | Σ dS per (local head, δ) [G][width] | Σ dQs rows [G][D]],
// dQs as the engine will store it (times the scale; XL heads have no transform).
void XlScore::finish_backward(TermState& s) const {
  if (s.unit_grads == nullptr) return;
  const RowBlock& rb = *s.rows.rows;
  const std::int64_t dp = p_.dim_padded, d = p_.dim, g_count = p_.group_size;
  double* dqs = s.unit_grads + width_ * g_count * (dp + 1);
  for (std::int64_t r = 0; r < rb.width; ++r) {
    const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
    if (h < 0 || of_head(h) == nullptr) continue;
    const float* row = s.rows.dq + r * dp;
    for (std::int64_t t = 0; t < d; ++t)
      dqs[(h - s.rows.kvh * g_count) * d + t] += static_cast<double>(row[t] * p_.scale);
  }
  const std::int64_t n = width_ * g_count * dp;
  for (std::int64_t t = 0; t < n; ++t)
    s.unit_grads[t] += static_cast<double>(s.buffers[kDp][static_cast<std::size_t>(t)]);
}

// The parameters' gradients from the per-KV-head totals of the units' slots (fp64):
//   dP_h(δ) = Σ dS·Qs + scale·(v_h − u_h)·Σ dS      (the second part through c_h(δ))
//   dv_h = scale·Σ_δ (Σ dS)·P_h(δ),   du_h = Σ_i d(q + u)_i − dv_h,
//   dW_R[h·D + d][m] = Σ_δ dP_h(δ)[d]·r(δ)[m]  (an f32 matrix product, blocked_gemm).
void XlScore::reduce(std::span<const TermUnit> units, AttentionGradients& grads) const {
  const std::int64_t per_kv = unit_gradient_size(), dp = p_.dim_padded, g_count = p_.group_size, dim = p_.dim;
  const std::vector<double>& totals = sum_slots_per_kv_head(units, per_kv, p_.kv_heads, CallBuffer::kTermTotals);
  const auto gi = static_cast<std::size_t>(group_);
  const XlTables& t = table_;
  const XlParams& params = params_;
  std::vector<double>& flat = grads.groups[gi].terms[static_cast<std::size_t>(index_)];
  const std::int64_t hd = params.heads() * dim;
  double* out_u = flat.data();
  double* out_v = flat.data() + hd;
  double* out_w_r = flat.data() + 2 * hd;
  const std::int64_t hg = t.heads, h_first = p_.group_first_head[gi], cols = hg * dp;
  AlignedFloats& d_projected = zeroed_floats(CallBuffer::kTerm0, static_cast<std::size_t>(width_ * cols));
  // Heads are independent (their own columns of d_projected, their own u and v): in parallel.
#pragma omp parallel for schedule(static) num_threads(std::min <int>(threads_for(width_ * cols), static_cast <int>(hg)))
  for (std::int64_t lh = 0; lh < hg; ++lh) {
    const std::int64_t h = h_first + lh, kvh = h / g_count, g = h % g_count;
    const double* dp_total = totals.data() + kvh * per_kv;
    const double* hist = dp_total + width_ * g_count * dp + g * width_;
    const double* dqs = dp_total + width_ * g_count * (dp + 1) + g * dim;
    // δ outer, so that every row walks in memory order; each dv[d] still sums over δ in order.
    std::vector<double> dv(static_cast<std::size_t>(dim), 0.0);
    for (std::int64_t u = 0; u < width_; ++u) {
      const double sum = hist[u];
      const float* p_row = t.p_row(u, lh, dp);
      const double* dp_row = dp_total + (u * g_count + g) * dp;
      float* to = d_projected.data() + u * cols + lh * dp;
      for (std::int64_t d = 0; d < dim; ++d) {
        const auto at = static_cast<std::size_t>(lh * dim + d);
        dv[static_cast<std::size_t>(d)] += sum * static_cast<double>(p_row[d]);
        to[d] = static_cast<float>(dp_row[d] + p_.scale_f64 * (params.v()[at] - params.u()[at]) * sum);
      }
    }
    for (std::int64_t d = 0; d < dim; ++d) {
      const auto at = static_cast<std::size_t>(lh * dim + d);
      const double dv_d = dv[static_cast<std::size_t>(d)] * p_.scale_f64;
      out_v[at] += dv_d;
      out_u[at] += dqs[d] - dv_d;
    }
  }
  const std::int64_t dm = params.d_model(), dmp = t.d_model_padded;
  AlignedFloats& dw = zeroed_floats(CallBuffer::kTerm1, static_cast<std::size_t>(cols * dmp));
  blocked_gemm(d_projected.data(), 1, cols, sinusoids().data(), dmp, dw.data(), dmp, cols, dmp, width_);
#pragma omp parallel for schedule(static) num_threads(threads_for(cols* dm))
  for (std::int64_t row = 0; row < hg * dim; ++row) {
    const std::int64_t lh = row / dim, d = row % dim;
    for (std::int64_t m = 0; m < dm; ++m) {
      out_w_r[(lh * dim + d) * dm + m] += dw[static_cast<std::size_t>((lh * dp + d) * dmp + m)];
    }
  }
}

}  // namespace

}  // namespace posenc::detail

namespace posenc {

std::unique_ptr<detail::ScoreTerm> detail::fused_form(const XlTerm& term, const AttentionPlan& plan, std::int64_t group,
                                                      std::int64_t index) {
  return std::make_unique<XlScore>(plan, group, index, term.params());
}

}  // namespace posenc
