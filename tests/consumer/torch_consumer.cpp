// Uses posenc::torch from an installed posenc: a libtorch program calls posenc's ops through the
// dispatcher (the library registers them when it loads) and checks a value.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "posenc/torch/classes.hpp"

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
  // The fused attention with a typed scheme: ALiBi over one key gives that key's value.
  using posenc::torch_adapter::SchemeClass;
  using Schemes = c10::List<c10::intrusive_ptr<SchemeClass>>;
  using Temperature = c10::optional<c10::intrusive_ptr<posenc::torch_adapter::TemperatureClass>>;
  const auto attention =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("posenc::attention", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const Schemes&, const std::vector<at::Tensor>&,
              const std::vector<at::Tensor>&, const c10::optional<at::Tensor>&, bool, std::int64_t, std::int64_t,
              c10::optional<std::int64_t>, const Temperature&, double, c10::optional<double>,
              const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, std::vector<std::int64_t>,
              std::vector<std::int64_t>, bool, c10::optional<std::string>)>();
  Schemes schemes;
  schemes.push_back(c10::make_intrusive<SchemeClass>("alibi", 2, c10::Dict<std::string, double>(), c10::nullopt));
  const at::Tensor q = at::randn({1, 1, 2, 8}), k = at::randn({1, 1, 2, 8}), v = at::randn({1, 1, 2, 8});
  const auto [out, lse] =
      attention.call(q, k, v, schemes, {}, {}, c10::nullopt, true, -1, -1, c10::nullopt, c10::nullopt, 0.0,
                     c10::nullopt, c10::nullopt, c10::nullopt, {}, {}, true, c10::nullopt);
  if (!at::allclose(out, v, 0.0, 1e-6)) {
    std::fprintf(stderr, "torch consumer: attention over one key differs from its value\n");
    return 1;
  }
  std::printf("torch consumer ok (table[1, 0] = %.6f, attention)\n", got);
  return 0;
}
