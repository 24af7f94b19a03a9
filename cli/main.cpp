// posenc — the command-line tool. Errors: one line on stderr, exit status 1 (2 for usage).
#include <fmt/core.h>

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "commands.hpp"
#include "usage.hpp"
#include "posenc/posenc.hpp"

namespace {

// `posenc study …` runs posenc-study (built with the PyTorch extension, next to this program)
// with the same arguments: the study needs libtorch, which the command itself does not link.
int run_study(int argc, char** argv) {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::canonical("/proc/self/exe", ec);
  const std::filesystem::path study = (ec ? std::filesystem::path(argv[0]) : self).parent_path() / "posenc-study";
  std::vector<char*> args;
  std::string name = study.string();
  args.push_back(name.data());
  for (int i = 2; i < argc; ++i) args.push_back(argv[i]);
  args.push_back(nullptr);
  execv(name.c_str(), args.data());
  fmt::print(stderr,
             "posenc: study = {}; expected the study program built beside posenc (configure with "
             "-DPOSENC_BUILD_TORCH=ON, as scripts/main.sh does)\n",
             name);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::string_view(argv[1]) == "study") return run_study(argc, argv);
  CLI::App app{"posenc: positional encodings for transformers — exact, fast, trainable on the CPU"};
  app.set_version_flag("--version", std::string("posenc ") + std::string(posenc::version()));
  app.require_subcommand(1);
  std::string target = "auto";
  app.add_option("--target", target, "Kernel target: auto, avx512, avx2, sse4, scalar or ref (fp64 reference)")
      ->envname("POSENC_TARGET");

  posenc::cli::Runner tour = posenc::cli::add_tour(app);
  posenc::cli::Runner table = posenc::cli::add_table(app);
  posenc::cli::Runner bench = posenc::cli::add_bench(app);
  posenc::cli::Runner rope_freqs = posenc::cli::add_rope_freqs(app);
  posenc::cli::Runner alibi_slopes = posenc::cli::add_alibi_slopes(app);
  posenc::cli::Runner t5_buckets = posenc::cli::add_t5_buckets(app);
  posenc::cli::Runner plot = posenc::cli::add_plot(app);
  posenc::cli::Runner schemes = posenc::cli::add_schemes(app);
  // Listed for --help; handled before parsing (run_study).
  app.add_subcommand("study",
                     "The length-extrapolation study: trains small language models per positional scheme at L "
                     "and measures them at L … 16L (posenc study --help)")
      ->allow_extras();

  if (const int status = posenc::cli::parse_or_exit(app, argc, argv, "posenc"); status >= 0) return status;
  return posenc::cli::run_or_exit("posenc", [&] {
    posenc::set_target(target);
    for (CLI::App* sub : app.get_subcommands()) {
      if (sub->get_name() == "tour") tour();
      if (sub->get_name() == "table") table();
      if (sub->get_name() == "bench") bench();
      if (sub->get_name() == "rope-freqs") rope_freqs();
      if (sub->get_name() == "alibi-slopes") alibi_slopes();
      if (sub->get_name() == "t5-buckets") t5_buckets();
      if (sub->get_name() == "plot") plot();
      if (sub->get_name() == "schemes") schemes();
    }
  });
}
