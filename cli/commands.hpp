// Subcommands of the `posenc` command. Each registers its options on a CLI11 subcommand and
// returns the function that runs it after parsing.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <optional>
#include <string>
#include <nlohmann/json.hpp>

#include "posenc/rotary.hpp"

namespace posenc::cli {

using Runner = std::function<void()>;

// The whole command (app.cpp): parses argv, runs the subcommand, returns the exit status (0, 1 for
// an error, 2 for a usage error; usage.hpp). `study` is posenc-study's, handed over by main().
int run(int argc, char** argv);

// An option whose absence is "unset" and whose every given value is kept (and later checked): no
// sentinel value stands for "unset".
template <class T>
CLI::Option* add_optional(CLI::App* sub, const std::string& name, std::optional<T>& slot, const std::string& help) {
  return sub->add_option_function<T>(
      name, [&slot](const T& value) { slot = value; }, help);
}

Runner add_tour(CLI::App& app);
Runner add_table(CLI::App& app);
Runner add_bench(CLI::App& app);
Runner add_rope_freqs(CLI::App& app);
Runner add_alibi_slopes(CLI::App& app);
Runner add_t5_buckets(CLI::App& app);
Runner add_plot(CLI::App& app);
Runner add_schemes(CLI::App& app);

// rope-freqs --against ggml (ggml_rope.cpp): ggml's frequencies and attention factor for the
// config that gave `transformers` (whose semantics posenc follows), and how far apart they are.
nlohmann::json compare_with_ggml(const HfRopeConfig& config, const RopeParams& transformers);

}  // namespace posenc::cli
