// The C++ API's views, probed as a hostile caller would: zero strides (broadcast inputs, aliased
// outputs), outputs that overlap inputs, positions at the int64 extremes, and attention whose
// outputs alias q, k or v. Each is a clear posenc::Error naming the view, or a correct result —
// never a silent overwrite.
#include <cstdint>
#include <limits>
#include <vector>

#include "testing.hpp"

namespace posenc {
namespace {

using testing::expect_error;

constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
constexpr std::int64_t kMin = std::numeric_limits<std::int64_t>::min();

std::vector<float> ramp(std::size_t n) {
  std::vector<float> x(n);
  for (std::size_t i = 0; i < n; ++i) x[i] = 0.25f * static_cast<float>(i % 13) - 1.0f;
  return x;
}

// A stride-0 input is a broadcast: the same result as its materialized copy.
TEST(Views, ZeroStrideInputsReadAsTheirBroadcast) {
  const RopeParams params(8, 8);
  const Positions positions = Positions::range(4);
  std::vector<float> row = ramp(2 * 8), full(4 * 2 * 8);
  for (std::int64_t s = 0; s < 4; ++s) std::copy(row.begin(), row.end(), full.begin() + s * 16);
  std::vector<float> got(4 * 2 * 8), want(4 * 2 * 8);
  rope_apply(params, positions, ConstTensorView::of(row.data(), {1, 4, 2, 8}, {0, 0, 8, 1}), ConstTensorView{},
             TensorView::of(got.data(), {1, 4, 2, 8}), TensorView{});
  rope_apply(params, positions, ConstTensorView::of(full.data(), {1, 4, 2, 8}), ConstTensorView{},
             TensorView::of(want.data(), {1, 4, 2, 8}), TensorView{});
  EXPECT_EQ(got, want);
}

// A stride-0 output would name one element by several indices: refused by the stride's name.
TEST(Views, ZeroStrideOutputsAreRefused) {
  std::vector<float> q = ramp(4 * 2 * 8), out(2 * 8);
  expect_error(
      [&] {
        rope_apply(RopeParams(8, 8), Positions::range(4), ConstTensorView::of(q.data(), {1, 4, 2, 8}),
                   ConstTensorView{}, TensorView::of(out.data(), {1, 4, 2, 8}, {0, 0, 8, 1}), TensorView{});
      },
      {"rope_apply", "q_out", "stride"});
  std::vector<float> table(8);
  expect_error(
      [&] {
        sinusoidal_table(SinusoidalParams(8), Positions::range(3), TensorView::of(table.data(), {3, 8}, {0, 1}));
      },
      {"sinusoidal_table", "out", "stride"});
}

// Out of place with the output the input itself is in place (documented, correct); an output
// that overlaps its input shifted by a row is refused, not a result read from half-written rows.
TEST(Views, OutputsOverlappingInputsAreInPlaceOrRefused) {
  const RopeParams params(8, 8);
  const Positions positions = Positions::range(3);
  std::vector<float> buffer = ramp(4 * 8), copy = buffer, want(3 * 8);
  rope_apply(params, positions, ConstTensorView::of(copy.data(), {1, 3, 1, 8}), ConstTensorView{},
             TensorView::of(want.data(), {1, 3, 1, 8}), TensorView{});
  rope_apply(params, positions, ConstTensorView::of(buffer.data(), {1, 3, 1, 8}), ConstTensorView{},
             TensorView::of(buffer.data(), {1, 3, 1, 8}), TensorView{});
  EXPECT_EQ(std::vector<float>(buffer.begin(), buffer.begin() + 24), want);
  expect_error(
      [&] {
        rope_apply(params, positions, ConstTensorView::of(buffer.data(), {1, 3, 1, 8}), ConstTensorView{},
                   TensorView::of(buffer.data() + 8, {1, 3, 1, 8}), TensorView{});
      },
      {"rope_apply: q_out", "expected memory disjoint from q", "or exactly the same view"});
  std::vector<float> x = ramp(4 * 8);
  expect_error(
      [&] {
        sinusoidal_add(SinusoidalParams(8), ConstTensorView::of(x.data(), {1, 3, 8}), positions,
                       TensorView::of(x.data() + 4, {1, 3, 8}));
      },
      {"sinusoidal_add: out", "expected memory disjoint from x"});
}

// Attention never writes an output over q, k or v, whole or in part, nor lse over out.
TEST(Views, AttentionOutputsMustNotAliasItsInputs) {
  // v's buffer is out's size, so that an out over it is a valid view of its own.
  std::vector<float> q = ramp(1 * 4 * 2 * 8), k = ramp(1 * 4 * 1 * 8), v = ramp(1 * 4 * 2 * 8);
  AttentionSpec spec;
  spec.q = ConstTensorView::of(q.data(), {1, 4, 2, 8});
  spec.k = ConstTensorView::of(k.data(), {1, 4, 1, 8});
  spec.v = ConstTensorView::of(v.data(), {1, 4, 1, 8});
  spec.mask.causal = true;
  const Attention attention(spec);
  expect_error(
      [&] {
        attention.forward(TensorView::of(q.data(), {1, 4, 2, 8}), TensorView{});
      },
      {"out", "expected memory disjoint from q"});
  expect_error(
      [&] {
        attention.forward(TensorView::of(v.data(), {1, 4, 2, 8}), TensorView{});
      },
      {"out", "expected memory disjoint from v"});
  std::vector<float> out(1 * 4 * 2 * 8);
  expect_error(
      [&] {
        attention.forward(TensorView::of(out.data(), {1, 4, 2, 8}), TensorView::of(out.data() + 4, {1, 2, 4}));
      },
      {"lse", "out"});
  std::vector<float> lse(2 * 4);
  EXPECT_NO_THROW(attention.forward(TensorView::of(out.data(), {1, 4, 2, 8}), TensorView::of(lse.data(), {1, 2, 4})));
}

// Positions at the int64 extremes: every one refused by name, none wrapped into a valid position.
TEST(Views, PositionsAtTheInt64ExtremesAreRefused) {
  const std::vector<std::int64_t> lowest = {0, kMin}, highest = {kMax};
  expect_error([&] { Positions::ids(lowest); }, {"Positions::ids", "ids[1] = -9223372036854775808"});
  expect_error([&] { Positions::ids(highest); }, {"Positions::ids", "ids[0] = 9223372036854775807"});
  expect_error([&] { Positions::ids(highest, kMax, 1); }, {"Positions::ids"});
  expect_error([] { Positions::range(1, kMax); }, {"Positions::range", "start = 9223372036854775807"});
  expect_error([] { Positions::range(kMax, 0); }, {"Positions::range", "start + seq_len - 1"});
  expect_error([] { Positions::range(kMin); }, {"Positions::range", "seq_len = -9223372036854775808"});
  const std::vector<std::int64_t> late = {kMax}, early = {kMin};
  expect_error([&] { Positions::ranges(late, 1); }, {"Positions::ranges", "starts[0] = 9223372036854775807"});
  expect_error([&] { Positions::ranges(early, 1); }, {"Positions::ranges", "starts[0] = -9223372036854775808"});
  const std::vector<std::int64_t> long_cu = {0, kMax}, wrapped = {0, kMax, kMin};
  expect_error([&] { Positions::packed(long_cu); }, {"Positions::packed", "longest sequence - 1"});
  expect_error([&] { Positions::packed(wrapped); }, {"Positions::packed", "cu_seqlens[2] = -9223372036854775808"});
  // The largest valid position still works: 2^40.
  const std::vector<std::int64_t> last = {kMaxPosition};
  EXPECT_EQ(Positions::ids(last).max_position(), kMaxPosition);
}

}  // namespace
}  // namespace posenc
