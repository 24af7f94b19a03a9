// The command line as a function: everything `posenc` does except `study` (a separate program),
// callable in process by main() and by the command-line fuzzer (fuzz/fuzz_cli.cpp).
#include <CLI/CLI.hpp>
#include <string>

#include "commands.hpp"
#include "posenc/posenc.hpp"
#include "usage.hpp"

namespace posenc::cli {

int run(int argc, char** argv) {
  CLI::App app{"posenc: positional encodings for transformers — exact, fast, trainable on the CPU"};
  app.set_version_flag("--version", std::string("posenc ") + std::string(posenc::version()));
  app.require_subcommand(1);
  std::string target = "auto";
  app.add_option("--target", target, "Kernel target: auto, avx512, avx2, sse4, scalar or ref (fp64 reference)")
      ->envname("POSENC_TARGET");

  const Runner tour = add_tour(app);
  const Runner table = add_table(app);
  const Runner bench = add_bench(app);
  const Runner rope_freqs = add_rope_freqs(app);
  const Runner alibi_slopes = add_alibi_slopes(app);
  const Runner t5_buckets = add_t5_buckets(app);
  const Runner plot = add_plot(app);
  const Runner schemes = add_schemes(app);
  // Listed for --help; main() hands it to posenc-study before parsing.
  app.add_subcommand("study",
                     "The length-extrapolation study: trains small language models per positional scheme at L "
                     "and measures them at L … 16L (posenc study --help)")
      ->allow_extras();

  strict_integer_options(app);
  if (const int status = parse_or_exit(app, argc, argv, "posenc"); status >= 0) return status;
  return run_or_exit("posenc", [&] {
    set_target(target);
    for (CLI::App* sub : app.get_subcommands()) {
      if (sub->get_name() == "tour") tour();
      if (sub->get_name() == "table") table();
      if (sub->get_name() == "bench") bench();
      if (sub->get_name() == "rope-freqs") rope_freqs();
      if (sub->get_name() == "alibi-slopes") alibi_slopes();
      if (sub->get_name() == "t5-buckets") t5_buckets();
      if (sub->get_name() == "plot") plot();
      if (sub->get_name() == "schemes") schemes();
      if (sub->get_name() == "study")
        throw Error("posenc", "command", "study", "a command run in process (the study is the program posenc-study)");
    }
  });
}

}  // namespace posenc::cli
