// Registry entries (posenc/registry.hpp) of the schemes whose classes live in bias.hpp,
// relative.hpp, rotary.hpp and absolute.hpp: how each is named, which options it takes, the shape
// of its learned parameters, and its HeadGroup. Initial values (no parameters given) are the
// papers' (ALiBi's slopes) or the classes' seeded init().
#include <cmath>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "posenc/error.hpp"
#include "posenc/memory.hpp"
#include "posenc/registry.hpp"

namespace posenc::scheme_entries {
namespace {

std::vector<double> slice(const std::vector<double>& values, std::int64_t offset, std::int64_t count) {
  return {values.begin() + offset, values.begin() + offset + count};
}

// Products and sums of sizes for parameter shapes, refused by name past an int64.
std::int64_t checked_product(const char* scheme, std::initializer_list<std::int64_t> factors) {
  std::int64_t p = 1;
  for (const std::int64_t f : factors) {
    if (__builtin_mul_overflow(p, f, &p)) {
      throw Error(std::string("scheme ") + scheme, "parameters", "more than 2^63 values",
                  "options whose parameters fit an int64");
    }
  }
  return p;
}
std::int64_t checked_sum(const char* scheme, std::initializer_list<std::int64_t> terms) {
  std::int64_t sum = 0;
  for (const std::int64_t t : terms) {
    if (__builtin_add_overflow(sum, t, &sum)) {
      throw Error(std::string("scheme ") + scheme, "parameters", "more than 2^63 values",
                  "options whose parameters fit an int64");
    }
  }
  return sum;
}

std::vector<double> joined(std::initializer_list<const std::vector<double>*> parts) {
  std::vector<double> all;
  for (const auto* part : parts) all.insert(all.end(), part->begin(), part->end());
  return all;
}

// One matrix for every head: value(r) at r = key position − query position.
SchemePicture shared_picture(std::string name, const Positions& positions,
                             const std::function<double(std::int64_t)>& value) {
  const std::int64_t n = positions.seq_len();
  std::vector<double> m(checked_allocation(checked_mul(n, n, "picture size"), sizeof(double), "picture", "positions²") /
                        sizeof(double));
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t j = 0; j < n; ++j)
      m[static_cast<std::size_t>(i * n + j)] = value(positions.at(0, j) - positions.at(0, i));
  }
  return {{std::move(m)}, std::move(name)};
}

HeadGroup bias_group(const SchemeArgs& a, BiasScheme bias) {
  HeadGroup g;
  g.heads = a.heads;
  g.bias = std::move(bias);
  return g;
}

}  // namespace

SchemeEntry none_entry() {
  return {.name = "none",
          .aliases = {"nope"},
          .family = "none",
          .summary = "no positional term (NoPE: the causal mask is the only signal)",
          .source = "Kazemnejad et al. 2023, The Impact of Positional Encoding on Length Generalization",
          .options = {},
          .parameters = "",
          .parameter_shape = [](const SchemeArgs&) { return std::vector<std::int64_t>{}; },
          .make =
              [](const SchemeArgs& a) {
                return HeadGroup{a.heads, {}, {}};
              }};
}

namespace {
// RoPE's options (rope, xpos): base, rotary_dim, interleaved, keys_rotated.
std::vector<SchemeOption> rope_options() {
  return {{"base", 10000.0, "frequency base"},
          {"rotary_dim", 0, "rotated dimensions (absent: head_dim)", true, 2, SchemeOption::kMaxSize, true},
          flag_option("interleaved", false, "1: pairs (x0, x1), (x2, x3)…; 0: halves (x_i, x_{i+r/2})"),
          flag_option("keys_rotated", false, "1: k is a cache of rotated keys (only q is rotated)")};
}
RopeParams rope_params(const SchemeArgs& a, RopeScaling scaling = {}, std::int64_t max_position_embeddings = 2048) {
  if (a.rope) return *a.rope;
  const std::int64_t rotary = a.has("rotary_dim") ? a.integer("rotary_dim") : a.head_dim;
  return RopeParams(a.head_dim, rotary, a.number("base"),
                    a.flag("interleaved") ? RopeLayout::kInterleaved : RopeLayout::kHalfSplit, scaling,
                    max_position_embeddings);
}
// A test-time scaling of a model trained at train_length, from a longer context on: args.rope
// with the scaling, in place of the options it holds.
LengthVariant rope_scaling_variant(std::string name, std::string summary,
                                   RopeScaling (*scaling)(std::int64_t train_length, std::int64_t context_length)) {
  return {std::move(name), std::move(summary),
          [scaling](SchemeArgs& a, std::int64_t train_length, std::int64_t context_length) {
            if (context_length <= train_length) return;
            if (a.rope) throw Error("scheme rope", "rope", "given", "options, which the length variant scales");
            a.rope = rope_params(a, scaling(train_length, context_length), train_length);
            for (const char* set : {"base", "rotary_dim", "interleaved"}) a.options.erase(set);
          }};
}
}  // namespace

SchemeEntry rope_entry() {
  return {.name = "rope",
          .family = "transform",
          .summary = "q, k rotated by θ_i·position in pairs, θ_i = base^(−2i/rotary_dim)",
          .source = "Su et al. 2021, RoFormer",
          .options = rope_options(),
          .parameters = "",
          .parameter_shape = [](const SchemeArgs&) { return std::vector<std::int64_t>{}; },
          .make =
              [](const SchemeArgs& a) {
                return HeadGroup{a.heads, RotaryQK{rope_params(a), a.flag("keys_rotated"), 0}, {}};
              },
          .takes_rope_parameters = true,
          .length_variants = {// Hugging Face's dynamic NTK with factor 1: base·(seq/M)^(d/(d−2)) past M = train_length.
                              rope_scaling_variant(
                                  "ntk", "dynamic NTK: the base grows with the context past the training length",
                                  [](std::int64_t, std::int64_t) {
                                    RopeScaling scaling;
                                    scaling.type = RopeType::kDynamic;
                                    return scaling;
                                  }),
                              // YaRN (Peng et al. 2023) with factor = context / training length.
                              rope_scaling_variant("yarn", "YaRN with factor = context / training length",
                                                   [](std::int64_t train_length, std::int64_t context_length) {
                                                     RopeScaling scaling;
                                                     scaling.type = RopeType::kYarn;
                                                     scaling.factor = static_cast<double>(context_length) /
                                                                      static_cast<double>(train_length);
                                                     scaling.original_max_position_embeddings = train_length;
                                                     return scaling;
                                                   })}};
}

SchemeEntry xpos_entry() {
  return {.name = "xpos",
          .family = "transform",
          .summary =
              "RoPE with pair i of q scaled by ζ_i^(p/γ), of k by ζ_i^(−p/γ), ζ_i = (2i + 0.4·r)/(1.4·r): q·k decays",
          .source = "Sun et al. 2022, A Length-Extrapolatable Transformer",
          .options =
              [] {
                std::vector<SchemeOption> options = rope_options();
                options.push_back({"scale_base", 512.0, "γ, positions per e-fold of the decay", false, 1e-300});
                options.push_back({"center", 0.0, "the position where the scales are 1"});
                return options;
              }(),
          .parameters = "",
          .parameter_shape = [](const SchemeArgs&) { return std::vector<std::int64_t>{}; },
          .make =
              [](const SchemeArgs& a) {
                return HeadGroup{a.heads,
                                 RotaryQK{rope_params(a).with_xpos(a.number("scale_base"), a.number("center")),
                                          a.flag("keys_rotated"), 0},
                                 {}};
              }};
}

SchemeEntry absolute_entry() {
  return {.name = "absolute",
          .family = "transform",
          .summary = "the sinusoid of the position added to q and k, not v (position-infused attention)",
          .source = "Press et al. 2021, Shortformer",
          .options = {{"dim", 0, "width of the sinusoid (absent: head_dim; else it must equal head_dim)", true, 1,
                       SchemeOption::kMaxSize, true},
                      {"base", 10000.0, "frequency base"},
                      flag_option("interleaved", true, "1: (sin, cos) pairs; 0: [sin | cos] halves")},
          .parameters = "",
          .parameter_shape = [](const SchemeArgs&) { return std::vector<std::int64_t>{}; },
          .make =
              [](const SchemeArgs& a) {
                return HeadGroup{
                    a.heads,
                    AbsoluteQK{SinusoidalParams(
                        a.has("dim") ? a.integer("dim") : a.head_dim, a.number("base"),
                        a.flag("interleaved") ? SinusoidalLayout::kInterleaved : SinusoidalLayout::kSplitHalves)},
                    {}};
              }};
}

SchemeEntry alibi_entry() {
  return SchemeEntry{.name = "alibi",
                     .family = "relative-bias",
                     .summary = "b = m_h·r (causal) or −m_h·|r| (symmetric), r = key − query",
                     .source = "Press et al. 2022, Train Short, Test Long",
                     .options = {flag_option("symmetric", false, "1: −m·|r| (encoders)"),
                                 {"max_bias", 8.0, "the slopes' exponent scale"}},
                     .parameters = "slopes [heads]",
                     .parameter_shape = [](const SchemeArgs& a) { return std::vector<std::int64_t>{a.heads}; },
                     .make =
                         [](const SchemeArgs& a) {
                           const AlibiForm form = a.flag("symmetric") ? AlibiForm::kSymmetric : AlibiForm::kCausal;
                           return bias_group(a, a.parameters.empty() ? AlibiParams(a.heads, form, a.number("max_bias"))
                                                                     : AlibiParams(a.parameters, form));
                         },
                     // The paper's slopes.
                     .parameters_fixed = true};
}

// T5's buckets by default (Raffel et al. 2020), the option's default and the bench table's rows.
constexpr std::int64_t kT5Buckets = 32;

SchemeEntry t5_entry() {
  SchemeEntry entry =
      SchemeEntry{.name = "t5",
                  .family = "relative-bias",
                  .summary = "b = table[bucket(r), h]: exact near 0, logarithmic buckets up to max_distance",
                  .source = "Raffel et al. 2020, T5",
                  .options = {size_option("num_buckets", kT5Buckets, "buckets"),
                              size_option("max_distance", 128, "distance of the last bucket"),
                              flag_option("bidirectional", true, "0: causal buckets")},
                  .parameters = "table [num_buckets, heads] (zeros at first)",
                  .parameter_shape =
                      [](const SchemeArgs& a) {
                        return std::vector<std::int64_t>{a.integer("num_buckets"), a.heads};
                      },
                  .make =
                      [](const SchemeArgs& a) {
                        return bias_group(a, T5BiasParams(a.heads, a.integer("num_buckets"), a.integer("max_distance"),
                                                          a.flag("bidirectional"), a.parameters));
                      }};
  // The bucket ids (the learned table is a model's, zeros at first).
  entry.picture = [](const HeadGroup& g, const Positions& positions) {
    const T5BiasParams& t5 = *g.bias->get_if<T5BiasParams>();
    return shared_picture("buckets", positions, [&](std::int64_t r) { return static_cast<double>(t5.bucket(r)); });
  };
  entry.picture_ignores = {"heads", "head_dim"};
  entry.decoder_preset = [](SchemeArgs& a, std::int64_t) { a.options["bidirectional"] = 0; };
  entry.training = [](const SchemeArgs& a, std::int64_t) {
    return std::vector<TrainedSlice>{{.name = "table", .shape = {a.integer("num_buckets"), a.heads}}};
  };
  // A decoder's causal buckets, and a table of varied values (zeros would make every score's
  // bias equal).
  entry.bench_preset = [](SchemeArgs& a, std::int64_t) {
    a.options["bidirectional"] = 0;
    const std::int64_t buckets = a.has("num_buckets") ? a.integer("num_buckets") : kT5Buckets;
    if (buckets < 1) throw Error("t5", "num_buckets", std::to_string(buckets), "at least 1");
    a.parameters.resize(static_cast<std::size_t>(checked_mul(buckets, a.heads, "t5 table (num_buckets · heads)")));
    for (std::size_t e = 0; e < a.parameters.size(); ++e) a.parameters[e] = static_cast<double>(e % 7) * 0.25 - 0.75;
  };
  return entry;
}

SchemeEntry kerple_entry() {
  return SchemeEntry{.name = "kerple",
                     .family = "relative-bias",
                     .summary = "b = −r1_h·log(1 + r2_h·|r|) (log) or −r1_h·|r|^r2_h (power)",
                     .source = "Chi et al. 2022, KERPLE",
                     .options = {flag_option("power", false, "1: the power form"),
                                 {"r1", 1.0, "r1 of every head at first"},
                                 {"r2", 0.5, "r2 of every head at first"}},
                     .parameters = "[r1 | r2] [2, heads]",
                     .parameter_shape =
                         [](const SchemeArgs& a) {
                           return std::vector<std::int64_t>{2, a.heads};
                         },
                     .make =
                         [](const SchemeArgs& a) {
                           const KerpleForm form = a.flag("power") ? KerpleForm::kPower : KerpleForm::kLog;
                           const auto h = static_cast<std::size_t>(a.heads);
                           if (a.parameters.empty()) {
                             return bias_group(a, KerpleParams(form, std::vector<double>(h, a.number("r1")),
                                                               std::vector<double>(h, a.number("r2"))));
                           }
                           return bias_group(a, KerpleParams(form, slice(a.parameters, 0, a.heads),
                                                             slice(a.parameters, a.heads, a.heads)));
                         },
                     // r1 and r2 positive through softplus, both 1 at first (softplus(0.5413) = 1.0000).
                     .training =
                         [](const SchemeArgs& a, std::int64_t) {
                           return std::vector<TrainedSlice>{{.name = "raw",
                                                             .shape = {2, a.heads},
                                                             .init = TrainedSlice::Init::kConstant,
                                                             .value = 0.5413,
                                                             .softplus = true}};
                         }};
}

SchemeEntry fire_entry() {
  SchemeEntry entry =
      SchemeEntry{.name = "fire",
                  .family = "bias",
                  .summary = "b = MLP_h(ψ(|i − j|)/ψ(max(L, i))), ψ(t) = log(1 + c·t)",
                  .source = "Li et al. 2023, Functional Interpolation for Relative Positions",
                  .options = {size_option("hidden", 32, "MLP width"),
                              {"c", 1.0, "c of ψ at first"},
                              {"threshold", 512.0, "L at first"},
                              seed_option()},
                  .parameters = "[w1 (hidden) | b1 (hidden) | w2 (heads·hidden) | b2 (heads) | c | L]",
                  .parameter_shape =
                      [](const SchemeArgs& a) {
                        const std::int64_t k = a.integer("hidden");
                        return std::vector<std::int64_t>{
                            checked_sum("fire", {2 * k, checked_product("fire", {a.heads, k}), a.heads, 2})};
                      },
                  .make =
                      [](const SchemeArgs& a) {
                        const std::int64_t k = a.integer("hidden"), h = a.heads;
                        if (a.parameters.empty()) {
                          return bias_group(a, FireParams::init(h, k, static_cast<std::uint64_t>(a.integer("seed")),
                                                                a.number("c"), a.number("threshold")));
                        }
                        const std::vector<double>& p = a.parameters;
                        return bias_group(a, FireParams(h, slice(p, 0, k), slice(p, k, k), slice(p, 2 * k, h * k),
                                                        slice(p, 2 * k + h * k, h), p[p.size() - 2], p[p.size() - 1]));
                      }};
  entry.picture_ignores = {"head_dim"};  // FIRE's MLP sees positions only
  // The MLP drawn at random (the output layer scaled by 1/sqrt(hidden)); c and L positive through
  // softplus, c = softplus(2.2522) = 2.35 ≈ e^0.85 and L about the training length at first.
  entry.training = [](const SchemeArgs& a, std::int64_t train_length) {
    using enum TrainedSlice::Init;
    const std::int64_t k = a.integer("hidden");
    return std::vector<TrainedSlice>{
        {.name = "w1", .shape = {k}, .init = kNormal, .value = 1.0},
        {.name = "b1", .shape = {k}, .init = kNormal, .value = 2.0},
        {.name = "w2", .shape = {a.heads, k}, .init = kNormal, .value = std::sqrt(static_cast<double>(k))},
        {.name = "b2", .shape = {a.heads}},
        {.name = "c_raw", .shape = {1}, .init = kConstant, .value = 2.2522, .softplus = true},
        {.name = "l_raw",
         .shape = {1},
         .init = kConstant,
         .value = static_cast<double>(train_length),
         .softplus = true}};
  };
  return entry;
}

SchemeEntry tupe_entry() {
  return SchemeEntry{
      .name = "tupe",
      .family = "bias",
      .summary = "b = (p_i U^Q_h)·(p_j U^K_h)/sqrt(2D), p a learned absolute table",
      .source = "Ke et al. 2021, Rethinking Positional Encoding in Language Pre-training",
      .options = {size_option("d_model", 64, "width of the position table"),
                  size_option("max_len", 512, "rows of the position table"),
                  flag_option("cls_reset", false, "1: position 0 is a [CLS] token with learned θ1, θ2"), seed_option()},
      .parameters = "[table (max_len·d_model) | U^Q (d_model·heads·head_dim) | U^K | θ1 (heads) | θ2 (heads)]",
      .parameter_shape =
          [](const SchemeArgs& a) {
            const std::int64_t table = checked_product("tupe", {a.integer("max_len"), a.integer("d_model")});
            const std::int64_t u = checked_product("tupe", {a.integer("d_model"), a.heads, a.head_dim});
            return std::vector<std::int64_t>{checked_sum("tupe", {table, u, u, 2 * a.heads})};
          },
      .make =
          [](const SchemeArgs& a) {
            const std::int64_t d_model = a.integer("d_model"), max_len = a.integer("max_len");
            if (a.parameters.empty()) {
              return bias_group(a, TupeParams::init(a.heads, a.head_dim, d_model, max_len, a.flag("cls_reset"), 0.02,
                                                    static_cast<std::uint64_t>(a.integer("seed"))));
            }
            const std::int64_t table = max_len * d_model, u = d_model * a.heads * a.head_dim;
            const std::vector<double>& p = a.parameters;
            return bias_group(a,
                              TupeParams(a.heads, a.head_dim, d_model, slice(p, 0, table), slice(p, table, u),
                                         slice(p, table + u, u), a.flag("cls_reset"), slice(p, table + 2 * u, a.heads),
                                         slice(p, table + 2 * u + a.heads, a.heads)));
          },
      // A model's width of table, over every position of the call.
      .bench_preset =
          [](SchemeArgs& a, std::int64_t keys) {
            a.options["d_model"] = 256;
            a.options["max_len"] = static_cast<double>(keys + 1);
          }};
}

// The entry's own term: the first of the group its factory built.
template <class Term>
const Term& term_of(const HeadGroup& g, const char* scheme) {
  const Term* term = g.terms.empty() ? nullptr : dynamic_cast<const Term*>(g.terms.front().get());
  if (term == nullptr)
    throw Error(std::string("scheme ") + scheme, "group.terms[0]", "another term or none", "its own");
  return *term;
}

// The entry's term's gradient (none for a group without it).
std::vector<double> first_term_gradient(const GroupGradients& g) {
  return g.terms.empty() ? std::vector<double>{} : g.terms.front();
}

SchemeEntry shaw_entry() {
  SchemeEntry entry = SchemeEntry{
      .name = "shaw",
      .family = "relative-terms",
      .summary = "logit += scale·q·a^K[clip(r, ±k)], out += Σ_j p_ij·a^V[clip(r, ±k)]",
      .source = "Shaw et al. 2018, Self-Attention with Relative Position Representations",
      .options = {{"max_distance", 16, "the clip k", true, 0, SchemeOption::kMaxSize}, seed_option()},
      .parameters = "[key table | value table] [2, 2·max_distance + 1, head_dim]",
      .parameter_shape =
          [](const SchemeArgs& a) {
            return std::vector<std::int64_t>{2, 2 * a.integer("max_distance") + 1, a.head_dim};
          },
      .make =
          [](const SchemeArgs& a) {
            const std::int64_t k = a.integer("max_distance");
            HeadGroup g{a.heads, {}, {}};
            if (a.parameters.empty()) {
              g.terms.push_back(std::make_shared<ShawTerm>(
                  a.heads, ShawParams::init(k, a.head_dim, 0.02, static_cast<std::uint64_t>(a.integer("seed")))));
            } else {
              const std::int64_t half = static_cast<std::int64_t>(a.parameters.size()) / 2;
              g.terms.push_back(std::make_shared<ShawTerm>(
                  a.heads, ShawParams(k, a.head_dim, slice(a.parameters, 0, half), slice(a.parameters, half, half))));
            }
            return g;
          },
      .parameters_of =
          [](const HeadGroup& g) {
            const ShawParams& shaw = term_of<ShawTerm>(g, "shaw").params();
            const std::vector<double> zeros(static_cast<std::size_t>(shaw.rows() * shaw.head_dim()), 0.0);
            const auto& key = shaw.key_table().empty() ? zeros : shaw.key_table();
            const auto& value = shaw.value_table().empty() ? zeros : shaw.value_table();
            return joined({&key, &value});
          },
      .gradients_of = first_term_gradient};
  // The table row each (query, key) pair reads: clip(r, −k, k) + k.
  entry.picture = [](const HeadGroup& g, const Positions& positions) {
    const ShawParams& shaw = term_of<ShawTerm>(g, "shaw").params();
    return shared_picture("rows", positions, [&](std::int64_t r) { return static_cast<double>(shaw.row_of(r)); });
  };
  entry.picture_ignores = {"heads", "head_dim", "seed"};
  entry.bench_preset = [](SchemeArgs& a, std::int64_t) { a.options["max_distance"] = 64; };  // a 129-row table
  return entry;
}

SchemeEntry xl_entry() {
  SchemeEntry entry = SchemeEntry{
      .name = "xl",
      .family = "relative-terms",
      .summary = "logit += scale·(u_h·k_j + (q_i + v_h)·W_R r(i − j)), r a sinusoid of d_model",
      .source = "Dai et al. 2019, Transformer-XL",
      .options = {size_option("d_model", 64, "width of the sinusoid r"),
                  {"base", 10000.0, "the sinusoid's base"},
                  seed_option()},
      .parameters = "[u (heads·head_dim) | v (heads·head_dim) | W_R (heads·head_dim·d_model)]",
      .parameter_shape =
          [](const SchemeArgs& a) {
            const std::int64_t hd = checked_product("xl", {a.heads, a.head_dim});
            return std::vector<std::int64_t>{
                checked_sum("xl", {hd, hd, checked_product("xl", {hd, a.integer("d_model")})})};
          },
      .make =
          [](const SchemeArgs& a) {
            const std::int64_t d_model = a.integer("d_model"), hd = a.heads * a.head_dim;
            HeadGroup g{a.heads, {}, {}};
            if (a.parameters.empty()) {
              const XlParams init =
                  XlParams::init(a.heads, a.head_dim, d_model, 0.02, static_cast<std::uint64_t>(a.integer("seed")));
              g.terms.push_back(std::make_shared<XlTerm>(
                  XlParams(a.heads, a.head_dim, d_model, init.u(), init.v(), init.w_r(), a.scale, a.number("base"))));
            } else {
              g.terms.push_back(std::make_shared<XlTerm>(
                  XlParams(a.heads, a.head_dim, d_model, slice(a.parameters, 0, hd), slice(a.parameters, hd, hd),
                           slice(a.parameters, 2 * hd, hd * d_model), a.scale, a.number("base"))));
            }
            return g;
          },
      .parameters_of =
          [](const HeadGroup& g) {
            const XlParams& xl = term_of<XlTerm>(g, "xl").params();
            return joined({&xl.u(), &xl.v(), &xl.w_r()});
          },
      .gradients_of = first_term_gradient};
  // The position terms a zero query and zero keys see: scale·v_h·W_R r(i − j).
  entry.picture = [](const HeadGroup& g, const Positions& positions) {
    const XlParams& xl = term_of<XlTerm>(g, "xl").params();
    const std::int64_t n = positions.seq_len(), heads = g.heads, dim = xl.head_dim();
    const std::int64_t per_head = checked_mul(n, n, "picture size");
    const auto count = [](std::int64_t values, const char* what) {
      return checked_allocation(values, sizeof(double), "picture", what) / sizeof(double);
    };
    const std::vector<double> zeros(count(checked_mul(checked_mul(n, heads, "picture size"), dim, "picture size"), "q"),
                                    0.0);
    std::vector<double> all(count(checked_mul(heads, per_head, "picture size"), "heads · positions²"), 0.0);
    xl_add_position_terms(xl, ConstTensorView::of(zeros.data(), {n, heads, dim}),
                          ConstTensorView::of(zeros.data(), {n, heads, dim}), positions, positions,
                          TensorView::of(all.data(), {heads, n, n}));
    SchemePicture picture;
    for (std::int64_t h = 0; h < heads; ++h) {
      picture.heads.emplace_back(all.begin() + h * per_head, all.begin() + (h + 1) * per_head);
    }
    return picture;
  };
  // d_model = H·D, as in its models.
  entry.bench_preset = [](SchemeArgs& a, std::int64_t) {
    a.options["d_model"] = static_cast<double>(checked_mul(a.heads, a.head_dim, "xl d_model (heads · head_dim)"));
  };
  return entry;
}

}  // namespace posenc::scheme_entries
