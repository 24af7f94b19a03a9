#include "retrieval_task.hpp"

#include <numeric>
#include <string>
#include <vector>

#include "posenc/error.hpp"

namespace posenc::study {

CopyBatch make_retrieval_batch(std::int64_t batch, std::int64_t n, std::mt19937_64& rng) {
  if (n < 1 || n > kRetrievalKeys) {
    throw Error("study retrieval task", "n", std::to_string(n),
                "1 … " + std::to_string(kRetrievalKeys) + " pairs (distinct keys)");
  }
  if (batch < 1) throw Error("study retrieval task", "batch", std::to_string(batch), "at least 1");
  const std::int64_t length = 4 * n + 1;
  auto inputs = torch::empty({batch, length}, torch::kInt64);
  auto targets = torch::full({batch, length}, kIgnored, torch::kInt64);
  auto* in = inputs.data_ptr<std::int64_t>();
  auto* tg = targets.data_ptr<std::int64_t>();
  std::vector<std::int64_t> keys(static_cast<std::size_t>(kRetrievalKeys)), values(static_cast<std::size_t>(n)),
      order(static_cast<std::size_t>(n));
  for (std::int64_t b = 0; b < batch; ++b) {
    std::iota(keys.begin(), keys.end(), std::int64_t{0});
    draw_distinct(keys, n, rng);
    for (auto& v : values) v = kRetrievalKeys + static_cast<std::int64_t>(rng() % kRetrievalValues);
    std::iota(order.begin(), order.end(), std::int64_t{0});
    draw_distinct(order, n, rng);  // a uniform permutation: the query order
    std::int64_t* x = in + b * length;
    std::int64_t* y = tg + b * length;
    for (std::int64_t i = 0; i < n; ++i) {
      x[2 * i] = keys[static_cast<std::size_t>(i)];
      x[2 * i + 1] = values[static_cast<std::size_t>(i)];
    }
    x[2 * n] = kRetrievalSeparator;
    for (std::int64_t i = 0; i < n; ++i) {
      const auto p = static_cast<std::size_t>(order[static_cast<std::size_t>(i)]);
      x[2 * n + 1 + 2 * i] = keys[p];
      x[2 * n + 2 + 2 * i] = values[p];
      y[2 * n + 1 + 2 * i] = values[p];  // the input after the query
    }
  }
  return {inputs, targets};
}

}  // namespace posenc::study
