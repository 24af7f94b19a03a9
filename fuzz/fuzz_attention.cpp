// The fused attention, differentially: small random shapes (decode's few queries included), GQA,
// packed sequences, every dtype, causal / window / soft-cap / chunk / key-length masks, a
// registered scheme with random parameters, sinks and forget gates, and now and then a NaN or ±inf
// in q, k, v or d_out — forward against the fp64 reference (ref::attention_forward) and the naive
// f32 composition, backward (f32) against the fp64 reference (ref::attention_backward).
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fuzzing.hpp"

using namespace posenc;

namespace {

// The generic test matrix's options (tests/test_schemes.cpp): tables small at these shapes.
SchemeArgs scheme_args(const SchemeEntry& entry, std::int64_t heads, std::int64_t dim) {
  SchemeArgs a;
  a.heads = heads;
  a.head_dim = dim;
  const auto set = [&](const char* name, double value) {
    for (const SchemeOption& o : entry.options) {
      if (o.name == name) a.options[name] = value;
    }
  };
  set("hidden", 6);
  set("threshold", 16);
  set("d_model", 12);
  set("max_len", 512);
  set("max_distance", 9);
  set("num_buckets", 8);
  if (entry.family == "relative-bias") set("dim", 24);
  return a;
}

struct Result {
  std::vector<double> out, lse, dq, dk, dv;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::set_up();
  fuzz::Input in(data, size);
  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kF16};
  const DType dtype = dtypes[in.pick(3)];
  const std::int64_t kv_heads = in.integer(1, 2), heads = kv_heads * in.integer(1, 3);
  const std::int64_t dims[] = {4, 8, 16, 24, 32, 64};
  const std::int64_t dim = dims[in.pick(6)];
  const bool packed = in.flag();
  std::int64_t batch = packed ? 1 : in.integer(1, 2), q_len = 0, k_len = 0;
  std::vector<std::int64_t> cu_q, cu_k;
  if (packed) {
    cu_q = {0};
    cu_k = {0};
    for (std::int64_t s = in.integer(1, 3); s > 0; --s) {
      const std::int64_t lk = in.integer(1, 90), lq = in.flag() ? std::min<std::int64_t>(lk, 48)
                                                                : in.integer(1, std::min<std::int64_t>(lk, 48));
      cu_q.push_back(cu_q.back() + lq);
      cu_k.push_back(cu_k.back() + lk);
    }
    q_len = cu_q.back();
    k_len = cu_k.back();
  } else {
    // Up to 300 keys (past a key tile) but at most 48 queries (the fp64 reference under the
    // sanitizers is O(Sq·Sk·D) per head and pass: a few per key, or decode's few).
    k_len = in.flag() ? in.integer(1, 300) : in.integer(1, 40);
    q_len = in.flag() ? in.integer(1, 4) : in.integer(1, std::min<std::int64_t>(k_len, 48));
  }
  // The fp64 reference and the naive composition run under the sanitizers, about 100 times slower
  // than a release build: at most 2^19 (query, key, head, dim) products per call.
  if (batch * q_len * k_len * heads * dim > (std::int64_t{1} << 19)) return 0;
  const std::int64_t tokens_q = batch * q_len, tokens_k = batch * k_len;
  AttentionSpec spec;
  spec.mask.causal = in.flag();
  if (in.flag()) spec.mask.window_left = in.integer(0, 70);
  if (!spec.mask.causal && in.flag()) spec.mask.window_right = in.integer(0, 70);
  if (in.flag()) spec.mask.softcap = in.uniform(1, 50);
  if (in.flag()) spec.mask.chunk_size = in.integer(1, 100);
  if (!packed && in.flag()) {
    for (std::int64_t b = 0; b < batch; ++b) spec.mask.key_lengths.push_back(in.integer(0, k_len));
  }
  // The scheme, its parameters moved off their initial values (as the generic matrix does).
  const std::vector<SchemeEntry>& entries = schemes();
  const SchemeEntry& entry = entries[in.pick(entries.size())];
  SchemeArgs args = scheme_args(entry, heads, dim);
  // A scheme's per-token inputs (forgetting's log gate) over the keys' tokens, drawn from the
  // entry's typical values (drawn only for such entries, so the corpus keeps its meaning).
  std::vector<std::vector<double>> entry_inputs;
  for (const SchemeInput& input : entry.inputs) {
    std::vector<double>& x = entry_inputs.emplace_back(static_cast<std::size_t>(tokens_k * heads));
    for (double& g : x) g = input.typical(in.uniform(0, 1));
    args.inputs[input.name] = packed ? ConstTensorView::of(x.data(), {tokens_k, heads})
                                     : ConstTensorView::of(x.data(), {batch, k_len, heads});
  }
  std::optional<HeadGroup> group;
  fuzz::accepted(entry.name.c_str(), [&] {
    std::vector<double> theta = scheme_parameters(entry, make_head_group(entry.name, args));
    for (double& t : theta) t = t == 0 ? in.uniform(-0.5, 0.5) : t * in.uniform(0.5, 1.5);
    args.parameters = theta;
    group = make_head_group(entry.name, args);
  });
  if (!group) return 0;
  std::vector<double> log_fgate;
  const std::size_t own_terms = group->terms.size();  // the scheme's own (Shaw's, XL's, the sinks entry's)
  const bool sinks = in.flag();
  if (sinks) {
    std::vector<double> logits(static_cast<std::size_t>(heads));
    for (double& s : logits) s = in.uniform(-4, 4);
    group->terms.push_back(std::make_shared<AttentionSinks>(logits));
  }
  const bool forgetting = in.flag();
  if (forgetting) {
    log_fgate.resize(static_cast<std::size_t>(tokens_k * heads));
    for (double& g : log_fgate) g = -in.uniform(0, 2);
  }

  // Inputs in [−2, 2] (q, k) and [−1, 1] (v, d_out), rounded to the dtype; one may be NaN or ±inf.
  const auto values = [&](std::int64_t n, double scale) {
    std::vector<double> x(static_cast<std::size_t>(n));
    for (double& v : x) v = fuzz::element(fuzz::store({in.uniform(-scale, scale)}, dtype), dtype, 0);
    return x;
  };
  std::vector<double> q = values(tokens_q * heads * dim, 2), k = values(tokens_k * kv_heads * dim, 2),
                      v = values(tokens_k * kv_heads * dim, 1), d_out = values(tokens_q * heads * dim, 1);
  std::string placed = "none";
  if (in.flag()) {
    std::vector<double>* targets[] = {&q, &k, &v, &d_out};
    const std::size_t which = in.pick(4);
    std::vector<double>& t = *targets[which];
    const double bad[] = {std::nan(""), INFINITY, -INFINITY};
    const double value = bad[in.pick(3)];  // chosen first, as the inputs of the corpus were
    const std::size_t at = in.pick(t.size());
    t[at] = value;
    placed = fuzz::number(value) + " in " + "qkvd"[which] + " at " + std::to_string(at);
    spec.skip_vanishing_tiles = false;  // a skipped tile is the policy's one documented exception
  }
  // Now and then a non-finite learned parameter instead (drawn last, so that the inputs of the
  // corpus keep their meaning): the scheme refuses it by name, or it propagates as in the reference
  // (a sink of −inf is no sink).
  if (!args.parameters.empty() && in.flag()) {
    const double bad[] = {std::nan(""), INFINITY, -INFINITY};
    const double value = bad[in.pick(3)];
    const std::size_t at = in.pick(args.parameters.size());
    args.parameters[at] = value;
    const std::vector<AttentionTermRef> added(group->terms.begin() + static_cast<std::ptrdiff_t>(own_terms),
                                              group->terms.end());
    group.reset();
    fuzz::accepted(entry.name.c_str(), [&] { group = make_head_group(entry.name, args); });
    if (!group) return 0;
    group->terms.insert(group->terms.end(), added.begin(), added.end());
    placed = fuzz::number(value) + " in parameter " + std::to_string(at);
    spec.skip_vanishing_tiles = false;
  }
  // Or a NaN or −inf forget gate (+inf is refused): it propagates as the running-sum composition.
  if (forgetting && in.flag()) {
    const double value = in.flag() ? std::nan("") : -INFINITY;
    const std::size_t at = in.pick(log_fgate.size());
    log_fgate[at] = value;
    placed = fuzz::number(value) + " in log_fgate at " + std::to_string(at);
    spec.skip_vanishing_tiles = false;
  }
  const std::vector<std::int64_t> q_shape =
      packed ? std::vector<std::int64_t>{q_len, heads, dim} : std::vector<std::int64_t>{batch, q_len, heads, dim};
  const std::vector<std::int64_t> k_shape =
      packed ? std::vector<std::int64_t>{k_len, kv_heads, dim} : std::vector<std::int64_t>{batch, k_len, kv_heads, dim};
  const std::vector<unsigned char> qb = fuzz::store(q, dtype), kb = fuzz::store(k, dtype), vb = fuzz::store(v, dtype);
  const std::vector<unsigned char> gate = fuzz::store(log_fgate, DType::kF64);
  if (forgetting) {
    const ConstTensorView gv =
        packed ? ConstTensorView::contiguous(gate.data(), DType::kF64, std::vector<std::int64_t>{k_len, heads})
               : ConstTensorView::contiguous(gate.data(), DType::kF64, std::vector<std::int64_t>{batch, k_len, heads});
    group->terms.push_back(std::make_shared<ForgetGate>(gv));
  }
  spec.q = ConstTensorView::contiguous(qb.data(), dtype, q_shape);
  spec.k = ConstTensorView::contiguous(kb.data(), dtype, k_shape);
  spec.v = ConstTensorView::contiguous(vb.data(), dtype, k_shape);
  spec.cu_seqlens_q = cu_q;
  spec.cu_seqlens_k = cu_k;
  spec.groups = {*group};
  const std::string context =
      " (" + entry.name + ", " + std::string(dtype_name(dtype)) + ", B " + std::to_string(batch) + ", Sq " +
      std::to_string(q_len) + ", Sk " + std::to_string(k_len) + ", H " + std::to_string(heads) + "/" +
      std::to_string(kv_heads) + ", D " + std::to_string(dim) + (packed ? ", packed" : "") +
      (spec.mask.causal ? ", causal" : "") + ", window " + std::to_string(spec.mask.window_left) + "/" +
      std::to_string(spec.mask.window_right) + ", softcap " + fuzz::number(spec.mask.softcap) +
      (spec.mask.chunk_size ? ", chunk " + std::to_string(*spec.mask.chunk_size) : "") +
      (spec.mask.key_lengths.empty() ? "" : ", key lengths " + std::to_string(spec.mask.key_lengths[0]) + "…") +
      (forgetting ? ", forget gates" : "") + (sinks ? ", sinks" : "") + ", non-finite: " + placed + ")";
  std::optional<Attention> att;
  if (!fuzz::accepted("Attention", [&] { att.emplace(spec); })) return 0;

  const std::vector<std::int64_t> lse_shape =
      packed ? std::vector<std::int64_t>{heads, q_len} : std::vector<std::int64_t>{batch, heads, q_len};
  // mode 0 fused (returns whether it ran on bf16 dot products), 1 fp64, 2 naive f32, 3 naive with
  // bf16 products.
  const auto forward_of = [&](const Attention& a, int mode, DType out_dtype, std::vector<unsigned char>& out,
                              std::vector<float>& lse) {
    out.assign(static_cast<std::size_t>(tokens_q * heads * dim) * dtype_size(out_dtype), 0);
    lse.assign(static_cast<std::size_t>(tokens_q * heads), 0.0f);
    const TensorView ov = TensorView::contiguous(out.data(), out_dtype, q_shape);
    const TensorView lv = TensorView::contiguous(lse.data(), DType::kF32, lse_shape);
    if (mode == 0) return a.forward(ov, lv).bf16_products;
    if (mode == 3) {
      ref::attention_forward_bf16_products(a, ov, lv);
    } else {
      ref::attention_forward(a, ov, lv, mode == 2);
    }
    return false;
  };
  const auto forward = [&](int mode, DType out_dtype, std::vector<unsigned char>& out, std::vector<float>& lse) {
    (void)forward_of(*att, mode, out_dtype, out, lse);
  };
  const auto as_doubles = [](const std::vector<unsigned char>& bytes, DType dt) {
    std::vector<double> x(bytes.size() / dtype_size(dt));
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = fuzz::element(bytes, dt, i);
    return x;
  };
  // A normaliser in place of the softmax (stick-breaking, CoPE) has no naive composition: what
  // Attention accepts of the draws above runs, fused and in fp64 (fuzz_normalisers compares the
  // two on the classes Attention hands the call to).
  if (group->normaliser) {
    std::vector<unsigned char> fused_out, exact_out;
    std::vector<float> fused_lse, exact_lse;
    forward_of(*att, 0, dtype, fused_out, fused_lse);
    forward_of(*att, 1, DType::kF64, exact_out, exact_lse);
    return 0;
  }
  // Now and then (drawn last, so that the corpus keeps its meaning) the keys and values come from a
  // quantized cache of them instead: the same checks, against the references over that cache.
  std::vector<unsigned char> kq, vq;
  std::optional<Attention> cached;
  std::string cache_text;
  if (std::getenv("POSENC_FUZZ_VERBOSE") != nullptr) std::fprintf(stderr, "cache draw at byte %zu\n", in.position());
  if (!packed && in.flag()) {
    const CacheFormat formats[] = {CacheFormat::kQ8_0, CacheFormat::kQ4_0, CacheFormat::kFp8E4M3};
    const CacheFormat f = dim % 32 == 0 ? formats[in.pick(3)] : CacheFormat::kFp8E4M3;
    const std::int64_t rb = cache_row_bytes(f, dim), rows = tokens_k * kv_heads;
    const std::vector<float> kf(k.begin(), k.end()), vf(v.begin(), v.end());
    kq.resize(static_cast<std::size_t>(rows * rb));
    vq.resize(kq.size());
    quantize_rows(f, kf.data(), rows, dim, kq.data(), rb);
    quantize_rows(f, vf.data(), rows, dim, vq.data(), rb);
    AttentionSpec qs = spec;
    qs.k = {};
    qs.v = {};
    qs.cache = QuantizedCache{f,
                              {kq.data(), batch, k_len, kv_heads, dim, k_len * kv_heads * rb, kv_heads * rb, rb},
                              {vq.data(), batch, k_len, kv_heads, dim, k_len * kv_heads * rb, kv_heads * rb, rb}};
    if (!fuzz::accepted("Attention", [&] { cached.emplace(qs); })) return 0;
    cache_text = ", " + std::string(cache_format_name(f)) + " cache";
  }
  if (std::getenv("POSENC_FUZZ_VERBOSE") != nullptr)
    std::fprintf(stderr, "case%s%s\n", context.c_str(), cache_text.c_str());
  const Attention& checked = cached ? *cached : *att;
  std::vector<unsigned char> fused_out, exact_out, naive_out;
  std::vector<float> fused_lse, exact_lse, naive_lse;
  // On the host's bf16 dot products the yardstick is the naive composition with the same roundings.
  const bool bf16_products = forward_of(checked, 0, dtype, fused_out, fused_lse);
  forward_of(checked, 1, DType::kF64, exact_out, exact_lse);
  forward_of(checked, bf16_products ? 3 : 2, dtype, naive_out, naive_lse);
  const std::vector<double> fused = as_doubles(fused_out, dtype), exact = as_doubles(exact_out, DType::kF64),
                            naive = as_doubles(naive_out, dtype);
  std::vector<double> exact_rounded(exact.size());
  for (std::size_t i = 0; i < exact.size(); ++i)
    exact_rounded[i] = fuzz::element(fuzz::store({exact[i]}, dtype), dtype, 0);
  // flash-attention's criterion, as in the generic matrix: the fused error at most a few times
  // the naive f32 composition's (which meets the same logits and the same output rounding), with
  // a floor of 2^-20 of max|v| and one ulp of the output's dtype (both sides are rounded to it).
  const double ulp = dtype == DType::kBF16 ? std::ldexp(1.0, -7) : dtype == DType::kF16 ? std::ldexp(1.0, -10) : 0.0;
  const double naive_err = fuzz::max_finite_difference(naive, exact);
  // The floor is recursive summation's worst case over the keys (Higham: n·u of Σ|p·v| <= max|v|),
  // which the fused order can reach where the naive order is lucky (one query over 294 keys).
  const double sum_floor = static_cast<double>(k_len) * std::ldexp(1.0, -23);
  // A quantized cache holds the dequantised values: at most max|v|·(1 + 2^-11) (an f16 scale rounded up).
  const double vmax = std::max(fuzz::max_finite(v), 1e-3) * (cached ? 1.001 : 1.0);
  // bf16 products: small cases can make the naive error small by luck, so docs/attention.md's
  // worst-case bound holds as well (η: the logits' rounding, which also moves lse).
  const double eta = bf16_products ? std::ldexp(1.0, -8) * 1.02 * std::sqrt(static_cast<double>(dim)) *
                                         fuzz::max_finite(q) * fuzz::max_finite(k)
                                   : 0.0;
  const double bf16_bound = bf16_products ? (std::ldexp(1.0, -9) + std::expm1(2 * eta)) * vmax : 0.0;
  fuzz::expect_match(("out" + context + cache_text).c_str(), fused, exact_rounded,
                     std::max(4 * naive_err, bf16_bound) + (std::ldexp(1.0, -20) + sum_floor + ulp) * vmax);
  const std::vector<double> fl(fused_lse.begin(), fused_lse.end()), el(exact_lse.begin(), exact_lse.end()),
      nl(naive_lse.begin(), naive_lse.end());
  fuzz::expect_match(("lse" + context + cache_text).c_str(), fl, el,
                     4 * fuzz::max_finite_difference(nl, el) + eta + std::ldexp(1.0, -18) * (1 + fuzz::max_finite(el)));

  if (dtype != DType::kF32 || cached) return 0;  // a quantized cache has no backward
  // Backward (f32): each gradient is a sum of f32 terms. 2^-13 of its largest magnitude
  // (tests/attention_testing.hpp's expect_close) covers sums of up to ~2^10 terms; where the sum
  // cancels to ~0 the error is that of the terms instead. dS_ij = P_ij·(dP_ij − δ_i): P carries
  // the relative error of its exponent, ~2^-24 of |logit| + |lse| (a few ulps more for exp and
  // the logit's own dot product, |q·k|·scale·D), and |dP| + |δ| <= 2·D·max|dO|·max|v|. So dq
  // gets that error times scale·max|k| (Σ_j P_ij <= 1), dk times scale·max|q| times the rows a
  // key meets (Sq·H/G), dv max|dO| times those rows, parameter gradients a position (< Sq + Sk)
  // per pair. A factor 4 on top covers the sums' own rounding.
  const double mdo = std::max(fuzz::max_finite(d_out), 1e-3), mv = std::max(fuzz::max_finite(v), 1e-3);
  const double mq = std::max(fuzz::max_finite(q), 1e-3), mk = std::max(fuzz::max_finite(k), 1e-3);
  const double scale = 1 / std::sqrt(static_cast<double>(dim)), d = static_cast<double>(dim);
  const double eps = 4 * std::ldexp(1.0, -24) * (8 + 2 * fuzz::max_finite(el) + d * scale * mq * mk);
  const double rows = static_cast<double>(q_len * (heads / kv_heads)), ds = 2 * d * mdo * mv;
  const double terms_q = ds * scale * mk, terms_k = ds * scale * mq * rows, terms_v = mdo * rows;
  const double terms_p = ds * rows * static_cast<double>(k_len) * static_cast<double>(q_len + k_len);
  const std::vector<unsigned char> dob = fuzz::store(d_out, DType::kF32), dob64 = fuzz::store(d_out, DType::kF64);
  const auto backward = [&](bool reference) {
    const DType dt = reference ? DType::kF64 : DType::kF32;
    std::vector<unsigned char> out, dq(static_cast<std::size_t>(tokens_q * heads * dim) * dtype_size(dt), 0),
        dk(static_cast<std::size_t>(tokens_k * kv_heads * dim) * dtype_size(dt), 0), dv = dk;
    std::vector<float> lse;
    forward(reference ? 1 : 0, dt, out, lse);
    AttentionGradients grads = att->zero_gradients();
    const ConstTensorView ov = ConstTensorView::contiguous(out.data(), dt, q_shape);
    const ConstTensorView lv = ConstTensorView::contiguous(lse.data(), DType::kF32, lse_shape);
    const ConstTensorView dov = ConstTensorView::contiguous((reference ? dob64 : dob).data(), dt, q_shape);
    const TensorView dqv = TensorView::contiguous(dq.data(), dt, q_shape),
                     dkv = TensorView::contiguous(dk.data(), dt, k_shape),
                     dvv = TensorView::contiguous(dv.data(), dt, k_shape);
    if (reference) {
      ref::attention_backward(*att, ov, lv, dov, dqv, dkv, dvv, &grads);
    } else {
      att->backward(ov, lv, dov, dqv, dkv, dvv, &grads);
    }
    Result r;
    r.dq = as_doubles(dq, dt);
    r.dk = as_doubles(dk, dt);
    r.dv = as_doubles(dv, dt);
    r.out = scheme_gradients(entry, grads.groups[0]);
    for (const auto& t : grads.groups[0].terms) r.out.insert(r.out.end(), t.begin(), t.end());
    return r;
  };
  const Result got = backward(false);
  const Result want = backward(true);
  const auto close = [&context, eps](const std::string& what, const std::vector<double>& g,
                                     const std::vector<double>& w, double terms) {
    fuzz::expect_match((what + context).c_str(), g, w,
                       std::ldexp(1.0, -13) * std::max(fuzz::max_finite(w), 1e-3) + eps * terms);
  };
  close("dq", got.dq, want.dq, terms_q);
  close("dk", got.dk, want.dk, terms_k);
  close("dv", got.dv, want.dv, terms_v);
  close("parameter gradients", got.out, want.out, terms_p);
  return 0;
}
