// Uses the installed library: a table, an in-place add with a cache offset, and an error.
#include <posenc/posenc.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  const posenc::SinusoidalParams params(8);
  std::vector<float> table(3 * 8);
  posenc::sinusoidal_table(params, posenc::Positions::range(3), posenc::TensorView::of(table.data(), {3, 8}));
  if (std::fabs(table[8] - std::sin(1.0f)) > 1e-7f) return 1;
  std::vector<float> x(2 * 8, 0.0f);
  posenc::sinusoidal_add_inplace(params, posenc::TensorView::of(x.data(), {2, 8}), posenc::Positions::range(2, 1));
  if (x[0] != table[8]) return 2;
  try {
    posenc::SinusoidalParams bad(7);
    return 3;
  } catch (const posenc::Error& e) {
    std::printf("consumer ok (%s; %s)\n", std::string(posenc::version()).c_str(), e.what());
  }
  return 0;
}
