#include "posenc/positions.hpp"

#include <algorithm>
#include <string>

#include "posenc/error.hpp"
#include "posenc/tensor.hpp"

namespace posenc {
namespace {

std::string max_position_text() { return "a position in [0, 2^40]"; }

void check_position(const char* where, const char* param, std::int64_t index, std::int64_t value) {
  if (value < 0 || value > kMaxPosition) {
    throw Error(where, std::string(param) + "[" + std::to_string(index) + "]", std::to_string(value),
                max_position_text());
  }
}

void check_seq_len(const char* where, std::int64_t seq_len) {
  if (seq_len < 0) throw Error(where, "seq_len", std::to_string(seq_len), ">= 0");
}

}  // namespace

Positions Positions::range(std::int64_t seq_len, std::int64_t start) {
  check_seq_len("Positions::range", seq_len);
  if (start < 0 || start > kMaxPosition) {
    throw Error("Positions::range", "start", std::to_string(start), max_position_text());
  }
  if (seq_len > 0 && seq_len - 1 > kMaxPosition - start) {
    throw Error("Positions::range", "start + seq_len - 1", std::to_string(start) + " + " + std::to_string(seq_len - 1),
                "a last position <= 2^40");
  }
  Positions p;
  p.kind_ = Kind::kRange;
  p.seq_len_ = seq_len;
  p.start_ = start;
  p.max_position_ = seq_len > 0 ? start + seq_len - 1 : start;
  return p;
}

Positions Positions::ranges(std::span<const std::int64_t> starts, std::int64_t seq_len) {
  check_seq_len("Positions::ranges", seq_len);
  if (starts.empty()) {
    throw Error("Positions::ranges", "starts.size()", "0", "one start per batch row (>= 1)");
  }
  Positions p;
  p.kind_ = Kind::kRanges;
  p.batch_ = static_cast<std::int64_t>(starts.size());
  p.seq_len_ = seq_len;
  p.data_ = starts.data();
  p.data_len_ = p.batch_;
  for (std::int64_t b = 0; b < p.batch_; ++b) {
    const std::int64_t start = starts[static_cast<std::size_t>(b)];
    check_position("Positions::ranges", "starts", b, start);
    const std::int64_t steps = std::max<std::int64_t>(seq_len - 1, 0);
    if (steps > kMaxPosition - start) {  // start + steps would pass 2^40 (or overflow)
      throw Error("Positions::ranges", "starts[" + std::to_string(b) + "] + seq_len - 1",
                  std::to_string(start) + " + " + std::to_string(steps), "a last position <= 2^40");
    }
    p.max_position_ = std::max(p.max_position_, start + steps);
  }
  return p;
}

Positions Positions::ids(std::span<const std::int64_t> ids) {
  Positions p;
  p.kind_ = Kind::kIds;
  p.seq_len_ = static_cast<std::int64_t>(ids.size());
  p.data_ = ids.data();
  p.data_len_ = p.seq_len_;
  // The range test inline and the error's text only for a bad id: a decode step checks every
  // position of its cache.
  for (std::int64_t i = 0; i < p.seq_len_; ++i) {
    const std::int64_t id = ids[static_cast<std::size_t>(i)];
    if (id < 0 || id > kMaxPosition) check_position("Positions::ids", "ids", i, id);
    p.max_position_ = std::max(p.max_position_, id);
  }
  return p;
}

Positions Positions::ids(std::span<const std::int64_t> ids, std::int64_t batch, std::int64_t seq_len) {
  check_seq_len("Positions::ids", seq_len);
  if (batch < 1) throw Error("Positions::ids", "batch", std::to_string(batch), ">= 1");
  const std::int64_t count = checked_mul(batch, seq_len, "Positions::ids batch * seq_len");
  if (count != static_cast<std::int64_t>(ids.size())) {
    throw Error("Positions::ids", "ids.size()", std::to_string(ids.size()),
                "batch * seq_len = " + std::to_string(count));
  }
  Positions p = Positions::ids(ids);
  p.kind_ = Kind::kBatchIds;
  p.batch_ = batch;
  p.seq_len_ = seq_len;
  return p;
}

Positions Positions::packed(std::span<const std::int64_t> cu_seqlens) {
  if (cu_seqlens.empty() || cu_seqlens.front() != 0) {
    throw Error("Positions::packed", "cu_seqlens[0]",
                cu_seqlens.empty() ? std::string("(empty)") : std::to_string(cu_seqlens.front()),
                "0 (cumulative sequence lengths start at 0)");
  }
  Positions p;
  p.kind_ = Kind::kPacked;
  p.data_ = cu_seqlens.data();
  p.data_len_ = static_cast<std::int64_t>(cu_seqlens.size());
  for (std::size_t k = 1; k < cu_seqlens.size(); ++k) {
    if (cu_seqlens[k] < cu_seqlens[k - 1]) {
      throw Error("Positions::packed", "cu_seqlens[" + std::to_string(k) + "]", std::to_string(cu_seqlens[k]),
                  ">= cu_seqlens[" + std::to_string(k - 1) + "] = " + std::to_string(cu_seqlens[k - 1]));
    }
    const std::int64_t length = cu_seqlens[k] - cu_seqlens[k - 1];
    if (length > 0) p.max_position_ = std::max(p.max_position_, length - 1);
  }
  check_position("Positions::packed", "longest sequence - 1", 0, p.max_position_);
  p.seq_len_ = cu_seqlens.back();
  return p;
}

std::int64_t Positions::at(std::int64_t b, std::int64_t s) const {
  switch (kind_) {
    case Kind::kRange:
      return start_ + s;
    case Kind::kRanges:
      return data_[b] + s;
    case Kind::kIds:
      return data_[s];
    case Kind::kBatchIds:
      return data_[b * seq_len_ + s];
    case Kind::kPacked: {
      // The sequence holding token s is the last k with cu_seqlens[k] <= s.
      const std::int64_t* first_after = std::upper_bound(data_, data_ + data_len_, s);
      return s - *(first_after - 1);
    }
  }
  return 0;
}

void Positions::check_grid(const char* where, std::int64_t batch, std::int64_t seq_len) const {
  if (seq_len_ != seq_len) {
    throw Error(where, "positions.seq_len()", std::to_string(seq_len_),
                std::to_string(seq_len) + " (one position per token)");
  }
  if (batch_ != 0 && batch_ != batch) {
    throw Error(where, "positions.batch()", std::to_string(batch_),
                "0 (shared) or the batch size " + std::to_string(batch));
  }
}

}  // namespace posenc
