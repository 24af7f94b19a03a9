// RoPE, differentially: parameters of any type and scaling (built or refused by name), positions
// up to kMaxPosition, both layouts, every dtype, in place or out of place, every direction, an
// occasional NaN or ±inf in q — the fused kernels against the fp64 reference (ref::rope_apply).
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "fuzzing.hpp"

using namespace posenc;

namespace {

double sane_or_any(fuzz::Input& in, double lo, double hi) { return in.flag() ? in.any_number() : in.uniform(lo, hi); }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::set_up();
  fuzz::Input in(data, size);
  const std::int64_t head_dim = in.flag() ? in.any_integer() : 2 * in.integer(1, 40);
  const std::int64_t rotary_dim =
      in.flag() ? in.any_integer() : 2 * in.integer(1, std::max<std::int64_t>(head_dim / 2, 1));
  const double base = in.flag() ? in.any_number() : in.uniform(2.0, 1e6);
  const RopeLayout layout = in.flag() ? RopeLayout::kInterleaved : RopeLayout::kHalfSplit;
  RopeScaling s;
  s.type = static_cast<RopeType>(in.integer(0, 7));
  s.factor = sane_or_any(in, 1.0, 64.0);
  s.original_max_position_embeddings = in.flag() ? in.any_integer() : in.integer(0, 8192);
  if (in.flag()) s.beta_fast = in.any_number();
  if (in.flag()) s.beta_slow = in.any_number();
  if (in.flag()) s.mscale = sane_or_any(in, 0.0, 2.0);
  if (in.flag()) s.mscale_all_dim = sane_or_any(in, 0.0, 2.0);
  s.truncate = in.flag();
  if (in.flag()) s.attention_factor = sane_or_any(in, 0.5, 2.0);
  if (in.flag()) s.low_freq_factor = sane_or_any(in, 1.0, 4.0);
  if (in.flag()) s.high_freq_factor = sane_or_any(in, 1.0, 8.0);
  for (auto* factors : {&s.short_factor, &s.long_factor}) {
    if (!in.flag()) continue;
    const auto n = static_cast<std::size_t>(in.flag() ? in.integer(0, 50) : std::max<std::int64_t>(rotary_dim / 2, 0));
    if (n > 64) continue;
    for (std::size_t i = 0; i < n; ++i) factors->push_back(sane_or_any(in, 1.0, 8.0));
  }
  if (in.flag()) s.partial_rotary_factor = sane_or_any(in, 0.0, 1.0);
  const std::int64_t max_positions = in.flag() ? in.any_integer() : in.integer(1, 1 << 17);
  std::vector<double> freq_factors;
  if (in.flag() && rotary_dim > 0 && rotary_dim <= 128) {
    for (std::int64_t i = 0; i < rotary_dim / 2; ++i) freq_factors.push_back(sane_or_any(in, 0.5, 8.0));
  }
  std::optional<RopeParams> params;
  fuzz::accepted("RopeParams", [&] {
    params = RopeParams(head_dim, rotary_dim, base, layout, s, max_positions, freq_factors);
    if (in.flag()) params = params->with_rotary_offset(in.integer(0, 8));
  });
  if (!params || params->head_dim() > 160) return 0;
  const double alpha = params->attention_factor();
  fuzz::require(std::isfinite(alpha) && alpha > 0, "attention factor " + std::to_string(alpha));

  // Tokens [B, S, H, D] at positions start + s (anywhere up to kMaxPosition).
  const std::int64_t batch = in.integer(1, 2), seq = in.integer(1, 24), heads = in.integer(1, 3);
  const std::int64_t start = in.flag() ? in.integer(0, kMaxPosition - seq) : in.integer(0, 5000);
  const std::int64_t seq_len = in.flag() ? 0 : in.integer(1, 1 << 20);
  const auto direction = static_cast<RopeDirection>(in.integer(0, 2));
  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kF16, DType::kF64};
  const DType dtype = dtypes[in.pick(4)];
  const bool in_place = in.flag();
  const Positions positions = Positions::range(seq, start);
  const std::int64_t d = params->head_dim(), count = batch * seq * heads * d;
  std::vector<double> x(static_cast<std::size_t>(count));
  for (double& v : x) v = fuzz::element(fuzz::store({in.uniform(-1, 1)}, dtype), dtype, 0);
  std::int64_t bad_at = -1;
  if (in.flag()) {
    const double bad[] = {std::nan(""), INFINITY, -INFINITY};
    const double value = bad[in.pick(3)];
    bad_at = static_cast<std::int64_t>(in.pick(x.size()));
    x[static_cast<std::size_t>(bad_at)] = value;
  }
  const std::vector<std::int64_t> shape = {batch, seq, heads, d};
  const std::vector<unsigned char> source = fuzz::store(x, dtype);
  std::vector<unsigned char> got = in_place ? source : std::vector<unsigned char>(source.size());
  std::vector<unsigned char> want(static_cast<std::size_t>(count) * 8);
  const ConstTensorView xv = ConstTensorView::contiguous(source.data(), dtype, shape);
  const TensorView gv = TensorView::contiguous(got.data(), dtype, shape);
  bool ran = false;
  fuzz::accepted("rope_apply", [&] {
    if (in_place) {
      rope_apply(*params, positions, gv, TensorView{}, direction, seq_len);
    } else {
      rope_apply(*params, positions, xv, ConstTensorView{}, gv, TensorView{}, direction, seq_len);
    }
    ran = true;
  });
  const std::vector<unsigned char> wide = fuzz::store(x, DType::kF64);
  bool ran_ref = false;
  fuzz::accepted("ref::rope_apply", [&] {
    ref::rope_apply(*params, positions, ConstTensorView::contiguous(wide.data(), DType::kF64, shape), ConstTensorView{},
                    TensorView::contiguous(want.data(), DType::kF64, shape), TensorView{}, direction, seq_len);
    ran_ref = true;
  });
  fuzz::require(ran == ran_ref, "the kernel and the reference disagree on accepting the call");
  if (!ran) return 0;
  std::vector<double> g(static_cast<std::size_t>(count)), w(g.size());
  double omega = 0;
  // The frequencies the call used: seq_len 0 means max_position + 1 (rope_apply's contract).
  const std::int64_t effective_len = seq_len == 0 ? start + seq : seq_len;
  for (const double o : params->inv_frequencies(effective_len)) omega = std::max(omega, o);
  for (std::size_t i = 0; i < g.size(); ++i) {
    g[i] = fuzz::element(got, dtype, i);
    w[i] = fuzz::element(fuzz::store({fuzz::element(want, DType::kF64, i)}, dtype), dtype, 0);
  }
  // Per element (|x| <= 1, so |y| <= α·√2): f32 kernels carry ~3 ulps of α plus the fp64
  // reference's own angle error, (start + S)·ω·2^-53 rad (2^-51 here); a 16-bit store adds one ulp of |y|
  // (relative 2^-7 for bf16, 2^-10 for f16; both sides are rounded to the dtype here).
  const double sigma = direction == RopeDirection::kInverse ? 1 / alpha : alpha;
  const double angle = static_cast<double>(start + seq) * omega * std::ldexp(1.0, -51);
  const double rel = dtype == DType::kBF16 ? std::ldexp(1.0, -7) : dtype == DType::kF16 ? std::ldexp(1.0, -10) : 0.0;
  // f16 values below 2^-14 are subnormal, spaced 2^-24 apart whatever their size.
  const double floor16 = dtype == DType::kF16 ? std::ldexp(1.0, -24) : 0.0;
  const double tol = dtype == DType::kF64 ? 0.0 : (1e-6 + angle) * 2 * sigma + rel * 2 * sigma + floor16;
  const std::string context =
      "rope (" + std::string(rope_type_name(params->scaling().type)) + ", D " + std::to_string(d) + ", r " +
      std::to_string(params->rotary_dim()) + ", offset " + std::to_string(params->rotary_offset()) + ", " +
      std::string(dtype_name(dtype)) + (layout == RopeLayout::kInterleaved ? ", interleaved" : ", half-split") +
      ", start " + std::to_string(start) + ", direction " + std::to_string(static_cast<int>(direction)) +
      (in_place ? ", in place" : "") + ", non-finite at " + std::to_string(bad_at) + ", α " + fuzz::number(alpha) + ")";
  // The kernels take α·cos θ and α·sin θ in f32: a coefficient below f32's smallest subnormal is 0
  // there, so an infinite partner gives inf·0 = NaN (as an f32 eager composition does) where the
  // fp64 reference's tiny coefficient gives ±inf. That element is the documented exception.
  const std::vector<double> omegas = params->inv_frequencies(effective_len);
  const std::int64_t r = params->rotary_dim(), offset = params->rotary_offset();
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (!(std::isnan(g[i]) && std::isinf(w[i]))) continue;
    const std::int64_t j = static_cast<std::int64_t>(i) % d - offset;
    const std::int64_t token = static_cast<std::int64_t>(i) / (heads * d) % seq;
    if (j < 0 || j >= r) continue;
    const std::int64_t pair = layout == RopeLayout::kInterleaved ? j / 2 : j % (r / 2);
    const double theta = static_cast<double>(start + token) * omegas[static_cast<std::size_t>(pair)];
    const auto vanishes = [&](double c) { return c != 0 && static_cast<float>(sigma * c) == 0.0f; };
    if (vanishes(std::sin(theta)) || vanishes(std::cos(theta))) g[i] = w[i];
  }
  fuzz::expect_match(context.c_str(), g, w, tol);
  return 0;
}
