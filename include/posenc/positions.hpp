// posenc/positions.hpp — explicit per-token positions.
//
// Every token carries an int64 position; nothing in posenc assumes that a token's position equals
// its row. One type covers the cases models meet, all through the same code path:
//
//   range(S, start)        pos(b, s) = start + s                  (a prompt, or a KV-cache offset)
//   ranges(starts, S)      pos(b, s) = starts[b] + s              (batched decode, ragged caches)
//   ids(ids)               pos(b, s) = ids[s]                     (one id list shared by the batch)
//   ids(ids, B, S)         pos(b, s) = ids[b·S + s]               (any ids per batch row)
//   packed(cu_seqlens)     pos(0, t) = t - cu_seqlens[k] for the sequence k that holds token t
//                                                                 (packed sequences restart at 0)
//
//   packed([0, 3, 5, 9])   tokens: t0 t1 t2 | t3 t4 | t5 t6 t7 t8
//                          pos:     0  1  2 |  0  1 |  0  1  2  3
//
// Positions are views: id arrays and cu_seqlens are borrowed, not copied, and must outlive the
// Positions object. They are validated when built: every position must lie in
// [0, kMaxPosition]; cu_seqlens must start at 0 and not decrease. A position out of range throws
// posenc::Error naming the index and the value.
#pragma once

#include <cstdint>
#include <span>

namespace posenc {

// 2^40 ≈ 1.1e12 tokens. Bounded so that position × frequency stays exact enough in fp64 for the
// angle reduction (see absolute.hpp for the error bound as a function of the position).
inline constexpr std::int64_t kMaxPosition = std::int64_t{1} << 40;

class Positions {
 public:
  enum class Kind : std::uint8_t { kRange, kRanges, kIds, kBatchIds, kPacked };

  static Positions range(std::int64_t seq_len, std::int64_t start = 0);
  static Positions ranges(std::span<const std::int64_t> starts, std::int64_t seq_len);
  static Positions ids(std::span<const std::int64_t> ids);
  static Positions ids(std::span<const std::int64_t> ids, std::int64_t batch, std::int64_t seq_len);
  static Positions packed(std::span<const std::int64_t> cu_seqlens);

  Kind kind() const { return kind_; }
  // Number of batch rows the positions describe; 0 means "the same for every batch row".
  std::int64_t batch() const { return batch_; }
  std::int64_t seq_len() const { return seq_len_; }
  // Largest position; kernels use it to validate table sizes (learned encodings).
  std::int64_t max_position() const { return max_position_; }

  // Position of token s in batch row b. Valid for 0 <= s < seq_len() and, unless batch() == 0,
  // 0 <= b < batch(). O(1) except for packed positions (O(log #sequences)).
  std::int64_t at(std::int64_t b, std::int64_t s) const;

  // Throws posenc::Error unless these positions can serve a [batch, seq_len] token grid:
  // seq_len must match, and batch() must be 0 (shared) or equal `batch`. `where` names the caller.
  void check_grid(const char* where, std::int64_t batch, std::int64_t seq_len) const;

 private:
  Positions() = default;

  Kind kind_ = Kind::kRange;
  std::int64_t batch_ = 0;
  std::int64_t seq_len_ = 0;
  std::int64_t start_ = 0;
  std::int64_t max_position_ = 0;
  const std::int64_t* data_ = nullptr;  // ids, starts or cu_seqlens
  std::int64_t data_len_ = 0;
};

}  // namespace posenc
