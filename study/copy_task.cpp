#include "copy_task.hpp"

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "posenc/error.hpp"

namespace posenc::study {

void draw_distinct(std::vector<std::int64_t>& pool, std::int64_t n, std::mt19937_64& rng) {
  const auto size = static_cast<std::int64_t>(pool.size());
  for (std::int64_t i = 0; i < n; ++i) {
    const auto j = i + static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(size - i));
    std::swap(pool[static_cast<std::size_t>(i)], pool[static_cast<std::size_t>(j)]);
  }
}

CopyBatch make_copy_batch(std::int64_t batch, std::int64_t n, std::mt19937_64& rng) {
  if (n < 1 || n > kCopySymbols) {
    throw Error("study copy task", "n", std::to_string(n), "1 … " + std::to_string(kCopySymbols) + " distinct symbols");
  }
  if (batch < 1) throw Error("study copy task", "batch", std::to_string(batch), "at least 1");
  const std::int64_t length = 2 * n + 2;
  auto inputs = torch::empty({batch, length}, torch::kInt64);
  auto targets = torch::full({batch, length}, kIgnored, torch::kInt64);
  auto* in = inputs.data_ptr<std::int64_t>();
  auto* tg = targets.data_ptr<std::int64_t>();
  std::vector<std::int64_t> symbols(static_cast<std::size_t>(kCopySymbols));
  for (std::int64_t b = 0; b < batch; ++b) {
    std::iota(symbols.begin(), symbols.end(), std::int64_t{0});
    draw_distinct(symbols, n, rng);
    std::int64_t* x = in + b * length;
    std::int64_t* y = tg + b * length;
    x[0] = x[n + 1] = kCopySeparator;
    for (std::int64_t i = 0; i < n; ++i) {
      x[1 + i] = x[n + 2 + i] = symbols[static_cast<std::size_t>(i)];
      y[n + 1 + i] = symbols[static_cast<std::size_t>(i)];  // the input at n + 2 + i
    }
  }
  return {inputs, targets};
}

std::pair<std::int64_t, std::int64_t> count_correct(const torch::Tensor& logits, const torch::Tensor& targets) {
  const torch::Tensor scored = targets.ne(kIgnored);
  const torch::Tensor right = logits.argmax(-1).eq(targets).logical_and(scored);
  return {right.sum().item<std::int64_t>(), scored.sum().item<std::int64_t>()};
}

}  // namespace posenc::study
