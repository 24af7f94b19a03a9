// The command line, in process: any arguments to the commands that neither write files nor time
// the machine (tour, table, rope-freqs, alibi-slopes, t5-buckets, schemes). Each run ends with
// status 0, 1 (an error) or 2 (a usage error), never a crash, a hang or an uncaught exception.
// The input is the arguments separated by NUL bytes.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "commands.hpp"
#include "fuzzing.hpp"

using namespace posenc;

namespace {

// Output goes nowhere: printing is not what is tested, and a fuzzer prints millions of tables.
class Silenced {
 public:
  Silenced() {
    std::fflush(stdout);
    std::fflush(stderr);
    out_ = dup(1);
    err_ = dup(2);
    const int null = open("/dev/null", O_WRONLY);
    dup2(null, 1);
    dup2(null, 2);
    close(null);
  }
  ~Silenced() {
    std::fflush(stdout);
    std::fflush(stderr);
    dup2(out_, 1);
    dup2(err_, 2);
    close(out_);
    close(err_);
  }
  Silenced(const Silenced&) = delete;
  Silenced& operator=(const Silenced&) = delete;

 private:
  int out_, err_;
};

bool allowed(std::string_view command) {
  for (const char* c : {"tour", "table", "rope-freqs", "alibi-slopes", "t5-buckets", "schemes"}) {
    if (command == c) return true;
  }
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // Tables are bounded by the allocation limit; 4 MiB keeps the largest one printable in a moment.
  fuzz::set_up(std::int64_t{4} << 20);
  std::vector<std::string> args = {"posenc"};
  std::string arg;
  for (std::size_t i = 0; i <= size && args.size() <= 24; ++i) {
    if (i == size || data[i] == 0) {
      args.push_back(arg);
      arg.clear();
    } else if (arg.size() < 64) {
      arg.push_back(static_cast<char>(data[i]));
    }
  }
  // The first word that is not a global option must be a permitted command; no path may name a
  // directory, so that no file outside the working directory is read.
  std::size_t first = 1;
  while (first < args.size() && args[first].rfind("--target", 0) == 0) first += args[first] == "--target" ? 2 : 1;
  if (first >= args.size() || !allowed(args[first])) return 0;
  for (const std::string& a : args) {
    if (a.find('/') != std::string::npos) return 0;
  }
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  int status;
  {
    const Silenced quiet;
    status = cli::run(static_cast<int>(argv.size()), argv.data());
  }
  set_target("auto");
  fuzz::require(status == 0 || status == 1 || status == 2, "exit status " + std::to_string(status));
  return 0;
}
