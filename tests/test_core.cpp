// Core types: 16-bit floats, tensor views, positions, errors, runtime target control.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>

#include "../src/internal.hpp"  // AlignedFloats: the attention scratch's allocator
#include "posenc/memory.hpp"
#include "testing.hpp"

namespace posenc {
namespace {

using testing::expect_error;

// ─── Aligned scratch ──────────────────────────────────────────────────────────────────────────
// The attention kernels count on their scratch starting on a cache line; glibc's malloc gives
// only 16 bytes, so a plain std::vector would pass by luck at most one size in four.
TEST(AlignedFloats, EveryBlockStartsOnACacheLine) {
  for (const std::size_t n :
       {std::size_t{1}, std::size_t{3}, std::size_t{17}, std::size_t{1000}, std::size_t{100003}}) {
    detail::AlignedFloats v(n, 1.0f);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(v.data()) % 64, 0u) << n;
    v.resize(3 * n + 5);  // a reallocation keeps the alignment and the contents
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(v.data()) % 64, 0u) << n;
    EXPECT_EQ(v[n - 1], 1.0f);
  }
}

// ─── Memory on 2 MiB pages ────────────────────────────────────────────────────────────────────
// The blocks of plans' tables (TableFloats) go back to a cache: a table one key longer (a decode
// step's next plan) finds its predecessor's block, on a cache line; posenc::empty_cache()
// returns them, and blocks below kTableBlockMin never enter it.
TEST(TableFloats, ATableOneKeyLongerReusesTheBlockOfTheStepBefore) {
  posenc::empty_cache();
  const std::size_t n = ((std::size_t{4} << 20) + (std::size_t{100} << 10)) / sizeof(float);  // class 4.5 MiB
  const float* first = nullptr;
  {
    posenc::detail::TableFloats t(n, 1.0f);
    first = t.data();
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(first) % 64, 0u);
  }
  {
    posenc::detail::TableFloats t(n + 32 * 17);
    EXPECT_EQ(t.data(), first);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.data()) % 64, 0u);
    t.back() = 2.0f;  // the block holds the longer table
  }
  {
    // Twice the size is another class: a block of its own.
    posenc::detail::TableFloats t(2 * n + 4096);
    EXPECT_NE(t.data(), first);
    posenc::detail::TableFloats again(n);
    EXPECT_EQ(again.data(), first);
  }
  posenc::empty_cache();
  // Small tables take ordinary aligned blocks.
  posenc::detail::TableFloats small(100);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(small.data()) % 64, 0u);
}

TEST(HugePageBuffer, AlignedZeroedAndWritableToItsLastByte) {
  constexpr std::size_t page = HugePageBuffer::kPageBytes;
  for (const std::size_t n : {std::size_t{1}, std::size_t{4096}, page - 1, page, page + 1, 5 * page + 3}) {
    HugePageBuffer buffer(n);
    ASSERT_NE(buffer.data(), nullptr) << n;
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(buffer.data()) % page, 0u) << n;
    EXPECT_EQ(buffer.size(), n);
    EXPECT_EQ(buffer.mapped_bytes() % page, 0u) << n;
    EXPECT_GE(buffer.mapped_bytes(), n);
    EXPECT_LT(buffer.mapped_bytes(), n + page);
    auto* bytes = buffer.as<unsigned char>();
    EXPECT_EQ(buffer.count<unsigned char>(), n);
    EXPECT_EQ(buffer.count<float>(), n / 4);
    std::size_t nonzero = 0;
    for (std::size_t i = 0; i < n; ++i) nonzero += bytes[i] != 0;
    EXPECT_EQ(nonzero, 0u) << n;
    bytes[0] = 1;
    bytes[n - 1] = 2;  // the last byte asked for is mapped and writable
    EXPECT_EQ(bytes[n - 1], 2);
  }
}

TEST(HugePageBuffer, EmptyAndMoved) {
  HugePageBuffer empty(0);
  EXPECT_EQ(empty.data(), nullptr);
  EXPECT_EQ(empty.size(), 0u);
  EXPECT_EQ(empty.mapped_bytes(), 0u);

  HugePageBuffer a(3000);
  a.as<float>()[10] = 7.0f;
  void* const where = a.data();
  HugePageBuffer b(std::move(a));
  EXPECT_EQ(a.data(), nullptr);  // NOLINT(bugprone-use-after-move): the moved-from state is specified
  EXPECT_EQ(a.size(), 0u);
  EXPECT_EQ(b.data(), where);
  EXPECT_EQ(b.as<float>()[10], 7.0f);
  HugePageBuffer c(100);
  c = std::move(b);  // releases c's own mapping, takes b's
  EXPECT_EQ(c.data(), where);
  EXPECT_EQ(c.size(), 3000u);
  EXPECT_EQ(b.data(), nullptr);  // NOLINT(bugprone-use-after-move)
}

TEST(HugePageBuffer, RejectsSizesItCannotMap) {
  expect_error([] { HugePageBuffer too_large(std::numeric_limits<std::size_t>::max()); },
               {"HugePageBuffer", "bytes = 18446744073709551615", "at most"});
  expect_error([] { HugePageBuffer exbibyte(std::size_t{1} << 60); },
               {"HugePageBuffer", "bytes = 1152921504606846976", "allocation limit"});
#if defined(__linux__)
  // Past a raised limit, 2^60 bytes (an exbibyte) reach mmap, which no x86-64 address space serves.
  const std::size_t limit = allocation_limit();
  set_allocation_limit(std::size_t{1} << 61);
  expect_error([] { HugePageBuffer exbibyte(std::size_t{1} << 60); },
               {"HugePageBuffer", "bytes = 1152921504606846976", "mmap failed"});
  set_allocation_limit(limit);
#endif
}

// Sizes from arguments are checked before anything is allocated: an overflowing product and a
// product past the limit are refused by name, with the bytes they would need.
TEST(AllocationLimit, RefusesWhatWouldNotFitByName) {
  const std::size_t limit = allocation_limit();
  EXPECT_GE(limit, std::size_t{1} << 20);  // the machine's memory: at least a mebibyte anywhere we run
  EXPECT_EQ(checked_allocation(1000, 8, "here", "rows"), 8000u);
  expect_error([] { checked_allocation(-1, 8, "here", "rows"); }, {"here: rows = -1", ">= 0"});
  expect_error([] { checked_allocation(std::int64_t{1} << 62, 8, "here", "rows"); },
               {"here: rows = 4611686018427387904", "32.0 EiB needed", "allocation limit"});
  set_allocation_limit(4096);
  expect_error([] { checked_allocation(513, 8, "here", "rows"); }, {"rows = 513", "at most 512", "4.0 KiB"});
  expect_error([] { alibi_slopes(1000); }, {"alibi_slopes", "heads = 1000", "at most 512"});
  set_allocation_limit(limit);
  expect_error([] { set_allocation_limit(0); }, {"set_allocation_limit", "bytes = 0", "1 to 2^62"});
  // Products that could wrap: (2k + 1) Shaw rows, T5's buckets · heads, and the head count of
  // ALiBi's power-of-two loop; and FLOATER's substeps, bounded before any product is formed.
  expect_error([] { ShawParams(std::int64_t{1} << 62, 1); }, {"ShawParams", "max_distance = 4611686018427387904"});
  expect_error([] { ShawParams(std::int64_t{1} << 40, 64); }, {"ShawParams", "allocation limit"});
  expect_error([] { T5BiasParams(8, std::int64_t{1} << 61, std::int64_t{1} << 60, true); },
               {"T5BiasParams", "num_buckets"});
  expect_error([] { alibi_slopes(std::int64_t{1} << 62); }, {"alibi_slopes", "heads = 4611686018427387904"});
  const FloaterParams floater = FloaterParams::init(4, 8, 1);
  for (const std::int64_t substeps : {std::int64_t{1} << 62, std::int64_t{1} << 45}) {
    expect_error(
        [&] {
          FloaterParams(4, floater.w1(), floater.b1(), floater.w2(), floater.b2(), floater.p0(),
                        floater.time_per_position(), substeps);
        },
        {"FloaterParams: substeps = " + std::to_string(substeps), "in [1, 65536]"});
  }
}

// From fuzz_schemes: unchecked, Kerple's 2^31 heads and FIRE's hidden width reach std::bad_alloc,
// and FIRE's pieces make (hidden + 1)·hidden tables. The registry checks a scheme's parameters against
// the allocation limit before its factory runs; FIRE bounds its tabulated pieces.
TEST(AllocationLimit, SchemeSizesAreRefusedByName) {
  SchemeArgs args;
  args.heads = std::int64_t{1} << 31;
  args.head_dim = 8;
  expect_error([&] { make_head_group("kerple", args); }, {"parameters [2, 2147483648]", "allocation limit"});
  expect_error([] { FireParams::init(1, std::int64_t{1} << 15); },
               {"FireParams::init", "heads · hidden · (hidden + 1) = 1 · 32768 · 32769", "at most 2^28"});
  EXPECT_EQ(FireParams::init(8, 32).hidden(), 32);
}

// −(−2^63) does not exist in int64: the farthest relative position still has the last bucket.
TEST(T5Buckets, TheMostNegativePositionIsTheLastBucket) {
  EXPECT_EQ(t5_bucket(std::numeric_limits<std::int64_t>::min(), 32, 128, true), 15);
  EXPECT_EQ(t5_bucket(std::numeric_limits<std::int64_t>::min(), 32, 128, false), 31);
  EXPECT_EQ(t5_bucket(std::numeric_limits<std::int64_t>::max(), 32, 128, true), 31);
  // A range so narrow that the log formula's float runs past every bucket.
  EXPECT_EQ(t5_bucket(-(std::int64_t{1} << 62), std::int64_t{1} << 40, (std::int64_t{1} << 39) + 1, false),
            (std::int64_t{1} << 40) - 1);
}

#if defined(__linux__)
TEST(HugePageBuffer, AdvisesHugePagesWhereTheKernelHasThem) {
  // The advice is accepted whenever the kernel was built with transparent huge pages, whose
  // setting this file shows; whether pages are granted depends on free memory, so that is not
  // asserted.
  std::FILE* setting = std::fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
  if (setting == nullptr) GTEST_SKIP() << "no transparent huge pages in this kernel";
  std::fclose(setting);
  EXPECT_TRUE(HugePageBuffer(HugePageBuffer::kPageBytes).huge_pages_advised());
}
#endif

// ─── 16-bit floats ─────────────────────────────────────────────────────────────────────────────

TEST(Float16, EveryHalfRoundTrips) {
  for (std::uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const f16 h{static_cast<std::uint16_t>(bits)};
    const float f = from_f16(h);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(from_f16(to_f16(f)))) << bits;
    } else {
      EXPECT_EQ(to_f16(f).bits, h.bits) << "bits " << bits;
    }
  }
}

TEST(Float16, RoundsToNearestEven) {
  // Between consecutive halves a and b, the midpoint goes to the one with an even mantissa, and
  // anything off the midpoint to the nearer one. Checked for every positive finite half pair.
  for (std::uint32_t bits = 0; bits < 0x7bffu; ++bits) {
    const double a = from_f16(f16{static_cast<std::uint16_t>(bits)});
    const double b = from_f16(f16{static_cast<std::uint16_t>(bits + 1)});
    const double mid = 0.5 * (a + b);
    const std::uint16_t even = (bits % 2 == 0) ? bits : bits + 1;
    EXPECT_EQ(to_f16(static_cast<float>(mid)).bits, even) << bits;
    EXPECT_EQ(to_f16(static_cast<float>(a + 0.25 * (b - a))).bits, bits) << bits;
    EXPECT_EQ(to_f16(static_cast<float>(a + 0.75 * (b - a))).bits, bits + 1) << bits;
  }
  EXPECT_EQ(to_f16(65504.0f).bits, 0x7bffu);
  EXPECT_EQ(to_f16(65519.0f).bits, 0x7bffu);  // below the midpoint to 2^16
  EXPECT_EQ(to_f16(65520.0f).bits, 0x7c00u);  // the midpoint rounds (to even) to infinity
  EXPECT_EQ(to_f16(-std::numeric_limits<float>::infinity()).bits, 0xfc00u);
  EXPECT_EQ(to_f16(-0.0f).bits, 0x8000u);
}

TEST(BFloat16, RoundsToNearestEvenAndKeepsNaN) {
  for (std::uint32_t top = 0; top < 0x7f7fu; top += 7) {
    const float a = from_bf16(bf16{static_cast<std::uint16_t>(top)});
    const float b = from_bf16(bf16{static_cast<std::uint16_t>(top + 1)});
    const float mid = std::bit_cast<float>((static_cast<std::uint32_t>(top) << 16) | 0x8000u);
    EXPECT_EQ(to_bf16(a).bits, top);
    EXPECT_EQ(to_bf16(b).bits, top + 1);
    EXPECT_EQ(to_bf16(mid).bits, top % 2 == 0 ? top : top + 1) << top;
  }
  EXPECT_TRUE(std::isnan(from_bf16(to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose payload sits only in the low 16 bits must not become infinity.
  EXPECT_TRUE(std::isnan(from_bf16(to_bf16(std::bit_cast<float>(0x7f800001u)))));
}

// ─── Tensor views ──────────────────────────────────────────────────────────────────────────────

TEST(TensorView, ContiguousStridesAndDescription) {
  std::vector<float> data(24);
  const TensorView v = TensorView::of(data.data(), {2, 3, 4});
  EXPECT_EQ(v.rank(), 3);
  EXPECT_EQ(v.stride(0), 12);
  EXPECT_EQ(v.stride(1), 4);
  EXPECT_EQ(v.stride(2), 1);
  EXPECT_EQ(v.numel(), 24);
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(v.describe(), "[2, 3, 4] strides [12, 4, 1] f32");
  const ConstTensorView c = v;  // mutable converts to const
  EXPECT_EQ(c.data(), data.data());
  // A [S, D] view of every other row is not contiguous.
  const TensorView rows = TensorView::of(data.data(), {3, 4}, {8, 1});
  EXPECT_FALSE(rows.is_contiguous());
}

TEST(TensorView, RejectsBadShapesWithClearMessages) {
  float x = 0;
  expect_error([&] { TensorView::of(&x, {2, -1}); }, {"tensor view", "shape[1] = -1", ">= 0"});
  expect_error([&] { TensorView::of(&x, {2, 2}, {-1, 1}); }, {"strides[0] = -1", ">= 0"});
  expect_error([&] { TensorView::of(&x, {2, 2}, {1}); }, {"strides", "one stride per axis"});
  expect_error([&] { TensorView::of(&x, {1, 1, 1, 1, 1, 1, 1}); }, {"rank = 7", "1 to 6"});
  expect_error([&] { TensorView::of(static_cast<float*>(nullptr), {2}); }, {"data = null"});
  // Extents that overflow int64 — in elements, or only once multiplied by the element size.
  expect_error(
      [&] {
        TensorView::of(&x, {std::int64_t{1} << 40, std::int64_t{1} << 30});
      },
      {"size arithmetic", "fits in int64"});
  expect_error([&] { TensorView::of(&x, {std::int64_t{1} << 62}); }, {"tensor view extent in bytes", "fits in int64"});
  // Misaligned for the dtype: undefined behaviour in any scalar loop, so refused.
  std::vector<double> wide(4);
  auto* odd = reinterpret_cast<double*>(reinterpret_cast<char*>(wide.data()) + 4);
  expect_error([&] { TensorView::of(odd, {2}); }, {"tensor view: data = 0x", "aligned to 8 bytes for f64"});
  // An empty view may have a null pointer.
  EXPECT_NO_THROW(TensorView::of(static_cast<float*>(nullptr), {0, 4}));
}

TEST(CheckedArithmetic, DetectsOverflow) {
  EXPECT_EQ(checked_mul(1 << 20, 1 << 20, "x"), std::int64_t{1} << 40);
  expect_error([] { checked_mul(std::int64_t{1} << 32, std::int64_t{1} << 31, "table size"); },
               {"table size", "4294967296 * 2147483648"});
  expect_error([] { checked_add(std::numeric_limits<std::int64_t>::max(), 1, "sum"); }, {"sum"});
}

// ─── Positions ─────────────────────────────────────────────────────────────────────────────────

TEST(Positions, EveryKindAddressesTokens) {
  const Positions range = Positions::range(5, 100);
  EXPECT_EQ(range.batch(), 0);
  EXPECT_EQ(range.at(3, 4), 104);
  EXPECT_EQ(range.max_position(), 104);

  const std::vector<std::int64_t> starts = {0, 7};
  const Positions ranges = Positions::ranges(starts, 3);
  EXPECT_EQ(ranges.batch(), 2);
  EXPECT_EQ(ranges.at(1, 2), 9);
  EXPECT_EQ(ranges.max_position(), 9);

  const std::vector<std::int64_t> ids = {5, 1, 9};
  const Positions shared = Positions::ids(ids);
  EXPECT_EQ(shared.at(7, 2), 9);
  EXPECT_EQ(shared.max_position(), 9);

  const std::vector<std::int64_t> grid = {0, 1, 2, 10, 11, 12};
  const Positions per_row = Positions::ids(grid, 2, 3);
  EXPECT_EQ(per_row.at(1, 0), 10);

  const std::vector<std::int64_t> cu = {0, 3, 5, 5, 9};  // includes an empty sequence
  const Positions packed = Positions::packed(cu);
  EXPECT_EQ(packed.seq_len(), 9);
  const std::int64_t expected[] = {0, 1, 2, 0, 1, 0, 1, 2, 3};
  for (std::int64_t t = 0; t < 9; ++t) EXPECT_EQ(packed.at(0, t), expected[t]) << t;
  EXPECT_EQ(packed.max_position(), 3);
}

TEST(Positions, RejectsInvalidIds) {
  const std::vector<std::int64_t> negative = {0, 1, -3};
  expect_error([&] { Positions::ids(negative); }, {"Positions::ids", "ids[2] = -3", "[0, 2^40]"});
  const std::vector<std::int64_t> huge = {(std::int64_t{1} << 40) + 1};
  expect_error([&] { Positions::ids(huge); }, {"ids[0] = 1099511627777"});
  expect_error([] { Positions::range(4, -1); }, {"Positions::range", "start = -1"});
  expect_error([] { Positions::range(-2); }, {"seq_len = -2", ">= 0"});
  expect_error([] { Positions::range(10, std::int64_t{1} << 40); }, {"start + seq_len - 1"});
  const std::vector<std::int64_t> grid = {0, 1, 2};
  expect_error([&] { Positions::ids(grid, 2, 2); }, {"ids.size() = 3", "batch * seq_len = 4"});
  const std::vector<std::int64_t> bad_start = {1, 4};
  expect_error([&] { Positions::packed(bad_start); }, {"cu_seqlens[0] = 1", "start at 0"});
  const std::vector<std::int64_t> decreasing = {0, 4, 2};
  expect_error([&] { Positions::packed(decreasing); }, {"cu_seqlens[2] = 2", ">= cu_seqlens[1] = 4"});
  const std::vector<std::int64_t> starts = {0, -5};
  expect_error([&] { Positions::ranges(starts, 3); }, {"starts[1] = -5"});
  expect_error([] { Positions::ranges({}, 3); }, {"Positions::ranges", "starts.size() = 0", "one start per batch row"});
  const std::vector<std::int64_t> late = {5};
  expect_error([&] { Positions::ranges(late, std::numeric_limits<std::int64_t>::max()); },
               {"starts[0] + seq_len - 1 = 5 + 9223372036854775806", "<= 2^40"});
}

TEST(Positions, GridCheckNamesTheMismatch) {
  const std::vector<std::int64_t> starts = {0, 7};
  const Positions p = Positions::ranges(starts, 3);
  EXPECT_NO_THROW(p.check_grid("op", 2, 3));
  expect_error([&] { p.check_grid("op", 3, 3); }, {"op: positions.batch() = 2", "batch size 3"});
  expect_error([&] { p.check_grid("op", 2, 4); }, {"positions.seq_len() = 3", "4 (one position per token)"});
}

// ─── Runtime ───────────────────────────────────────────────────────────────────────────────────

TEST(Runtime, TargetsCanBeForcedAndRestored) {
  const std::vector<std::string> targets = available_targets();
  ASSERT_GE(targets.size(), 2u);
  EXPECT_EQ(targets.back(), "ref");
  EXPECT_EQ(targets[targets.size() - 2], "scalar");  // the portable baseline is always there
  for (const std::string& t : targets) {
    set_target(t);
    EXPECT_EQ(active_target(), t);
  }
  set_target("auto");
  EXPECT_EQ(active_target(), targets.front());
  expect_error([] { set_target("avx9000"); }, {"set_target", "name = avx9000", "auto or one of:", "ref"});
}

TEST(Runtime, ThreadsAndVersion) {
  set_num_threads(1);
  EXPECT_EQ(num_threads(), 1);
  set_num_threads(2);
  EXPECT_EQ(num_threads(), 2);
  expect_error([] { set_num_threads(0); }, {"set_num_threads", "n = 0", ">= 1"});
  EXPECT_EQ(version(), "0.1.0");
}

TEST(Error, CarriesTheParameter) {
  const Error e("where", "dim", "7", "an even number");
  EXPECT_STREQ(e.what(), "where: dim = 7; expected an even number");
  EXPECT_EQ(e.param(), "dim");
}

// From fuzz_schemes and fuzz_config: an option name or a JSON excerpt may hold a newline, yet every
// message is one line of printable text, whatever the caller passed.
TEST(Error, IsOneLineWhateverTheValue) {
  const Error e("where", std::string("na\nme\x01", 7), "{\n  \"a\":\t1\x7f}", "one line");
  EXPECT_STREQ(e.what(), "where: na\\nme\\x01\\x00 = {\\n  \"a\":\\t1\\x7f}; expected one line");
  const Error long_value("where", "json", std::string(1000, 'x'), "a short value");
  EXPECT_NE(std::string(long_value.what()).find(std::string(200, 'x') + "… (1000 bytes); expected a short value"),
            std::string::npos);
  EXPECT_EQ(std::string(long_value.what()).find(std::string(201, 'x')), std::string::npos);
}

}  // namespace
}  // namespace posenc
