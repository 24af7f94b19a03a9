// The two normalisers in place of the softmax, differentially, on their own classes (Attention
// hands them the call): stick-breaking (the first byte even) or CoPE (odd). Small random shapes
// (decode's few queries included), GQA, packed sequences (some refused: more queries than keys),
// every dtype, any scale (refused by name unless finite), values narrower or wider than the keys;
// stick-breaking with attend_current and the vanishing-tile stop on or off, CoPE with tables of 1
// to 80 positions (clamped early or never) in q's dtype or f32, random or with rows on a line; now
// and then a NaN or ±inf in q, k, v, d_out, and d_rem or the table. Forward against the fp64
// reference (ref::stickbreaking_forward, ref::cope_forward), and for f32 inputs backward against
// ref::stickbreaking_backward or ref::cope_backward: non-finite values in the same places, finite
// ones within tolerance (docs/fuzzing.md). CoPE's dq and dk are compared on tables with rows on a
// line only: their derivative steps where a gate sum crosses an integer, and an f32 sum within its
// rounding of one may take the other side (test_cope.cpp).
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "fuzzing.hpp"

using namespace posenc;

namespace {

std::vector<double> as_doubles(const std::vector<unsigned char>& bytes, DType dt) {
  std::vector<double> x(bytes.size() / dtype_size(dt));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = fuzz::element(bytes, dt, i);
  return x;
}

// The fused object and its fp64 twin, of either class.
struct Pair {
  std::optional<StickBreakingAttention> sb, sb64;
  std::optional<CopeAttention> cope, cope64;
  // out in out_dtype, the row statistic (rem or lse) in f32.
  void forward(bool reference, const TensorView& out, const TensorView& stat) const {
    if (sb) {
      (reference ? *sb64 : *sb).forward(out, stat);
    } else {
      (reference ? *cope64 : *cope).forward(out, stat);
    }
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::set_up();
  fuzz::Input in(data, size);
  const bool cope = (in.byte() & 1) != 0;
  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kF16};
  const DType dtype = dtypes[in.pick(3)];
  const DType table_dtype = cope && in.flag() ? DType::kF32 : dtype;
  const std::int64_t kv_heads = in.integer(1, 2), heads = in.flag() ? in.integer(1, 5) : kv_heads * in.integer(1, 3);
  const std::int64_t dims[] = {1, 4, 8, 16, 24, 32, 40, 64};
  const std::int64_t dim = dims[in.pick(8)], dim_v = in.flag() ? dim : dims[in.pick(8)];
  const std::int64_t npos = !cope ? 0 : in.flag() ? in.integer(1, 8) : in.integer(1, 80);
  const bool linear = cope && in.flag();
  const bool packed = in.flag();
  std::int64_t batch = packed ? 1 : in.integer(1, 2), q_len = 0, k_len = 0;
  std::vector<std::int64_t> cu_q, cu_k;
  if (packed) {
    cu_q = {0};
    cu_k = {0};
    for (std::int64_t s = in.integer(1, 3); s > 0; --s) {
      const std::int64_t lk = in.integer(0, 90), lq = in.integer(0, std::min<std::int64_t>(lk + 1, 48));
      cu_q.push_back(cu_q.back() + lq);
      cu_k.push_back(cu_k.back() + lk);
    }
    q_len = cu_q.back();
    k_len = cu_k.back();
  } else {
    k_len = in.flag() ? in.integer(1, 300) : in.integer(1, 40);
    q_len = in.flag() ? in.integer(1, 4) : in.integer(1, std::min<std::int64_t>(k_len + 1, 48));
  }
  // The fp64 reference runs under the sanitizers: at most 2^19 products per call.
  if (batch * q_len * (k_len * (dim + dim_v) + npos * dim) * heads > (std::int64_t{1} << 19)) return 0;
  const bool attend_current = !cope && in.flag(), skip = !cope && in.flag();
  // Any scale is refused by name or runs; the differential check needs scale·q·k within f32's
  // range (a product past FLT_MAX is inf in the f32 logits, finite in fp64), so large accepted
  // scales stop after the forward's checks.
  const double scale_drawn = in.flag() ? in.any_number() : (in.flag() ? 0.0 : in.uniform(-2.0, 2.0));
  const std::int64_t tokens_q = batch * q_len, tokens_k = batch * k_len;
  const auto values = [&](std::int64_t n, double scale, DType dt) {
    std::vector<double> x(static_cast<std::size_t>(n));
    for (double& v : x) v = fuzz::element(fuzz::store({in.uniform(-scale, scale)}, dt), dt, 0);
    return x;
  };
  // Stick-breaking's q and k in [−3, 3]: logits of up to tens of units, so that rows use their
  // stick up at once.
  const double qk = cope ? 2 : 3;
  std::vector<double> q = values(tokens_q * heads * dim, qk, dtype), k = values(tokens_k * kv_heads * dim, qk, dtype),
                      v = values(tokens_k * kv_heads * dim_v, 1, dtype), table, d_out, d_rem;
  if (cope) {
    table = values(npos * dim, 1, table_dtype);
    d_out = values(tokens_q * heads * dim_v, 1, dtype);
  } else {
    d_out = values(tokens_q * heads * dim_v, 1, dtype);
    d_rem = values(tokens_q * heads, 1, dtype);
  }
  if (linear) {
    for (std::int64_t n = 2; n < npos; ++n) {
      for (std::int64_t t = 0; t < dim; ++t) {
        const auto at = [&](std::int64_t m) -> double& { return table[static_cast<std::size_t>(m * dim + t)]; };
        at(n) =
            fuzz::element(fuzz::store({at(0) + static_cast<double>(n) * (at(1) - at(0))}, table_dtype), table_dtype, 0);
      }
    }
  }
  std::string placed = "none";
  if (in.flag()) {
    std::vector<double>* targets[] = {&q, &k, &v, cope ? &table : &d_out, cope ? &d_out : &d_rem};
    const std::size_t which = in.pick(5);
    std::vector<double>& t = *targets[which];
    const double bad[] = {std::nan(""), INFINITY, -INFINITY};
    const double value = bad[in.pick(3)];
    if (!t.empty()) {
      const std::size_t at = in.pick(t.size());
      t[at] = value;
      placed = fuzz::number(value) + " in " + (cope ? "qkved" : "qkvdr")[which] + " at " + std::to_string(at);
    }
  }
  const auto shape = [&](std::int64_t len, std::int64_t h, std::int64_t d) {
    return packed ? std::vector<std::int64_t>{len, h, d} : std::vector<std::int64_t>{batch, len, h, d};
  };
  const std::vector<std::int64_t> q_shape = shape(q_len, heads, dim), k_shape = shape(k_len, kv_heads, dim),
                                  v_shape = shape(k_len, kv_heads, dim_v), o_shape = shape(q_len, heads, dim_v),
                                  t_shape = {npos, dim};
  const std::vector<std::int64_t> stat_shape =
      packed ? std::vector<std::int64_t>{q_len, heads} : std::vector<std::int64_t>{batch, q_len, heads};
  const std::vector<unsigned char> qb = fuzz::store(q, dtype), kb = fuzz::store(k, dtype), vb = fuzz::store(v, dtype),
                                   tb = fuzz::store(table, table_dtype);
  const std::vector<unsigned char> q64 = fuzz::store(q, DType::kF64), k64 = fuzz::store(k, DType::kF64),
                                   v64 = fuzz::store(v, DType::kF64), t64 = fuzz::store(table, DType::kF64);
  const auto view = [](const std::vector<unsigned char>& b, DType dt, const std::vector<std::int64_t>& s) {
    return ConstTensorView::contiguous(b.data(), dt, s);
  };
  const std::string context =
      std::string(" (") + (cope ? "CoPE, " : "stick-breaking, ") + std::string(dtype_name(dtype)) +
      (cope ? ", table " + std::string(dtype_name(table_dtype)) + (linear ? " on a line" : "") : "") + ", B " +
      std::to_string(batch) + ", Sq " + std::to_string(q_len) + ", Sk " + std::to_string(k_len) + ", H " +
      std::to_string(heads) + "/" + std::to_string(kv_heads) + ", D " + std::to_string(dim) + "/" +
      std::to_string(dim_v) + (cope ? ", npos " + std::to_string(npos) : "") + (packed ? ", packed" : "") +
      (attend_current ? ", attend_current" : "") + (skip ? ", skip" : "") + ", scale " + fuzz::number(scale_drawn) +
      ", non-finite: " + placed + ")";
  if (std::getenv("POSENC_FUZZ_VERBOSE") != nullptr) std::fprintf(stderr, "case%s\n", context.c_str());
  Pair pair;
  if (cope) {
    CopeSpec spec{view(qb, dtype, q_shape),
                  view(kb, dtype, k_shape),
                  view(vb, dtype, v_shape),
                  view(tb, table_dtype, t_shape),
                  scale_drawn,
                  cu_q,
                  cu_k};
    if (!fuzz::accepted("CopeAttention", [&] { pair.cope.emplace(spec); })) return 0;
    pair.cope64.emplace(CopeSpec{view(q64, DType::kF64, q_shape), view(k64, DType::kF64, k_shape),
                                 view(v64, DType::kF64, v_shape), view(t64, DType::kF64, t_shape), scale_drawn, cu_q,
                                 cu_k});  // the same shapes: accepted too
  } else {
    StickBreakingSpec spec{view(qb, dtype, q_shape),
                           view(kb, dtype, k_shape),
                           view(vb, dtype, v_shape),
                           scale_drawn,
                           attend_current,
                           cu_q,
                           cu_k,
                           skip};
    if (!fuzz::accepted("StickBreakingAttention", [&] { pair.sb.emplace(spec); })) return 0;
    spec.q = view(q64, DType::kF64, q_shape);
    spec.k = view(k64, DType::kF64, k_shape);
    spec.v = view(v64, DType::kF64, v_shape);
    pair.sb64.emplace(spec);
  }
  if (std::abs(scale_drawn) > 1e6) return 0;

  // out in `out_dtype` (f32 for 16-bit inputs' backward), the statistic in f32.
  const auto forward = [&](bool reference, DType out_dtype, std::vector<unsigned char>& out, std::vector<float>& stat) {
    out.assign(static_cast<std::size_t>(tokens_q * heads * dim_v) * dtype_size(out_dtype), 0);
    stat.assign(static_cast<std::size_t>(tokens_q * heads), 0.0f);
    pair.forward(reference, TensorView::contiguous(out.data(), out_dtype, o_shape),
                 TensorView::contiguous(stat.data(), DType::kF32, stat_shape));
  };
  std::vector<unsigned char> fused_out, exact_out;
  std::vector<float> fused_stat, exact_stat;
  forward(false, dtype, fused_out, fused_stat);
  forward(true, DType::kF64, exact_out, exact_stat);
  const std::vector<double> got = as_doubles(fused_out, dtype), want64 = as_doubles(exact_out, DType::kF64);
  std::vector<double> want(want64.size());
  for (std::size_t i = 0; i < want.size(); ++i) want[i] = fuzz::element(fuzz::store({want64[i]}, dtype), dtype, 0);
  const double scale = scale_drawn == 0 ? 1 / std::sqrt(static_cast<double>(dim)) : std::abs(scale_drawn);
  // CoPE with an inf or NaN among its inputs: which table rows a position touches decides where it
  // goes (a NaN or inf table row into a logit, a NaN dS into that row's gradient), and a gate sum
  // within rounding of an integer m (a gate of 1e-13 beside gates of 1) is m in f32 and m + 1e-13
  // in fp64, taking row m + 1 with a weight of 0 or of 1e-13: 0·NaN is NaN on one side only, and
  // 1e-13·(−inf) drops a key on one side only. When some row's finite sum (fp64, walked here) lies
  // that close to an integer, the two sides are not compared; they still run, under the sanitizers.
  bool ambiguous = false;
  if (cope && placed != "none") {
    const double signed_scale = scale_drawn == 0 ? scale : scale_drawn;
    for (std::size_t si = 0; si + 1 < (packed ? cu_q.size() : static_cast<std::size_t>(batch) + 1); ++si) {
      const std::int64_t q0 = packed ? cu_q[si] : static_cast<std::int64_t>(si) * q_len,
                         lq = packed ? cu_q[si + 1] - cu_q[si] : q_len,
                         k0 = packed ? cu_k[si] : static_cast<std::int64_t>(si) * k_len,
                         lk = packed ? cu_k[si + 1] - cu_k[si] : k_len;
      for (std::int64_t h = 0; h < heads && !ambiguous; ++h) {
        const std::int64_t kvh = h / (heads / kv_heads);
        for (std::int64_t i = 0; i < lq && !ambiguous; ++i) {
          double sum = 0;
          for (std::int64_t j = lk - lq + i; j >= 0 && sum <= static_cast<double>(npos); --j) {
            double dot = 0;
            for (std::int64_t t = 0; t < dim; ++t)
              dot += q[static_cast<std::size_t>(((q0 + i) * heads + h) * dim + t)] *
                     k[static_cast<std::size_t>(((k0 + j) * kv_heads + kvh) * dim + t)];
            sum += 1 / (1 + std::exp(-signed_scale * dot));
            ambiguous = ambiguous || std::abs(sum - std::round(sum)) < 1e-4;
          }
        }
      }
    }
  }
  const auto relax = [&](std::vector<double>& a, std::vector<double>& b) {
    if (!ambiguous) return;
    std::fill(a.begin(), a.end(), 0.0);
    std::fill(b.begin(), b.end(), 0.0);
  };
  std::vector<double> got_c = got, want_c = want, fused_s(fused_stat.begin(), fused_stat.end()),
                      exact_s(exact_stat.begin(), exact_stat.end());
  relax(got_c, want_c);
  relax(fused_s, exact_s);
  const double zmax = scale * static_cast<double>(dim) * qk * qk;
  const double ulp = dtype == DType::kBF16 ? std::ldexp(1.0, -7) : dtype == DType::kF16 ? std::ldexp(1.0, -10) : 0.0;
  const double vmax = std::max(fuzz::max_finite(v), 1e-3), sum_err = static_cast<double>(k_len) * std::ldexp(1.0, -23);
  // Stick-breaking: f32 logits (|z| <= zmax) and running sums of softplus: a weight that matters
  // (carry above −30) has a log error of a few 2^-24·(30 + zmax). CoPE: z in f32, ⟨q, e[n]⟩ an f32
  // sum of D products (<= qe), and the positions' Kahan sums (a few ulps of npos, times the
  // table's slope <= 2·qe): each within 2^-20 of those sizes; a logit error δ moves out by
  // 2δ·max|v|. Both add the sum over the keys (k_len·2^-23 of max|v|), and 16-bit outputs an ulp.
  const double qe = static_cast<double>(dim) * 2 * std::max(fuzz::max_finite(table), 1e-3);
  const double log_err = cope ? 2 * std::ldexp(1.0, -20) * (zmax + qe * (1 + 2 * static_cast<double>(npos)))
                              : 16 * std::ldexp(1.0, -24) * (30 + zmax);
  fuzz::expect_match(("out" + context).c_str(), got_c, want_c, vmax * (log_err + sum_err + ulp));
  fuzz::expect_match(((cope ? "lse" : "rem") + context).c_str(), fused_s, exact_s,
                     cope ? log_err / 2 + std::ldexp(1.0, -22) * (zmax + qe + std::log(static_cast<double>(k_len) + 1))
                          : log_err + sum_err);

  if (dtype != DType::kF32) return 0;
  const bool with_d_rem = !cope && in.flag();
  const std::vector<unsigned char> dob = fuzz::store(d_out, DType::kF32), dob64 = fuzz::store(d_out, DType::kF64);
  const std::vector<float> drem(d_rem.begin(), d_rem.end());
  const auto backward = [&](bool reference) {
    const DType dt = reference ? DType::kF64 : DType::kF32, tdt = reference ? DType::kF64 : table_dtype;
    std::vector<unsigned char> out, dq(static_cast<std::size_t>(tokens_q * heads * dim) * dtype_size(dt), 0),
        dk(static_cast<std::size_t>(tokens_k * kv_heads * dim) * dtype_size(dt), 0),
        dv(static_cast<std::size_t>(tokens_k * kv_heads * dim_v) * dtype_size(dt), 0),
        de(static_cast<std::size_t>(npos * dim) * dtype_size(tdt), 0);
    std::vector<float> stat;
    forward(reference, dt, out, stat);
    const ConstTensorView ov = view(out, dt, o_shape),
                          sv = ConstTensorView::contiguous(stat.data(), DType::kF32, stat_shape),
                          dov = view(reference ? dob64 : dob, dt, o_shape);
    const TensorView dqv = TensorView::contiguous(dq.data(), dt, q_shape),
                     dkv = TensorView::contiguous(dk.data(), dt, k_shape),
                     dvv = TensorView::contiguous(dv.data(), dt, v_shape);
    if (cope) {
      (reference ? *pair.cope64 : *pair.cope)
          .backward(ov, sv, dov, dqv, dkv, dvv, TensorView::contiguous(de.data(), tdt, t_shape));
    } else {
      (reference ? *pair.sb64 : *pair.sb)
          .backward(ov, sv, dov,
                    with_d_rem ? ConstTensorView::contiguous(drem.data(), DType::kF32, stat_shape) : ConstTensorView(),
                    dqv, dkv, dvv);
    }
    return std::vector<std::vector<double>>{as_doubles(dq, dt), as_doubles(dk, dt), as_doubles(dv, dt),
                                            as_doubles(de, tdt)};
  };
  auto g = backward(false), w = backward(true);
  for (std::size_t i = 0; i < g.size(); ++i) relax(g[i], w[i]);
  // Each gradient sums f32 terms, carrying the logits' error, over the keys or rows it meets,
  // times max|q|, max|k| (or max|e|): stick-breaking's dz carries R = G − Σ_{m>=j} g's rounding
  // (k_len·2^-22 of |G| <= Dv·max|d_out|·max|v| + |d_rem|); CoPE's dS = P·(dP − Δ) and the
  // positions' dp (times the table's slope).
  const double mg = static_cast<double>(dim_v) * std::max(fuzz::max_finite(d_out), 1e-3) * vmax + 1;
  const double terms = cope ? static_cast<double>(k_len + q_len * heads + npos) * (scale * 2 + qe) * mg * (1 + 2 * qe)
                            : static_cast<double>(k_len + q_len * heads) * scale * 3 * mg;
  const double grad_err = (cope ? log_err / 2 : log_err) + static_cast<double>(k_len) * std::ldexp(1.0, -22);
  const char* names[] = {"dq", "dk", "dv", "d_table"};
  for (std::size_t i = 0; i < (cope ? 4u : 3u); ++i) {
    if (cope && i < 2 && !linear) continue;
    fuzz::expect_match((std::string(names[i]) + context).c_str(), g[i], w[i],
                       std::ldexp(1.0, -12) * std::max(fuzz::max_finite(w[i]), 1e-3) + grad_err * terms);
  }
  return 0;
}
