// Uses posenc::torch from an installed posenc: a libtorch program calls posenc's ops through the
// dispatcher (the library registers them when it loads) and checks a value.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#include <cstdio>

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
  std::printf("torch consumer ok (table[1, 0] = %.6f)\n", got);
  return 0;
}
