// posenc tour — a short printed tour of every encoding implemented so far, on small examples.
// It grows as encodings land; each section shows the math, a few numbers and one property.
#include <fmt/core.h>

#include <cmath>
#include <string>
#include <vector>

#include "commands.hpp"
#include "posenc/posenc.hpp"

namespace posenc::cli {
namespace {

void print_rows(const std::vector<float>& v, std::int64_t rows, std::int64_t cols,
                const std::vector<std::int64_t>& labels) {
  for (std::int64_t r = 0; r < rows; ++r) {
    std::string line = fmt::format("    pos {:>4} |", labels[static_cast<std::size_t>(r)]);
    for (std::int64_t c = 0; c < cols; ++c) line += fmt::format(" {:>7.4f}", v[static_cast<std::size_t>(r * cols + c)]);
    fmt::print("{}\n", line);
  }
}

void section(const char* title) { fmt::print("\n━━ {} {}\n", title, std::string(70 - std::string(title).size(), '-')); }

void tour_sinusoidal() {
  section("Sinusoidal (Vaswani et al. 2017)");
  fmt::print("  PE(p, 2i) = sin(p·ω_i), PE(p, 2i+1) = cos(p·ω_i), ω_i = 10000^(-2i/d)\n\n");
  const std::int64_t d = 8, n = 4;
  std::vector<float> table(static_cast<std::size_t>(n * d));
  for (auto layout : {SinusoidalLayout::kInterleaved, SinusoidalLayout::kSplitHalves}) {
    sinusoidal_table(SinusoidalParams(d, 10000.0, layout), Positions::range(n),
                     TensorView::of(table.data(), {n, d}));
    fmt::print("  layout {} — d = 8, positions 0..3\n",
               layout == SinusoidalLayout::kInterleaved ? "interleaved [s0 c0 s1 c1 …]" : "split halves [s0 s1 … | c0 c1 …]");
    print_rows(table, n, d, {0, 1, 2, 3});
    fmt::print("\n");
  }

  // Exactness at long positions: posenc against the fp32 tutorial formula, both against the truth
  // computed in long double.
  const std::int64_t wide = 1024;
  const std::vector<std::int64_t> far = {(1 << 16) + 3, (1 << 20) + 7, (1 << 24) - 1};
  std::vector<float> rows(far.size() * static_cast<std::size_t>(wide));
  sinusoidal_table(SinusoidalParams(wide), Positions::ids(far),
                   TensorView::of(rows.data(), {static_cast<std::int64_t>(far.size()), wide}));
  fmt::print("  Long positions, d = {}: max |error| against the exact sin/cos (long double)\n", wide);
  fmt::print("    {:>10}   {:>14}   {:>14}\n", "position", "posenc f32", "fp32 p*div_term");
  for (std::size_t r = 0; r < far.size(); ++r) {
    double err_posenc = 0, err_naive = 0;
    const float neg_log_base_over_d = -std::log(10000.0f) / static_cast<float>(wide);
    for (std::int64_t i = 0; i < wide / 2; ++i) {
      const long double angle =
          static_cast<long double>(far[r]) * std::pow(10000.0L, -2.0L * i / wide);
      const float div_term = std::exp(static_cast<float>(2 * i) * neg_log_base_over_d);
      const float naive_angle = static_cast<float>(far[r]) * div_term;
      const double true_sin = static_cast<double>(std::sin(angle));
      const double true_cos = static_cast<double>(std::cos(angle));
      err_naive = std::max({err_naive, std::fabs(std::sin(naive_angle) - true_sin),
                            std::fabs(std::cos(naive_angle) - true_cos)});
      err_posenc = std::max({err_posenc, std::fabs(rows[r * wide + 2 * i] - true_sin),
                             std::fabs(rows[r * wide + 2 * i + 1] - true_cos)});
    }
    fmt::print("    {:>10}   {:>14.3e}   {:>14.3e}\n", far[r], err_posenc, err_naive);
  }
  fmt::print("    (2^-24 = {:.3e}: posenc stays within it; the fp32 formula loses the angle)\n",
             std::ldexp(1.0, -24));
}

void tour_learned() {
  section("Learned absolute table (GPT-2, BERT)");
  fmt::print("  y[b, s] = x[b, s] + W[pos(b, s)];  backward: dW[pos] += dy, dx += dy\n\n");
  const std::int64_t max_len = 6, d = 4;
  LearnedTable table(max_len, d);
  learned_init_normal(table.view(), 0.02, /*seed=*/1);
  const std::vector<std::int64_t> ids = {0, 1, 2, 1};
  std::vector<float> x(ids.size() * d, 1.0f), y(ids.size() * d);
  const auto s = static_cast<std::int64_t>(ids.size());
  learned_forward(table.view(), ConstTensorView::of(x.data(), {s, d}), Positions::ids(ids),
                  TensorView::of(y.data(), {s, d}));
  fmt::print("  W ~ N(0, 0.02²), seed 1; x = 1; y for positions 0, 1, 2, 1:\n");
  print_rows(y, s, d, ids);

  std::vector<float> dy(ids.size() * d, 1.0f), d_table(static_cast<std::size_t>(max_len * d), 0.0f);
  learned_backward(ConstTensorView::of(dy.data(), {s, d}), Positions::ids(ids),
                   TensorView::of(d_table.data(), {max_len, d}));
  fmt::print("\n  backward with dy = 1: row 1 of dW sums its two tokens, deterministically\n");
  print_rows(std::vector<float>(d_table.begin(), d_table.begin() + 3 * d), 3, d, {0, 1, 2});

  const std::vector<std::int64_t> too_far = {7};
  std::vector<float> one(d, 0.0f), out(d);
  try {
    learned_forward(table.view(), ConstTensorView::of(one.data(), {1, d}), Positions::ids(too_far),
                    TensorView::of(out.data(), {1, d}));
  } catch (const Error& e) {
    fmt::print("\n  position 7 with max_len 6 is an error:\n    {}\n", e.what());
  }
}

void run_tour() {
  fmt::print("posenc {} — a tour of the encodings implemented so far\n", version());
  std::string targets;
  for (const auto& t : available_targets()) targets += (targets.empty() ? "" : ", ") + t;
  fmt::print("kernels: {} (available: {}), {} thread(s)\n", active_target(), targets, num_threads());
  tour_sinusoidal();
  tour_learned();
  fmt::print("\nNext: `posenc table sinusoidal --length 10 --dim 4`, `posenc bench sinusoidal`.\n");
}

}  // namespace

Runner add_tour(CLI::App& app) {
  app.add_subcommand("tour", "A short printed tour of every encoding implemented so far");
  return [] { run_tour(); };
}

}  // namespace posenc::cli
