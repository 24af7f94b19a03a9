// The study's second synthetic task: associative recall, after multi-query associative recall
// (Arora et al. 2023, Zoology): find the value of a key seen earlier. Where the copy task's answer
// always sits n + 1 tokens back (a position-only shortcut fits every training length), here each
// answer sits at a distance set by a random query order: only a lookup by content solves it.
//
// One example with n pairs (n distinct keys from 0 … 127, values drawn independently from
// 128 … 254; 255 is the separator), queried in a random order π:
//
//   position  0  1   …  2n−2 2n−1   2n    2n+1  2n+2   …  4n−1   4n
//   input     k1 v1  …  kn   vn     SEP   kπ1   vπ1    …  kπn    vπn
//   target    ·  ·   …  ·    ·      ·     vπ1   ·      …  vπn    ·      (· = not scored)
//
// After a query key the model must name its value. An example of nominal length E holds
// n = ⌊(E − 1)/4⌋ pairs (4n + 1 ≤ E tokens; 16·32 = 512 gives 127 pairs, all but one key).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <random>

#include "copy_task.hpp"

namespace posenc::study {

inline constexpr std::int64_t kRetrievalKeys = 128;    // keys 0 … 127
inline constexpr std::int64_t kRetrievalValues = 127;  // values 128 … 254
inline constexpr std::int64_t kRetrievalSeparator = 255;

// `batch` examples of n pairs each; throws posenc::Error unless 1 ≤ n ≤ kRetrievalKeys and
// batch ≥ 1. Targets are kIgnored where not scored (count_correct in copy_task.hpp scores them).
CopyBatch make_retrieval_batch(std::int64_t batch, std::int64_t n, std::mt19937_64& rng);

// The number of pairs an example of nominal length e holds: ⌊(e − 1)/4⌋.
inline std::int64_t retrieval_pairs(std::int64_t e) { return (e - 1) / 4; }

}  // namespace posenc::study
