// `posenc schemes`: the registry (posenc/registry.hpp) — every scheme the fused attention takes,
// its family, options with defaults, learned parameters, per-token inputs and formula (JSON:
// schemes_json, the form posenc.schemes() reads).
#include <fmt/core.h>

#include <algorithm>
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
    std::size_t width = 0;  // the longest name's
    for (const SchemeEntry& e : schemes()) width = std::max(width, e.name.size());
    const std::size_t indent = width + 17;
    for (const SchemeEntry& e : schemes()) {
      fmt::print("{:<{}} {:<15} {}\n", e.name, width, e.family, e.summary);
      std::string options;
      for (const SchemeOption& o : e.options) {
        options += (options.empty() ? "" : ", ") + o.name + "=" + fmt::format("{:g}", o.default_value);
      }
      if (!options.empty()) fmt::print("{:<{}}options: {}\n", "", indent, options);
      for (const std::string& alias : e.aliases) fmt::print("{:<{}}also: {}\n", "", indent, alias);
      for (const LengthVariant& v : e.length_variants)
        fmt::print("{:<{}}at longer contexts: {}-{}, {}\n", "", indent, e.name, v.name, v.summary);
      if (!e.parameters.empty()) fmt::print("{:<{}}learned: {}\n", "", indent, e.parameters);
      for (const SchemeInput& in : e.inputs)
        fmt::print("{:<{}}per-token input: {}, {}\n", "", indent, in.name, in.description);
      if (e.causal_only) fmt::print("{:<{}}causal attention only\n", "", indent);
      fmt::print("{:<{}}{}\n", "", indent, e.source);
    }
  };
}

}  // namespace posenc::cli
