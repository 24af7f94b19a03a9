// The study's copy task: the layout of an example, distinct symbols, the scored positions, the
// accuracy count, and clear errors.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "copy_task.hpp"
#include "posenc/error.hpp"

namespace posenc::study {
namespace {

TEST(StudyCopyTask, LayoutAndTargets) {
  std::mt19937_64 rng(7);
  for (std::int64_t n : {std::int64_t{1}, std::int64_t{2}, std::int64_t{15}, std::int64_t{127}, kCopySymbols}) {
    const CopyBatch batch = make_copy_batch(3, n, rng);
    ASSERT_EQ(batch.inputs.sizes(), (std::vector<std::int64_t>{3, 2 * n + 2}));
    ASSERT_EQ(batch.targets.sizes(), batch.inputs.sizes());
    for (std::int64_t b = 0; b < 3; ++b) {
      const auto x = batch.inputs[b], y = batch.targets[b];
      EXPECT_EQ(x[0].item<std::int64_t>(), kCopySeparator);
      EXPECT_EQ(x[n + 1].item<std::int64_t>(), kCopySeparator);
      std::set<std::int64_t> seen;
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t s = x[1 + i].item<std::int64_t>();
        EXPECT_GE(s, 0);
        EXPECT_LT(s, kCopySymbols);
        EXPECT_TRUE(seen.insert(s).second) << "symbol " << s << " repeats (n = " << n << ")";
        EXPECT_EQ(x[n + 2 + i].item<std::int64_t>(), s);  // the copy
        EXPECT_EQ(y[n + 1 + i].item<std::int64_t>(), s);  // predicted from the token before it
      }
      for (std::int64_t t = 0; t <= n; ++t) EXPECT_EQ(y[t].item<std::int64_t>(), kIgnored) << t;
      EXPECT_EQ(y[2 * n + 1].item<std::int64_t>(), kIgnored);
      // Each target is the next input: a model reading inputs[0, t] predicts inputs[t + 1].
      for (std::int64_t t = n + 1; t <= 2 * n; ++t) EXPECT_EQ(y[t].item<std::int64_t>(), x[t + 1].item<std::int64_t>());
    }
  }
}

TEST(StudyCopyTask, SameSeedSameExamplesAndEverySymbolDrawn) {
  std::mt19937_64 a(3), b(3);
  EXPECT_TRUE(torch::equal(make_copy_batch(4, 20, a).inputs, make_copy_batch(4, 20, b).inputs));
  // Over many examples the first symbol takes every value: the draw is not stuck on a subset.
  std::set<std::int64_t> first;
  const CopyBatch many = make_copy_batch(4000, 1, a);
  for (std::int64_t i = 0; i < 4000; ++i) first.insert(many.inputs[i][1].item<std::int64_t>());
  EXPECT_EQ(static_cast<std::int64_t>(first.size()), kCopySymbols);
}

TEST(StudyCopyTask, CountsArgMaxOnScoredPositionsOnly) {
  std::mt19937_64 rng(1);
  const CopyBatch batch = make_copy_batch(2, 5, rng);
  // Logits that name every input token's successor: all scored targets right.
  auto logits = torch::zeros({2, 12, 256});
  for (std::int64_t b = 0; b < 2; ++b) {
    for (std::int64_t t = 0; t + 1 < 12; ++t) logits[b][t][batch.inputs[b][t + 1].item<std::int64_t>()] = 1.0;
  }
  EXPECT_EQ(count_correct(logits, batch.targets), (std::pair<std::int64_t, std::int64_t>{10, 10}));
  // One scored position wrong, and unscored positions changed: only the first counts.
  logits[0][6].zero_();
  logits[0][6][kCopySeparator] = 1.0;
  logits[1][0].zero_();
  EXPECT_EQ(count_correct(logits, batch.targets), (std::pair<std::int64_t, std::int64_t>{9, 10}));
}

TEST(StudyCopyTask, ClearErrors) {
  std::mt19937_64 rng(1);
  for (std::int64_t n : {std::int64_t{0}, kCopySymbols + 1}) {
    try {
      make_copy_batch(1, n, rng);
      ADD_FAILURE() << "n = " << n << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("n = " + std::to_string(n) + "; expected 1 … 255 distinct symbols"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_THROW(make_copy_batch(0, 4, rng), Error);
}

}  // namespace
}  // namespace posenc::study
