#include "testing.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace posenc::testing {

std::vector<std::string> all_targets() { return available_targets(); }

void EveryTarget::SetUp() { set_target(GetParam()); }
void EveryTarget::TearDown() {
  set_target("auto");
  set_num_threads(2);
}

void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> fragments) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string message = e.what();
    for (const std::string& fragment : fragments) {
      EXPECT_NE(message.find(fragment), std::string::npos)
          << "message \"" << message << "\" lacks \"" << fragment << "\"";
    }
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a non-posenc exception: " << e.what();
    return;
  }
  ADD_FAILURE() << "did not throw posenc::Error";
}

std::mt19937_64& rng() {
  static std::mt19937_64 generator(20261122);
  return generator;
}

double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng()); }

std::int64_t uniform_int(std::int64_t lo, std::int64_t hi) {
  return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng());
}

double element(const void* data, DType dtype, std::int64_t i) {
  switch (dtype) {
    case DType::kF32:
      return static_cast<const float*>(data)[i];
    case DType::kF64:
      return static_cast<const double*>(data)[i];
    case DType::kBF16:
      return from_bf16(static_cast<const bf16*>(data)[i]);
    case DType::kF16:
      return from_f16(static_cast<const f16*>(data)[i]);
  }
  return 0;
}

double round_to(double value, DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return static_cast<float>(value);
    case DType::kF64:
      return value;
    case DType::kBF16:
      return from_bf16(to_bf16(static_cast<float>(value)));
    case DType::kF16:
      return from_f16(to_f16(static_cast<float>(value)));
  }
  return value;
}

std::vector<unsigned char> to_dtype(const std::vector<double>& values, DType dtype) {
  std::vector<unsigned char> bytes(values.size() * dtype_size(dtype));
  for (std::size_t i = 0; i < values.size(); ++i) {
    const double v = values[i];
    switch (dtype) {
      case DType::kF32:
        reinterpret_cast<float*>(bytes.data())[i] = static_cast<float>(v);
        break;
      case DType::kF64:
        reinterpret_cast<double*>(bytes.data())[i] = v;
        break;
      case DType::kBF16:
        reinterpret_cast<bf16*>(bytes.data())[i] = to_bf16(static_cast<float>(v));
        break;
      case DType::kF16:
        reinterpret_cast<f16*>(bytes.data())[i] = to_f16(static_cast<float>(v));
        break;
    }
  }
  return bytes;
}

double largest(const std::vector<double>& x) {
  double m = 0;
  for (const double v : x) m = std::max(m, std::abs(v));
  return m;
}

void expect_near_all(const std::vector<double>& got, const std::vector<double>& want, double tol, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], tol) << what << " at " << i;
  }
}

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i])))) return false;
    if (a[i] == 0 && std::signbit(a[i]) != std::signbit(b[i])) return false;
  }
  return true;
}

std::vector<unsigned char> garbage_buffer(DType dtype, std::int64_t count) {
  std::vector<unsigned char> buffer(static_cast<std::size_t>(count) * dtype_size(dtype) + 64, 0xff);
  return buffer;
}

}  // namespace posenc::testing
