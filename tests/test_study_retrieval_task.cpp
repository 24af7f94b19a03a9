// The study's retrieval task: the layout of an example, distinct keys, every query answered by the
// value its key was paired with, a query order that is a real permutation, and clear errors.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>

#include "posenc/error.hpp"
#include "retrieval_task.hpp"

namespace posenc::study {
namespace {

std::int64_t at(const torch::Tensor& t, std::int64_t i) { return t[i].item<std::int64_t>(); }

TEST(StudyRetrievalTask, LayoutAndTargets) {
  std::mt19937_64 rng(7);
  for (std::int64_t n : {std::int64_t{1}, std::int64_t{2}, std::int64_t{7}, std::int64_t{63}, kRetrievalKeys}) {
    const CopyBatch batch = make_retrieval_batch(3, n, rng);
    ASSERT_EQ(batch.inputs.sizes(), (std::vector<std::int64_t>{3, 4 * n + 1}));
    ASSERT_EQ(batch.targets.sizes(), batch.inputs.sizes());
    for (std::int64_t b = 0; b < 3; ++b) {
      const auto x = batch.inputs[b], y = batch.targets[b];
      std::map<std::int64_t, std::int64_t> value_of;
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t k = at(x, 2 * i), v = at(x, 2 * i + 1);
        EXPECT_GE(k, 0);
        EXPECT_LT(k, kRetrievalKeys);
        EXPECT_GE(v, kRetrievalKeys);
        EXPECT_LT(v, kRetrievalKeys + kRetrievalValues);
        EXPECT_TRUE(value_of.emplace(k, v).second) << "key " << k << " repeats (n = " << n << ")";
        EXPECT_EQ(at(y, 2 * i), kIgnored);
        EXPECT_EQ(at(y, 2 * i + 1), kIgnored);
      }
      EXPECT_EQ(at(x, 2 * n), kRetrievalSeparator);
      EXPECT_EQ(at(y, 2 * n), kIgnored);
      std::set<std::int64_t> queried;
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t q = at(x, 2 * n + 1 + 2 * i);
        ASSERT_EQ(value_of.count(q), 1u) << "query " << q << " was never paired";
        EXPECT_TRUE(queried.insert(q).second) << "key " << q << " queried twice";
        // Scored after the query; the answer is also the next input (teacher forcing).
        EXPECT_EQ(at(y, 2 * n + 1 + 2 * i), value_of[q]);
        EXPECT_EQ(at(x, 2 * n + 2 + 2 * i), value_of[q]);
        EXPECT_EQ(at(y, 2 * n + 2 + 2 * i), kIgnored);
      }
    }
  }
}

// The query order is a uniform permutation, not the pairs' order: over many examples of 8 pairs
// the first query is each of the 8 keys about equally often, so an answer's distance varies.
TEST(StudyRetrievalTask, QueriesInRandomOrderAndEveryKeyAndValueDrawn) {
  std::mt19937_64 rng(3);
  const std::int64_t n = 8, examples = 8000;
  const CopyBatch batch = make_retrieval_batch(examples, n, rng);
  std::vector<std::int64_t> first_is_pair(n, 0);
  std::set<std::int64_t> keys, values;
  for (std::int64_t b = 0; b < examples; ++b) {
    const auto x = batch.inputs[b];
    for (std::int64_t i = 0; i < n; ++i) {
      keys.insert(at(x, 2 * i));
      values.insert(at(x, 2 * i + 1));
      if (at(x, 2 * i) == at(x, 2 * n + 1)) ++first_is_pair[static_cast<std::size_t>(i)];
    }
  }
  // 1000 expected per pair; a binomial's standard deviation is 30, so 850 … 1150 is 5σ.
  for (std::int64_t i = 0; i < n; ++i) {
    EXPECT_GT(first_is_pair[static_cast<std::size_t>(i)], 850) << i;
    EXPECT_LT(first_is_pair[static_cast<std::size_t>(i)], 1150) << i;
  }
  EXPECT_EQ(static_cast<std::int64_t>(keys.size()), kRetrievalKeys);
  EXPECT_EQ(static_cast<std::int64_t>(values.size()), kRetrievalValues);
  std::mt19937_64 a(5), b(5);
  EXPECT_TRUE(torch::equal(make_retrieval_batch(4, 20, a).inputs, make_retrieval_batch(4, 20, b).inputs));
}

TEST(StudyRetrievalTask, PairsPerLength) {
  EXPECT_EQ(retrieval_pairs(32), 7);     // 29 tokens
  EXPECT_EQ(retrieval_pairs(512), 127);  // 509 tokens
  EXPECT_EQ(retrieval_pairs(16), 3);
}

TEST(StudyRetrievalTask, ClearErrors) {
  std::mt19937_64 rng(1);
  for (std::int64_t n : {std::int64_t{0}, kRetrievalKeys + 1}) {
    try {
      make_retrieval_batch(1, n, rng);
      ADD_FAILURE() << "n = " << n << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("n = " + std::to_string(n) + "; expected 1 … 128 pairs"), std::string::npos)
          << e.what();
    }
  }
  EXPECT_THROW(make_retrieval_batch(0, 4, rng), Error);
}

}  // namespace
}  // namespace posenc::study
