// posenc table sinusoidal --length N --dim D [--base B] [--layout interleaved|split] [--offset P]
//                         [--dtype f32|f64|bf16|f16] [--format text|csv|json]
// posenc table rope       --length N --dim D [--base B] [--offset P] [...]
// posenc table NAME --length N [--heads H] [--head h] [--head-dim D] [--OPTION V] [--set OPTION=V]
//   any registered scheme with a picture (posenc schemes: alibi, t5, kerple, fire, tupe, shaw, xl,
//   sandwich, …; nope is none), built by the registry with its defaults: rows = query positions
//   offset … offset + N − 1, columns = key positions (causal schemes print their values above the
//   diagonal too: masking is attention's job). The scheme's picture decides what is shown (t5: bucket
//   ids, shaw: table rows, xl: the position terms of zero q and k). A flag --OPTION sets the
//   registry option OPTION (dashes for underscores); --causal sets bidirectional to its negation,
//   --form power is power = 1. A flag the picture does not depend on is refused.
// posenc table floater --length N --dim D [--hidden M] [--seed S] [...]
#include <fmt/core.h>

#include <algorithm>
#include <charconv>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "commands.hpp"
#include "posenc/posenc.hpp"

namespace posenc::cli {
namespace {

struct TableOptions {
  std::string encoding;
  std::int64_t length = 10;
  std::int64_t dim = 4;
  double base = 10000.0;
  std::string layout = "interleaved";
  std::int64_t offset = 0;
  std::string dtype = "f32";
  std::string format = "text";
  // registered schemes
  std::int64_t heads = 8;
  std::optional<std::int64_t> head;  // absent: every head
  std::int64_t head_dim = 16;
  std::vector<std::string> settings;  // NAME=VALUE options
  // floater
  std::int64_t hidden = 32;
  std::uint64_t seed = 0;
  double time_per_position = 0.1;
  std::int64_t substeps = 1;
};

DType parse_dtype(const std::string& name) {
  if (name == "f32") return DType::kF32;
  if (name == "f64") return DType::kF64;
  if (name == "bf16") return DType::kBF16;
  if (name == "f16") return DType::kF16;
  throw Error("table", "--dtype", name, "f32, f64, bf16 or f16");
}

// The printed form of a 2-D tensor in PyTorch (4 decimals, common width, the first and last three
// rows and columns when there are more than 1000 values), so the classic tutorial table matches.
std::string torch_style(const std::vector<double>& v, std::int64_t rows, std::int64_t cols) {
  const bool summarize = rows * cols > 1000;
  constexpr std::int64_t kEdge = 3;
  auto shown = [&](std::int64_t i, std::int64_t n) {
    return !summarize || n <= 2 * kEdge || i < kEdge || i >= n - kEdge;
  };
  std::size_t width = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      if (shown(r, rows) && shown(c, cols)) {
        width = std::max(width, fmt::format("{:.4f}", v[static_cast<std::size_t>(r * cols + c)]).size());
      }
    }
  }
  std::string out = "tensor([";
  bool first_row = true;
  for (std::int64_t r = 0; r < rows; ++r) {
    if (!shown(r, rows)) {
      if (r == kEdge) out += ",\n        ...";
      continue;
    }
    if (!first_row) out += ",\n        ";
    first_row = false;
    out += "[";
    bool first_col = true;
    for (std::int64_t c = 0; c < cols; ++c) {
      if (!shown(c, cols)) {
        if (c == kEdge) out += ", ...";
        continue;
      }
      if (!first_col) out += ", ";
      first_col = false;
      out += fmt::format("{:>{}.4f}", v[static_cast<std::size_t>(r * cols + c)], width);
    }
    out += "]";
  }
  return out + "])";
}

// Widens `count` values of `dtype` at `data` to double.
std::vector<double> widen(const std::vector<unsigned char>& storage, DType dtype, std::size_t count) {
  std::vector<double> values(count);
  for (std::size_t i = 0; i < count; ++i) {
    switch (dtype) {
      case DType::kF32:
        values[i] = reinterpret_cast<const float*>(storage.data())[i];
        break;
      case DType::kF64:
        values[i] = reinterpret_cast<const double*>(storage.data())[i];
        break;
      case DType::kBF16:
        values[i] = from_bf16(reinterpret_cast<const bf16*>(storage.data())[i]);
        break;
      case DType::kF16:
        values[i] = from_f16(reinterpret_cast<const f16*>(storage.data())[i]);
        break;
    }
  }
  return values;
}

nlohmann::json rows_of(const std::vector<double>& values, std::int64_t rows, std::int64_t cols) {
  nlohmann::json out = nlohmann::json::array();
  for (std::int64_t r = 0; r < rows; ++r) {
    out.push_back(std::vector<double>(values.begin() + r * cols, values.begin() + (r + 1) * cols));
  }
  return out;
}

// Prints named tables of the same shape, rows = positions, in the requested format.
void print_tables(const TableOptions& o, const std::vector<std::pair<std::string, std::vector<double>>>& tables,
                  std::int64_t cols, nlohmann::json doc, const char* column = "d") {
  if (o.format == "text") {
    for (const auto& [name, values] : tables) {
      if (tables.size() > 1) fmt::print("{} = ", name);
      fmt::print("{}\n", torch_style(values, o.length, cols));
    }
  } else if (o.format == "csv") {
    std::string line = "position";
    for (const auto& [name, values] : tables) {
      for (std::int64_t j = 0; j < cols; ++j) {
        line += tables.size() > 1 ? fmt::format(",{}_{}{}", name, column, j) : fmt::format(",{}{}", column, j);
      }
    }
    fmt::print("{}\n", line);
    for (std::int64_t r = 0; r < o.length; ++r) {
      line = std::to_string(o.offset + r);
      for (const auto& [name, values] : tables) {
        for (std::int64_t j = 0; j < cols; ++j)
          line += fmt::format(",{}", values[static_cast<std::size_t>(r * cols + j)]);
      }
      fmt::print("{}\n", line);
    }
  } else if (o.format == "json") {
    for (const auto& [name, values] : tables) doc[name] = rows_of(values, o.length, cols);
    fmt::print("{}\n", doc.dump());
  } else {
    throw Error("table", "--format", o.format, "text, csv or json");
  }
}

// Whether head h of `heads` is printed; an explicit --head must name one of them.
bool head_wanted(const TableOptions& o, std::int64_t h, std::int64_t heads) {
  if (o.head && (*o.head < 0 || *o.head >= heads)) {
    throw Error("table", "--head", std::to_string(*o.head),
                "in [0, " + std::to_string(heads) + ") (--heads " + std::to_string(heads) + ")");
  }
  return !o.head || *o.head == h;
}

// The registered scheme an encoding names (by name or alias: nope is none), or null.
const SchemeEntry* pictured_scheme(const std::string& encoding) {
  for (const SchemeEntry& e : schemes()) {
    const bool named = e.name == encoding || std::find(e.aliases.begin(), e.aliases.end(), encoding) != e.aliases.end();
    if (named && has_picture(e)) return &e;
  }
  return nullptr;
}

// What a flag sets for a registered scheme: "heads", "head_dim", or an option's name (dashes for
// underscores; --causal and --form are the bidirectional and power options' old spellings). ""
// for --length, --offset and --format (every encoding reads them), --head and --set.
std::string target_of_flag(const std::string& flag) {
  if (flag == "--length" || flag == "--offset" || flag == "--format" || flag == "--set" || flag == "--head") return "";
  if (flag == "--heads") return "heads";
  if (flag == "--causal") return "bidirectional";
  if (flag == "--form") return "power";
  std::string name = flag.substr(2);
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}
bool declares(const SchemeEntry& e, const std::string& option) {
  return std::any_of(e.options.begin(), e.options.end(), [&](const SchemeOption& o) { return o.name == option; });
}
// Whether the scheme's picture depends on what the flag sets.
bool reads(const SchemeEntry& e, const std::string& target) {
  const std::vector<std::string> ignored = picture_ignores(e);
  if (std::find(ignored.begin(), ignored.end(), target) != ignored.end()) return false;
  return target == "heads" || target == "head_dim" || declares(e, target);
}
std::string flag_of(const CLI::Option& opt) { return opt.get_lnames().empty() ? "" : "--" + opt.get_lnames().front(); }

constexpr std::int64_t kExactIntegers = std::int64_t{1} << 53;  // a double holds every integer up to it

// An option's value as typed: an integer option reads an int64 (a double past 2^53 would round).
double number_of(const std::string& where, const std::string& text, bool integer) {
  if (integer) {
    std::int64_t value = 0;
    const char* end = text.data() + text.size();
    const auto [at, ec] = std::from_chars(text.data(), end, value);
    if (ec != std::errc() || at != end) throw Error("table", where, text, "an integer");
    if (value > kExactIntegers || value < -kExactIntegers)
      throw Error("table", where, text, "an integer of magnitude at most 2^53");
    return static_cast<double>(value);
  }
  std::size_t used = 0;
  double number = 0;
  try {
    number = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size()) throw Error("table", where, text, "a number");
  return number;
}

// A bare flag's value: CLI11 keeps "--flag=VALUE" as typed.
double flag_value(const std::string& flag, const std::string& text) {
  for (const char* yes : {"true", "1", "on", "yes"}) {
    if (text == yes) return 1.0;
  }
  for (const char* no : {"false", "0", "off", "no"}) {
    if (text == no) return 0.0;
  }
  throw Error("table", flag, text, "true or false (1 or 0)");
}

// Where each of the registry's arguments came from: the flag (or "--set NAME") and its text.
using ArgSources = std::map<std::string, std::pair<std::string, std::string>>;

// The registry's arguments from the given flags and --set; each option set once.
SchemeArgs scheme_args(const CLI::App& sub, const TableOptions& o, const SchemeEntry& entry, ArgSources& set_by) {
  SchemeArgs args;
  args.heads = o.heads;
  args.head_dim = o.head_dim;
  for (const auto& [flag, value] : {std::pair{"--heads", o.heads}, std::pair{"--head-dim", o.head_dim}}) {
    if (sub.get_option(flag)->count() > 0) set_by[target_of_flag(flag)] = {flag, std::to_string(value)};
  }
  // text: the value as given (an integer flag's in decimal), kept to restate the scheme's errors.
  const auto set = [&](const std::string& option, double value, const std::string& source, const std::string& text) {
    if (const auto it = set_by.find(option); it != set_by.end()) {
      throw Error("table", source, fmt::format("{}", value),
                  "one value for " + option + " (" + it->second.first + " sets it too)");
    }
    set_by.emplace(option, std::pair{source, text});
    args.options[option] = value;
  };
  const auto integer = [&](const std::string& option) {
    for (const SchemeOption& so : entry.options) {
      if (so.name == option) return so.integer;
    }
    return false;
  };
  for (const CLI::Option* opt : sub.get_options()) {
    const std::string flag = flag_of(*opt);
    const std::string option = flag.empty() ? "" : target_of_flag(flag);
    if (opt->count() == 0 || !declares(entry, option)) continue;  // the others: check_flags_apply
    const std::string text = opt->results().empty() ? "true" : opt->results().back();
    if (flag == "--causal") {
      set(option, 1.0 - flag_value(flag, text), flag, text);
    } else if (flag == "--form") {
      if (text != "log" && text != "power") throw Error("table", "--form", text, "log or power");
      set(option, text == "power" ? 1.0 : 0.0, flag, text);
    } else if (opt->get_expected_min() == 0) {
      set(option, flag_value(flag, text), flag, text);
    } else if (flag == "--dim") {  // flags the table's own encodings read too: their parsed values
      set(option, static_cast<double>(o.dim), flag, text);
    } else if (flag == "--base") {
      set(option, o.base, flag, text);
    } else if (flag == "--hidden") {
      set(option, static_cast<double>(o.hidden), flag, text);
    } else if (flag == "--seed") {
      if (o.seed > (std::uint64_t{1} << 53))
        throw Error("table", flag, std::to_string(o.seed), "at most 2^53 for " + entry.name);
      set(option, static_cast<double>(o.seed), flag, text);
    } else {
      set(option, number_of(flag, text, integer(option)), flag, text);
    }
  }
  for (const std::string& assignment : o.settings) {
    const std::size_t eq = assignment.find('=');
    if (eq == std::string::npos || eq == 0) throw Error("table", "--set", assignment, "NAME=VALUE");
    const std::string name = assignment.substr(0, eq);
    const std::string text = assignment.substr(eq + 1);
    if (declares(entry, name) && !reads(entry, name)) {
      throw Error("table", "--set " + name, text,
                  "an option " + entry.name + "'s picture depends on (it shows no " + name + ")");
    }
    set(name, number_of("--set " + name, text, integer(name)), "--set " + name, text);
  }
  return args;
}

// A registered scheme's picture: a matrix per head (or the chosen head), or one for all heads.
void run_scheme_table(const CLI::App& sub, const TableOptions& o, const SchemeEntry& entry) {
  if (o.length < 1) throw Error("table", "--length", std::to_string(o.length), ">= 1");
  if (o.heads < 1) throw Error("table", "--heads", std::to_string(o.heads), ">= 1");
  const bool per_head = reads(entry, "heads");
  constexpr std::int64_t kMaxElements = std::int64_t{1} << 26;
  if (checked_mul(o.length, o.length, "table size") > kMaxElements / (per_head ? o.heads : 1)) {
    throw Error("table", per_head ? "--length² × --heads" : "--length²",
                std::to_string(o.length) + "²" + (per_head ? " × " + std::to_string(o.heads) : ""),
                "at most 2^26 values (the C++ API has no such limit)");
  }
  ArgSources sources;
  SchemeArgs given = scheme_args(sub, o, entry, sources);
  // The registry and the scheme name an option; the user typed a flag: say it in the flag's terms.
  const auto by_flag = [&](auto&& build) {
    try {
      return build();
    } catch (const Error& e) {
      // Only an option of the scheme (the registry's unknown-option error names "option").
      const bool option = declares(entry, e.param()) || e.param() == "heads" || e.param() == "head_dim";
      const auto it = sources.find(e.param());
      if (!option || it == sources.end() || e.expected().empty()) throw;
      throw Error("table", it->second.first, it->second.second,
                  e.expected() + " (" + entry.name + "'s " + e.param() + ")");
    }
  };
  const SchemeArgs args = by_flag([&] { return complete_scheme_args(entry, std::move(given)); });
  // A learned table of positions (TUPE) must reach the last one.
  if (const auto it = args.options.find("max_len");
      it != args.options.end() && static_cast<double>(o.offset) + static_cast<double>(o.length) > it->second) {
    throw Error("table", "--offset + --length", std::to_string(o.offset) + " + " + std::to_string(o.length),
                "at most max_len = " + fmt::format("{}", it->second) + " (--max-len)");
  }
  const HeadGroup group = by_flag([&] { return entry.make(args); });
  const std::int64_t n = o.length;
  SchemePicture picture = scheme_picture(entry, group, Positions::range(n, o.offset));
  nlohmann::json doc = {{"encoding", o.encoding}, {"length", n}, {"offset", o.offset}};
  if (per_head) doc["heads"] = o.heads;
  if (reads(entry, "head_dim")) doc["head_dim"] = o.head_dim;
  for (const SchemeOption& option : entry.options) {
    const auto it = args.options.find(option.name);
    if (it == args.options.end() || !reads(entry, option.name)) continue;
    if (option.is_flag()) {
      doc[option.name] = it->second != 0.0;
    } else if (option.integer) {
      doc[option.name] = static_cast<std::int64_t>(it->second);
    } else {
      doc[option.name] = it->second;
    }
  }
  std::vector<std::pair<std::string, std::vector<double>>> tables;
  if (!picture.shared.empty()) {
    if (o.head) {
      throw Error("table", "--head", std::to_string(*o.head),
                  "no head for " + o.encoding + " (one matrix of " + picture.shared + " for all heads)");
    }
    tables.emplace_back(picture.shared, std::move(picture.heads.front()));
  } else {
    const auto heads = static_cast<std::int64_t>(picture.heads.size());
    head_wanted(o, 0, heads);  // checks --head
    for (std::int64_t h = 0; h < heads; ++h) {
      if (head_wanted(o, h, heads))
        tables.emplace_back("head" + std::to_string(h), std::move(picture.heads[static_cast<std::size_t>(h)]));
    }
  }
  print_tables(o, tables, n, doc, "k");
}

void run_table(const CLI::App& sub, const TableOptions& o) {
  if (o.encoding == "floater") {
    if (o.length < 0) throw Error("table", "--length", std::to_string(o.length), ">= 0");
    const FloaterParams floater = FloaterParams::init(o.dim, o.hidden, o.seed, 1.0, o.time_per_position, o.substeps);
    const std::int64_t rows = o.offset + o.length;
    if (checked_mul(rows, o.dim, "table size") > (std::int64_t{1} << 26)) {
      throw Error("table", "(--offset + --length) × --dim", std::to_string(rows) + " × " + std::to_string(o.dim),
                  "at most 2^26 values");
    }
    std::vector<double> all(static_cast<std::size_t>(rows * o.dim));
    floater_table(floater, TensorView::of(all.data(), {rows, o.dim}));
    print_tables(o, {{"values", std::vector<double>(all.begin() + o.offset * o.dim, all.end())}}, o.dim,
                 {{"encoding", "floater"},
                  {"dim", o.dim},
                  {"hidden", o.hidden},
                  {"seed", o.seed},
                  {"time_per_position", o.time_per_position},
                  {"substeps", o.substeps},
                  {"offset", o.offset},
                  {"length", o.length}});
    return;
  }
  if (o.encoding != "sinusoidal" && o.encoding != "rope") {
    const SchemeEntry* entry = pictured_scheme(o.encoding);
    if (entry == nullptr) {
      std::string names = "sinusoidal, rope, floater";
      for (const SchemeEntry& e : schemes()) {
        if (has_picture(e)) names += ", " + (e.aliases.empty() ? e.name : e.aliases.front());
      }
      // A registered scheme without a picture says why.
      for (const SchemeEntry& e : schemes()) {
        if (e.name == o.encoding || std::find(e.aliases.begin(), e.aliases.end(), o.encoding) != e.aliases.end())
          names += " (" + o.encoding + ", a " + e.family + " scheme, is no matrix of positions alone)";
      }
      throw Error("table", "encoding", o.encoding, names);
    }
    if (o.format != "text" && o.format != "csv" && o.format != "json") {
      throw Error("table", "--format", o.format, "text, csv or json");
    }
    run_scheme_table(sub, o, *entry);
    return;
  }
  if (o.length < 0) throw Error("table", "--length", std::to_string(o.length), ">= 0");
  if (o.format != "text" && o.format != "csv" && o.format != "json") {
    throw Error("table", "--format", o.format, "text, csv or json");
  }
  const Positions positions = Positions::range(o.length, o.offset);
  const DType dtype = parse_dtype(o.dtype);
  // Columns: d for sinusoidal; d/2 frequencies (cos and sin tables) for rope.
  const std::int64_t cols = o.encoding == "rope" ? o.dim / 2 : o.dim;
  const std::int64_t elements = checked_mul(o.length, std::max<std::int64_t>(cols, 1), "table size");
  // The command holds the table and its printed form in memory: refuse what cannot fit.
  constexpr std::int64_t kMaxElements = std::int64_t{1} << 30;
  if (elements > kMaxElements) {
    throw Error("table", "--length × --dim", std::to_string(o.length) + " × " + std::to_string(o.dim),
                "at most 2^30 values (the C++ API has no such limit)");
  }
  const auto count = static_cast<std::size_t>(elements);
  const std::vector<std::int64_t> shape = {o.length, cols};
  if (o.encoding == "sinusoidal") {
    SinusoidalLayout layout = SinusoidalLayout::kInterleaved;
    if (o.layout == "split") {
      layout = SinusoidalLayout::kSplitHalves;
    } else if (o.layout != "interleaved") {
      throw Error("table", "--layout", o.layout, "interleaved or split");
    }
    const SinusoidalParams params(o.dim, o.base, layout);
    // Build in the requested dtype, then widen for printing (so bf16 prints its rounding).
    std::vector<unsigned char> storage(count * dtype_size(dtype) + 1);
    sinusoidal_table(params, positions, TensorView::contiguous(storage.data(), dtype, shape));
    print_tables(o, {{"values", widen(storage, dtype, count)}}, cols,
                 {{"encoding", "sinusoidal"},
                  {"dim", o.dim},
                  {"base", o.base},
                  {"layout", o.layout},
                  {"offset", o.offset},
                  {"length", o.length},
                  {"dtype", o.dtype}});
  } else {
    const RopeParams params(o.dim, o.dim, o.base);
    std::vector<unsigned char> cos(count * dtype_size(dtype) + 1), sin(cos.size());
    rope_cos_sin(params, positions, TensorView::contiguous(cos.data(), dtype, shape),
                 TensorView::contiguous(sin.data(), dtype, shape));
    print_tables(o, {{"cos", widen(cos, dtype, count)}, {"sin", widen(sin, dtype, count)}}, cols,
                 {{"encoding", "rope"},
                  {"dim", o.dim},
                  {"base", o.base},
                  {"offset", o.offset},
                  {"length", o.length},
                  {"dtype", o.dtype}});
  }
}

// A flag given for an encoding that does not read it is refused by name rather than ignored: the
// table's own encodings read the flags listed here, a registered scheme what its picture depends on
// (its options, heads and head_dim but those picture_ignores names) and --set.
void check_flags_apply(const CLI::App& sub, const std::string& encoding) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> native = {
      {"--dim", {"sinusoidal", "rope", "floater"}}, {"--base", {"sinusoidal", "rope"}}, {"--layout", {"sinusoidal"}},
      {"--dtype", {"sinusoidal", "rope"}},          {"--hidden", {"floater"}},          {"--seed", {"floater"}},
      {"--time-per-position", {"floater"}},         {"--substeps", {"floater"}},
  };
  for (const CLI::Option* opt : sub.get_options()) {
    const std::string flag = flag_of(*opt);
    if (flag.empty() || opt->count() == 0) continue;
    const std::string target = target_of_flag(flag);
    if (target.empty() && flag != "--set" && flag != "--head") continue;  // --length, --offset, --format
    std::vector<std::string> names;
    for (const auto& [f, readers] : native) {
      if (f == flag) names = readers;
    }
    for (const SchemeEntry& e : schemes()) {
      if (!has_picture(e)) continue;
      // --head: every registered scheme (a shared matrix refuses it by name when it is printed).
      // An entry by its first alias where it has one (none: nope).
      if (flag == "--set" || flag == "--head" || reads(e, target))
        names.push_back(e.aliases.empty() ? e.name : e.aliases.front());
    }
    if (std::find(names.begin(), names.end(), encoding) != names.end()) continue;
    std::string list;
    for (const std::string& n : names) list += (list.empty() ? "" : ", ") + n;
    throw Error("table", flag, opt->results().empty() ? "given" : opt->results().front(),
                "only with " + list + " (" + encoding + " does not read it)");
  }
}

}  // namespace

Runner add_table(CLI::App& app) {
  auto o = std::make_shared<TableOptions>();
  CLI::App* sub = app.add_subcommand("table", "Print an encoding table (rows = positions)");
  sub->add_option("encoding", o->encoding,
                  "Encoding: sinusoidal; rope (cos and sin, one column per frequency); floater (a seeded layer's "
                  "trajectory); or a registered scheme with a picture (posenc schemes): alibi, t5 (bucket ids), "
                  "kerple, fire, tupe, shaw (table rows), xl (position terms of zero q and k), sandwich, nope, … "
                  "(matrices: rows = queries, columns = keys; learned schemes show their initial parameters)")
      ->required();
  sub->add_option("--length,-n", o->length, "Number of positions (rows)")->capture_default_str();
  sub->add_option("--dim,-d", o->dim,
                  "Encoding width, or rope's rotary dim (even); a scheme's dim option (default: the scheme's)")
      ->capture_default_str();
  sub->add_option("--base", o->base, "Frequency base (a scheme's base option)")->capture_default_str();
  sub->add_option("--layout", o->layout, "interleaved (sin, cos pairs) or split ([sin | cos])")->capture_default_str();
  sub->add_option("--offset", o->offset, "First position")->capture_default_str();
  sub->add_option("--dtype", o->dtype, "f32, f64, bf16 or f16")->capture_default_str();
  sub->add_option("--format", o->format, "text (PyTorch-style), csv or json")->capture_default_str();
  sub->add_option("--heads,-H", o->heads, "Registered schemes with a matrix per head: number of heads")
      ->capture_default_str();
  add_optional(sub, "--head", o->head, "Registered schemes: print only this head (default: every head)");
  sub->add_option("--head-dim", o->head_dim, "Registered schemes whose picture depends on it: head size (tupe, xl)")
      ->capture_default_str();
  sub->add_option("--hidden", o->hidden, "floater: MLP width (a scheme's hidden option)")->capture_default_str();
  sub->add_option("--seed", o->seed, "floater: initialisation seed (a scheme's seed option)")->capture_default_str();
  sub->add_option("--time-per-position", o->time_per_position, "floater: Δ, the ODE time between positions")
      ->capture_default_str();
  sub->add_option("--substeps", o->substeps, "floater: RK4 steps per position")->capture_default_str();
  sub->add_option("--set", o->settings, "Registered schemes: an option, NAME=VALUE");
  sub->add_flag("--causal")->description("Schemes with a bidirectional option (t5): set it to 0 (--causal=false: 1)");
  sub->add_option("--form")->description("Schemes with a power option (kerple): log (0) or power (1)");
  // Every other option of a registered scheme with a picture is a flag of its own name (a bare flag
  // for 0-or-1 options), read only by the schemes whose picture depends on it.
  for (const SchemeEntry& e : schemes()) {
    if (!has_picture(e)) continue;
    for (const SchemeOption& option : e.options) {
      std::string flag = "--" + option.name;
      std::replace(flag.begin(), flag.end(), '_', '-');
      if (sub->get_option_no_throw(flag) != nullptr) continue;
      std::string readers;
      for (const SchemeEntry& r : schemes()) {
        if (has_picture(r) && declares(r, option.name)) readers += (readers.empty() ? "" : ", ") + r.name;
      }
      const std::string help = readers + ": " + option.description;
      if (option.is_flag()) {
        sub->add_flag(flag)->description(help);
      } else {
        sub->add_option(flag)->description(help);
      }
    }
  }
  return [o, sub] {
    check_flags_apply(*sub, o->encoding);
    run_table(*sub, *o);
  };
}

}  // namespace posenc::cli
