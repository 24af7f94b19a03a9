// How posenc's programs end: --help and --version exit 0; a usage error (an unknown option, a
// value CLI11 cannot read, or a posenc::Error naming a command-line flag) prints one line and
// exits 2; any other error prints one line and exits 1. Never an uncaught exception or CLI11's
// own exit codes (104–109), whose meanings nobody scripts against.
#pragma once

#include <fmt/core.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <new>
#include <string_view>

#include "posenc/error.hpp"

namespace posenc::cli {

// A posenc::Error about a flag ("--heads", "--to − --from") is the caller's usage error.
inline bool names_flag(const Error& e) { return std::string_view(e.param()).substr(0, 2) == "--"; }

// CLI11's parse, ending the program as above. Returns -1 when the program should go on.
inline int parse_or_exit(CLI::App& app, int argc, char** argv, const char* program) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    fmt::print(stderr, "{}: {}\n", program, e.what());
    return 2;
  } catch (const Error& e) {  // an option's own check, run while parsing
    fmt::print(stderr, "{}: {}\n", program, e.what());
    return 2;
  }
  return -1;
}

// Runs the program's work, ending it as above.
template <class Work>
int run_or_exit(const char* program, Work&& work) {
  try {
    work();
    return 0;
  } catch (const Error& e) {
    std::fflush(stdout);
    fmt::print(stderr, "{}: {}\n", program, e.what());
    return names_flag(e) ? 2 : 1;
  } catch (const std::bad_alloc&) {
    std::fflush(stdout);
    fmt::print(stderr, "{}: out of memory (an allocation the system refused; smaller sizes, or fewer threads)\n",
               program);
    return 1;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    fmt::print(stderr, "{}: {}\n", program, e.what());
    return 1;
  }
}

}  // namespace posenc::cli
