// The study's first synthetic task: copying a sequence of distinct symbols, a task that perplexity
// cannot fake — a model either retrieves the token it saw n + 1 positions back or it does not.
//
// One example of nominal length E (n = E/2 − 1 symbols, drawn without repetition from the byte
// values 0 … 254; 255 is the separator):
//
//   position  0    1 … n        n+1   n+2 … 2n+1
//   input     SEP  s1 … sn      SEP   s1  … sn
//   target    ·    · … ·        s1    s2  … ·       (· = not scored: kIgnored)
//
// The second half is scored: after the separator the model must name s1, after s_i it must name
// s_(i+1). Since no symbol repeats, the answer is fixed by content (find the previous occurrence
// of the current token, take its successor) or by position (look n + 1 tokens back); only the
// first generalises when n grows past anything seen in training. Training draws n uniformly from
// [2, L/2 − 1] per batch (lengths 6 … L); evaluation at E = L … 16L uses n = E/2 − 1 (so 16L ≤ 512:
// 255 distinct symbols).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <random>
#include <vector>

namespace posenc::study {

inline constexpr std::int64_t kCopySeparator = 255;
inline constexpr std::int64_t kCopySymbols = 255;  // 0 … 254
inline constexpr std::int64_t kIgnored = -100;     // torch's cross_entropy default ignore_index

// A batch of a synthetic task (this one's examples are 2n + 2 long, retrieval_task.hpp's 4n + 1).
struct CopyBatch {
  torch::Tensor inputs;   // [batch, length] int64
  torch::Tensor targets;  // [batch, length] int64, kIgnored where not scored
};

// `batch` examples with n symbols each; throws posenc::Error unless 1 ≤ n ≤ kCopySymbols and
// batch ≥ 1.
CopyBatch make_copy_batch(std::int64_t batch, std::int64_t n, std::mt19937_64& rng);

// Puts n distinct entries of `pool`, drawn uniformly, at its front: the first n steps of a
// Fisher–Yates shuffle, written out rather than std::shuffle so that the draw is the same with
// every standard library. Both synthetic tasks draw their symbols and keys with it.
void draw_distinct(std::vector<std::int64_t>& pool, std::int64_t n, std::mt19937_64& rng);

// The number of scored targets whose arg-max logit is right, and the number scored: logits
// [batch, S, vocab], targets [batch, S].
std::pair<std::int64_t, std::int64_t> count_correct(const torch::Tensor& logits, const torch::Tensor& targets);

}  // namespace posenc::study
