#include "corpus.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "posenc/error.hpp"

namespace posenc::study {
namespace {

constexpr const char* kWhere = "corpus";

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(kWhere, "path", path.string(), "a readable file");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// A Brown file: tokens "word/tag" separated by spaces, paragraphs separated by blank lines.
bool is_closing(const std::string& word) {
  return word == "." || word == "," || word == ";" || word == ":" || word == "?" || word == "!" || word == ")" ||
         word == "''" || word == "'s" || word == "n't";
}

}  // namespace

std::string strip_brown_tags(const std::string& tagged) {
  std::string out;
  std::istringstream lines(tagged);
  std::string line;
  bool open_quote = false;
  while (std::getline(lines, line)) {
    std::istringstream tokens(line);
    std::string token, text;
    bool attach_next = false;  // after an opening quote or bracket
    while (tokens >> token) {
      const auto slash = token.rfind('/');
      std::string word = slash == std::string::npos || slash == 0 ? token : token.substr(0, slash);
      const bool closing = is_closing(word);
      if (word == "``") {
        word = "\"";
        open_quote = true;
      } else if (word == "''") {
        word = "\"";
        open_quote = false;
      }
      if (!text.empty() && !closing && !attach_next) text += ' ';
      text += word;
      attach_next = word == "\"" ? open_quote : word == "(";
    }
    if (!text.empty()) out += text + '\n';
  }
  return out;
}

std::int64_t first_invalid_utf8(const std::string& text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const std::size_t n = text.size();
  for (std::size_t i = 0; i < n;) {
    const unsigned c = s[i];
    std::size_t len = 0;
    std::uint32_t code = 0, min = 0;
    if (c < 0x80) {
      ++i;
      continue;
    }
    if ((c & 0xE0) == 0xC0) {
      len = 2, code = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, code = c & 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, code = c & 0x07, min = 0x10000;
    } else {
      return static_cast<std::int64_t>(i);
    }
    if (i + len > n) return static_cast<std::int64_t>(i);
    for (std::size_t k = 1; k < len; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) return static_cast<std::int64_t>(i);
      code = (code << 6) | (s[i + k] & 0x3F);
    }
    if (code < min || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) return static_cast<std::int64_t>(i);
    i += len;
  }
  return -1;
}

Corpus load_corpus(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (ec || !fs::exists(status)) throw Error(kWhere, "path", path, "an existing file or Brown Corpus directory");
  Corpus corpus;
  const auto append = [](std::vector<std::uint8_t>& to, const std::string& text) {
    to.insert(to.end(), text.begin(), text.end());
  };
  const auto check_utf8 = [&](const std::string& text, const std::string& name) {
    if (const std::int64_t bad = first_invalid_utf8(text); bad >= 0) {
      throw Error(kWhere, "path", name, "UTF-8 text (byte " + std::to_string(bad) + " is not)");
    }
  };
  if (fs::is_directory(status)) {
    // Brown: its 500 text files are named by category letter and number (ca01 … cr09).
    std::vector<fs::path> files;
    for (const auto& entry : fs::directory_iterator(path)) {
      const std::string name = entry.path().filename().string();
      if (entry.is_regular_file() && name.size() == 4 && name[0] == 'c' &&
          std::isalpha(static_cast<unsigned char>(name[1])) && std::isdigit(static_cast<unsigned char>(name[2])) &&
          std::isdigit(static_cast<unsigned char>(name[3]))) {
        files.push_back(entry.path());
      }
    }
    std::sort(files.begin(), files.end());
    if (files.empty()) throw Error(kWhere, "path", path, "a Brown Corpus directory (files ca01 … cr09)");
    for (std::size_t f = 0; f < files.size(); ++f) {
      const std::string raw = read_file(files[f]);
      check_utf8(raw, files[f].string());
      append(f % 10 == 9 ? corpus.validation : corpus.train, strip_brown_tags(raw));
    }
    corpus.source = "Brown Corpus (" + std::to_string(files.size()) + " files, " + path + ")";
  } else {
    const std::string text = read_file(path);
    check_utf8(text, path);
    if (text.empty()) throw Error(kWhere, "path", path, "a non-empty text file");
    std::size_t cut = text.size() - text.size() / 10;
    const std::size_t line = text.find('\n', cut);
    if (line != std::string::npos && line - cut < 4096) cut = line + 1;
    corpus.train.assign(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(cut));
    corpus.validation.assign(text.begin() + static_cast<std::ptrdiff_t>(cut), text.end());
    corpus.source = path;
  }
  if (corpus.train.empty()) throw Error(kWhere, "path", path, "a non-empty corpus");
  return corpus;
}

}  // namespace posenc::study
