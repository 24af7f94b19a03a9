// posenc alibi-slopes --heads H [--max-bias B]
// posenc t5-buckets [--num-buckets N] [--max-distance M] [--causal] --from A --to B
// Both print a JSON list: the slopes of heads 0 … H−1, or the buckets of relative positions
// (key − query) A … B as Hugging Face transformers computes them.
#include <fmt/core.h>

#include <nlohmann/json.hpp>
#include <string>

#include "commands.hpp"
#include "posenc/posenc.hpp"

namespace posenc::cli {

Runner add_alibi_slopes(CLI::App& app) {
  struct Options {
    std::int64_t heads = 8;
    double max_bias = 8.0;
  };
  auto o = std::make_shared<Options>();
  CLI::App* sub = app.add_subcommand("alibi-slopes", "Print the ALiBi slopes of H heads (Press et al.) as a JSON list");
  sub->add_option("--heads,-H", o->heads, "Number of heads")->capture_default_str();
  sub->add_option("--max-bias", o->max_bias, "Largest bias exponent (8 in the paper; llama.cpp's max_bias)")
      ->capture_default_str();
  return [o] { fmt::print("{}\n", nlohmann::json(alibi_slopes(o->heads, o->max_bias)).dump()); };
}

Runner add_t5_buckets(CLI::App& app) {
  struct Options {
    std::int64_t num_buckets = 32, max_distance = 128, from = -8, to = 8;
    bool causal = false;
  };
  auto o = std::make_shared<Options>();
  CLI::App* sub = app.add_subcommand(
      "t5-buckets", "Print T5 relative-position buckets (transformers' _relative_position_bucket) as a JSON list");
  sub->add_option("--num-buckets", o->num_buckets, "Number of buckets")->capture_default_str();
  sub->add_option("--max-distance", o->max_distance, "Distance where the last bucket starts")->capture_default_str();
  sub->add_flag("--causal", o->causal, "Unidirectional buckets (decoder); default bidirectional");
  sub->add_option("--from", o->from, "First relative position (key − query)")->capture_default_str();
  sub->add_option("--to", o->to, "Last relative position")->capture_default_str();
  return [o] {
    if (o->to < o->from)
      throw Error("t5-buckets", "--to", std::to_string(o->to), ">= --from = " + std::to_string(o->from));
    constexpr std::int64_t kMaxCount = std::int64_t{1} << 26;
    std::int64_t span = 0;
    if (__builtin_sub_overflow(o->to, o->from, &span) || span >= kMaxCount) {
      throw Error("t5-buckets", "--to − --from", std::to_string(o->to) + " − " + std::to_string(o->from),
                  "< 2^26 (the list is printed)");
    }
    nlohmann::json list = nlohmann::json::array();
    // By count, not `r <= to`: r would pass 2^63 − 1 when --to is that.
    for (std::int64_t n = 0; n <= span; ++n)
      list.push_back(t5_bucket(o->from + n, o->num_buckets, o->max_distance, !o->causal));
    fmt::print("{}\n", list.dump());
  };
}

}  // namespace posenc::cli
