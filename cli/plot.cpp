// posenc plot [--out DIR] [--only NAMES] [--format png|svg|both]
//
// Figures of the encodings, drawn by gnuplot from numbers posenc computes with its own fp64 API
// (the numbers stay beside each picture as <name>.dat, and the script as plots.gp):
//
//   sinusoid-squiggles   PE(p) of a few dimensions against position (d = 128)
//   sinusoidal-table     the sinusoidal table as a heat map (positions × dimensions)
//   rope-table           RoPE's cos and sin per rotation pair as heat maps
//   sinusoidal-similarity  PE(p)·PE(p + δ) against δ, from two starting positions (it depends on δ only)
//   rope-decay           RoFormer's long-term decay: the relative upper bound of a rotated dot
//                        product against distance (Su et al. 2021, §3.4.3), base 10^4 and 5·10^5
//   alibi-bias           ALiBi biases of four of eight heads (query × key, causal)
//   t5-bias              T5 biases of four heads of a freshly initialised table (causal)
//   t5-bucket-map        T5 bucket of every (query, key), bidirectional and causal
//   t5-buckets           T5 bucket against relative position, both kinds
//   kerple-bias          Kerple's log and power kernels for a few (r1, r2)
//   fire-bias            FIRE biases of a freshly initialised MLP (its normalised distance)
//   rope-scaling         wavelength 2π/ω_i per rotation pair under Llama-3.1-like settings:
//                        default, linear, dynamic NTK, YaRN and llama3 scalings
//   <name>-bias          every other score bias of the registry (posenc schemes) with its
//                        defaults, e.g. sandwich-bias, tupe-bias
//
// Errors (posenc::Error): an unknown figure name, an unknown format, an --out that cannot be
// written, gnuplot missing or failing.
#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <complex>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numbers>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "commands.hpp"
#include "posenc/posenc.hpp"

namespace posenc::cli {
namespace {

namespace fs = std::filesystem;

constexpr double kPi = std::numbers::pi;

// A figure: its data files are written into the output directory by `write`, which returns the
// gnuplot commands that draw it (the terminal and output are set by the caller).
struct Figure {
  std::string name;
  int width, height;
  std::function<std::string(const fs::path& dir)> write;
};

void write_file(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.flush();
  if (!out) throw Error("plot", "--out", path.parent_path().string(), "a writable directory");
}

// A matrix as gnuplot's `matrix` format: one row per line; kMasked where at() is NaN (a masked
// cell; kImage draws it blank — gnuplot warns about NaN read from a matrix file, not about one
// computed in `using`).
constexpr const char* kMasked = "1e99";
constexpr const char* kImage = "matrix using 1:2:($3 >= 1e99 ? NaN : $3) with image notitle";

std::string matrix_text(std::int64_t rows, std::int64_t cols,
                        const std::function<double(std::int64_t, std::int64_t)>& at) {
  std::string text = fmt::format("# {} rows × {} columns; {} marks a masked cell\n", rows, cols, kMasked);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      const double v = at(r, c);
      text += std::isnan(v) ? std::string(kMasked) : fmt::format("{:.6g}", v);
      text += c + 1 < cols ? ' ' : '\n';
    }
  }
  return text;
}

// Heat-map settings: row 0 at the top (as attention matrices are drawn), a diverging palette
// when values take both signs.
std::string heat_map_style(bool diverging) {
  return std::string("set autoscale xfix\nset autoscale yfix\nset yrange [*:*] reverse\nset size ratio -1\n") +
         (diverging
              ? "set palette defined (-1 '#2166ac', 0 '#f7f7f7', 1 '#b2182b')\n"
              : "set palette defined (0 '#440154', 0.25 '#3b528b', 0.5 '#21918c', 0.75 '#5ec962', 1 '#fde725')\n");
}

// Heat maps side by side (gnuplot's multiplot, `layout` "rows,cols"): one panel per (panel title,
// matrix file).
std::string heat_map_panels(const char* layout, const std::string& title,
                            const std::vector<std::pair<std::string, std::string>>& panels) {
  std::string plot = fmt::format("set multiplot layout {} title '{}'\n", layout, title);
  for (const auto& [panel, file] : panels) plot += "set title '" + panel + "'\nplot '" + file + "' " + kImage + "\n";
  return plot + "unset multiplot\n";
}

constexpr std::int64_t kDim = 128;

std::vector<double> sinusoidal_rows(std::int64_t first, std::int64_t count) {
  std::vector<double> table(static_cast<std::size_t>(count * kDim));
  sinusoidal_table(SinusoidalParams(kDim), Positions::range(count, first), TensorView::of(table.data(), {count, kDim}));
  return table;
}

std::string sinusoid_squiggles(const fs::path& dir) {
  constexpr std::int64_t kPositions = 100;
  const std::vector<double> table = sinusoidal_rows(0, kPositions);
  // Interleaved layout: dimension 2i is sin(p·ω_i), 2i + 1 is cos(p·ω_i).
  const std::vector<std::int64_t> dims = {4, 5, 16, 32, 64};
  std::string data = "# position";
  for (std::int64_t d : dims) data += fmt::format(" dim{}", d);
  data += "\n";
  for (std::int64_t p = 0; p < kPositions; ++p) {
    data += std::to_string(p);
    for (std::int64_t d : dims) data += fmt::format(" {:.6f}", table[static_cast<std::size_t>(p * kDim + d)]);
    data += "\n";
  }
  write_file(dir / "sinusoid-squiggles.dat", data);
  const std::vector<double> omega = SinusoidalParams(kDim).inv_frequencies();
  std::string plot = "plot ";
  for (std::size_t c = 0; c < dims.size(); ++c) {
    const std::int64_t d = dims[c];
    plot += fmt::format(
        "'sinusoid-squiggles.dat' using 1:{} with lines lw 2 title '{} (dimension {}, wavelength {:.1f})'{}", c + 2,
        d % 2 == 0 ? "sin" : "cos", d, 2 * kPi / omega[static_cast<std::size_t>(d / 2)],
        c + 1 < dims.size() ? ", " : "\n");
  }
  return "set title 'Sinusoidal encoding PE(p) per dimension (d = 128, base 10000, interleaved sin/cos)'\n"
         "set xlabel 'position p'\nset ylabel 'PE(p)_{dimension}'\nset yrange [-1.1:1.9]\n"
         "set key top center horizontal maxcols 2\nset grid\n" +
         plot;
}

std::string sinusoidal_table_figure(const fs::path& dir) {
  constexpr std::int64_t kPositions = 256;
  const std::vector<double> table = sinusoidal_rows(0, kPositions);
  write_file(dir / "sinusoidal-table.dat", matrix_text(kPositions, kDim, [&](std::int64_t p, std::int64_t d) {
               return table[static_cast<std::size_t>(p * kDim + d)];
             }));
  return heat_map_style(true) +
         "set title 'Sinusoidal table (d = 128, base 10000): even dimensions sin, odd cos'\n"
         "set xlabel 'dimension'\nset ylabel 'position'\nset cblabel 'PE(p)_d'\nset cbrange [-1:1]\n"
         "set size noratio\nplot 'sinusoidal-table.dat' " +
         std::string(kImage) + "\n";
}

std::string rope_table_figure(const fs::path& dir) {
  constexpr std::int64_t kPositions = 256, kPairs = kDim / 2;
  std::vector<double> cos(static_cast<std::size_t>(kPositions * kPairs)), sin(cos.size());
  rope_cos_sin(RopeParams(kDim, kDim, 10000.0), Positions::range(kPositions),
               TensorView::of(cos.data(), {kPositions, kPairs}), TensorView::of(sin.data(), {kPositions, kPairs}));
  const auto cell = [](const std::vector<double>& v) {
    return [&v](std::int64_t p, std::int64_t i) { return v[static_cast<std::size_t>(p * kPairs + i)]; };
  };
  write_file(dir / "rope-cos.dat", matrix_text(kPositions, kPairs, cell(cos)));
  write_file(dir / "rope-sin.dat", matrix_text(kPositions, kPairs, cell(sin)));
  return heat_map_style(true) +
         "set size noratio\nset cbrange [-1:1]\nset xlabel 'rotation pair i (θ_i = 10000^{-2i/128})'\n"
         "set ylabel 'position p'\n" +
         heat_map_panels("1,2", "RoPE rotation angles p·θ_i (head dim 128, base 10000)",
                         {{"cos(p·θ_i)", "rope-cos.dat"}, {"sin(p·θ_i)", "rope-sin.dat"}});
}

std::string sinusoidal_similarity(const fs::path& dir) {
  constexpr std::int64_t kDistances = 513;
  constexpr std::int64_t kStarts[2] = {0, 1000};
  std::string data = "# distance dot_from_0 dot_from_1000  (PE(p)·PE(p + δ) / (d/2))\n";
  std::vector<std::vector<double>> tables;
  for (std::int64_t start : kStarts) tables.push_back(sinusoidal_rows(start, kDistances));
  for (std::int64_t delta = 0; delta < kDistances; ++delta) {
    data += std::to_string(delta);
    for (const auto& t : tables) {
      double dot = 0;
      for (std::int64_t d = 0; d < kDim; ++d)
        dot += t[static_cast<std::size_t>(d)] * t[static_cast<std::size_t>(delta * kDim + d)];
      data += fmt::format(" {:.6f}", dot / (kDim / 2));
    }
    data += "\n";
  }
  write_file(dir / "sinusoidal-similarity.dat", data);
  return "set title 'Sinusoidal encodings: dot-product similarity against distance (d = 128); it depends on δ only'\n"
         "set xlabel 'distance δ (positions)'\nset ylabel 'PE(p)·PE(p + δ) / (d/2)'\nset grid\nset key top right\nset "
         "xrange [0:512]\n"
         "plot 'sinusoidal-similarity.dat' using 1:2 with lines lw 3 title 'from p = 0', "
         "'' using 1:3 with lines lw 2 dt 2 lc rgb 'black' title 'from p = 1000'\n";
}

// RoFormer §3.4.3: with h_i = q_i k_i* and S_j = Σ_{k<j} e^{i·δ·θ_k}, a rotated dot product is
// bounded by (max_i |h_{i+1} − h_i|)·Σ_j |S_j|; the figure shows (1/(d/2))·Σ_{j=1}^{d/2} |S_j|, the
// relative upper bound, which decays with distance.
std::string rope_decay(const fs::path& dir) {
  constexpr std::int64_t kDistances = 1025;
  const double bases[2] = {10000.0, 500000.0};
  std::string data = "# distance bound_base_1e4 bound_base_5e5\n";
  std::vector<std::vector<double>> omegas;
  for (double base : bases) omegas.push_back(RopeParams(kDim, kDim, base).inv_frequencies());
  for (std::int64_t delta = 0; delta < kDistances; ++delta) {
    data += std::to_string(delta);
    for (const auto& omega : omegas) {
      std::complex<double> partial = 0;
      double sum = 0;
      for (double w : omega) {
        partial += std::polar(1.0, static_cast<double>(delta) * w);
        sum += std::abs(partial);
      }
      data += fmt::format(" {:.6f}", sum / static_cast<double>(omega.size()));
    }
    data += "\n";
  }
  write_file(dir / "rope-decay.dat", data);
  return "set title \"RoPE's long-term decay (RoFormer §3.4.3): relative upper bound of q·R(δ)k, head dim 128\"\n"
         "set xlabel 'relative distance δ'\nset ylabel '(1/(d/2)) Σ_j |S_j|'\nset grid\nset key top right\nset xrange "
         "[0:1024]\n"
         "plot 'rope-decay.dat' using 1:2 with lines lw 2 title 'base 10000 (RoFormer)', "
         "'' using 1:3 with lines lw 2 title 'base 500000 (Llama 3)'\n";
}

// Four heads of a bias scheme as a 2 × 2 multiplot of query × key heat maps, keys after the query
// blank (the causal mask).
std::string bias_panels(
    const fs::path& dir, const char* name, const std::string& title, std::int64_t n,
    const std::vector<std::pair<std::string, std::function<double(std::int64_t, std::int64_t)>>>& heads) {
  std::vector<std::pair<std::string, std::string>> panels;
  for (std::size_t h = 0; h < heads.size(); ++h) {
    const std::string file = fmt::format("{}-{}.dat", name, h);
    write_file(dir / file,
               matrix_text(n, n, [&](std::int64_t i, std::int64_t j) { return j > i ? NAN : heads[h].second(i, j); }));
    panels.emplace_back(heads[h].first, file);
  }
  return heat_map_style(false) + "set xlabel 'key position j'\nset ylabel 'query position i'\nset cblabel 'bias'\n" +
         heat_map_panels("2,2", title, panels);
}

std::string alibi_bias(const fs::path& dir) {
  const BiasScheme alibi = AlibiParams(8);
  const std::vector<double> slopes = alibi_slopes(8);
  std::vector<std::pair<std::string, std::function<double(std::int64_t, std::int64_t)>>> heads;
  for (std::int64_t h : {0, 2, 4, 7}) {
    heads.emplace_back(fmt::format("head {} (slope 1/{:g})", h, 1.0 / slopes[static_cast<std::size_t>(h)]),
                       [alibi, h](std::int64_t i, std::int64_t j) { return bias_value(alibi, h, i, j); });
  }
  return bias_panels(dir, "alibi-bias", "ALiBi biases −m_h·(i − j), 4 of 8 heads (Press et al. 2022)", 64, heads);
}

std::string kerple_bias(const fs::path& dir) {
  const BiasScheme log_form = KerpleParams(KerpleForm::kLog, {1.0, 4.0}, {1.0, 0.1});
  const BiasScheme power_form = KerpleParams(KerpleForm::kPower, {0.5, 0.05}, {0.5, 1.5});
  std::vector<std::pair<std::string, std::function<double(std::int64_t, std::int64_t)>>> heads;
  heads.emplace_back("log: r1 = 1, r2 = 1",
                     [log_form](std::int64_t i, std::int64_t j) { return bias_value(log_form, 0, i, j); });
  heads.emplace_back("log: r1 = 4, r2 = 0.1",
                     [log_form](std::int64_t i, std::int64_t j) { return bias_value(log_form, 1, i, j); });
  heads.emplace_back("power: r1 = 0.5, r2 = 0.5",
                     [power_form](std::int64_t i, std::int64_t j) { return bias_value(power_form, 0, i, j); });
  heads.emplace_back("power: r1 = 0.05, r2 = 1.5",
                     [power_form](std::int64_t i, std::int64_t j) { return bias_value(power_form, 1, i, j); });
  return bias_panels(dir, "kerple-bias",
                     "Kerple biases: −r1·log(1 + r2·|i − j|) and −r1·|i − j|^{r2} (Chi et al. 2022)", 64, heads);
}

std::string fire_bias(const fs::path& dir) {
  // A fresh layer (seeded), c = 1 and threshold L = 32: rows past 32 see distances normalised by
  // their own position, so the pattern scales with i (FIRE's point).
  const BiasScheme fire = FireParams::init(4, 32, 1, 1.0, 32.0);
  std::vector<std::pair<std::string, std::function<double(std::int64_t, std::int64_t)>>> heads;
  for (std::int64_t h = 0; h < 4; ++h) {
    heads.emplace_back(fmt::format("head {}", h),
                       [fire, h](std::int64_t i, std::int64_t j) { return bias_value(fire, h, i, j); });
  }
  return bias_panels(
      dir, "fire-bias",
      "FIRE biases f(log(1 + |i − j|) / log(1 + max(32, i))) of a freshly initialised MLP (Li et al. 2023)", 128,
      heads);
}

std::string t5_bias(const fs::path& dir) {
  // A freshly initialised table, as Hugging Face's T5 draws it: N(0, d_model^−1/2), d_model = 512
  // (seeded; a trained table is a model's). The bias is table[bucket(j − i), head].
  constexpr std::int64_t kHeads = 8, kBuckets = 32;
  std::mt19937_64 rng(1);
  std::normal_distribution<double> normal(0.0, 1.0 / std::sqrt(512.0));
  std::vector<double> table(static_cast<std::size_t>(kBuckets * kHeads));
  for (double& v : table) v = normal(rng);
  const BiasScheme t5 = T5BiasParams(kHeads, kBuckets, 128, false, table);
  std::vector<std::pair<std::string, std::function<double(std::int64_t, std::int64_t)>>> heads;
  for (std::int64_t h = 0; h < 4; ++h) {
    heads.emplace_back(fmt::format("head {}", h),
                       [t5, h](std::int64_t i, std::int64_t j) { return bias_value(t5, h, i, j); });
  }
  return bias_panels(
      dir, "t5-bias",
      "T5 biases table[bucket(j − i), h], causal, 32 buckets, max distance 128, a freshly initialised table", 192,
      heads);
}

std::string t5_bucket_map(const fs::path& dir) {
  constexpr std::int64_t kN = 192;
  for (bool bidirectional : {true, false}) {
    write_file(dir / (bidirectional ? "t5-bucket-map-bidirectional.dat" : "t5-bucket-map-causal.dat"),
               matrix_text(kN, kN, [&](std::int64_t i, std::int64_t j) {
                 return !bidirectional && j > i ? NAN : static_cast<double>(t5_bucket(j - i, 32, 128, bidirectional));
               }));
  }
  return heat_map_style(false) +
         "set xlabel 'key position j'\nset ylabel 'query position i'\nset cblabel 'bucket'\nset cbrange [0:31]\n" +
         heat_map_panels("1,2",
                         "T5 relative-position buckets of (i, j): 32 buckets, max distance 128 (bias = a learned "
                         "table[bucket, head])",
                         {{"bidirectional (encoder)", "t5-bucket-map-bidirectional.dat"},
                          {"causal (decoder)", "t5-bucket-map-causal.dat"}});
}

std::string t5_buckets(const fs::path& dir) {
  std::string data = "# relative_position(key-query) bidirectional causal\n";
  for (std::int64_t r = -300; r <= 300; ++r) {
    data += fmt::format("{} {} {}\n", r, t5_bucket(r, 32, 128, true), t5_bucket(r, 32, 128, false));
  }
  write_file(dir / "t5-buckets.dat", data);
  // The last bucket starts where the log formula reaches it (≈ 91 bidirectional, 112 causal), not at
  // max_distance: the dotted lines mark ±max_distance, where the formula would pass it.
  return "set title 'T5 buckets against relative position (32 buckets, max distance 128, dotted): exact near 0, then "
         "logarithmic, then one shared bucket'\n"
         "set xlabel 'relative position j − i'\nset ylabel 'bucket'\nset grid\nset key top left\n"
         "set arrow from -128, graph 0 to -128, graph 1 nohead dt 3\nset arrow from 128, graph 0 to 128, graph 1 "
         "nohead dt 3\n"
         "plot 't5-buckets.dat' using 1:2 with steps lw 2 title 'bidirectional (32 buckets, 16 per direction)', "
         "'' using 1:3 with steps lw 2 title 'causal (32 buckets, past keys only)'\n";
}

// Llama-3.1-like settings: head dim 128, base 500000, pre-training context M0 = 8192, factor 8.
std::string rope_scaling(const fs::path& dir) {
  constexpr std::int64_t kM0 = 8192;
  constexpr double kFactor = 8.0, kBase = 500000.0;
  const auto params = [&](RopeType type) {
    RopeScaling scaling;
    scaling.type = type;
    scaling.factor = type == RopeType::kDefault ? 1.0 : kFactor;
    scaling.original_max_position_embeddings = kM0;
    return RopeParams(kDim, kDim, kBase, RopeLayout::kHalfSplit, scaling, kM0);
  };
  const std::vector<std::pair<const char*, std::vector<double>>> curves = {
      {"default (no scaling)", params(RopeType::kDefault).inv_frequencies()},
      {"linear, factor 8 (position interpolation)", params(RopeType::kLinear).inv_frequencies()},
      {"dynamic NTK at 65536 tokens",
       params(RopeType::kDynamic).inv_frequencies(static_cast<std::int64_t>(kFactor) * kM0)},
      {"YaRN, factor 8 (β_{fast} 32, β_{slow} 1)", params(RopeType::kYarn).inv_frequencies()},
      {"llama3, factor 8 (low 1, high 4)", params(RopeType::kLlama3).inv_frequencies()},
  };
  std::string data = "# pair";
  for (const auto& c : curves) data += fmt::format(" \"{}\"", c.first);
  data += "  (wavelength 2π/ω_i in positions)\n";
  for (std::size_t i = 0; i < curves[0].second.size(); ++i) {
    data += std::to_string(i);
    for (const auto& c : curves) data += fmt::format(" {:.6g}", 2 * kPi / c.second[i]);
    data += "\n";
  }
  write_file(dir / "rope-scaling.dat", data);
  std::string plot = "plot ";
  for (std::size_t c = 0; c < curves.size(); ++c) {
    // The default curve drawn wider: the scaled ones coincide with it where they leave ω_i alone.
    plot += fmt::format("'rope-scaling.dat' using 1:{} with linespoints lw {} pt {} ps 0.6 title '{}', ", c + 2,
                        c == 0 ? 5 : 2, c + 1, curves[c].first);
  }
  plot += fmt::format(
      "{} with lines dt 2 lc rgb 'black' title 'pre-training context M0 = {}', {} with lines dt 3 lc rgb 'gray30' "
      "title 'extended context 8·M0'\n",
      kM0, kM0, static_cast<std::int64_t>(kFactor) * kM0);
  return "set title 'RoPE scalings: wavelength 2π/ω_i per rotation pair (head dim 128, base 500000, M0 = 8192, factor "
         "8)'\n"
         "set xlabel 'rotation pair i'\nset ylabel 'wavelength (positions, log scale)'\nset logscale y\nset format y "
         "'10^{%T}'\n"
         "set grid\nset key top left\nset xrange [0:63]\n" +
         plot;
}

// Any other registered score bias (posenc schemes) with its defaults: four of eight heads.
std::string registry_bias(const fs::path& dir, const SchemeEntry& entry) {
  const HeadGroup group = make_head_group(entry.name, SchemeArgs{.heads = 8, .head_dim = 64});
  const BiasScheme bias = *group.bias;
  std::vector<std::pair<std::string, std::function<double(std::int64_t, std::int64_t)>>> heads;
  for (std::int64_t h : {0, 2, 4, 7}) {
    heads.emplace_back(fmt::format("head {}", h),
                       [bias, h](std::int64_t i, std::int64_t j) { return bias_value(bias, h, i, j); });
  }
  const std::string name = entry.name + "-bias";
  // The source up to its first comma (the authors and year), with gnuplot's quotes doubled.
  std::string source = entry.source.substr(0, entry.source.find(','));
  for (std::size_t at = source.find('\''); at != std::string::npos; at = source.find('\'', at + 2))
    source.insert(at, 1, '\'');
  return bias_panels(dir, name.c_str(),
                     fmt::format("{}: biases with its registry defaults, 4 of 8 heads ({})", entry.name, source), 64,
                     heads);
}

const std::vector<Figure>& figures() {
  static const std::vector<Figure> all = [] {
    std::vector<Figure> list = {
        {"sinusoid-squiggles", 1000, 600, sinusoid_squiggles},
        {"sinusoidal-table", 900, 700, sinusoidal_table_figure},
        {"rope-table", 1200, 650, rope_table_figure},
        {"sinusoidal-similarity", 1000, 600, sinusoidal_similarity},
        {"rope-decay", 1000, 600, rope_decay},
        {"alibi-bias", 1000, 900, alibi_bias},
        {"t5-bias", 1000, 900, t5_bias},
        {"t5-bucket-map", 1200, 650, t5_bucket_map},
        {"t5-buckets", 1000, 600, t5_buckets},
        {"kerple-bias", 1000, 900, kerple_bias},
        {"fire-bias", 1000, 900, fire_bias},
        {"rope-scaling", 1000, 650, rope_scaling},
    };
    // The registry's score biases (of the relative position, or of both positions) that have no
    // figure of their own above.
    for (const SchemeEntry& e : schemes()) {
      if (e.family != "relative-bias" && e.family != "bias") continue;
      const std::string name = e.name + "-bias";
      if (std::any_of(list.begin(), list.end(), [&](const Figure& f) { return f.name == name; })) continue;
      list.push_back({name, 1000, 900, [&e](const fs::path& dir) { return registry_bias(dir, e); }});
    }
    return list;
  }();
  return all;
}

std::string figure_names() {
  std::string names;
  for (const Figure& f : figures()) names += (names.empty() ? "" : ", ") + std::string(f.name);
  return names;
}

}  // namespace

Runner add_plot(CLI::App& app) {
  struct Options {
    std::string out = "posenc-plots", only, format = "both";
  };
  auto o = std::make_shared<Options>();
  CLI::App* sub = app.add_subcommand("plot", "Draw figures of the encodings (PNG/SVG via gnuplot): " + figure_names());
  sub->add_option("--out", o->out, "Output directory")->capture_default_str();
  sub->add_option("--only", o->only, "Comma-separated figure names (default: all)");
  sub->add_option("--format", o->format, "png, svg or both")->capture_default_str();
  return [o] {
    std::vector<const Figure*> chosen;
    if (o->only.empty()) {
      for (const Figure& f : figures()) chosen.push_back(&f);
    } else {
      std::stringstream list(o->only);
      std::string name;
      while (std::getline(list, name, ',')) {
        const Figure* found = nullptr;
        for (const Figure& f : figures()) found = name == f.name ? &f : found;
        if (found == nullptr) throw Error("plot", "--only", name, "one of " + figure_names());
        chosen.push_back(found);
      }
    }
    std::vector<std::pair<const char*, const char*>> formats;
    if (o->format == "png" || o->format == "both") formats.emplace_back("pngcairo enhanced font 'Sans,11'", "png");
    if (o->format == "svg" || o->format == "both")
      formats.emplace_back("svg enhanced font 'Sans,11' background rgb 'white'", "svg");
    if (formats.empty()) throw Error("plot", "--format", o->format, "png, svg or both");
    if (std::system("command -v gnuplot > /dev/null 2>&1") != 0) {
      throw Error("plot", "gnuplot", "not found", "gnuplot installed (apt install gnuplot-nox)");
    }
    // The script is run with `cd '<out>'`: a quote in the path would end the shell word.
    if (o->out.find('\'') != std::string::npos) throw Error("plot", "--out", o->out, "a path without a single quote");
    const fs::path dir(o->out);
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw Error("plot", "--out", o->out, "a directory that can be created (" + ec.message() + ")");
    // One script, run inside the output directory: every path in it is a plain file name.
    std::string script;
    for (const Figure* f : chosen) {
      const std::string body = f->write(dir);
      for (const auto& [terminal, extension] : formats) {
        script += fmt::format("reset\nset terminal {} size {},{}\nset output '{}.{}'\n{}", terminal, f->width,
                              f->height, f->name, extension, body);
      }
    }
    script += "set output\n";
    write_file(dir / "plots.gp", script);
    const std::string command = "cd '" + dir.string() + "' && gnuplot plots.gp";
    if (std::system(command.c_str()) != 0) throw Error("plot", "gnuplot", "plots.gp", "to run (see its message above)");
    for (const Figure* f : chosen) {
      for (const auto& format : formats)
        fmt::print("{}\n", (dir / (std::string(f->name) + "." + format.second)).string());
    }
  };
}

}  // namespace posenc::cli
