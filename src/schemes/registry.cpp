// The registry (posenc/registry.hpp): a scheme's entry function is declared and listed here, in
// the order `posenc schemes` lists them, and defined beside its code (builtin.cpp for the schemes
// whose classes predate src/schemes/; src/schemes/<name>.cpp for the others).
#include "posenc/registry.hpp"

#include "posenc/memory.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <string_view>

#include "internal.hpp"

namespace posenc {
namespace scheme_entries {
// The entries, each defined beside its scheme.
SchemeEntry none_entry();
SchemeEntry rope_entry();
SchemeEntry xpos_entry();
SchemeEntry absolute_entry();
SchemeEntry alibi_entry();
SchemeEntry t5_entry();
SchemeEntry kerple_entry();
SchemeEntry fire_entry();
SchemeEntry tupe_entry();
SchemeEntry shaw_entry();
SchemeEntry xl_entry();
SchemeEntry sandwich_entry();
SchemeEntry sinks_entry();
SchemeEntry forgetting_entry();
SchemeEntry table_entry();
SchemeEntry stickbreaking_entry();
SchemeEntry cope_entry();
}  // namespace scheme_entries

const std::vector<SchemeEntry>& schemes() {
  // clang-format off
  static const std::vector<SchemeEntry> all = {
      scheme_entries::none_entry(),
      scheme_entries::rope_entry(),
      scheme_entries::xpos_entry(),
      scheme_entries::absolute_entry(),
      scheme_entries::alibi_entry(),
      scheme_entries::t5_entry(),
      scheme_entries::kerple_entry(),
      scheme_entries::fire_entry(),
      scheme_entries::tupe_entry(),
      scheme_entries::shaw_entry(),
      scheme_entries::xl_entry(),
      scheme_entries::sandwich_entry(),
      scheme_entries::sinks_entry(),
      scheme_entries::forgetting_entry(),
      scheme_entries::table_entry(),
      scheme_entries::stickbreaking_entry(),
      scheme_entries::cope_entry(),
  };
  // clang-format on
  return all;
}

const SchemeEntry& find_scheme(std::string_view name) {
  std::string names;
  for (const SchemeEntry& e : schemes()) {
    if (e.name == name || std::find(e.aliases.begin(), e.aliases.end(), name) != e.aliases.end()) return e;
    names += (names.empty() ? "" : ", ") + e.name;
    for (const std::string& alias : e.aliases) names += ", " + alias;
  }
  throw Error("schemes", "name", name, "one of " + names);
}

double SchemeArgs::number(std::string_view name) const {
  const auto it = options.find(name);
  if (it == options.end()) throw Error("SchemeArgs", "options", name, "an option the scheme declares");
  return it->second;
}

std::int64_t SchemeArgs::integer(std::string_view name) const { return static_cast<std::int64_t>(number(name)); }

ConstTensorView SchemeArgs::input(std::string_view name) const {
  const auto it = inputs.find(name);
  if (it == inputs.end()) throw Error("SchemeArgs", name, "absent", "a per-token input the scheme declares");
  return it->second;
}

SchemeOption flag_option(std::string name, bool default_value, std::string description) {
  return {std::move(name), default_value ? 1.0 : 0.0, std::move(description), true, 0.0, 1.0};
}
SchemeOption size_option(std::string name, double default_value, std::string description) {
  return {std::move(name), default_value, std::move(description), true, 1.0, SchemeOption::kMaxSize};
}
SchemeOption seed_option() { return {"seed", 0, "initialisation seed", true, 0.0, 9007199254740992.0}; }

SchemeArgs complete_scheme_args(const SchemeEntry& entry, SchemeArgs args) {
  const std::string where = "scheme " + entry.name;
  const auto max_size = static_cast<std::int64_t>(SchemeOption::kMaxSize);
  if (args.heads < 1 || args.heads > max_size) {
    throw Error(where, "heads", std::to_string(args.heads), "in [1, 2^31]");
  }
  if (args.head_dim < 1 || args.head_dim > max_size) {
    throw Error(where, "head_dim", std::to_string(args.head_dim), "in [1, 2^31]");
  }
  if (args.rope && !entry.takes_rope_parameters) {
    throw Error(where, "rope", "given", "RoPE parameters only for a scheme that takes them (rope)");
  }
  for (const auto& [name, value] : args.options) {
    const SchemeOption* option = nullptr;
    for (const SchemeOption& o : entry.options) option = o.name == name ? &o : option;
    if (option == nullptr) {
      std::string names;
      for (const SchemeOption& o : entry.options) names += (names.empty() ? "" : ", ") + o.name;
      throw Error(where, "option", name, names.empty() ? "no options" : "one of " + names);
    }
    if (std::isnan(value) || (option->integer && value != std::trunc(value))) {
      throw Error(where, name, detail::to_text(value), option->integer ? "an integer" : "a number");
    }
    if (value < option->minimum || value > option->maximum) {
      const auto bound = [&](double b) {
        return b == SchemeOption::kMaxSize ? std::string("2^31") : detail::to_text(b);
      };
      throw Error(where, name, detail::to_text(value),
                  option->maximum == SchemeOption::kUnbounded ? ">= " + bound(option->minimum)
                  : option->minimum == -SchemeOption::kUnbounded
                      ? "<= " + bound(option->maximum)
                      : "in [" + bound(option->minimum) + ", " + bound(option->maximum) + "]");
    }
    // Integers up to 2^53: beyond, a double no longer holds every integer (the ranges above stop
    // there; this covers an unbounded one).
    if (option->integer && std::fabs(value) > 9007199254740992.0) {
      throw Error(where, name, detail::to_text(value), "an integer of magnitude at most 2^53");
    }
    if (args.rope && (name == "base" || name == "rotary_dim" || name == "interleaved")) {
      throw Error(where, name, detail::to_text(value), "absent when RoPE parameters are given (they set it)");
    }
  }
  for (const SchemeOption& o : entry.options) {
    if (!o.optional) args.options.emplace(o.name, o.default_value);
  }
  // Per-token inputs: none but the declared ones (make_head_group requires each of those).
  std::string input_names;
  for (const SchemeInput& in : entry.inputs) input_names += (input_names.empty() ? "" : ", ") + in.name;
  for (const auto& given : args.inputs) {
    const std::string& name = given.first;  // (clang 14 cannot capture a structured binding)
    if (std::none_of(entry.inputs.begin(), entry.inputs.end(), [&](const SchemeInput& in) { return in.name == name; }))
      throw Error(where, "input", name, input_names.empty() ? "no per-token inputs" : "one of " + input_names);
  }

  // The parameters' count, overflow-checked (sizes are below 2^31, but shapes multiply them).
  std::int64_t count = 0;
  std::string shape;
  for (const std::int64_t extent : entry.parameter_shape(args)) {
    if (extent < 0 || (count > 0 && extent > 0 && count > std::numeric_limits<std::int64_t>::max() / extent)) {
      throw Error(where, "parameters", "a shape of more than 2^63 values", "options whose parameters fit an int64");
    }
    count = shape.empty() ? extent : count * extent;
    shape += (shape.empty() ? "" : ", ") + std::to_string(extent);
  }
  // The factory allocates about that many values (and the group's gradients as many again).
  if (count > 0) {
    const std::string what = "parameters [" + shape + "]";
    checked_allocation(count, 2 * sizeof(double), where.c_str(), what.c_str());
  }
  if (!args.parameters.empty() && static_cast<std::int64_t>(args.parameters.size()) != count) {
    throw Error(where, "parameters", std::to_string(args.parameters.size()) + " values",
                count == 0 ? "none: " + entry.name + " has no learned parameters"
                           : std::to_string(count) + " = [" + shape + "] (" + entry.parameters + ")");
  }
  return args;
}

std::vector<double> scheme_parameters(const SchemeEntry& entry, const HeadGroup& group) {
  if (entry.parameters_of) return entry.parameters_of(group);
  // The same rule as scheme_gradients: a group's score bias owns the learned parameters.
  if (group.bias) {
    if (const RelativeBias* rb = relative_bias(*group.bias)) return rb->parameters();
    if (const PositionBias* pb = position_bias(*group.bias)) return pb->parameters();
    if (entry.family == "relative-bias")
      throw Error("scheme " + entry.name, "bias", "not a RelativeBias", "its family's interface");
  }
  return {};
}

std::vector<double> scheme_gradients(const SchemeEntry& entry, const GroupGradients& grads) {
  if (entry.gradients_of) return entry.gradients_of(grads);
  return grads.bias;  // a score bias's, in its registered order; empty for the other schemes
}

std::vector<std::vector<double>> scheme_input_gradients(const SchemeEntry& entry, const GroupGradients& grads) {
  if (entry.inputs.empty()) return {};
  if (!entry.input_gradients_of)
    throw Error("scheme " + entry.name, "input_gradients_of", "unset", "set for an entry with inputs");
  return entry.input_gradients_of(grads);
}

bool has_picture(const SchemeEntry& entry) {
  return static_cast<bool>(entry.picture) || entry.family == "relative-bias" || entry.family == "bias" ||
         entry.family == "term" || entry.family == "none";
}

std::vector<std::string> picture_ignores(const SchemeEntry& entry) {
  if (entry.picture_ignores) return *entry.picture_ignores;
  if (entry.family == "relative-bias" || entry.family == "none") return {"head_dim"};
  return {};
}

SchemePicture scheme_picture(const SchemeEntry& entry, const HeadGroup& group, const Positions& positions) {
  if (entry.picture) return entry.picture(group, positions);
  if (!has_picture(entry)) {
    throw Error("scheme " + entry.name, "picture", entry.family,
                "a scheme with a picture (a bias of the positions, none, or an entry that gives one)");
  }
  const std::int64_t n = positions.seq_len();
  const std::int64_t per_head = checked_mul(n, n, "scheme_picture: positions²");
  checked_allocation(checked_mul(per_head, group.heads, "scheme_picture: heads · positions²"), sizeof(double),
                     "scheme_picture", "heads · positions²");
  const auto cells = static_cast<std::size_t>(per_head);
  SchemePicture picture;
  if (entry.family == "term") {  // the group's first term at the positions (its tokens their indices)
    if (group.terms.empty()) throw Error("scheme " + entry.name, "terms", "none", "the term of a term scheme");
    const AttentionTerm& term = *group.terms[0];
    for (std::int64_t h = 0; h < group.heads; ++h) {
      std::vector<double>& m = picture.heads.emplace_back(cells);
      TokenPair pair;
      for (pair.query_token = 0; pair.query_token < n; ++pair.query_token) {
        pair.query_position = positions.at(0, pair.query_token);
        for (pair.key_token = 0; pair.key_token < n; ++pair.key_token) {
          pair.key_position = positions.at(0, pair.key_token);
          m[static_cast<std::size_t>(pair.query_token * n + pair.key_token)] = term.value(h, pair);
        }
      }
    }
    return picture;
  }
  if (!group.bias) {
    picture.heads.assign(static_cast<std::size_t>(group.heads), std::vector<double>(cells, 0.0));
    return picture;
  }
  std::vector<double> all(cells * static_cast<std::size_t>(bias_heads(*group.bias)));
  bias_materialize(*group.bias, positions, positions, TensorView::of(all.data(), {bias_heads(*group.bias), n, n}));
  for (std::size_t h = 0; h < all.size() / cells; ++h) {
    picture.heads.emplace_back(all.begin() + static_cast<std::ptrdiff_t>(h * cells),
                               all.begin() + static_cast<std::ptrdiff_t>((h + 1) * cells));
  }
  return picture;
}

namespace {

// A JSON string: quotes, backslashes and control characters escaped; UTF-8 passes through.
std::string json_string(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
      out += escaped;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// A JSON number: the shortest text that reads back to the same double, whatever the locale, with
// ".0" on an integral value so that it reads back as a float (null when not finite).
std::string json_number(double x) {
  if (!std::isfinite(x)) return "null";
  char text[32];
  const auto end = std::to_chars(text, text + sizeof text, x).ptr;
  std::string out(text, end);
  if (out.find_first_of(".e") == std::string::npos) out += ".0";
  return out;
}

}  // namespace

std::string schemes_json() {
  std::string out = "[";
  for (const SchemeEntry& e : schemes()) {
    std::string options, inputs;
    for (const SchemeOption& o : e.options) {
      options += (options.empty() ? "{" : ", {") + std::string("\"name\": ") + json_string(o.name) +
                 ", \"default\": " + json_number(o.default_value) + ", \"integer\": " + (o.integer ? "true" : "false") +
                 ", \"description\": " + json_string(o.description) + "}";
    }
    for (const SchemeInput& in : e.inputs) {
      const double a = in.typical ? in.typical(0.0) : 0.0, b = in.typical ? in.typical(1.0) : 0.0;
      inputs += (inputs.empty() ? "{" : ", {") + std::string("\"name\": ") + json_string(in.name) +
                ", \"description\": " + json_string(in.description) + ", \"typical\": [" + json_number(std::min(a, b)) +
                ", " + json_number(std::max(a, b)) + "], \"logit_form\": " + json_string(in.logit_form) + "}";
    }
    std::string aliases, variants;
    for (const std::string& a : e.aliases) aliases += (aliases.empty() ? "" : ", ") + json_string(a);
    for (const LengthVariant& v : e.length_variants) {
      variants += (variants.empty() ? "{" : ", {") + std::string("\"name\": ") + json_string(v.name) +
                  ", \"summary\": " + json_string(v.summary) + "}";
    }
    out += (out.size() == 1 ? "\n  {" : ",\n  {") + std::string("\"name\": ") + json_string(e.name) +
           ", \"aliases\": [" + aliases + "], \"family\": " + json_string(e.family) +
           ", \"summary\": " + json_string(e.summary) + ", \"source\": " + json_string(e.source) +
           ", \"parameters\": " + json_string(e.parameters) +
           ", \"parameters_fixed\": " + (e.parameters_fixed ? "true" : "false") + ", \"options\": [" + options +
           "], \"inputs\": [" + inputs + "], \"causal_only\": " + (e.causal_only ? "true" : "false") +
           ", \"length_variants\": [" + variants + "]}";
  }
  return out + "\n]";
}

HeadGroup make_head_group(std::string_view name, SchemeArgs args) {
  const SchemeEntry& entry = find_scheme(name);
  SchemeArgs full = complete_scheme_args(entry, std::move(args));
  // An input has no default to stand in: each declared one is given, over the group's heads
  // (SchemeInput's contract, so no factory checks it).
  for (const SchemeInput& in : entry.inputs) {
    const auto it = full.inputs.find(in.name);
    if (it == full.inputs.end()) throw Error("scheme " + entry.name, in.name, "absent", "a tensor: " + in.description);
    const ConstTensorView& v = it->second;
    if (v.rank() < 1 || v.size(v.rank() - 1) != full.heads) {
      throw Error("scheme " + entry.name, in.name, v.describe(),
                  "[B, Sk, heads] or [Tk, heads] with heads = " + std::to_string(full.heads));
    }
  }
  return entry.make(full);
}

}  // namespace posenc
