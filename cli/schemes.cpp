// `posenc schemes`: the registry (posenc/registry.hpp) — every scheme the fused attention takes,
// its family, options with defaults, learned parameters, per-token inputs and formula (JSON:
// schemes_json, the form posenc.schemes() reads).
#include <fmt/core.h>

#include <memory>
#include <string>

#include "commands.hpp"
#include "posenc/posenc.hpp"

namespace posenc::cli {

Runner add_schemes(CLI::App& app) {
  auto format = std::make_shared<std::string>("text");
  CLI::App* sub = app.add_subcommand("schemes", "List the registered positional schemes, their options and formulas");
  sub->add_option("--format", *format, "text or json")->capture_default_str();
  return [format] {
    if (*format != "text" && *format != "json") throw Error("schemes", "--format", *format, "text or json");
    if (*format == "json") {
      fmt::print("{}\n", schemes_json());
      return;
    }
    for (const SchemeEntry& e : schemes()) {
      fmt::print("{:<10} {:<15} {}\n", e.name, e.family, e.summary);
      std::string options;
      for (const SchemeOption& o : e.options) {
        options += (options.empty() ? "" : ", ") + o.name + "=" + fmt::format("{:g}", o.default_value);
      }
      if (!options.empty()) fmt::print("{:<27}options: {}\n", "", options);
      if (!e.parameters.empty()) fmt::print("{:<27}learned: {}\n", "", e.parameters);
      for (const SchemeInput& in : e.inputs) fmt::print("{:<27}per-token input: {}, {}\n", "", in.name, in.description);
      if (e.causal_only) fmt::print("{:<27}causal attention only\n", "");
      fmt::print("{:<27}{}\n", "", e.source);
    }
  };
}

}  // namespace posenc::cli
