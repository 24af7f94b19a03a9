#include "posenc/error.hpp"

#include <string>

namespace posenc {
namespace {

std::string compose(std::string_view where, std::string_view param, std::string_view value, std::string_view expected) {
  std::string message;
  message.reserve(where.size() + param.size() + value.size() + expected.size() + 24);
  message.append(where).append(": ").append(param).append(" = ").append(value);
  message.append("; expected ").append(expected);
  return message;
}

}  // namespace

Error::Error(std::string_view where, std::string_view param, std::string_view value, std::string_view expected)
    : std::runtime_error(compose(where, param, value, expected)), param_(param) {}

Error::Error(const std::string& message) : std::runtime_error(message) {}

}  // namespace posenc
