// posenc tour — a short printed tour of every encoding implemented so far, on small examples.
// It grows as encodings land; each section shows the math, a few numbers and one property.
#include <fmt/core.h>
#include <fmt/ranges.h>

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
    sinusoidal_table(SinusoidalParams(d, 10000.0, layout), Positions::range(n), TensorView::of(table.data(), {n, d}));
    fmt::print("  layout {} — d = 8, positions 0..3\n", layout == SinusoidalLayout::kInterleaved
                                                            ? "interleaved [s0 c0 s1 c1 …]"
                                                            : "split halves [s0 s1 … | c0 c1 …]");
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
      const long double angle = static_cast<long double>(far[r]) * std::pow(10000.0L, -2.0L * i / wide);
      const float div_term = std::exp(static_cast<float>(2 * i) * neg_log_base_over_d);
      const float naive_angle = static_cast<float>(far[r]) * div_term;
      const double true_sin = static_cast<double>(std::sin(angle));
      const double true_cos = static_cast<double>(std::cos(angle));
      err_naive = std::max(
          {err_naive, std::fabs(std::sin(naive_angle) - true_sin), std::fabs(std::cos(naive_angle) - true_cos)});
      err_posenc = std::max(
          {err_posenc, std::fabs(rows[r * wide + 2 * i] - true_sin), std::fabs(rows[r * wide + 2 * i + 1] - true_cos)});
    }
    fmt::print("    {:>10}   {:>14.3e}   {:>14.3e}\n", far[r], err_posenc, err_naive);
  }
  fmt::print("    (2^-24 = {:.3e}: posenc stays within it; the fp32 formula loses the angle)\n", std::ldexp(1.0, -24));
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

// q·k after rotating q to position m and k to n, with angles in f32 (as most code computes them).
double fp32_rope_score(const std::vector<float>& q, const std::vector<float>& k, std::int64_t m, std::int64_t n,
                       const std::vector<double>& inv_freq) {
  const std::size_t half = inv_freq.size();
  double dot = 0;
  for (std::size_t i = 0; i < half; ++i) {
    const float w = static_cast<float>(inv_freq[i]);
    const float am = static_cast<float>(m) * w, an = static_cast<float>(n) * w;
    const float qa = q[i] * std::cos(am) - q[i + half] * std::sin(am),
                qb = q[i + half] * std::cos(am) + q[i] * std::sin(am);
    const float ka = k[i] * std::cos(an) - k[i + half] * std::sin(an),
                kb = k[i + half] * std::cos(an) + k[i] * std::sin(an);
    dot += static_cast<double>(qa) * ka + static_cast<double>(qb) * kb;
  }
  return dot;
}

void tour_rope() {
  section("Rotary (RoPE; Su et al. 2021)");
  fmt::print("  pairs (a_i, b_i) turn by p·ω_i, ω_i = base^(-2i/r); <R(m)q, R(n)k> depends on m - n only\n\n");
  const std::int64_t d = 8;
  std::vector<float> x(d);
  for (std::int64_t j = 0; j < d; ++j) x[static_cast<std::size_t>(j)] = static_cast<float>(j + 1);
  for (auto layout : {RopeLayout::kInterleaved, RopeLayout::kHalfSplit}) {
    std::vector<float> y(d);
    rope_apply(RopeParams(d, d, 10000.0, layout), Positions::range(1, 1), ConstTensorView::of(x.data(), {1, 1, d}),
               TensorView(), TensorView::of(y.data(), {1, 1, d}), TensorView());
    fmt::print("  {:<28} x = 1..8 at position 1 → [{:.4f}]\n",
               layout == RopeLayout::kInterleaved ? "interleaved [a0 b0 a1 b1 …]" : "half-split [a0 a1 … b0 b1 …]",
               fmt::join(y, ", "));
  }
  // Relative position at long context: the score of (m + t, n + t) should equal that of (m, n).
  const std::int64_t dim = 128;
  const RopeParams params(dim, dim, 10000.0);
  std::vector<float> q(dim), k(dim);
  for (std::int64_t j = 0; j < dim; ++j) {
    q[static_cast<std::size_t>(j)] = static_cast<float>(std::sin(0.7 * static_cast<double>(j) + 0.3));
    k[static_cast<std::size_t>(j)] = static_cast<float>(std::cos(1.3 * static_cast<double>(j)));
  }
  auto score = [&](std::int64_t m, std::int64_t n) {
    std::vector<float> qr(dim), kr(dim);
    const std::vector<std::int64_t> pm = {m}, pn = {n};
    rope_apply(params, Positions::ids(pm), ConstTensorView::of(q.data(), {1, 1, dim}), TensorView(),
               TensorView::of(qr.data(), {1, 1, dim}), TensorView());
    rope_apply(params, Positions::ids(pn), ConstTensorView::of(k.data(), {1, 1, dim}), TensorView(),
               TensorView::of(kr.data(), {1, 1, dim}), TensorView());
    double dot = 0;
    for (std::int64_t j = 0; j < dim; ++j)
      dot += static_cast<double>(qr[static_cast<std::size_t>(j)]) * kr[static_cast<std::size_t>(j)];
    return dot;
  };
  const std::vector<double> w = params.inv_frequencies();
  const double exact = score(10, 3);
  fmt::print("\n  q·k for positions (10 + t, 3 + t), d = 128: the same for every t, ideally ({:.5f})\n", exact);
  fmt::print("    {:>10}   {:>12}   {:>16}\n", "t", "posenc", "fp32 angles");
  for (const std::int64_t t :
       {std::int64_t{0}, std::int64_t{1} << 16, std::int64_t{1} << 20, (std::int64_t{1} << 24) - 11}) {
    fmt::print("    {:>10}   {:>12.5f}   {:>16.5f}\n", t, score(10 + t, 3 + t),
               fp32_rope_score(q, k, 10 + t, 3 + t, w));
  }
  RopeScaling llama3;
  llama3.type = RopeType::kLlama3;
  llama3.factor = 8;
  llama3.low_freq_factor = 1;
  llama3.high_freq_factor = 4;
  llama3.original_max_position_embeddings = 8192;
  const std::vector<double> scaled =
      RopeParams(128, 128, 5e5, RopeLayout::kHalfSplit, llama3, 131072).inv_frequencies();
  fmt::print("\n  Llama 3.1 (rope_type llama3, factor 8): ω_0 = {:.6g}, ω_40 = {:.6g}, ω_63 = {:.6g}\n", scaled[0],
             scaled[40], scaled[63]);
  fmt::print("  (`posenc rope-freqs --config config.json` prints them for any Hugging Face config)\n");
}

void tour_biases() {
  section("A closer look at the built-in biases: ALiBi, T5, Kerple, NoPE, …");
  fmt::print("  score(h, i, j) = q_i·k_j/√d + b(h, j − i): the bias depends on the key − query distance\n\n");
  const std::vector<double> slopes = alibi_slopes(12);
  fmt::print(
      "  ALiBi (Press et al. 2022), b = −m_h·(i − j). Slopes for 12 heads (8 of 2^(−k), then every\n"
      "  other slope of 16 heads):\n    {:.4g}\n",
      fmt::join(slopes, " "));
  const std::int64_t n = 6;
  std::vector<float> bias(static_cast<std::size_t>(n * n));
  const Positions pos = Positions::range(n, 100);  // a cache offset changes nothing: only j − i counts
  bias_materialize(AlibiParams(std::vector<double>{0.25}), pos, pos, TensorView::of(bias.data(), {1, n, n}));
  fmt::print("  m = 1/4 at query positions 100…105 (rows) against keys 100…105 (columns; masking is attention's):\n");
  print_rows(bias, n, n, {100, 101, 102, 103, 104, 105});
  fmt::print("\n  T5 buckets (32 buckets, max_distance 128, bidirectional), exactly as transformers computes them:\n");
  for (const std::int64_t r : {-1000, -128, -100, -16, -8, -7, -1, 0, 1, 7, 8, 16, 100, 128, 1000}) {
    fmt::print("    bucket({:>5}) = {}\n", r, t5_bucket(r));
  }
  fmt::print("  (16 is where float32 decides: log(2)/log(16)·8 must come out as exactly 2)\n");
  const KerpleParams kerple(KerpleForm::kLog, {1.0}, {0.5});
  fmt::print("\n  Kerple (Chi et al. 2022), log form −r1·log(1 + r2·|i − j|), r1 = 1, r2 = 1/2:\n   ");
  for (const std::int64_t r : {0, 1, 10, 100, 1000, 100000}) fmt::print(" b({}) = {:.4f}", r, bias_value(kerple, 0, r));
  fmt::print("\n  — a slower, logarithmic decay than ALiBi's straight line.\n");
  fmt::print("\n  NoPE: b = 0 and nothing else; a causal decoder still learns positions from the mask.\n");

  const FireParams fire = FireParams::init(1, 32, 0, 1.0, 8.0);
  fmt::print(
      "\n  FIRE (Li et al. 2023): b = MLP(log(1 + c|i − j|) / log(1 + c·max(L, i))); the input stays in\n"
      "  [0, 1] at any length. A fresh layer (L = 8), the bias to the query's own token and 4 back:\n   ");
  for (const std::int64_t i : {8, 80, 800, 8000}) {
    fmt::print(" i = {}: {:.3f}, {:.3f};", i, bias_value(fire, 0, i, i), bias_value(fire, 0, i, i - 4));
  }
  fmt::print("\n  f_θ is piecewise linear ({} pieces here), so posenc evaluates a bias as one multiply-add.\n",
             fire.kinks().size() + 1);

  const TupeParams tupe = TupeParams::init(1, 8, 16, 64, true, 0.5, 1);
  fmt::print(
      "\n  TUPE (Ke et al. 2021): b = (p_i U^Q)·(p_j U^K)/sqrt(2D) from its own absolute table and\n"
      "  projections; with the [CLS] reset, position 0 gets learned θ1/θ2 instead. A fresh layer:\n   ");
  for (const auto& [i, j] : {std::pair<std::int64_t, std::int64_t>{0, 5}, {5, 0}, {5, 5}, {5, 9}, {40, 44}}) {
    fmt::print(" b({}, {}) = {:.3f};", i, j, bias_value(tupe, 0, i, j));
  }
  fmt::print("\n");

  const ShawParams shaw(2, 1);
  fmt::print(
      "\n  Shaw et al. 2018: distances clipped to [−k, k] pick rows of learned a^K (scores) and a^V\n"
      "  (values). The rows keys 0 … 9 read for query 5, k = 2:\n    rows");
  for (std::int64_t j = 0; j < 10; ++j) fmt::print(" {}", shaw.row_of(j - 5));
  fmt::print("\n");

  const XlParams xl = XlParams::init(1, 4, 8, 0.5, 3);
  const std::vector<float> zeros(4, 0.0f);
  std::vector<float> xl_row(6, 0.0f);
  XlEvaluator(xl, -10, 10).add_row(0, zeros.data(), 5, zeros.data(), 0, 0, 6, xl_row.data());
  fmt::print(
      "\n  Transformer-XL (Dai et al. 2019): scores gain u·k_j + (q_i + v)·W_R r(i − j), r sinusoidal.\n"
      "  For a zero query and keys, what remains is v·W_R r(i − j), query 5 against keys 0 … 5:\n   ");
  for (const float value : xl_row) fmt::print(" {:.4f}", value);
  fmt::print("\n  (`posenc table tupe|shaw|xl --length 6` prints whole matrices, of the registry's initial layers.)\n");
}

void tour_floater() {
  section("FLOATER (Liu et al. 2020)");
  fmt::print(
      "  p(t) solves dp/dt = MLP(t, p), p(0) = p0; position n is p(n·Δ), integrated by RK4. A longer\n"
      "  table integrates further and repeats the shorter one exactly:\n");
  const FloaterParams floater = FloaterParams::init(4, 16, 2, 1.0, 0.1, 2);
  std::vector<float> table(static_cast<std::size_t>(6 * 4));
  floater_table(floater, TensorView::of(table.data(), {6, 4}));
  print_rows(table, 6, 4, {0, 1, 2, 3, 4, 5});
}

// Every registered scheme (posenc schemes): its family, source and formula, and where it has a
// picture (posenc table), head 0's logit term with its defaults for the query at position 16
// against keys 16, 15, 14, 12, 8 and 0.
void tour_registry() {
  section("Every scheme of the attention, from the registry");
  const Positions positions = Positions::range(17);
  for (const SchemeEntry& e : schemes()) {
    fmt::print("  {} ({}; {}): {}\n", e.name, e.source, e.family, e.summary);
    if (!has_picture(e) || !e.inputs.empty()) continue;
    const HeadGroup g = make_head_group(e.name, SchemeArgs{.heads = 8, .head_dim = 64});
    const SchemePicture picture = scheme_picture(e, g, positions);
    fmt::print("    {}, query 16 against keys 16, 15, 14, 12, 8, 0:",
               picture.shared.empty() ? std::string("head 0 of 8") : picture.shared + " (every head)");
    for (const std::int64_t j : {16, 15, 14, 12, 8, 0})
      fmt::print(" {:.4g}", picture.heads.front()[static_cast<std::size_t>(16 * 17 + j)]);
    fmt::print("\n");
  }
  fmt::print("  (`posenc schemes` lists their options; `posenc table NAME --length 6` prints a matrix.)\n");
}

void run_tour() {
  fmt::print("posenc {} — a tour of the encodings implemented so far\n", version());
  std::string targets;
  for (const auto& t : available_targets()) targets += (targets.empty() ? "" : ", ") + t;
  fmt::print("kernels: {} (available: {}), {} thread(s)\n", active_target(), targets, num_threads());
  tour_sinusoidal();
  tour_learned();
  tour_rope();
  tour_biases();
  tour_floater();
  tour_registry();
  fmt::print(
      "\nNext: `posenc table sinusoidal --length 10 --dim 4`, `posenc table rope --length 4 --dim 8`,\n"
      "`posenc table alibi --length 8 --heads 4`, `posenc t5-buckets --from -20 --to 20`,\n"
      "`posenc bench sinusoidal`, `posenc bench rope --length 4096 --dim 128`.\n");
}

}  // namespace

Runner add_tour(CLI::App& app) {
  app.add_subcommand("tour", "A short printed tour of every encoding implemented so far");
  return [] { run_tour(); };
}

}  // namespace posenc::cli
