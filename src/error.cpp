#include "posenc/error.hpp"

#include <string>

namespace posenc {
namespace {

// A message is one line of text, whatever the caller passed: control bytes (a newline in a JSON
// excerpt, a name made of arbitrary bytes) are written as \n, \t or \xNN, and a value longer
// than 200 bytes is cut, saying how long it was.
void append_printable(std::string& out, std::string_view text, std::size_t limit) {
  static constexpr char kHex[] = "0123456789abcdef";
  for (std::size_t i = 0; i < text.size() && i < limit; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c == '\n') {
      out.append("\\n");
    } else if (c == '\t') {
      out.append("\\t");
    } else if (c < 0x20 || c == 0x7f) {
      out.append("\\x").push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  if (text.size() > limit) out.append("… (").append(std::to_string(text.size())).append(" bytes)");
}

std::string compose(std::string_view where, std::string_view param, std::string_view value, std::string_view expected) {
  constexpr std::size_t kAll = std::string_view::npos;
  std::string message;
  message.reserve(where.size() + param.size() + value.size() + expected.size() + 24);
  append_printable(message, where, kAll);
  message.append(": ");
  append_printable(message, param, 200);
  message.append(" = ");
  append_printable(message, value, 200);
  message.append("; expected ");
  append_printable(message, expected, kAll);
  return message;
}

}  // namespace

Error::Error(std::string_view where, std::string_view param, std::string_view value, std::string_view expected)
    : std::runtime_error(compose(where, param, value, expected)), param_(param), expected_(expected) {}

Error::Error(const std::string& message) : std::runtime_error(message) {}

}  // namespace posenc
