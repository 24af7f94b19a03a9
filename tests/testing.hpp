// Shared test helpers: run a test body under every compiled target, check error messages,
// random inputs with printed seeds.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "posenc/posenc.hpp"

namespace posenc::testing {

// Every target this build and CPU can run, "ref" included (it must agree with itself too).
std::vector<std::string> all_targets();

// Test fixture parametrised by target name; restores "auto" and the thread count afterwards.
class EveryTarget : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override;
  void TearDown() override;
};

// Asserts that fn throws posenc::Error whose message contains every fragment.
void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> fragments);

// Deterministic generator; its seed appears in failure messages via SCOPED_TRACE.
std::mt19937_64& rng();
double uniform(double lo, double hi);
std::int64_t uniform_int(std::int64_t lo, std::int64_t hi);  // inclusive

// Read element i of a buffer of any dtype, widened to double.
double element(const void* data, DType dtype, std::int64_t i);

// `value` rounded to `dtype` and widened back (f32, bf16, f16; f64 unchanged).
double round_to(double value, DType dtype);

// `values` rounded once to `dtype` (through the public conversions), as raw bytes.
std::vector<unsigned char> to_dtype(const std::vector<double>& values, DType dtype);

// The largest |x| (0 for none).
double largest(const std::vector<double>& x);
// got[i] within tol of want[i] for every i (and as many), the first miss reported as `what` at i.
void expect_near_all(const std::vector<double>& got, const std::vector<double>& want, double tol, const char* what);
// The same doubles: NaN where the other is NaN, and the sign of each zero.
bool same_bits(const std::vector<double>& a, const std::vector<double>& b);
// (loss(x + h) − loss(x − h)) / 2h, with x restored: the central difference that gradients are
// checked against (its error O(h²) on a smooth piece).
template <class Loss>
double central_difference(double& x, double h, Loss&& loss) {
  const double keep = x;
  x = keep + h;
  const double up = loss();
  x = keep - h;
  const double down = loss();
  x = keep;
  return (up - down) / (2 * h);
}

// A raw buffer for `count` elements of `dtype`, filled with NaN-like garbage so that untouched
// elements are noticed.
std::vector<unsigned char> garbage_buffer(DType dtype, std::int64_t count);

}  // namespace posenc::testing
