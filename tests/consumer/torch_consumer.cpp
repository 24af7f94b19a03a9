// Uses posenc::torch from an installed posenc: a libtorch program calls posenc's ops through the
// dispatcher (the library registers them when it loads) and checks a value.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "posenc/torch/classes.hpp"
#include "posenc/torch/ops.hpp"

int main() {
  const auto table = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("posenc::sinusoidal_table", "")
                         .typed<at::Tensor(const at::Tensor&, std::int64_t, double, bool, c10::ScalarType)>();
  const at::Tensor t = table.call(at::arange(3, at::kLong), 8, 10000.0, true, at::kFloat);
  const double got = t.index({1, 0}).item<double>();
  if (t.size(0) != 3 || t.size(1) != 8 || std::fabs(got - std::sin(1.0)) > 1e-7) {
    std::fprintf(stderr, "torch consumer: table[1, 0] = %.9f; expected sin(1)\n", got);
    return 1;
  }
  // The fused attention with a typed scheme, by named arguments: ALiBi over one key gives that key's value.
  posenc::torch_adapter::AttentionArgs args;
  args.schemes.push_back(c10::make_intrusive<posenc::torch_adapter::SchemeClass>(
      "alibi", 2, c10::Dict<std::string, double>(), c10::nullopt));
  args.causal = true;
  const at::Tensor q = at::randn({1, 1, 2, 8}), k = at::randn({1, 1, 2, 8}), v = at::randn({1, 1, 2, 8});
  const auto [out, lse] = posenc::torch_adapter::call_attention(q, k, v, args);
  if (!at::allclose(out, v, 0.0, 1e-6)) {
    std::fprintf(stderr, "torch consumer: attention over one key differs from its value\n");
    return 1;
  }
  std::printf("torch consumer ok (table[1, 0] = %.6f, attention)\n", got);
  return 0;
}
