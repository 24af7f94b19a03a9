// How posenc's programs end: --help and --version exit 0; a usage error (an unknown option, a
// value CLI11 cannot read, or a posenc::Error naming a command-line flag) prints one line and
// exits 2; any other error prints one line and exits 1. Never an uncaught exception or CLI11's
// own exit codes (104–109), whose meanings nobody scripts against.
#pragma once

#include <fmt/core.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <string>
#include <exception>
#include <new>
#include <string_view>

#include "posenc/error.hpp"

namespace posenc::cli {

// A posenc::Error about a flag ("--heads", "--to − --from") is the caller's usage error.
inline bool names_flag(const Error& e) { return std::string_view(e.param()).substr(0, 2) == "--"; }

// CLI11 reads an integer option with strtoll's base 0 (010 is 8, 0x10 is 16), saturates past
// int64's range (99999999999999999999 reads as 2^63 − 1) and wraps a negative unsigned (--seed -1
// is 2^64 − 1). Every integer option of `app` and its subcommands reads decimal digits instead
// (as --set does), and refuses the others naming the value.
inline void strict_integer_options(CLI::App& app) {
  for (CLI::Option* opt : app.get_options()) {
    const std::string type = opt->get_type_name();
    const bool is_unsigned = type.rfind("UINT", 0) == 0;
    if (type.rfind("INT", 0) != 0 && !is_unsigned) continue;
    opt->transform(CLI::Validator(
        [is_unsigned](std::string& text) -> std::string {
          const std::size_t sign = !text.empty() && (text[0] == '+' || text[0] == '-') ? 1 : 0;
          const std::string_view digits = std::string_view(text).substr(sign);
          if (digits.empty() || digits.find_first_not_of("0123456789") != std::string_view::npos)
            return text + " is not a decimal integer; expected digits with an optional sign";
          std::int64_t value = 0;
          const auto [at, ec] =
              std::from_chars(text.data() + (text[0] == '+' ? 1 : 0), text.data() + text.size(), value);
          if (ec == std::errc::result_out_of_range) {
            return text + " is past int64; expected an integer in " + (is_unsigned ? "[0, 2^63)" : "[-2^63, 2^63)");
          }
          if (is_unsigned && value < 0) return text + " is negative; expected an integer >= 0";
          // Leading zeros dropped, so CLI11's base-0 read sees the decimal number.
          const std::size_t first = std::min(digits.find_first_not_of('0'), digits.size() - 1);
          text = std::string(text.substr(0, sign)) + std::string(digits.substr(first));
          return {};
        },
        "", "int64"));
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) strict_integer_options(*sub);
}

// CLI11's parse, ending the program as above. Returns -1 when the program should go on.
inline int parse_or_exit(CLI::App& app, int argc, char** argv, const char* program) {
  // An unknown command word: name it and the commands (CLI11 would only say one is required).
  const auto commands = app.get_subcommands([](CLI::App*) { return true; });
  const auto known = [&](const char* word) {
    for (const CLI::App* c : commands) {
      if (c->check_name(word)) return true;
    }
    return false;
  };
  if (argc >= 2 && argv[1][0] != '-' && !commands.empty() && !known(argv[1])) {
    std::string names;
    for (const CLI::App* c : commands) names += (names.empty() ? "" : ", ") + c->get_name();
    fmt::print(stderr, "{}: command = {}; expected one of {}\n", program, argv[1], names);
    return 2;
  }
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
