// posenc/registry.hpp — every positional scheme of the fused attention, by name.
//
// One list (src/schemes/registry.cpp, a line per scheme) that the torch ops, the Python package
// (posenc.schemes(), the generic modules), the command line (`posenc schemes`, `table`, `bench
// attention --scheme`) and the generic test matrix (tests/test_schemes.cpp) read. An entry says
// what a scheme is called, what it is, which options it takes (numbers; flags are 0 or 1) with
// their defaults, the shape of its learned parameters, the per-token inputs it reads (activations
// a caller passes with each call, such as Forgetting Attention's log forget gate), and how to
// build its HeadGroup.
//
//   const HeadGroup g = posenc::make_head_group("sandwich", {.heads = 8, .head_dim = 64,
//                                                            .options = {{"dim", 128}}});
//
// Errors: an unknown name, option or input, a non-integral value for an integer option, a
// declared input that is absent, or parameters of the wrong size throw posenc::Error naming
// them; the scheme's own constructor checks the rest.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "posenc/attention.hpp"

namespace posenc {

struct SchemeOption {
  std::string name;
  double default_value = 0.0;
  std::string description;
  bool integer = false;  // must hold an integer
  // The range an explicit value must lie in (the scheme's own constructor checks the rest); sizes
  // stay below 2^31 so that products of them fit an int64.
  double minimum = -kUnbounded, maximum = kUnbounded;
  // No default: absent means what the description says (e.g. rope's rotary_dim: head_dim), and
  // make_head_group leaves it absent rather than inventing a value that stands for "unset".
  bool optional = false;

  // A flag: an integer option that is 0 or 1 (flag_option).
  bool is_flag() const { return integer && minimum == 0.0 && maximum == 1.0; }

  static constexpr double kUnbounded = 1.7976931348623157e308;
  static constexpr double kMaxSize = 2147483648.0;  // 2^31
};
// Shorthands for the entries: a flag (0 or 1), a size in [1, 2^31], a seed in [0, 2^53].
SchemeOption flag_option(std::string name, bool default_value, std::string description);
SchemeOption size_option(std::string name, double default_value, std::string description);
SchemeOption seed_option();

// A per-token input: an activation of the model, not a learned parameter, over the keys' token
// grid ([B, Sk, heads], or [Tk, heads] for packed sequences; its last extent the group's heads).
// The group views it, so it must outlive every Attention built with the group; its gradient has
// its shape (scheme_input_gradients).
struct SchemeInput {
  std::string name;         // e.g. "log_fgate"
  std::string description;  // what it is and which values are valid
  // A trained model's value at quantile u in [0, 1] (u uniform gives their spread), which tests and
  // benchmarks draw (the scheme's constructor checks validity; this is not a bound).
  std::function<double(double u)> typical{};
  // How a decoder language model (posenc study) makes it from a block's normalised input x: log σ
  // of a learned linear map of x, one value per token and head (FoX's forget gates). False: a
  // decoder cannot train the scheme.
  bool decoder_log_sigmoid = false;
  // How the input enters the logit, for a front end that writes the score function itself
  // (posenc.flex): "sum_after_key", x_ij += Σ_{l=j+1..i} input[l, h], the sum over the tokens after
  // the key up to the query (FoX's log forget gates); "" when only the scheme's terms say.
  std::string logit_form{};
};

// What a factory receives: the head group's size, the options by name (make_head_group fills in
// the defaults and refuses unknown names), the learned parameters flattened in the order
// parameter_shape gives (empty: the scheme's initial values), and the per-token inputs by name.
struct SchemeArgs {
  std::int64_t heads = 0, head_dim = 0;
  double scale = 0.0;  // the attention's scale (0: 1/sqrt(head_dim)); Transformer-XL's terms use it
  std::map<std::string, double, std::less<>> options{};
  std::vector<double> parameters{};
  std::optional<RopeParams> rope{};  // "rope": full RoPE parameters (rope types, scaling) instead of options
  std::map<std::string, ConstTensorView, std::less<>> inputs{};  // SchemeEntry::inputs, every one given

  double number(std::string_view name) const;         // the option's value
  std::int64_t integer(std::string_view name) const;  // … checked to be an integer
  bool flag(std::string_view name) const { return number(name) != 0.0; }
  bool has(std::string_view name) const { return options.find(name) != options.end(); }
  ConstTensorView input(std::string_view name) const;  // the input's view
};

// What `posenc table` prints of a scheme: its part of the logit over query × key positions (rows =
// queries, columns = keys, row-major), one matrix per head, or one `shared` matrix that stands for
// every head under that name (T5's bucket ids, Shaw's table rows).
struct SchemePicture {
  std::vector<std::vector<double>> heads{};
  std::string shared{};  // non-empty: heads holds one matrix, printed under this name
};

// One slice of a scheme's flat parameters (parameter_shape's order) as a trainer holds it: its
// shape, its initial value, and whether the scheme reads softplus of what is trained (a positive
// parameter learned without a bound).
struct TrainedSlice {
  std::string name;
  std::vector<std::int64_t> shape;
  enum class Init { kZeros, kConstant, kNormal } init = Init::kZeros;
  // kConstant: the value; kNormal: a standard normal draw divided by this.
  double value = 0.0;
  bool softplus = false;
  // What the attention reads it in: f64 (a score bias's parameters) or f32 (CoPE's table, which
  // the attention reads in q's dtype or f32).
  DType dtype = DType::kF64;
};

// A form of a scheme for a longer context than a model was trained at, chosen at test time from the
// same trained model (RoPE's dynamic NTK and YaRN scalings). `posenc study` evaluates it as
// <scheme>-<name> beside the scheme, sharing its training.
struct LengthVariant {
  std::string name;
  std::string summary;
  // Sets args (the decoder's, with its options completed) for a context of context_length tokens
  // after training at train_length.
  std::function<void(SchemeArgs& args, std::int64_t train_length, std::int64_t context_length)> at_length{};
};

// A scheme's registry entry, built by field name (designated initializers, C++20): the fields
// left out keep the defaults below.
struct SchemeEntry {
  std::string name;
  // Other names find_scheme accepts (forgetting: fox, the FoX paper's).
  std::vector<std::string> aliases{};
  // "none", "transform" (q and k before the product), "relative-bias" (a RelativeBias,
  // scheme.hpp), "bias" (a score bias of the positions), "relative-terms" (terms with q or k),
  // "sink" (a logit in the softmax's denominator, term.hpp), "token-term" (a term of per-token
  // inputs, term.hpp), "term" (a term of the pair's positions given by its fp64 definition,
  // term.hpp: the group's first term; its picture is that term's value), "normaliser" (a
  // RowNormaliser, attention.hpp, in place of the softmax: stick-breaking, CoPE).
  std::string family;
  std::string summary;  // one line: the formula
  std::string source;   // the paper or model that defines it
  std::vector<SchemeOption> options;
  std::string parameters;  // the learned parameters, e.g. "slopes [heads]" ("" if none)
  // The learned parameters' shape for these arguments ({} when there are none).
  std::function<std::vector<std::int64_t>(const SchemeArgs&)> parameter_shape{};
  std::function<HeadGroup(const SchemeArgs&)> make{};
  // The per-token inputs the factory reads (SchemeArgs::inputs), and their gradients from a
  // group's (AttentionGradients), one flat vector per input in its (b, s, h) order.
  std::vector<SchemeInput> inputs{};
  std::function<std::vector<std::vector<double>>(const GroupGradients&)> input_gradients_of{};
  // Defined where no query sees a later key: a causal mask, a window ending at the query, or one
  // query per sequence (decode); an Attention refuses another mask.
  bool causal_only = false;
  // Takes SchemeArgs::rope, full RoPE parameters in place of its options base, rotary_dim and
  // interleaved (rope); another entry refuses them.
  bool takes_rope_parameters = false;
  // A normaliser whose row statistic (Attention's lse argument) takes a gradient
  // (Attention::backward's d_lse): stick-breaking's rem. The torch op then differentiates it.
  bool statistic_has_gradient = false;
  // The learned parameters are constants of the scheme's definition at their initial values
  // (ALiBi's slopes): a name alone gives them (posenc.attention(…, "alibi")), and a decoder
  // (posenc study) does not train them.
  bool parameters_fixed = false;
  // A group's learned parameters flat in parameter_shape's order, and its gradients
  // (AttentionGradients) flattened the same way. Unset: the group's score bias's — a
  // RelativeBias's parameters(), and GroupGradients::bias, which the engine fills in that order —
  // and none without one (scheme_parameters / scheme_gradients apply that rule).
  std::function<std::vector<double>(const HeadGroup&)> parameters_of{};
  std::function<std::vector<double>(const GroupGradients&)> gradients_of{};
  // The picture at positions × positions. Unset: a score bias materialised per head, zeros for a
  // group with no positional part (scheme_picture applies that rule), none for the others.
  std::function<SchemePicture(const HeadGroup&, const Positions&)> picture{};
  // What the picture does not depend on: "heads" (one matrix for every head), "head_dim", or option
  // names; `posenc table` refuses them rather than ignore them. Unset: head_dim for a relative bias
  // and none, nothing for the others (picture_ignores applies that rule).
  std::optional<std::vector<std::string>> picture_ignores{};
  // What benchmarks set beyond the defaults at a model's shape (`posenc bench attention`, `bench
  // bias`), given args with heads and head_dim and the call's key count: what a trained model of
  // the scheme holds and the defaults do not (a causal T5 table of varied values, TUPE's table
  // over every position). Unset: the defaults.
  std::function<void(SchemeArgs& args, std::int64_t keys)> bench_preset{};
  // How a decoder language model (posenc study) holds the scheme: the options of its causal form
  // given the training length (CoPE's table: train_length + 1 rows, since position 0 occurs);
  // the slices of its parameters with their initial values and reparametrisation (unset: the
  // scheme's initial parameters, learned as they are; none with parameters_fixed); and for a normaliser, whether the
  // model adds the row statistic times a learned per-head vector b_h [heads, head_dim], zero at first, to the output
  // (stick-breaking's rem·b_h, as its authors' models do). Its per-token inputs say how a decoder makes them
  // (SchemeInput::decoder_log_sigmoid).
  std::function<void(SchemeArgs& args, std::int64_t train_length)> decoder_preset{};
  std::function<std::vector<TrainedSlice>(const SchemeArgs& args, std::int64_t train_length)> training{};
  bool decoder_statistic_bias = false;
  // Test-time forms for longer contexts (see LengthVariant).
  std::vector<LengthVariant> length_variants{};
};

// Every registered scheme, in a fixed order.
const std::vector<SchemeEntry>& schemes();
// The registry as JSON, the one form that `posenc schemes --format json` prints and
// posenc.schemes() reads: [{name, aliases, family, summary, source, parameters, parameters_fixed,
// options: [{name, default, integer, description}], inputs: [{name, description, typical: [min,
// max] of a trained model's values, logit_form}], causal_only, length_variants: [{name, summary}]}].
std::string schemes_json();
// The entry of that name or alias; throws posenc::Error listing the names otherwise.
const SchemeEntry& find_scheme(std::string_view name);
// The HeadGroup of a registered scheme (options checked and completed with defaults, parameters
// checked against parameter_shape).
HeadGroup make_head_group(std::string_view name, SchemeArgs args);
// The options completed with defaults and checked, and the inputs given checked to be declared
// (what make_head_group passes to the factory, after it checks that every declared input is given).
SchemeArgs complete_scheme_args(const SchemeEntry& entry, SchemeArgs args);
// entry.parameters_of / gradients_of, or the family's rule when unset (see SchemeEntry).
std::vector<double> scheme_parameters(const SchemeEntry& entry, const HeadGroup& group);
std::vector<double> scheme_gradients(const SchemeEntry& entry, const GroupGradients& grads);
// entry.input_gradients_of (none for an entry without inputs).
std::vector<std::vector<double>> scheme_input_gradients(const SchemeEntry& entry, const GroupGradients& grads);
// entry.picture, or the rule above; throws posenc::Error naming the scheme when it has none (a
// transform, a sink or a term of per-token inputs: no matrix of positions alone).
SchemePicture scheme_picture(const SchemeEntry& entry, const HeadGroup& group, const Positions& positions);
// Whether scheme_picture gives one for this entry.
bool has_picture(const SchemeEntry& entry);
// entry.picture_ignores, or the rule above.
std::vector<std::string> picture_ignores(const SchemeEntry& entry);

}  // namespace posenc
