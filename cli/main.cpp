// posenc — the command-line tool. Errors: one line on stderr, exit status 1 (2 for usage).
#include <fmt/core.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "commands.hpp"

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
  return posenc::cli::run(argc, argv);
}
