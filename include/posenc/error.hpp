// posenc/error.hpp — the one exception type of posenc.
//
// Contract: every public function validates its arguments before it touches memory. Bad input
// throws posenc::Error whose message names where it happened, the parameter, the value it had
// and what was expected, e.g.
//
//   sinusoidal: dim = 7; expected an even number >= 2
//
// No public function asserts, clamps silently or has undefined behaviour on bad input.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace posenc {

class Error : public std::runtime_error {
 public:
  Error(std::string_view where, std::string_view param, std::string_view value, std::string_view expected);
  // A message that does not fit the parameter/value/expected pattern (e.g. an I/O failure).
  explicit Error(const std::string& message);

  const std::string& param() const noexcept { return param_; }
  // What was expected of the parameter (empty for a message-only error): a caller that knows the
  // parameter by another name (a command-line flag) can say it again in its own terms.
  const std::string& expected() const noexcept { return expected_; }

 private:
  std::string param_;
  std::string expected_;
};

}  // namespace posenc
