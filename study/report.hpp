// The study's results as tables, intervals and plots (study.cpp writes them): Markdown tables of
// bits per byte or accuracy, the mean and 95% interval over seeds, and gnuplot figures.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace posenc::study {

using json = nlohmann::ordered_json;

// Writes `text` to path through a temporary file and a rename (atomic on POSIX file systems).
void write_atomically(const std::filesystem::path& path, const std::string& text);

// Whether a results key is an accuracy (printed as a percentage).
bool is_accuracy(std::string_view key);

// A results table as Markdown: bits per byte (3 decimals) or a task's accuracy (percent), with
// its 95% interval where the results have one.
std::string results_table(const json& results, const std::vector<std::int64_t>& lengths, const char* key);

// The two-sided 95% quantile of Student's t with df degrees of freedom.
double t95(std::int64_t df);

// One scheme's cells over its seeds' runs: the mean of every number, and with two or more seeds
// the half-width t95·s/√N of its 95% interval (key + "_ci95"); the runs themselves under "runs".
json aggregate(const std::vector<json>& runs);

bool have_gnuplot();

struct Figure {
  const char* key;  // the results' field, and the file names (<key>.png, .svg, .dat)
  std::string title, ylabel;
  const std::vector<std::int64_t>* lengths;
};

// Each figure's numbers against evaluation length per scheme, PNG and SVG, through gnuplot.
void plot(const std::filesystem::path& out, const json& results, const std::vector<Figure>& figures);

}  // namespace posenc::study
