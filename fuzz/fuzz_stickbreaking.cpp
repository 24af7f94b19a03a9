// Stick-breaking attention, differentially: small random shapes (decode's few queries included),
// GQA, packed sequences (some refused: more queries than keys), every dtype, attend_current, the
// vanishing-tile stop on or off, any scale (refused by name unless finite), values narrower or
// wider than the keys, and now and then a NaN or ±inf in q, k, v, d_out or d_rem — forward
// against the fp64 reference (ref::stickbreaking_forward), backward (f32) against
// ref::stickbreaking_backward: non-finite values in the same places, finite ones within tolerance.
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
  const std::int64_t kv_heads = in.integer(1, 2), heads = in.flag() ? in.integer(1, 5) : kv_heads * in.integer(1, 3);
  const std::int64_t dims[] = {1, 4, 8, 16, 24, 32, 40, 64};
  const std::int64_t dim = dims[in.pick(8)], dim_v = in.flag() ? dim : dims[in.pick(8)];
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
  if (batch * q_len * k_len * heads * (dim + dim_v) > (std::int64_t{1} << 19)) return 0;
  StickBreakingSpec spec;
  spec.attend_current = in.flag();
  spec.skip_vanishing_tiles = in.flag();
  // Any scale is refused by name or runs; the differential check needs scale·q·k within f32's
  // range (a product past FLT_MAX is inf in the f32 logits, finite in fp64), so large accepted
  // scales stop after the forward's checks.
  spec.scale = in.flag() ? in.any_number() : (in.flag() ? 0.0 : in.uniform(-2.0, 2.0));
  const std::int64_t tokens_q = batch * q_len, tokens_k = batch * k_len;
  const auto values = [&](std::int64_t n, double scale) {
    std::vector<double> x(static_cast<std::size_t>(n));
    for (double& v : x) v = fuzz::element(fuzz::store({in.uniform(-scale, scale)}, dtype), dtype, 0);
    return x;
  };
  // q and k in [−3, 3]: logits of up to tens of units, so that rows use their stick up at once.
  std::vector<double> q = values(tokens_q * heads * dim, 3), k = values(tokens_k * kv_heads * dim, 3),
                      v = values(tokens_k * kv_heads * dim_v, 1), d_out = values(tokens_q * heads * dim_v, 1),
                      d_rem = values(tokens_q * heads, 1);
  std::string placed = "none";
  if (in.flag()) {
    std::vector<double>* targets[] = {&q, &k, &v, &d_out, &d_rem};
    const std::size_t which = in.pick(5);
    std::vector<double>& t = *targets[which];
    const double bad[] = {std::nan(""), INFINITY, -INFINITY};
    const double value = bad[in.pick(3)];
    if (!t.empty()) {
      const std::size_t at = in.pick(t.size());
      t[at] = value;
      placed = fuzz::number(value) + " in " + "qkvdr"[which] + " at " + std::to_string(at);
    }
  }
  const auto shape = [&](std::int64_t len, std::int64_t h, std::int64_t d) {
    return packed ? std::vector<std::int64_t>{len, h, d} : std::vector<std::int64_t>{batch, len, h, d};
  };
  const std::vector<std::int64_t> q_shape = shape(q_len, heads, dim), k_shape = shape(k_len, kv_heads, dim),
                                  v_shape = shape(k_len, kv_heads, dim_v), o_shape = shape(q_len, heads, dim_v);
  const std::vector<std::int64_t> rem_shape =
      packed ? std::vector<std::int64_t>{q_len, heads} : std::vector<std::int64_t>{batch, q_len, heads};
  const std::vector<unsigned char> qb = fuzz::store(q, dtype), kb = fuzz::store(k, dtype), vb = fuzz::store(v, dtype);
  const std::vector<unsigned char> q64 = fuzz::store(q, DType::kF64), k64 = fuzz::store(k, DType::kF64),
                                   v64 = fuzz::store(v, DType::kF64);
  spec.cu_seqlens_q = cu_q;
  spec.cu_seqlens_k = cu_k;
  StickBreakingSpec spec64 = spec;
  spec.q = ConstTensorView::contiguous(qb.data(), dtype, q_shape);
  spec.k = ConstTensorView::contiguous(kb.data(), dtype, k_shape);
  spec.v = ConstTensorView::contiguous(vb.data(), dtype, v_shape);
  spec64.q = ConstTensorView::contiguous(q64.data(), DType::kF64, q_shape);
  spec64.k = ConstTensorView::contiguous(k64.data(), DType::kF64, k_shape);
  spec64.v = ConstTensorView::contiguous(v64.data(), DType::kF64, v_shape);
  const std::string context = std::string(" (") + std::string(dtype_name(dtype)) + ", B " + std::to_string(batch) +
                              ", Sq " + std::to_string(q_len) + ", Sk " + std::to_string(k_len) + ", H " +
                              std::to_string(heads) + "/" + std::to_string(kv_heads) + ", D " + std::to_string(dim) +
                              "/" + std::to_string(dim_v) + (packed ? ", packed" : "") +
                              (spec.attend_current ? ", attend_current" : "") +
                              (spec.skip_vanishing_tiles ? ", skip" : "") + ", scale " + fuzz::number(spec.scale) +
                              ", non-finite: " + placed + ")";
  if (std::getenv("POSENC_FUZZ_VERBOSE") != nullptr) std::fprintf(stderr, "case%s\n", context.c_str());
  std::optional<StickBreakingAttention> fused, exact;
  if (!fuzz::accepted("StickBreakingAttention", [&] { fused.emplace(spec); })) return 0;
  exact.emplace(spec64);  // the same shapes: accepted too
  if (std::abs(spec.scale) > 1e6) return 0;

  const auto as_doubles = [](const std::vector<unsigned char>& bytes, DType dt) {
    std::vector<double> x(bytes.size() / dtype_size(dt));
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = fuzz::element(bytes, dt, i);
    return x;
  };
  // out in `out_dtype` (f32 for 16-bit inputs' backward), rem f32.
  const auto forward = [&](const StickBreakingAttention& att, DType out_dtype, std::vector<unsigned char>& out,
                           std::vector<float>& rem) {
    out.assign(static_cast<std::size_t>(tokens_q * heads * dim_v) * dtype_size(out_dtype), 0);
    rem.assign(static_cast<std::size_t>(tokens_q * heads), 0.0f);
    att.forward(TensorView::contiguous(out.data(), out_dtype, o_shape),
                TensorView::contiguous(rem.data(), DType::kF32, rem_shape));
  };
  std::vector<unsigned char> fused_out, exact_out;
  std::vector<float> fused_rem, exact_rem;
  forward(*fused, dtype, fused_out, fused_rem);
  forward(*exact, DType::kF64, exact_out, exact_rem);
  const std::vector<double> got = as_doubles(fused_out, dtype), want64 = as_doubles(exact_out, DType::kF64);
  std::vector<double> want(want64.size());
  for (std::size_t i = 0; i < want.size(); ++i) want[i] = fuzz::element(fuzz::store({want64[i]}, dtype), dtype, 0);
  // f32 logits (D products of inputs up to 3: |z| <= zmax) and running sums of softplus: a weight
  // that matters (carry above −30) has a log error of a few 2^-24·(30 + zmax); the sum over keys
  // adds k_len·2^-23 of max|v|; 16-bit outputs one ulp of it.
  const double scale = spec.scale == 0 ? 1 / std::sqrt(static_cast<double>(dim)) : std::abs(spec.scale);
  const double zmax = scale * static_cast<double>(dim) * 9;
  const double ulp = dtype == DType::kBF16 ? std::ldexp(1.0, -7) : dtype == DType::kF16 ? std::ldexp(1.0, -10) : 0.0;
  const double vmax = std::max(fuzz::max_finite(v), 1e-3);
  const double log_err = 16 * std::ldexp(1.0, -24) * (30 + zmax);
  fuzz::expect_match(("out" + context).c_str(), got, want,
                     vmax * (log_err + static_cast<double>(k_len) * std::ldexp(1.0, -23) + ulp));
  fuzz::expect_match(("rem" + context).c_str(), std::vector<double>(fused_rem.begin(), fused_rem.end()),
                     std::vector<double>(exact_rem.begin(), exact_rem.end()),
                     log_err + static_cast<double>(k_len) * std::ldexp(1.0, -23));

  if (dtype != DType::kF32) return 0;
  const bool with_d_rem = in.flag();
  const std::vector<unsigned char> dob = fuzz::store(d_out, DType::kF32), dob64 = fuzz::store(d_out, DType::kF64);
  std::vector<float> drem(d_rem.begin(), d_rem.end());
  const auto backward = [&](bool reference) {
    const DType dt = reference ? DType::kF64 : DType::kF32;
    const StickBreakingAttention& att = reference ? *exact : *fused;
    std::vector<unsigned char> out, dq(static_cast<std::size_t>(tokens_q * heads * dim) * dtype_size(dt), 0),
        dk(static_cast<std::size_t>(tokens_k * kv_heads * dim) * dtype_size(dt), 0),
        dv(static_cast<std::size_t>(tokens_k * kv_heads * dim_v) * dtype_size(dt), 0);
    std::vector<float> rem;
    forward(att, dt, out, rem);
    att.backward(ConstTensorView::contiguous(out.data(), dt, o_shape),
                 ConstTensorView::contiguous(rem.data(), DType::kF32, rem_shape),
                 ConstTensorView::contiguous((reference ? dob64 : dob).data(), dt, o_shape),
                 with_d_rem ? ConstTensorView::contiguous(drem.data(), DType::kF32, rem_shape) : ConstTensorView(),
                 TensorView::contiguous(dq.data(), dt, q_shape), TensorView::contiguous(dk.data(), dt, k_shape),
                 TensorView::contiguous(dv.data(), dt, v_shape));
    return std::vector<std::vector<double>>{as_doubles(dq, dt), as_doubles(dk, dt), as_doubles(dv, dt)};
  };
  const auto g = backward(false), w = backward(true);
  // Each gradient sums f32 terms; dz carries the logits' log error, and R = G − Σ_{m>=j} g its
  // sum's rounding (k_len·2^-23 of |G| <= Dv·max|d_out|·max|v| + |d_rem|), times scale·max|q or k|
  // and the keys or rows it meets.
  const double mg = static_cast<double>(dim_v) * std::max(fuzz::max_finite(d_out), 1e-3) * vmax + 1;
  const double terms = static_cast<double>(k_len + q_len * heads) * scale * 3 * mg;
  const char* names[] = {"dq", "dk", "dv"};
  for (int i = 0; i < 3; ++i) {
    fuzz::expect_match((std::string(names[i]) + context).c_str(), g[static_cast<std::size_t>(i)],
                       w[static_cast<std::size_t>(i)],
                       std::ldexp(1.0, -12) * std::max(fuzz::max_finite(w[static_cast<std::size_t>(i)]), 1e-3) +
                           (log_err + static_cast<double>(k_len) * std::ldexp(1.0, -22)) * terms);
  }
  return 0;
}
