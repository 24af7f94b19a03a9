// Shared by the fuzz targets (fuzz/fuzz_*.cpp): reading a fuzzer's bytes as typed choices, the
// rule every call is held to (it returns, or throws a posenc::Error naming a parameter — nothing
// else), and the comparison of a fused result with the fp64 reference.
//
// Each target defines LLVMFuzzerTestOneInput. With -DPOSENC_FUZZ=ON (clang) it links libFuzzer;
// in every build it also links replay.cpp, which runs the files of its corpus (fuzz/corpus/<name>)
// as a test, so that each input the fuzzers found stays a regression test under GCC too.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <vector>

#include "posenc/posenc.hpp"

namespace posenc::fuzz {

// A finding: print it and abort, which libFuzzer records as a crash with the input that caused it.
[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "posenc fuzz finding: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

inline void require(bool ok, const std::string& what) {
  if (!ok) fail(what);
}

// The fuzzer's bytes, consumed from the front as choices. When they run out every choice takes
// its smallest value, so that any input is a complete case.
class Input {
 public:
  Input(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}

  bool empty() const { return at_ >= size_; }
  // Bytes drawn so far, those past the end (zeros) included: an input padded with zeros to this
  // length and then extended reaches its next choice with the same choices before it.
  std::size_t position() const { return drawn_; }
  std::uint8_t byte() {
    ++drawn_;
    return at_ < size_ ? data_[at_++] : 0;
  }
  std::uint64_t bits(int count) {
    std::uint64_t x = 0;
    for (int i = 0; i < count; i += 8) x = (x << 8) | byte();
    return count >= 64 ? x : x & ((std::uint64_t{1} << count) - 1);
  }
  bool flag() { return (byte() & 1) != 0; }
  // An integer in [lo, hi] (hi − lo < 2^63).
  std::int64_t integer(std::int64_t lo, std::int64_t hi) {
    const auto span = static_cast<std::uint64_t>(hi) - static_cast<std::uint64_t>(lo);
    if (span == 0) return lo;
    const int width = span < 256 ? 8 : span < 65536 ? 16 : span < (1u << 24) ? 24 : 64;
    return static_cast<std::int64_t>(static_cast<std::uint64_t>(lo) + bits(width) % (span + 1));
  }
  std::size_t pick(std::size_t n) { return static_cast<std::size_t>(integer(0, static_cast<std::int64_t>(n) - 1)); }
  // A value in [lo, hi] on a grid of 2^16 steps.
  double uniform(double lo, double hi) { return lo + (hi - lo) * static_cast<double>(bits(16)) / 65535.0; }
  // Any double: a special value (0, −0, ±inf, NaN, extremes, subnormals, integers near 2^63) or
  // one of the bytes' own bit patterns.
  double any_number() {
    static const double kSpecial[] = {0.0,
                                      -0.0,
                                      1.0,
                                      -1.0,
                                      0.5,
                                      std::numeric_limits<double>::infinity(),
                                      -std::numeric_limits<double>::infinity(),
                                      std::numeric_limits<double>::quiet_NaN(),
                                      std::numeric_limits<double>::max(),
                                      -std::numeric_limits<double>::max(),
                                      std::numeric_limits<double>::denorm_min(),
                                      std::numeric_limits<double>::min(),
                                      9223372036854775807.0,
                                      -9223372036854775808.0,
                                      2147483648.0,
                                      4294967296.0,
                                      1e300,
                                      1e-300,
                                      3.5,
                                      65536.0};
    const std::uint8_t how = byte();
    if (how < 96) return kSpecial[how % std::size(kSpecial)];
    if (how < 192) return static_cast<double>(integer(-1000, 1000)) / (how < 144 ? 1.0 : 8.0);
    double x;
    const std::uint64_t b = bits(64);
    std::memcpy(&x, &b, sizeof x);
    return x;
  }
  // Any int64: small, at the edges of the common widths, or raw bits.
  std::int64_t any_integer() {
    static const std::int64_t kSpecial[] = {0,
                                            1,
                                            -1,
                                            2,
                                            std::numeric_limits<std::int64_t>::max(),
                                            std::numeric_limits<std::int64_t>::min(),
                                            std::int64_t{1} << 31,
                                            (std::int64_t{1} << 31) - 1,
                                            std::int64_t{1} << 32,
                                            std::int64_t{1} << 40,
                                            (std::int64_t{1} << 40) + 1,
                                            std::int64_t{1} << 62,
                                            -(std::int64_t{1} << 62)};
    const std::uint8_t how = byte();
    if (how < 64) return kSpecial[how % std::size(kSpecial)];
    if (how < 224) return integer(-64, 512);
    return static_cast<std::int64_t>(bits(64));
  }
  std::string text(std::size_t max_length) {
    std::string s;
    const std::size_t n = pick(max_length + 1);
    for (std::size_t i = 0; i < n && !empty(); ++i) s.push_back(static_cast<char>(byte()));
    return s;
  }
  std::string rest() {
    std::string s(reinterpret_cast<const char*>(data_ + std::min(at_, size_)), size_ - std::min(at_, size_));
    at_ = size_;
    return s;
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t at_ = 0, drawn_ = 0;
};

// The fuzzers' allocation limit: sizes past it must be refused by name (posenc::Error) before
// anything is allocated, so that a size a fuzzer makes up can neither exhaust memory nor pass.
inline void set_up(std::int64_t allocation_limit = std::int64_t{256} << 20) {
  static const bool done = [&] {
    set_allocation_limit(allocation_limit);
    set_num_threads(2);
    return true;
  }();
  (void)done;
}

// Runs `call`, which must return or throw a posenc::Error whose message names a parameter.
// Returns whether it returned. Any other exception is a finding.
template <class Call>
bool accepted(const char* what, Call&& call) {
  try {
    call();
    return true;
  } catch (const Error& e) {
    const std::string message = e.what();
    require(!message.empty() && message.find('\n') == std::string::npos,
            std::string(what) + ": an error message that is empty or spans lines: " + message);
    return false;
  } catch (const std::bad_alloc&) {
    fail(std::string(what) + ": std::bad_alloc instead of an error naming the size");
  } catch (const std::exception& e) {
    fail(std::string(what) + ": an exception that is not posenc::Error: " + e.what());
  }
}

inline std::string number(double x) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.9g", x);
  return buffer;
}

inline int kind(double x) { return std::isnan(x) ? 1 : std::isinf(x) ? (x > 0 ? 2 : 3) : 0; }

// The fused result against the fp64 reference: NaN and ±inf in the same places (the non-finite
// policy, docs/attention.md), and finite values within `tolerance`.
inline void expect_match(const char* what, const std::vector<double>& got, const std::vector<double>& want,
                         double tolerance) {
  require(got.size() == want.size(), std::string(what) + ": sizes differ");
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (kind(got[i]) != kind(want[i]) || (kind(want[i]) == 0 && !(std::fabs(got[i] - want[i]) <= tolerance))) {
      if (std::getenv("POSENC_FUZZ_VERBOSE") != nullptr) {  // every element, to see the pattern
        for (std::size_t j = 0; j < got.size(); ++j)
          std::fprintf(stderr, "%zu: %s %s\n", j, number(got[j]).c_str(), number(want[j]).c_str());
      }
      fail(std::string(what) + ": element " + std::to_string(i) + " is " + number(got[i]) +
           ", the fp64 reference gives " + number(want[i]) + " (tolerance " + number(tolerance) + ")");
    }
  }
}

inline double max_finite(const std::vector<double>& a) {
  double m = 0;
  for (const double x : a) m = std::isfinite(x) ? std::max(m, std::fabs(x)) : m;
  return m;
}

inline double max_finite_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (std::isfinite(a[i]) && std::isfinite(b[i])) m = std::max(m, std::fabs(a[i] - b[i]));
  }
  return m;
}

// Element i of a buffer of `dtype`, as a double; and values stored in a dtype (rounded once).
inline double element(const std::vector<unsigned char>& bytes, DType dtype, std::size_t i) {
  const unsigned char* p = bytes.data() + dtype_size(dtype) * i;
  double d = 0;
  float f = 0;
  bf16 b;
  f16 h;
  switch (dtype) {
    case DType::kF64:
      std::memcpy(&d, p, sizeof d);
      return d;
    case DType::kF32:
      std::memcpy(&f, p, sizeof f);
      return f;
    case DType::kBF16:
      std::memcpy(&b, p, sizeof b);
      return from_bf16(b);
    case DType::kF16:
      std::memcpy(&h, p, sizeof h);
      return from_f16(h);
  }
  return d;
}

inline std::vector<unsigned char> store(const std::vector<double>& values, DType dtype) {
  std::vector<unsigned char> bytes(values.size() * dtype_size(dtype));
  for (std::size_t i = 0; i < values.size(); ++i) {
    unsigned char* p = bytes.data() + dtype_size(dtype) * i;
    const auto f = static_cast<float>(values[i]);
    if (dtype == DType::kF64) std::memcpy(p, &values[i], 8);
    if (dtype == DType::kF32) std::memcpy(p, &f, 4);
    if (dtype == DType::kBF16) {
      const bf16 b = to_bf16(f);
      std::memcpy(p, &b, 2);
    }
    if (dtype == DType::kF16) {
      const f16 h = to_f16(f);
      std::memcpy(p, &h, 2);
    }
  }
  return bytes;
}

}  // namespace posenc::fuzz
