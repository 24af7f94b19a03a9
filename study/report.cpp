// The study's tables, intervals and plots (report.hpp).
#include "report.hpp"

#include <fmt/core.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <utility>

#include "posenc/error.hpp"

namespace posenc::study {

namespace fs = std::filesystem;

// Writes `text` to path through a temporary file and a rename (atomic on POSIX file systems).
void write_atomically(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw Error("study", "--out", path.parent_path().string(), "a writable directory");
    out << text;
    out.flush();
    if (!out) throw Error("study", "--out", tmp.string(), "space to write");
  }
  fs::rename(tmp, path);
}

// Accuracies print as percentages.
bool is_accuracy(std::string_view key) { return key.ends_with("_accuracy"); }

// A results table as Markdown: bits per byte (3 decimals) or a task's accuracy (percent).
std::string results_table(const json& results, const std::vector<std::int64_t>& lengths, const char* key) {
  const bool percent = is_accuracy(key);
  std::string out = "| scheme |";
  for (std::int64_t e : lengths) out += fmt::format(" {} |", e);
  out += "\n|---|";
  for (std::size_t i = 0; i < lengths.size(); ++i) out += "---:|";
  out += "\n";
  const std::string ci = std::string(key) + "_ci95";
  for (const auto& [name, r] : results.items()) {
    if (!r.contains(key)) continue;  // a train-long baseline has no synthetic tasks
    out += "| " + name + " |";
    for (std::int64_t e : lengths) {
      const double v = r.at(key).at(std::to_string(e)).get<double>();
      out += percent ? fmt::format(" {:.1f}%", 100.0 * v) : fmt::format(" {:.3f}", v);
      if (r.contains(ci)) {
        const double h = r.at(ci).at(std::to_string(e)).get<double>();
        out += percent ? fmt::format(" ± {:.1f}", 100.0 * h) : fmt::format(" ± {:.3f}", h);
      }
      out += " |";
    }
    out += "\n";
  }
  return out;
}

// The two-sided 95% quantile of Student's t with df degrees of freedom (tables; 1.96 past 30).
double t95(std::int64_t df) {
  static const double table[] = {12.706, 4.303, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201,
                                 2.179,  2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080,
                                 2.074,  2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042};
  return df >= 1 && df <= 29 ? table[df - 1] : 1.96;
}

// One scheme's cells over its seeds' runs: the mean of every number, and with two or more seeds
// the half-width t95·s/√N of its 95% interval (key + "_ci95"); the runs themselves under "runs".
json aggregate(const std::vector<json>& runs) {
  json out = {{"scheme", runs.front().at("scheme")}, {"trained_as", runs.front().at("trained_as")}};
  const auto n = static_cast<double>(runs.size());
  out["train_length"] = runs.front().at("train_length");
  for (const char* key : {"train_seconds", "train_seconds_per_mbyte", "final_train_bpb", "copy_train_seconds",
                          "copy_final_loss", "retrieval_train_seconds", "retrieval_final_loss"}) {
    if (!runs.front().contains(key)) continue;
    double sum = 0;
    for (const json& r : runs) sum += r.at(key).get<double>();
    out[key] = sum / n;
  }
  for (const char* key : {"bpb", "bpb_sliding", "copy_accuracy", "retrieval_accuracy"}) {
    if (!runs.front().contains(key)) continue;
    for (const auto& [length, unused] : runs.front().at(key).items()) {
      (void)unused;
      double sum = 0, squares = 0;
      for (const json& r : runs) sum += r.at(key).at(length).get<double>();
      const double mean = sum / n;
      for (const json& r : runs) squares += std::pow(r.at(key).at(length).get<double>() - mean, 2);
      out[key][length] = mean;
      if (runs.size() >= 2) {
        out[std::string(key) + "_ci95"][length] =
            t95(static_cast<std::int64_t>(runs.size()) - 1) * std::sqrt(squares / (n - 1)) / std::sqrt(n);
      }
    }
  }
  out["runs"] = runs;
  return out;
}

bool have_gnuplot() { return std::system("command -v gnuplot > /dev/null 2>&1") == 0; }

// Each figure's numbers against evaluation length per scheme, PNG and SVG, through gnuplot: one
// script (plots.gp) run in `out`, so every path in it is a plain file name.
void plot(const fs::path& out, const json& results, const std::vector<Figure>& figures) {
  std::string script;
  for (const Figure& f : figures) {
    const bool percent = is_accuracy(f.key);
    std::string data;
    const std::string ci = std::string(f.key) + "_ci95";
    bool bars = false;
    for (const auto& [name, r] : results.items()) {
      if (!r.contains(f.key)) continue;
      data += "\"" + name + "\"\n";
      for (std::int64_t e : *f.lengths) {
        const double v = r.at(f.key).at(std::to_string(e)).get<double>();
        const double h = r.contains(ci) ? r.at(ci).at(std::to_string(e)).get<double>() : 0.0;
        bars = bars || r.contains(ci);
        data += fmt::format("{} {:.6f} {:.6f}\n", e, percent ? 100.0 * v : v, percent ? 100.0 * h : h);
      }
      data += "\n\n";
    }
    write_atomically(out / (std::string(f.key) + ".dat"), data);
    for (const auto& [terminal, extension] :
         {std::pair{"pngcairo size 900,600", "png"}, std::pair{"svg size 900,600", "svg"}}) {
      script += fmt::format(
          "set terminal {}\nset output '{}.{}'\nset title '{}'\n"
          "set xlabel 'evaluation length (tokens, log scale)'\nset ylabel '{}'\n"
          "set logscale x 2\nset offsets graph 0.04, graph 0.04, 0, 0\nset key outside right\nset grid\n{}"
          // gnuplot has eight line colours; four more so that eleven schemes differ in colour
          // (and point type).
          "set linetype 9 lc rgb '#8c564b'\nset linetype 10 lc rgb '#e377c2'\nset linetype 11 lc rgb '#7f7f7f'\n"
          "set linetype 12 lc rgb '#bcbd22'\n"
          "plot for [i=0:*] '{}.dat' index i using 1:2{} with {} lw 2 lc (i + 1) pt (i + 1) "
          "title columnheader(1)\nunset yrange\n",
          terminal, f.key, extension, f.title, f.ylabel, percent ? "set yrange [0:100]\n" : "", f.key, bars ? ":3" : "",
          bars ? "yerrorlines" : "linespoints");
    }
  }
  write_atomically(out / "plots.gp", script);
  const std::string command = "cd '" + out.string() + "' && gnuplot plots.gp";
  if (std::system(command.c_str()) != 0) throw Error("study", "gnuplot", "plots.gp", "to run (see its message above)");
}

}  // namespace posenc::study
