// posenc table sinusoidal --length N --dim D [--base B] [--layout interleaved|split] [--offset P]
//                         [--dtype f32|f64|bf16|f16] [--format text|csv|json]
// posenc table rope       --length N --dim D [--base B] [--offset P] [...]
// posenc table alibi|t5|kerple|fire|tupe|shaw|xl|nope --length N [--heads H] [--head h] [options]
// posenc table floater --length N --dim D [--hidden M] [--seed S] [...]
//   a bias matrix: rows = query positions offset … offset + N − 1, columns = key positions
//   offset … offset + N − 1 (causal schemes print their values above the diagonal too: masking
//   is attention's job). t5 prints bucket ids (the learned table is a model's).
#include <fmt/core.h>

#include <algorithm>
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
  // bias schemes
  std::int64_t heads = 8;
  std::optional<std::int64_t> head;  // absent: every head
  bool symmetric = false;
  double max_bias = 8.0;
  std::int64_t num_buckets = 32;
  std::int64_t max_distance = 128;
  bool causal = false;
  std::string kerple_form = "log";
  std::vector<std::string> settings;  // registry schemes: NAME=VALUE options
  double r1 = 1.0, r2 = 0.5;
  std::int64_t hidden = 32;
  std::uint64_t seed = 0;
  bool cls_reset = false;
  double time_per_position = 0.1;
  std::int64_t substeps = 1;
  double fire_c = 1.0, threshold = 512.0;
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

// A bias matrix per head (or the chosen head): rows = query positions, columns = key positions.
// Whether head h of `heads` is printed; an explicit --head must name one of them.
bool head_wanted(const TableOptions& o, std::int64_t h, std::int64_t heads) {
  if (o.head && (*o.head < 0 || *o.head >= heads)) {
    throw Error("table", "--head", std::to_string(*o.head),
                "in [0, " + std::to_string(heads) + ") (--heads " + std::to_string(heads) + ")");
  }
  return !o.head || *o.head == h;
}

void run_bias_table(const TableOptions& o) {
  if (o.length < 1) throw Error("table", "--length", std::to_string(o.length), ">= 1");
  if (o.heads < 1) throw Error("table", "--heads", std::to_string(o.heads), ">= 1");
  constexpr std::int64_t kMaxElements = std::int64_t{1} << 26;
  if (checked_mul(o.length, o.length, "table size") > kMaxElements / std::max<std::int64_t>(o.heads, 1)) {
    throw Error("table", "--length² × --heads", std::to_string(o.length) + "² × " + std::to_string(o.heads),
                "at most 2^26 values (the C++ API has no such limit)");
  }
  const Positions positions = Positions::range(o.length, o.offset);
  const std::int64_t n = o.length;
  nlohmann::json doc = {{"encoding", o.encoding}, {"length", n}, {"offset", o.offset}};
  std::vector<std::pair<std::string, std::vector<double>>> tables;
  if (o.encoding == "shaw") {
    // The table row each (query, key) pair reads: clip(j − i, −k, k) + k.
    if (o.head)
      throw Error("table", "--head", std::to_string(*o.head), "no head for shaw (one table of rows for all heads)");
    const ShawParams shaw(o.max_distance, 1);
    std::vector<double> rows(static_cast<std::size_t>(n * n));
    for (std::int64_t i = 0; i < n; ++i) {
      for (std::int64_t j = 0; j < n; ++j)
        rows[static_cast<std::size_t>(i * n + j)] = static_cast<double>(shaw.row_of(j - i));
    }
    doc["max_distance"] = o.max_distance;
    print_tables(o, {{"rows", rows}}, n, doc, "k");
    return;
  }
  if (o.encoding == "xl") {
    // The position terms a zero query and zero keys see: scale·v·W_R r(i − j) (a seeded layer).
    const std::int64_t dim = 16, d_model = 32;
    const XlParams xl = XlParams::init(o.heads, dim, d_model, 0.5, o.seed);
    std::vector<double> zeros(static_cast<std::size_t>(n * o.heads * dim), 0.0),
        all(static_cast<std::size_t>(o.heads * n * n), 0.0);
    xl_add_position_terms(xl, ConstTensorView::of(zeros.data(), {n, o.heads, dim}),
                          ConstTensorView::of(zeros.data(), {n, o.heads, dim}), positions, positions,
                          TensorView::of(all.data(), {o.heads, n, n}));
    doc.update({{"heads", o.heads}, {"head_dim", dim}, {"d_model", d_model}, {"seed", o.seed}});
    std::vector<std::pair<std::string, std::vector<double>>> heads_tables;
    for (std::int64_t h = 0; h < o.heads; ++h) {
      if (!head_wanted(o, h, o.heads)) continue;
      heads_tables.emplace_back("head" + std::to_string(h),
                                std::vector<double>(all.begin() + h * n * n, all.begin() + (h + 1) * n * n));
    }
    print_tables(o, heads_tables, n, doc, "k");
    return;
  }
  if (o.encoding == "t5") {
    // Buckets, one matrix for all heads.
    if (o.head)
      throw Error("table", "--head", std::to_string(*o.head), "no head for t5 (one bucket matrix for all heads)");
    std::vector<double> buckets(static_cast<std::size_t>(n * n));
    for (std::int64_t i = 0; i < n; ++i) {
      for (std::int64_t j = 0; j < n; ++j)
        buckets[static_cast<std::size_t>(i * n + j)] =
            static_cast<double>(t5_bucket(j - i, o.num_buckets, o.max_distance, !o.causal));
    }
    doc.update({{"num_buckets", o.num_buckets}, {"max_distance", o.max_distance}, {"bidirectional", !o.causal}});
    print_tables(o, {{"buckets", buckets}}, n, doc, "k");
    return;
  }
  BiasScheme scheme = NoPE(std::max<std::int64_t>(o.heads, 1));
  if (o.encoding == "alibi") {
    scheme = AlibiParams(o.heads, o.symmetric ? AlibiForm::kSymmetric : AlibiForm::kCausal, o.max_bias);
    doc.update({{"heads", o.heads},
                {"max_bias", o.max_bias},
                {"form", o.symmetric ? "symmetric" : "causal"},
                {"slopes", std::get<AlibiParams>(scheme).slopes()}});
  } else if (o.encoding == "kerple") {
    if (o.kerple_form != "log" && o.kerple_form != "power")
      throw Error("table", "--form", o.kerple_form, "log or power");
    const std::vector<double> r1(static_cast<std::size_t>(o.heads), o.r1), r2(static_cast<std::size_t>(o.heads), o.r2);
    scheme = KerpleParams(o.kerple_form == "log" ? KerpleForm::kLog : KerpleForm::kPower, r1, r2);
    doc.update({{"heads", o.heads}, {"form", o.kerple_form}, {"r1", o.r1}, {"r2", o.r2}});
  } else if (o.encoding == "tupe") {
    scheme = TupeParams::init(o.heads, 16, 32, o.offset + n, o.cls_reset, 0.5, o.seed);
    doc.update({{"heads", o.heads}, {"head_dim", 16}, {"d_model", 32}, {"seed", o.seed}, {"cls_reset", o.cls_reset}});
  } else if (o.encoding == "fire") {
    scheme = FireParams::init(o.heads, o.hidden, o.seed, o.fire_c, o.threshold);
    doc.update(
        {{"heads", o.heads}, {"hidden", o.hidden}, {"seed", o.seed}, {"c", o.fire_c}, {"threshold", o.threshold}});
  } else if (o.encoding == "nope") {
    scheme = NoPE(o.heads);
    doc["heads"] = o.heads;
  } else {
    // Any other registered relative-bias scheme (posenc schemes), its options from --set.
    SchemeArgs args;
    args.heads = o.heads;
    args.head_dim = 1;
    for (const std::string& assignment : o.settings) {
      const std::size_t eq = assignment.find('=');
      if (eq == std::string::npos || eq == 0) throw Error("table", "--set", assignment, "NAME=VALUE");
      const std::string value = assignment.substr(eq + 1);
      std::size_t used = 0;
      double number = 0;
      try {
        number = std::stod(value, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used == 0 || used != value.size()) throw Error("table", "--set", assignment, "NAME=a number");
      args.options[assignment.substr(0, eq)] = number;
    }
    scheme = *make_head_group(o.encoding, args).bias;
    doc["heads"] = o.heads;
    for (const auto& [name, value] : complete_scheme_args(find_scheme(o.encoding), args).options) doc[name] = value;
  }
  const std::int64_t heads = bias_heads(scheme);
  head_wanted(o, 0, heads);  // checks --head before the work
  std::vector<double> all(static_cast<std::size_t>(heads * n * n));
  bias_materialize(scheme, positions, positions, TensorView::of(all.data(), {heads, n, n}));
  for (std::int64_t h = 0; h < heads; ++h) {
    if (!head_wanted(o, h, heads)) continue;
    tables.emplace_back("head" + std::to_string(h),
                        std::vector<double>(all.begin() + h * n * n, all.begin() + (h + 1) * n * n));
  }
  print_tables(o, tables, n, doc, "k");
}

void run_table(const TableOptions& o) {
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
  const auto registered_relative_bias = [&] {
    for (const SchemeEntry& e : schemes()) {
      if (e.name == o.encoding) return e.family == "relative-bias";
    }
    return false;
  };
  if (o.encoding == "alibi" || o.encoding == "t5" || o.encoding == "kerple" || o.encoding == "fire" ||
      o.encoding == "nope" || o.encoding == "shaw" || o.encoding == "xl" || o.encoding == "tupe" ||
      registered_relative_bias()) {
    if (o.format != "text" && o.format != "csv" && o.format != "json") {
      throw Error("table", "--format", o.format, "text, csv or json");
    }
    run_bias_table(o);
    return;
  }
  if (o.encoding != "sinusoidal" && o.encoding != "rope") {
    std::string others;
    for (const SchemeEntry& e : schemes()) {
      if (e.family == "relative-bias" && e.name != "alibi" && e.name != "t5" && e.name != "kerple")
        others += ", " + e.name;
    }
    throw Error("table", "encoding", o.encoding,
                "sinusoidal, rope, floater, alibi, t5, kerple, fire, tupe, shaw, xl, nope" + others);
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

// A flag given for an encoding that does not read it is refused by name rather than ignored.
void check_flags_apply(const CLI::App& sub, const std::string& encoding) {
  std::vector<std::string> other_biases;  // registered relative biases without flags of their own (--set)
  for (const SchemeEntry& e : schemes()) {
    if (e.family == "relative-bias" && e.name != "alibi" && e.name != "t5" && e.name != "kerple")
      other_biases.push_back(e.name);
  }
  std::vector<std::string> per_head = {"alibi", "kerple", "fire", "tupe", "xl", "nope"};
  per_head.insert(per_head.end(), other_biases.begin(), other_biases.end());
  const std::vector<std::pair<std::string, std::vector<std::string>>> readers = {
      {"--dim", {"sinusoidal", "rope", "floater"}},
      {"--base", {"sinusoidal", "rope"}},
      {"--layout", {"sinusoidal"}},
      {"--dtype", {"sinusoidal", "rope"}},
      {"--heads", per_head},
      {"--head", per_head},
      {"--symmetric", {"alibi"}},
      {"--max-bias", {"alibi"}},
      {"--num-buckets", {"t5"}},
      {"--causal", {"t5"}},
      {"--max-distance", {"t5", "shaw"}},
      {"--form", {"kerple"}},
      {"--r1", {"kerple"}},
      {"--r2", {"kerple"}},
      {"--hidden", {"fire", "floater"}},
      {"--seed", {"fire", "tupe", "xl", "floater"}},
      {"--cls-reset", {"tupe"}},
      {"--time-per-position", {"floater"}},
      {"--substeps", {"floater"}},
      {"--c", {"fire"}},
      {"--threshold", {"fire"}},
      {"--set", other_biases},
  };
  for (const auto& [flag, names] : readers) {
    const CLI::Option* opt = sub.get_option_no_throw(flag);
    if (opt == nullptr || opt->count() == 0 || std::find(names.begin(), names.end(), encoding) != names.end()) continue;
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
  sub->add_option(
         "encoding", o->encoding,
         "Encoding: sinusoidal; rope (cos and sin, one column per frequency); floater (a seeded layer's "
         "trajectory); alibi, t5 (bucket ids), kerple, fire, tupe (seeded layers), shaw (table rows), xl "
         "(position terms of zero q and k, a seeded layer), nope, or any other relative-bias scheme of `posenc "
         "schemes` such as sandwich (bias matrices: rows = queries, columns = keys)")
      ->required();
  sub->add_option("--length,-n", o->length, "Number of positions (rows)")->capture_default_str();
  sub->add_option("--dim,-d", o->dim, "Encoding width, or rope's rotary dim (even)")->capture_default_str();
  sub->add_option("--base", o->base, "Frequency base")->capture_default_str();
  sub->add_option("--layout", o->layout, "interleaved (sin, cos pairs) or split ([sin | cos])")->capture_default_str();
  sub->add_option("--offset", o->offset, "First position")->capture_default_str();
  sub->add_option("--dtype", o->dtype, "f32, f64, bf16 or f16")->capture_default_str();
  sub->add_option("--format", o->format, "text (PyTorch-style), csv or json")->capture_default_str();
  sub->add_option("--heads,-H", o->heads, "Bias schemes: number of heads")->capture_default_str();
  add_optional(sub, "--head", o->head, "Bias schemes: print only this head (default: every head)");
  sub->add_flag("--symmetric", o->symmetric, "alibi: −m·|i − j| (encoder) instead of the causal −m·(i − j)");
  sub->add_option("--max-bias", o->max_bias, "alibi: slope exponent scale (8 in the paper)")->capture_default_str();
  sub->add_option("--num-buckets", o->num_buckets, "t5: number of buckets")->capture_default_str();
  sub->add_option("--max-distance", o->max_distance, "t5: distance of the last bucket; shaw: the clip k")
      ->capture_default_str();
  sub->add_flag("--causal", o->causal, "t5: unidirectional buckets");
  sub->add_option("--form", o->kerple_form, "kerple: log or power")->capture_default_str();
  sub->add_option("--r1", o->r1, "kerple: r1 (every head)")->capture_default_str();
  sub->add_option("--r2", o->r2, "kerple: r2 (every head)")->capture_default_str();
  sub->add_option("--hidden", o->hidden, "fire, floater: MLP width")->capture_default_str();
  sub->add_option("--seed", o->seed, "fire, tupe, xl, floater: initialisation seed")->capture_default_str();
  sub->add_flag("--cls-reset", o->cls_reset, "tupe: position 0 is a [CLS] token with its own θ");
  sub->add_option("--time-per-position", o->time_per_position, "floater: Δ, the ODE time between positions")
      ->capture_default_str();
  sub->add_option("--substeps", o->substeps, "floater: RK4 steps per position")->capture_default_str();
  sub->add_option("--c", o->fire_c, "fire: c of ψ(t) = log(1 + c·t)")->capture_default_str();
  sub->add_option("--threshold", o->threshold, "fire: L, the smallest normaliser position")->capture_default_str();
  sub->add_option("--set", o->settings, "Other registered schemes (posenc schemes): an option, NAME=VALUE");
  return [o, sub] {
    check_flags_apply(*sub, o->encoding);
    run_table(*o);
  };
}

}  // namespace posenc::cli
