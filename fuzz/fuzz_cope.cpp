// CoPE, differentially: small random shapes (decode's few queries included), GQA, packed
// sequences (some refused: more queries than keys), every dtype, tables of 1 to 80 positions
// (clamped early or never) in q's dtype or f32, random or with rows on a line, any scale (refused
// by name unless finite), values narrower or wider than the keys, and now and then a NaN or ±inf
// in q, k, v, the table or d_out — forward against the fp64 reference (ref::cope_forward), and,
// for f32 inputs, backward against ref::cope_backward: non-finite values in the same places,
// finite ones within tolerance. dq and dk are compared on tables with rows on a line only: their
// derivative steps where a gate sum crosses an integer, and an f32 sum within its rounding of one
// may take the other side (test_cope.cpp).
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "fuzzing.hpp"

using namespace posenc;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::set_up();
  fuzz::Input in(data, size);
  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kF16};
  const DType dtype = dtypes[in.pick(3)];
  const DType table_dtype = in.flag() ? DType::kF32 : dtype;
  const std::int64_t kv_heads = in.integer(1, 2), heads = in.flag() ? in.integer(1, 5) : kv_heads * in.integer(1, 3);
  const std::int64_t dims[] = {1, 4, 8, 16, 24, 32, 40, 64};
  const std::int64_t dim = dims[in.pick(8)], dim_v = in.flag() ? dim : dims[in.pick(8)];
  const std::int64_t npos = in.flag() ? in.integer(1, 8) : in.integer(1, 80);
  const bool linear = in.flag();
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
  CopeSpec spec;
  // Any scale is refused by name or runs; the differential check needs scale·q·k within f32's
  // range, so large accepted scales stop after the forward's checks.
  spec.scale = in.flag() ? in.any_number() : (in.flag() ? 0.0 : in.uniform(-2.0, 2.0));
  const std::int64_t tokens_q = batch * q_len, tokens_k = batch * k_len;
  const auto values = [&](std::int64_t n, double scale, DType dt) {
    std::vector<double> x(static_cast<std::size_t>(n));
    for (double& v : x) v = fuzz::element(fuzz::store({in.uniform(-scale, scale)}, dt), dt, 0);
    return x;
  };
  std::vector<double> q = values(tokens_q * heads * dim, 2, dtype), k = values(tokens_k * kv_heads * dim, 2, dtype),
                      v = values(tokens_k * kv_heads * dim_v, 1, dtype), table = values(npos * dim, 1, table_dtype),
                      d_out = values(tokens_q * heads * dim_v, 1, dtype);
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
    std::vector<double>* targets[] = {&q, &k, &v, &table, &d_out};
    const std::size_t which = in.pick(5);
    std::vector<double>& t = *targets[which];
    const double bad[] = {std::nan(""), INFINITY, -INFINITY};
    const double value = bad[in.pick(3)];
    if (!t.empty()) {
      const std::size_t at = in.pick(t.size());
      t[at] = value;
      placed = fuzz::number(value) + " in " + "qkved"[which] + " at " + std::to_string(at);
    }
  }
  const auto shape = [&](std::int64_t len, std::int64_t h, std::int64_t d) {
    return packed ? std::vector<std::int64_t>{len, h, d} : std::vector<std::int64_t>{batch, len, h, d};
  };
  const std::vector<std::int64_t> q_shape = shape(q_len, heads, dim), k_shape = shape(k_len, kv_heads, dim),
                                  v_shape = shape(k_len, kv_heads, dim_v), o_shape = shape(q_len, heads, dim_v),
                                  t_shape = {npos, dim};
  const std::vector<std::int64_t> lse_shape =
      packed ? std::vector<std::int64_t>{q_len, heads} : std::vector<std::int64_t>{batch, q_len, heads};
  const std::vector<unsigned char> qb = fuzz::store(q, dtype), kb = fuzz::store(k, dtype), vb = fuzz::store(v, dtype),
                                   tb = fuzz::store(table, table_dtype);
  const std::vector<unsigned char> q64 = fuzz::store(q, DType::kF64), k64 = fuzz::store(k, DType::kF64),
                                   v64 = fuzz::store(v, DType::kF64), t64 = fuzz::store(table, DType::kF64);
  spec.cu_seqlens_q = cu_q;
  spec.cu_seqlens_k = cu_k;
  CopeSpec spec64 = spec;
  spec.q = ConstTensorView::contiguous(qb.data(), dtype, q_shape);
  spec.k = ConstTensorView::contiguous(kb.data(), dtype, k_shape);
  spec.v = ConstTensorView::contiguous(vb.data(), dtype, v_shape);
  spec.table = ConstTensorView::contiguous(tb.data(), table_dtype, t_shape);
  spec64.q = ConstTensorView::contiguous(q64.data(), DType::kF64, q_shape);
  spec64.k = ConstTensorView::contiguous(k64.data(), DType::kF64, k_shape);
  spec64.v = ConstTensorView::contiguous(v64.data(), DType::kF64, v_shape);
  spec64.table = ConstTensorView::contiguous(t64.data(), DType::kF64, t_shape);
  const std::string context =
      std::string(" (") + std::string(dtype_name(dtype)) + ", table " + std::string(dtype_name(table_dtype)) +
      (linear ? " on a line" : "") + ", B " + std::to_string(batch) + ", Sq " + std::to_string(q_len) + ", Sk " +
      std::to_string(k_len) + ", H " + std::to_string(heads) + "/" + std::to_string(kv_heads) + ", D " +
      std::to_string(dim) + "/" + std::to_string(dim_v) + ", npos " + std::to_string(npos) +
      (packed ? ", packed" : "") + ", scale " + fuzz::number(spec.scale) + ", non-finite: " + placed + ")";
  if (std::getenv("POSENC_FUZZ_VERBOSE") != nullptr) std::fprintf(stderr, "case%s\n", context.c_str());
  std::optional<CopeAttention> fused, exact;
  if (!fuzz::accepted("CopeAttention", [&] { fused.emplace(spec); })) return 0;
  exact.emplace(spec64);  // the same shapes: accepted too
  if (std::abs(spec.scale) > 1e6) return 0;

  const auto as_doubles = [](const std::vector<unsigned char>& bytes, DType dt) {
    std::vector<double> x(bytes.size() / dtype_size(dt));
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = fuzz::element(bytes, dt, i);
    return x;
  };
  const auto forward = [&](const CopeAttention& att, DType out_dtype, std::vector<unsigned char>& out,
                           std::vector<float>& lse) {
    out.assign(static_cast<std::size_t>(tokens_q * heads * dim_v) * dtype_size(out_dtype), 0);
    lse.assign(static_cast<std::size_t>(tokens_q * heads), 0.0f);
    att.forward(TensorView::contiguous(out.data(), out_dtype, o_shape),
                TensorView::contiguous(lse.data(), DType::kF32, lse_shape));
  };
  std::vector<unsigned char> fused_out, exact_out;
  std::vector<float> fused_lse, exact_lse;
  forward(*fused, dtype, fused_out, fused_lse);
  forward(*exact, DType::kF64, exact_out, exact_lse);
  const std::vector<double> got = as_doubles(fused_out, dtype), want64 = as_doubles(exact_out, DType::kF64);
  std::vector<double> want(want64.size());
  for (std::size_t i = 0; i < want.size(); ++i) want[i] = fuzz::element(fuzz::store({want64[i]}, dtype), dtype, 0);
  // Logits: z in f32 (|z| <= zmax), ⟨q, e[n]⟩ an f32 sum of D products (<= qe), and the positions'
  // Kahan sums (an error of a few ulps of npos, times the table's slope <= 2·qe): each within
  // 2^-20 of those sizes. A logit error δ moves out by 2δ·max|v|, plus k_len·2^-23 of max|v| for
  // the sums; 16-bit outputs one ulp of it.
  const double scale = spec.scale == 0 ? 1 / std::sqrt(static_cast<double>(dim)) : std::abs(spec.scale);
  const double zmax = scale * static_cast<double>(dim) * 4;
  const double qe = static_cast<double>(dim) * 2 * std::max(fuzz::max_finite(table), 1e-3);
  const double logit_err = std::ldexp(1.0, -20) * (zmax + qe * (1 + 2 * static_cast<double>(npos)));
  const double ulp = dtype == DType::kBF16 ? std::ldexp(1.0, -7) : dtype == DType::kF16 ? std::ldexp(1.0, -10) : 0.0;
  const double vmax = std::max(fuzz::max_finite(v), 1e-3);
  fuzz::expect_match(("out" + context).c_str(), got, want,
                     vmax * (2 * logit_err + static_cast<double>(k_len) * std::ldexp(1.0, -23) + ulp));
  fuzz::expect_match(("lse" + context).c_str(), std::vector<double>(fused_lse.begin(), fused_lse.end()),
                     std::vector<double>(exact_lse.begin(), exact_lse.end()),
                     logit_err + std::ldexp(1.0, -22) * (zmax + qe + std::log(static_cast<double>(k_len) + 1)));

  if (dtype != DType::kF32) return 0;
  const std::vector<unsigned char> dob = fuzz::store(d_out, DType::kF32), dob64 = fuzz::store(d_out, DType::kF64);
  const auto backward = [&](bool reference) {
    const DType dt = reference ? DType::kF64 : DType::kF32, tdt = reference ? DType::kF64 : table_dtype;
    const CopeAttention& att = reference ? *exact : *fused;
    std::vector<unsigned char> out, dq(static_cast<std::size_t>(tokens_q * heads * dim) * dtype_size(dt), 0),
        dk(static_cast<std::size_t>(tokens_k * kv_heads * dim) * dtype_size(dt), 0),
        dv(static_cast<std::size_t>(tokens_k * kv_heads * dim_v) * dtype_size(dt), 0),
        de(static_cast<std::size_t>(npos * dim) * dtype_size(tdt), 0);
    std::vector<float> lse;
    forward(att, dt, out, lse);
    att.backward(ConstTensorView::contiguous(out.data(), dt, o_shape),
                 ConstTensorView::contiguous(lse.data(), DType::kF32, lse_shape),
                 ConstTensorView::contiguous((reference ? dob64 : dob).data(), dt, o_shape),
                 TensorView::contiguous(dq.data(), dt, q_shape), TensorView::contiguous(dk.data(), dt, k_shape),
                 TensorView::contiguous(dv.data(), dt, v_shape), TensorView::contiguous(de.data(), tdt, t_shape));
    return std::vector<std::vector<double>>{as_doubles(dq, dt), as_doubles(dk, dt), as_doubles(dv, dt),
                                            as_doubles(de, tdt)};
  };
  const auto g = backward(false), w = backward(true);
  // Each gradient sums f32 terms of dS = P·(dP − Δ) (|dP|, |Δ| <= Dv·max|d_out|·max|v|) and of the
  // positions' dp (times the table's slope), carrying the logits' error, over the keys or rows
  // it meets, times max|q|, max|k| or max|e|.
  const double mg = static_cast<double>(dim_v) * std::max(fuzz::max_finite(d_out), 1e-3) * vmax + 1;
  const double terms = static_cast<double>(k_len + q_len * heads + npos) * (scale * 2 + qe) * mg * (1 + 2 * qe);
  const char* names[] = {"dq", "dk", "dv", "d_table"};
  for (int i = 0; i < 4; ++i) {
    if (i < 2 && !linear) continue;
    fuzz::expect_match((std::string(names[i]) + context).c_str(), g[static_cast<std::size_t>(i)],
                       w[static_cast<std::size_t>(i)],
                       std::ldexp(1.0, -12) * std::max(fuzz::max_finite(w[static_cast<std::size_t>(i)]), 1e-3) +
                           (logit_err + static_cast<double>(k_len) * std::ldexp(1.0, -22)) * terms);
  }
  return 0;
}
