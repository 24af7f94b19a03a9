// The study's corpus loader: Brown's tags stripped, UTF-8 checked, deterministic splits, clear
// errors for bad paths, empty files and bytes that are not UTF-8.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <unistd.h>

#include "corpus.hpp"
#include "posenc/error.hpp"

namespace posenc::study {
namespace {

namespace fs = std::filesystem;

fs::path temp_dir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("posenc_study_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void write(const fs::path& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(StudyCorpus, StripsBrownTags) {
  const std::string tagged =
      "\n\n\tThe/at jury/nn said/vbd ``/`` no/at evidence/nn ''/'' ,/, and/cc (/( it/pps )/) ended/vbd ./.\n\n"
      "\tIt's/pps+bez over/rp ;/. done/vbn ?/.\n";
  EXPECT_EQ(strip_brown_tags(tagged), "The jury said \"no evidence\", and (it) ended.\nIt's over; done?\n");
}

TEST(StudyCorpus, FindsTheFirstByteThatIsNotUtf8) {
  EXPECT_EQ(first_invalid_utf8("plain ascii"), -1);
  EXPECT_EQ(first_invalid_utf8("caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80"), -1);  // é € 😀
  EXPECT_EQ(first_invalid_utf8("ab\xFF"), 2);                                      // never in UTF-8
  EXPECT_EQ(first_invalid_utf8("a\xC0\xAF"), 1);                                   // overlong '/'
  EXPECT_EQ(first_invalid_utf8("x\xED\xA0\x80"), 1);                               // a surrogate
  EXPECT_EQ(first_invalid_utf8("xy\xE2\x82"), 2);                                  // truncated
  EXPECT_EQ(first_invalid_utf8("\xC3("), 0);                                       // bad continuation
}

TEST(StudyCorpus, SplitsATextFileAtTheLastTenthOnALineStart) {
  const fs::path dir = temp_dir("file");
  std::string text;
  for (int line = 0; line < 100; ++line) text += "line " + std::to_string(line) + " of the corpus\n";
  write(dir / "text.txt", text);
  const Corpus c = load_corpus((dir / "text.txt").string());
  EXPECT_EQ(c.train.size() + c.validation.size(), text.size());
  EXPECT_GE(c.validation.size(), text.size() / 10 - 30);
  EXPECT_EQ(c.train.back(), '\n');  // cut after a line
  EXPECT_EQ(std::string(c.validation.begin(), c.validation.begin() + 5), "line ");
  fs::remove_all(dir);
}

TEST(StudyCorpus, HoldsOutEveryTenthBrownFile) {
  const fs::path dir = temp_dir("brown");
  for (int f = 1; f <= 20; ++f) {
    char name[8], text[32];
    std::snprintf(name, sizeof name, "c%c%02d", f <= 10 ? 'a' : 'b', (f - 1) % 10 + 1);
    std::snprintf(text, sizeof text, "\tword%d/nn ./.\n", f);
    write(dir / name, text);
  }
  write(dir / "package.json", "{}");  // not a corpus file: ignored
  const Corpus c = load_corpus(dir.string());
  EXPECT_EQ(std::string(c.validation.begin(), c.validation.end()), "word10.\nword20.\n");
  EXPECT_EQ(std::string(c.train.begin(), c.train.begin() + 7), "word1.\n");
  EXPECT_NE(c.source.find("20 files"), std::string::npos);
  fs::remove_all(dir);
}

TEST(StudyCorpus, ClearErrors) {
  const fs::path dir = temp_dir("errors");
  const std::string missing = error_of([&] { load_corpus((dir / "missing.txt").string()); });
  EXPECT_NE(missing.find("missing.txt"), std::string::npos) << missing;
  EXPECT_NE(missing.find("an existing file or Brown Corpus directory"), std::string::npos) << missing;
  write(dir / "empty.txt", "");
  const std::string empty = error_of([&] { load_corpus((dir / "empty.txt").string()); });
  EXPECT_NE(empty.find("a non-empty text file"), std::string::npos) << empty;
  write(dir / "latin1.txt", "na\xEFve caf\xE9\n");
  const std::string latin1 = error_of([&] { load_corpus((dir / "latin1.txt").string()); });
  EXPECT_NE(latin1.find("UTF-8 text (byte 2 is not)"), std::string::npos) << latin1;
  fs::create_directories(dir / "not-brown");
  write(dir / "not-brown" / "notes.txt", "text");
  const std::string not_brown = error_of([&] { load_corpus((dir / "not-brown").string()); });
  EXPECT_NE(not_brown.find("a Brown Corpus directory"), std::string::npos) << not_brown;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace posenc::study
