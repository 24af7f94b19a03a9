// Every registered scheme's validation (posenc/registry.hpp): any head count, head size, option
// values (in range, out of range, NaN, ±inf, unknown names) and learned parameters (the declared
// count or not, any values). make_head_group returns a group or names what it refuses; a group it
// returns materialises its bias like the fp64 reference (relative biases) and builds an attention.
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "fuzzing.hpp"

using namespace posenc;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::set_up();
  fuzz::Input in(data, size);
  const std::vector<SchemeEntry>& entries = schemes();
  const SchemeEntry& entry = entries[in.pick(entries.size())];
  SchemeArgs args;
  args.heads = in.flag() ? in.any_integer() : in.integer(1, 6);
  args.head_dim = in.flag() ? in.any_integer() : 2 * in.integer(1, 16);
  if (in.flag()) args.scale = in.any_number();
  for (const SchemeOption& o : entry.options) {
    switch (in.byte() % 4) {
      case 0:
        break;  // the default
      case 1:
        args.options[o.name] = in.any_number();
        break;
      default: {  // a value in the declared range, kept small for sizes
        const double lo = std::max(o.minimum, -64.0), hi = std::min(o.maximum, 64.0);
        const double v = in.uniform(lo, hi);
        args.options[o.name] = o.integer ? std::round(v) : v;
      }
    }
  }
  if (in.flag()) args.options[in.text(12)] = in.any_number();
  std::vector<std::int64_t> shape;
  fuzz::accepted("parameter_shape", [&] {
    if (entry.parameter_shape) shape = entry.parameter_shape(complete_scheme_args(entry, args));
  });
  std::int64_t declared = shape.empty() ? 0 : 1;
  for (const std::int64_t n : shape) declared = n > 0 && declared <= (std::int64_t{1} << 24) / n ? declared * n : -1;
  if (in.flag() && declared > 0) {
    const std::int64_t n = in.flag() ? declared : declared + in.integer(-2, 2);
    for (std::int64_t i = 0; i < n; ++i) args.parameters.push_back(in.flag() ? in.any_number() : in.uniform(-1, 1));
  }
  // A scheme's per-token inputs: a small [1, tokens, heads] tensor, its heads now and then not the
  // group's, a value now and then outside the scheme's range (drawn only for such entries).
  std::vector<std::vector<double>> inputs;
  for (const SchemeInput& input : entry.inputs) {
    const std::int64_t tokens = in.integer(1, 4);
    const std::int64_t h = args.heads >= 1 && args.heads <= 6 && in.flag() ? args.heads : in.integer(1, 6);
    std::vector<double>& x = inputs.emplace_back(static_cast<std::size_t>(tokens * h));
    for (double& v : x) v = in.flag() ? in.any_number() : input.typical(in.uniform(0, 1));
    if (in.flag()) args.inputs[input.name] = ConstTensorView::of(x.data(), {1, tokens, h});
  }
  std::optional<HeadGroup> group;
  fuzz::accepted(entry.name.c_str(), [&] { group = make_head_group(entry.name, args); });
  if (!group) return 0;
  fuzz::require(group->heads == args.heads, entry.name + ": the group has " + std::to_string(group->heads) + " heads");
  if (!group->bias || args.heads > 8) return 0;
  const RelativeBias* relative = relative_bias(*group->bias);
  if (relative == nullptr) return 0;
  // Materialisation against the reference over a small grid of positions, near 0 or far.
  const std::int64_t sq = in.integer(1, 9), sk = in.integer(1, 9);
  const std::int64_t q0 = in.flag() ? in.integer(0, kMaxPosition - sq) : in.integer(0, 300);
  const std::int64_t k0 = in.flag() ? in.integer(0, kMaxPosition - sk) : in.integer(0, 300);
  const Positions qp = Positions::range(sq, q0), kp = Positions::range(sk, k0);
  std::vector<float> got(static_cast<std::size_t>(args.heads * sq * sk));
  std::vector<double> want(got.size());
  const bool ran = fuzz::accepted("bias_materialize", [&] {
    bias_materialize(*group->bias, qp, kp, TensorView::of(got.data(), {args.heads, sq, sk}));
  });
  const bool ran_ref = fuzz::accepted("ref::bias_materialize", [&] {
    ref::bias_materialize(*group->bias, qp, kp, TensorView::of(want.data(), {args.heads, sq, sk}));
  });
  fuzz::require(ran == ran_ref, entry.name + ": the kernel and the reference disagree on accepting the call");
  if (!ran) return 0;
  // The kernels compute in f32 from fp64 tables or slopes: a few ulps of each value. A sum of
  // sinusoids of r (Sandwich: d'/2 cosines, scaled by at most H/8) carries the fp64 reference's
  // own angle error, |r|·2^-52 per cosine, which grows with the positions.
  const double r_max = static_cast<double>(std::max(std::abs(q0 - k0 - sk), std::abs(k0 - q0 + sk + sq)));
  const SchemeArgs full = complete_scheme_args(entry, args);
  const double sines = full.has("dim") ? static_cast<double>(full.heads) * full.number("dim") / 16 : 0.0;
  const double angle = sines * r_max * std::ldexp(1.0, -51);
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double w = static_cast<float>(want[i]);
    fuzz::expect_match((entry.name + " bias").c_str(), {got[i]}, {w},
                       std::ldexp(1.0, -21) * std::fabs(w) + angle + 1e-30);
  }
  return 0;
}
