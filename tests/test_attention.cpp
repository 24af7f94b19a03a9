// Fused attention, forward and decode: against the fp64 reference with flash-attention's accuracy
// criterion (the fused f32 error at most twice the naive f32 composition's), for every scheme, mask,
// head grouping, layout and dtype on every target; decode's split keys and paths; the vanishing-tile
// skip; the matrix kernel. Backward, determinism and errors: test_attention_backward.cpp.
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "../src/kernels/attention/attention_kernels.hpp"  // attn_gemm: the matrix kernel under test
#include "testing.hpp"
#include "attention_testing.hpp"
#include "testing.hpp"

namespace posenc {
namespace {

using testing::EveryTarget;
using testing::expect_error;
using testing::uniform;
using testing::uniform_int;
using namespace attention_testing;

class AttentionForward : public EveryTarget {};

TEST_P(AttentionForward, NoPositionalSchemeAcrossShapesMasksAndLayouts) {
  for (int trial = 0; trial < 6; ++trial) {
    const std::int64_t dim = std::vector<std::int64_t>{64, 80, 96, 128, 24, 256}[static_cast<std::size_t>(trial)];
    const std::int64_t kv = uniform_int(1, 2), heads = kv * uniform_int(1, 3);
    const std::int64_t q_len = uniform_int(1, 150), k_len = q_len + uniform_int(0, 90);
    Problem p = make_problem(uniform_int(1, 2), q_len, k_len, heads, kv, dim, DType::kF32, trial % 2 == 1);
    AttentionSpec spec = spec_of(p);
    expect_accurate(p, spec, "none, D " + std::to_string(dim));
    spec.mask.causal = true;
    expect_accurate(p, spec, "causal, D " + std::to_string(dim));
    spec.mask.window_left = uniform_int(0, 40);
    expect_accurate(p, spec, "sliding window");
    spec.mask = {};
    spec.mask.window_left = 7;
    spec.mask.window_right = 3;
    spec.mask.softcap = 2.5;
    expect_accurate(p, spec, "two-sided window with soft-cap");
    spec.mask = {};
    spec.mask.causal = true;
    for (std::int64_t b = 0; b < p.batch; ++b) spec.mask.key_lengths.push_back(uniform_int(0, k_len));
    expect_accurate(p, spec, "key lengths");
    spec.mask = {};
    spec.scale = 0.3;
    expect_accurate(p, spec, "explicit scale");
  }
}

TEST_P(AttentionForward, EveryPositionalScheme) {
  const std::int64_t heads = 4, kv = 2, dim = 64;
  Problem p = make_problem(2, 70, 97, heads, kv, dim);
  const auto with = [&](std::vector<HeadGroup> groups, bool causal, const std::string& what) {
    AttentionSpec spec = spec_of(p);
    spec.groups = std::move(groups);
    spec.mask.causal = causal;
    expect_accurate(p, spec, what);
  };
  const RopeParams rope(dim, dim);
  with({{heads, RotaryQK{rope}, {}}}, true, "rope half-split");
  with({{heads, RotaryQK{RopeParams(dim, 32, 500.0, RopeLayout::kInterleaved)}, {}}}, true,
       "rope interleaved, partial");
  with({{heads, RotaryQK{rope.with_xpos(64.0, 40.0)}, {}}}, true, "xpos");
  RopeScaling yarn;
  yarn.type = RopeType::kYarn;
  yarn.factor = 4.0;
  yarn.original_max_position_embeddings = 32;
  with({{heads, RotaryQK{RopeParams(dim, dim, 10000.0, RopeLayout::kHalfSplit, yarn, 128)}, {}}}, false, "rope yarn");
  with({{heads, RotaryQK{rope, true}, {}}}, true, "rope, keys already rotated");
  with({{heads, AbsoluteQK{SinusoidalParams(dim)}, {}}}, true, "shortformer");
  with({{heads, {}, AlibiParams(heads)}}, true, "alibi");
  with({{heads, {}, AlibiParams(heads, AlibiForm::kSymmetric)}}, false, "alibi symmetric");
  std::vector<double> t5_table(static_cast<std::size_t>(32 * heads));
  for (auto& x : t5_table) x = uniform(-2, 2);
  with({{heads, {}, T5BiasParams(heads, 32, 128, true, t5_table)}}, false, "t5");
  with({{heads, {}, KerpleParams(KerpleForm::kLog, {1.5, 0.5, 2.0, 1.0}, {1.0, 2.0, 0.5, 1.5})}}, true, "kerple log");
  with({{heads, {}, FireParams::init(heads, 16, 3)}}, true, "fire");
  // Keys on both sides of each query: FIRE's row walk goes down its pieces, then up again.
  with({{heads, {}, FireParams::init(heads, 16, 3, 0.5, 8.0)}}, false, "fire, keys on both sides");
  with({{heads, {}, tupe_with_cls(heads, dim, 32, 200, 4)}}, false, "tupe");
  with({{heads, {}, TupeParams::init(heads, dim, 32, 200, false, 0.5, 5)}}, true, "tupe without the [CLS] reset");
  const ShawParams shaw = ShawParams::init(6, dim, 0.5, 11);
  with({{heads, {}, {}, {shaw_term(heads, shaw)}}}, true, "shaw");
  with({{2, RotaryQK{rope}, AlibiParams(2), {shaw_term(2, shaw)}},
        {2, {}, {}, {shaw_term(2, ShawParams::init(3, dim, 0.5, 12))}}},
       false, "shaw with rope + alibi, and another shaw width");
  // Transformer-XL: u, v of magnitude ~0.5 so that every term moves the logits.
  with({{heads, {}, {}, {xl_term(XlParams::init(heads, dim, 40, 0.5, 21))}}}, true, "transformer-xl");
  with({{heads, {}, {}, {xl_term(XlParams::init(heads, dim, 32, 0.5, 22))}}}, false,
       "transformer-xl, keys on both sides");
  // d_model past one depth step (256) of the table products (blocked_gemm), and not a multiple of
  // the lane padding.
  with({{heads, {}, {}, {xl_term(XlParams::init(heads, dim, 300, 0.5, 27))}}}, true, "transformer-xl, d_model 300");
  with({{heads, {}, TupeParams::init(heads, dim, 300, 200, false, 0.5, 6)}}, true, "tupe, d_model 300");
  // One head of a KV group XL, the other ALiBi (XL transforms nothing, so it may split a group).
  with({{1, {}, {}, {xl_term(XlParams::init(1, dim, 16, 0.5, 23))}},
        {1, {}, AlibiParams(1)},
        {2, {}, {}, {xl_term(XlParams::init(2, dim, 16, 0.5, 24))}}},
       true, "xl | alibi | xl");
  // Half the heads RoPE, half ALiBi (KV group boundaries: 2 heads per KV head).
  with({{2, RotaryQK{rope}, {}}, {2, {}, AlibiParams(2)}}, true, "rope + alibi by head group");
  with({{1, {}, AlibiParams(1)},
        {1, {}, NoPE(1)},
        {2, RotaryQK{rope}, T5BiasParams(2, 16, 64, false, std::vector<double>(32, 0.25))}},
       true, "alibi | nope | rope + t5");
}

TEST_P(AttentionForward, PackedSequencesAndExplicitPositions) {
  Problem p = make_packed({{5, 5}, {0, 3}, {33, 40}, {17, 17}, {1, 9}}, 4, 1, 48);
  AttentionSpec spec = spec_of(p);
  spec.mask.causal = true;
  expect_accurate(p, spec, "packed causal");
  spec.groups = {{4, RotaryQK{RopeParams(48, 48)}, AlibiParams(4)}};
  expect_accurate(p, spec, "packed rope + alibi");
  // Arbitrary, far-apart positions (tables by token, bias evaluated per element).
  Problem d = make_problem(1, 20, 40, 2, 2, 32);
  std::vector<std::int64_t> q_ids(20), k_ids(40);
  for (auto& x : q_ids) x = uniform_int(0, std::int64_t{1} << 30);
  for (auto& x : k_ids) x = uniform_int(0, std::int64_t{1} << 30);
  AttentionSpec s2 = spec_of(d);
  s2.q_positions = Positions::ids(q_ids);
  s2.k_positions = Positions::ids(k_ids);
  s2.groups = {{2, RotaryQK{RopeParams(32, 32)}, AlibiParams(2, AlibiForm::kSymmetric)}};
  expect_accurate(d, s2, "scattered positions");
  // XL over explicit positions with gaps (its P(δ) table spans their differences).
  Problem x = make_problem(2, 30, 50, 2, 1, 32);
  std::vector<std::int64_t> xq(60), xk(100);
  for (auto& v : xq) v = uniform_int(0, 300);
  for (auto& v : xk) v = uniform_int(0, 300);
  AttentionSpec s3 = spec_of(x);
  s3.q_positions = Positions::ids(xq, 2, 30);
  s3.k_positions = Positions::ids(xk, 2, 50);
  s3.groups = {{2, {}, {}, {xl_term(XlParams::init(2, 32, 16, 0.5, 25))}}};
  expect_accurate(x, s3, "xl, explicit positions");
  Problem xp = make_packed({{5, 9}, {40, 40}, {1, 7}}, 2, 2, 32);
  AttentionSpec s4 = spec_of(xp);
  s4.mask.causal = true;
  s4.groups = {{2, {}, {}, {xl_term(XlParams::init(2, 32, 24, 0.5, 26))}}};
  expect_accurate(xp, s4, "xl, packed");
}

TEST_P(AttentionForward, DecodeSplitsLongCachesExactly) {
  // 1 and 2 queries × 4 heads over 1 KV head: dot-product scores; 9000 keys: two chunks (of
  // 8192 keys: 4 MiB of 512-byte keys and values).
  for (const std::int64_t q_len : {1, 2}) {
    Problem p = make_problem(1, q_len, 9000, 4, 1, 64);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = true;
    expect_accurate(p, spec, "decode");
    spec.groups = {{4, RotaryQK{RopeParams(64, 64)}, AlibiParams(4)}};
    expect_accurate(p, spec, "decode rope + alibi");
    spec.groups = {{4, {}, {}, {shaw_term(4, ShawParams::init(16, 64, 0.5, 5))}}};
    expect_accurate(p, spec, "decode shaw");
    spec.groups = {{4, {}, {}, {xl_term(XlParams::init(4, 64, 32, 0.5, 6))}}};
    expect_accurate(p, spec, "decode xl");
    spec.groups = {{4, {}, tupe_with_cls(4, 64, 16, 9000, 7)}};
    expect_accurate(p, spec, "decode tupe");
  }
}

TEST_P(AttentionForward, DecodeReadsXlAndTupeTablesAtEveryEdge) {
  // Decode reads XL's P(δ) and TUPE's PK rows for a tile of consecutive keys as one block of
  // table rows. With three queries, a window cuts the block at both ends of XL's table and the
  // causal diagonal at its lower end; δ < 0, offset and non-causal positions read blocks inside
  // it; [CLS] keys and queries take TUPE's θ; gapped positions take the per-pair path. D 48 takes
  // the kernel's packed form on every vector target, D 44 its row form with scalar tails.
  for (const auto& [q_len, dim] : {std::pair<std::int64_t, std::int64_t>{1, 48}, {3, 48}, {3, 44}}) {
    Problem p = make_problem(1, q_len, 700, 4, 2, dim);
    for (const bool xl : {true, false}) {
      SCOPED_TRACE(xl ? "xl" : "tupe");
      AttentionSpec spec = spec_of(p);
      spec.groups = {xl ? HeadGroup{4, {}, {}, {xl_term(XlParams::init(4, dim, 20, 0.5, 31))}}
                        : HeadGroup{4, {}, tupe_with_cls(4, dim, 16, 2200, 32)}};
      expect_accurate(p, spec, "decode, full");
      spec.mask.causal = true;
      spec.mask.window_left = 130;
      expect_accurate(p, spec, "decode, window");
      spec.mask.window_left = -1;
      spec.mask.chunk_size = 96;
      expect_accurate(p, spec, "decode, chunks");
      spec.mask.chunk_size.reset();
      spec.q_positions = Positions::range(q_len, 1000);
      spec.k_positions = Positions::range(700, 400);
      expect_accurate(p, spec, "decode, offset positions");
      spec.q_positions = Positions::range(q_len, 0);  // TUPE: the [CLS] query
      spec.k_positions = Positions::range(700, 0);
      spec.mask.causal = false;
      expect_accurate(p, spec, "decode, queries from position 0");
      std::vector<std::int64_t> ids(700);
      for (std::size_t j = 0; j < ids.size(); ++j) ids[j] = static_cast<std::int64_t>(j * 3 + j % 5);
      spec.q_positions.reset();
      spec.k_positions = Positions::ids(ids);
      expect_accurate(p, spec, "decode, gapped key positions");
    }
  }
}

TEST_P(AttentionForward, DecodeBlocksMixShawWithOtherGroups) {
  // Decode runs every KV head's rows as one block: Shaw rows beside rows of another scheme, or of
  // another Shaw table width, take the per-row forms.
  for (const std::int64_t q_len : {1, 3}) {
    Problem p = make_problem(1, q_len, 700, 4, 2, 32);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = true;
    spec.groups = {{2, {}, {}, {shaw_term(2, ShawParams::init(5, 32, 0.5, 41))}}, {2, {}, AlibiParams(2)}};
    expect_accurate(p, spec, "decode, shaw + alibi");
    spec.groups = {{1, {}, {}, {shaw_term(1, ShawParams::init(3, 32, 0.5, 42))}},
                   {3, {}, {}, {shaw_term(3, ShawParams::init(9, 32, 0.5, 43))}}};
    expect_accurate(p, spec, "decode, shaw of two widths");
  }
}

TEST_P(AttentionForward, DecodeSizesTilesAndChunksByBytes) {
  // Wide caches get shorter key tiles (about 256 KiB of keys per tile) and shorter parallel
  // chunks (about 4 MiB of keys and values): 16 KV heads × D 128 in f32 take tiles of 32 keys
  // and chunks of 256 (700 keys: 3 chunks, the last partial); 32 KV heads tiles of 16 and chunks
  // of 128 (6 chunks); bf16 is counted as f32 (the same tiles and chunks as the f32 cache of its
  // values: DecodeReadsSixteenBitCachesAsTheirF32Values). Accurate, and the same bits for 1, 2
  // and 3 threads.
  struct Shape {
    std::int64_t heads, kv_heads, q_len;
    DType dtype;
  };
  for (const Shape& sh : {Shape{16, 16, 1, DType::kF32}, Shape{32, 32, 1, DType::kF32}, Shape{16, 16, 1, DType::kBF16},
                          Shape{16, 16, 4, DType::kF32}, Shape{32, 8, 2, DType::kF32}}) {
    const std::string what = std::to_string(sh.heads) + "/" + std::to_string(sh.kv_heads) + " heads, " +
                             std::to_string(sh.q_len) + " queries, " + std::string(dtype_name(sh.dtype));
    const Problem p = make_problem(1, sh.q_len, 700, sh.heads, sh.kv_heads, 128, sh.dtype);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = true;
    spec.groups = {{sh.heads, RotaryQK{RopeParams(128, 128)}, {}}};
    expect_accurate(p, spec, what);
    const Attention att(spec);
    std::vector<Outputs> runs;
    for (const int threads : {1, 2, 3}) {
      set_num_threads(threads);
      runs.push_back(run_forward(p, att, 0));
    }
    set_num_threads(2);
    for (std::size_t r = 1; r < runs.size(); ++r) {
      EXPECT_EQ(runs[r].out, runs[0].out) << what;
      EXPECT_EQ(runs[r].lse, runs[0].lse) << what;
    }
  }
}

TEST_P(AttentionForward, DecodeRunsEveryKvHeadAsOneBlock) {
  // Decode lays every KV head's rows side by side in one score tile (head g's rows at lanes g·R …):
  // a scheme that differs from head to head, masks, the soft-cap and key lengths must each reach
  // their own lanes. 4 KV heads; 2 rows (1 query × 2 heads, 2 queries × 1 head) or 4 rows per KV
  // head; 700 keys (tiles and a partial block), 9000 (three chunks).
  for (const std::array<std::int64_t, 3>& shape_of :
       std::vector<std::array<std::int64_t, 3>>{{1, 8, 700}, {2, 4, 700}, {1, 16, 9000}}) {
    // Named, not a structured binding: a lambda below captures k_len (clang 14 cannot capture bindings).
    const std::int64_t q_len = shape_of[0], heads = shape_of[1], k_len = shape_of[2];
    const std::int64_t dim = 64;
    Problem p = make_problem(k_len > 1000 ? 1 : 2, q_len, k_len, heads, 4, dim);
    const std::string shape =
        std::to_string(q_len) + " × " + std::to_string(heads) + " heads, " + std::to_string(k_len) + " keys: ";
    const auto with = [&](std::vector<HeadGroup> groups, const std::string& what,
                          const std::function<void(AttentionMask&)>& mask) {
      AttentionSpec spec = spec_of(p);
      spec.groups = std::move(groups);
      spec.mask.causal = true;
      mask(spec.mask);
      expect_accurate(p, spec, shape + what);
    };
    const auto causal = [](AttentionMask&) {};
    const std::int64_t half = heads / 2, quarter = heads / 4;
    std::vector<double> t5_table(static_cast<std::size_t>(32 * quarter));
    for (auto& x : t5_table) x = uniform(-2, 2);
    std::vector<double> r1(static_cast<std::size_t>(quarter)), r2(r1.size());
    for (std::size_t i = 0; i < r1.size(); ++i) {
      r1[i] = uniform(0.5, 2.0);
      r2[i] = uniform(0.5, 2.0);
    }
    with({{heads, {}, AlibiParams(heads)}}, "alibi", causal);
    // Four schemes, a quarter of the heads each: KV head g's rows carry scheme g.
    with({{quarter, RotaryQK{RopeParams(dim, dim)}, {}},
          {quarter, {}, AlibiParams(quarter)},
          {quarter, {}, T5BiasParams(quarter, 32, 128, true, t5_table)},
          {quarter, {}, KerpleParams(KerpleForm::kLog, r1, r2)}},
         "rope | alibi | t5 | kerple", causal);
    with({{half, {}, FireParams::init(half, 16, 3)}, {half, RotaryQK{RopeParams(dim, dim)}, AlibiParams(half)}},
         "fire | rope + alibi", causal);
    with({{heads, {}, AlibiParams(heads)}}, "alibi, window 37, soft-cap 5", [](AttentionMask& m) {
      m.window_left = 37;
      m.softcap = 5.0;
    });
    with({{heads, RotaryQK{RopeParams(dim, dim)}, {}}}, "rope, key lengths", [&](AttentionMask& m) {
      m.causal = false;
      m.key_lengths = {k_len / 3, k_len - 1};
      m.key_lengths.resize(static_cast<std::size_t>(p.batch));
    });
  }
}

// Prefill units of a group of 4 or 2 query blocks (forward_blocks) load each key tile once for the
// group. A group of n is formed when the blocks number at least 8·n per thread, so one thread runs
// the square problem (32 blocks of 128 queries) in groups of 4, two threads in pairs, and 64
// threads one block at a time; the results must agree bit for bit, and be accurate where grouped.
TEST_P(AttentionForward, GroupedBlocksKeepTheBitsOfSingleBlocks) {
  if (GetParam() == "ref") GTEST_SKIP() << "the fused kernels only (the reference has no blocks)";
  const auto expect_same_bits = [](const Problem& p, const AttentionSpec& spec, const std::string& what) {
    SCOPED_TRACE(what);
    const Attention att(spec);
    set_num_threads(64);
    const Outputs single = run_forward(p, att, 0);
    const AttentionStats single_tiles = single.stats;
    for (const int threads : {1, 2}) {
      set_num_threads(threads);
      const Outputs grouped = run_forward(p, att, 0);
      EXPECT_EQ(grouped.out, single.out) << threads << " threads";
      EXPECT_EQ(grouped.lse, single.lse) << threads << " threads";
      // The far-tile skip decides per block, grouped or not.
      EXPECT_EQ(grouped.stats.tiles, single_tiles.tiles) << threads << " threads";
      EXPECT_EQ(grouped.stats.skipped, single_tiles.skipped) << threads << " threads";
    }
    set_num_threads(2);
    return single_tiles.skipped;
  };
  const std::int64_t dim = 32;
  // 8 KV heads × 4 blocks of 128 queries; then queries ending a longer run of keys (the blocks'
  // last tiles partial, the second block's reaching further), GQA (G = 2, blocks of 64 queries,
  // an odd last block), and packed sequences.
  Problem square = make_problem(1, 512, 512, 8, 8, dim);
  Problem longer_keys = make_problem(1, 300, 517, 8, 8, dim);
  Problem grouped = make_problem(2, 230, 230, 8, 4, dim);
  Problem packed = make_packed({{300, 300}, {70, 90}, {260, 333}, {1, 5}}, 8, 8, dim);
  for (const Problem* p : {&square, &longer_keys, &grouped, &packed}) {
    AttentionSpec spec = spec_of(*p);
    spec.mask.causal = true;
    expect_same_bits(*p, spec, "causal");
    spec.mask.causal = false;
    expect_same_bits(*p, spec, "bidirectional");
    // Windows start each block's keys apart: such pairs run their blocks one at a time.
    spec.mask.causal = true;
    spec.mask.window_left = 100;
    expect_same_bits(*p, spec, "sliding window");
  }
  set_num_threads(1);
  AttentionSpec spec = spec_of(longer_keys);
  spec.mask.causal = true;
  expect_accurate(longer_keys, spec, "grouped, longer keys");
  spec = spec_of(grouped);
  spec.mask.causal = true;
  expect_accurate(grouped, spec, "grouped blocks, GQA");
  set_num_threads(2);
  // Every kind of scheme; ALiBi's steep slopes run the tiles from the diagonal down and skip far
  // ones (the last head has none, so its KV head's blocks skip nothing).
  const RopeParams rope(dim, dim);
  const std::vector<double> steep = {4.0, 2.0, 1.0, 0.5, 4.0, 2.0, 1.0, 0.0};
  spec = spec_of(square);
  spec.mask.causal = true;
  spec.groups = {{8, {}, AlibiParams(steep)}};
  EXPECT_GT(expect_same_bits(square, spec, "alibi, steep"), 0);
  spec.groups = {{8, RotaryQK{rope}, AlibiParams(steep)}};
  EXPECT_GT(expect_same_bits(square, spec, "rope + alibi, steep"), 0);
  spec.mask.causal = false;
  spec.groups = {{8, {}, AlibiParams(steep, AlibiForm::kSymmetric)}};
  EXPECT_GT(expect_same_bits(square, spec, "alibi symmetric, steep"), 0);
  std::vector<double> t5_table(static_cast<std::size_t>(32 * 8));
  for (auto& x : t5_table) x = uniform(-2, 2);
  const std::vector<std::pair<std::vector<HeadGroup>, std::string>> schemes = {
      {{{8, RotaryQK{rope}, {}}}, "rope"},
      {{{8, {}, T5BiasParams(8, 32, 128, true, t5_table)}}, "t5"},
      {{{8, {}, FireParams::init(8, 16, 3)}}, "fire"},
      {{{8, {}, {}, {shaw_term(8, ShawParams::init(6, dim, 0.5, 11))}}}, "shaw"},
      {{{8, {}, {}, {xl_term(XlParams::init(8, dim, 24, 0.5, 21))}}}, "transformer-xl"},
      {{{8, {}, tupe_with_cls(8, dim, 16, 600, 4)}}, "tupe"},
      {{{4, AbsoluteQK{SinusoidalParams(dim)}, {}}, {4, RotaryQK{rope}, {}}}, "shortformer | rope"}};
  for (const auto& [groups, what] : schemes) {
    spec = spec_of(longer_keys);
    spec.mask.causal = true;
    spec.groups = groups;
    expect_same_bits(longer_keys, spec, what);
  }
}

// ALiBi with steep slopes: far key tiles vanish and are skipped. Skipping must change no bit
// (against the same plan with skipping off, which runs the tiles in the same order) and must
// happen; the result stays as accurate as ever.
TEST_P(AttentionForward, VanishingFarTilesAreSkippedWithoutChangingABit) {
  if (GetParam() == "ref") GTEST_SKIP() << "the fused kernels only (the reference runs every pair)";
  const std::vector<double> steep = kSteepSlopes;
  const std::vector<VanishingCase> cases = {
      {"causal", 330, 330, true, -1, {{4, {}, AlibiParams(steep)}}},
      {"causal, queries at the end of longer keys", 150, 470, true, -1, {{4, {}, AlibiParams(steep)}}},
      {"rope + alibi", 300, 300, true, -1, {{4, RotaryQK{RopeParams(64, 64)}, AlibiParams(steep)}}},
      {"bidirectional, symmetric", 300, 300, false, -1, {{4, {}, AlibiParams(steep, AlibiForm::kSymmetric)}}},
      {"sliding window", 330, 330, true, 200, {{4, {}, AlibiParams(steep)}}},
      {"large logits", 330, 330, true, -1, {{4, {}, AlibiParams(steep)}}, true, 4.0},
      {"paper slopes, short", 130, 130, true, -1, {{4, {}, AlibiParams(4)}}, false},
  };
  for (const VanishingCase& c : cases) {
    SCOPED_TRACE(c.what);
    const Problem p = c.problem();
    const AttentionSpec spec = c.spec(p);
    const auto [skipping, running] = with_and_without_skip(spec);
    const Outputs a = run_forward(p, skipping, 0), b = run_forward(p, running, 0);
    EXPECT_EQ(b.stats.skipped, 0);
    EXPECT_EQ(a.stats.tiles, b.stats.tiles);
    if (c.skips) {
      EXPECT_GT(a.stats.skipped, 0);
    }
    ASSERT_EQ(a.out.size(), b.out.size());
    for (std::size_t i = 0; i < a.out.size(); ++i) {
      ASSERT_EQ(std::bit_cast<std::uint64_t>(a.out[i]), std::bit_cast<std::uint64_t>(b.out[i])) << "out " << i;
    }
    for (std::size_t i = 0; i < a.lse.size(); ++i) {
      ASSERT_EQ(std::bit_cast<std::uint64_t>(a.lse[i]), std::bit_cast<std::uint64_t>(b.lse[i])) << "lse " << i;
    }
    expect_accurate(p, spec, c.what);
  }
}
// On aligned_far_keys: skipping must change no bit and must happen.
TEST_P(AttentionForward, SkippedTilesHoldOnlyFlushedProbabilities) {
  if (GetParam() == "ref") GTEST_SKIP() << "the fused kernels only";
  const Problem p = aligned_far_keys();
  const auto [skipping, running] = with_and_without_skip(aligned_far_keys_spec(p));
  const Outputs a = run_forward(p, skipping, 0), b = run_forward(p, running, 0);
  EXPECT_GT(a.stats.skipped, 0);
  for (std::size_t i = 0; i < a.out.size(); ++i) {
    ASSERT_EQ(std::bit_cast<std::uint64_t>(a.out[i]), std::bit_cast<std::uint64_t>(b.out[i])) << "out " << i;
  }
  // A NaN in a key of an otherwise vanishing tile: its norm fails the bound, the tile runs, and
  // both plans give the same bits (NaN outputs where the target's max lets the NaN through, as
  // the SIMD targets do: there a skipped tile would show).
  Problem nan_key = aligned_far_keys();
  nan_key.k[5 * 64 + 3] = std::numeric_limits<double>::quiet_NaN();
  nan_key.kb = testing::to_dtype(nan_key.k, nan_key.dtype);
  const auto [skipping_nan, running_nan] = with_and_without_skip(aligned_far_keys_spec(nan_key));
  const Outputs c = run_forward(nan_key, skipping_nan, 0), e = run_forward(nan_key, running_nan, 0);
  for (std::size_t i = 0; i < c.out.size(); ++i) {
    ASSERT_EQ(std::bit_cast<std::uint64_t>(c.out[i]), std::bit_cast<std::uint64_t>(e.out[i])) << "out " << i;
  }
}

TEST_P(AttentionForward, DecodeAcrossRowsHeadsAndTails) {
  // The decode kernels block keys by the number of query rows per KV head (1 … 8) and sweep
  // every KV head per block: rows, KV heads, key counts that leave partial blocks and tiles, head
  // dims with a remainder of the lane count, head-major (strided) caches and 16-bit inputs.
  for (int trial = 0; trial < 8; ++trial) {
    const std::int64_t kv = std::vector<std::int64_t>{1, 2, 3, 8}[static_cast<std::size_t>(uniform_int(0, 3))];
    const std::int64_t group = uniform_int(1, 8), q_len = uniform_int(1, 8 / group);
    const std::int64_t dim = std::vector<std::int64_t>{24, 64, 80, 128}[static_cast<std::size_t>(trial % 4)];
    const std::int64_t k_len = q_len + uniform_int(0, trial == 7 ? 9000 : 300);
    const DType dt = trial % 3 == 2 ? DType::kBF16 : DType::kF32;
    Problem p = make_problem(uniform_int(1, 2), q_len, k_len, kv * group, kv, dim, dt, trial % 2 == 1);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = trial % 2 == 0;
    expect_accurate(p, spec,
                    "decode, " + std::to_string(group * q_len) + " rows per KV head, " + std::to_string(kv) +
                        " KV heads, D " + std::to_string(dim) + ", " + std::to_string(k_len) + " keys");
  }
}

TEST_P(AttentionForward, DecodeReadsSixteenBitCachesAsTheirF32Values) {
  // Decode reads bf16 and f16 caches where they lie, widening each vector exactly to f32 (on
  // targets with those widenings; elsewhere, and at dims whose rows leave a partial vector, the
  // engine widens each tile into f32 scratch). Either way the arithmetic must be that of an f32
  // cache holding the same values: lse equal to the bit, and the 16-bit output equal to the f32
  // output rounded once to the dtype. Rows per KV head 1 to 8 (5, 6 and 7 leave accumulators of
  // the packed scores idle; on SSE4's 4 lanes they take the widening path), dims that fill whole
  // vectors and one that does not (72), GQA, and a cache long enough to be split into chunks.
  struct Shape {
    std::int64_t q_len, heads, kv_heads, dim, k_len;
  };
  const Shape shapes[] = {{1, 8, 2, 64, 300},   {1, 16, 4, 128, 9000}, {1, 4, 4, 80, 517},
                          {2, 8, 2, 64, 131},   {1, 32, 4, 128, 700},  {1, 6, 2, 72, 250},
                          {1, 28, 4, 128, 600}, {1, 10, 2, 64, 333},   {2, 6, 2, 80, 190}};
  for (const DType dt : {DType::kBF16, DType::kF16}) {
    for (const Shape& sh : shapes) {
      const std::string what = std::string(dtype_name(dt)) + ", " + std::to_string(sh.q_len * sh.heads / sh.kv_heads) +
                               " rows per KV head, D " + std::to_string(sh.dim) + ", " + std::to_string(sh.k_len) +
                               " keys";
      SCOPED_TRACE(what);
      const Problem p16 = make_problem(1, sh.q_len, sh.k_len, sh.heads, sh.kv_heads, sh.dim, dt);
      Problem p32 = p16;
      p32.dtype = DType::kF32;
      p32.qb = testing::to_dtype(p16.q, DType::kF32);
      p32.kb = testing::to_dtype(p16.k, DType::kF32);
      p32.vb = testing::to_dtype(p16.v, DType::kF32);
      AttentionSpec spec16 = spec_of(p16), spec32 = spec_of(p32);
      spec16.mask.causal = spec32.mask.causal = true;
      spec16.groups = spec32.groups = {{sh.heads, {}, AlibiParams(sh.heads)}};
      const Outputs o16 = run_forward(p16, Attention(spec16), 0), o32 = run_forward(p32, Attention(spec32), 0);
      for (std::size_t i = 0; i < o32.lse.size(); ++i) ASSERT_EQ(o16.lse[i], o32.lse[i]) << "lse " << i;
      for (std::size_t i = 0; i < o32.out.size(); ++i)
        ASSERT_EQ(o16.out[i], testing::round_to(o32.out[i], dt)) << "out " << i;
      expect_accurate(p16, spec16, what);
    }
  }
}

TEST_P(AttentionForward, DecodeRotatesAnUnrotatedCacheTileByTile) {
  // One RoPE over every head with the cache stored un-rotated. Decode rotates the keys inside the
  // scores where the pairs fill whole vectors and the packed scores apply (D 128, full or partial
  // rotary), else while widening each tile into scratch (attn_pack_rotate_heads): in registers
  // when the pairs fill vectors (D 72 with 64 rotated: the rows do not fill them), row by row
  // otherwise (D 80: 40 pairs, on AVX-512). Interleaved pairs are rotated inside the scores
  // when the rotated dims fill whole vectors (D 128, rotary 128 or 64; D 80 with 80), else row by
  // row (D 72 with 64 rotated on AVX-512, whose rows do not fill 16-lane vectors; AVX2 and SSE4
  // rotate it in the scores). f32, bf16 and f16, caches long enough to be split.
  struct Shape {
    std::int64_t heads, kv_heads, dim, rotary_dim, k_len;
    DType dtype;
    RopeLayout layout = RopeLayout::kHalfSplit;
  };
  constexpr RopeLayout kInterleaved = RopeLayout::kInterleaved;
  const Shape shapes[] = {{8, 2, 128, 128, 700, DType::kF32},
                          {8, 2, 128, 64, 5000, DType::kF32},
                          {4, 4, 80, 80, 333, DType::kF32},
                          {8, 2, 128, 128, 9000, DType::kBF16},
                          {8, 2, 128, 64, 517, DType::kF16},
                          {6, 2, 80, 80, 250, DType::kBF16},
                          {8, 2, 72, 64, 400, DType::kF32},
                          {8, 2, 72, 64, 300, DType::kBF16},
                          {8, 2, 128, 128, 9000, DType::kF32, kInterleaved},
                          {8, 2, 128, 64, 517, DType::kBF16, kInterleaved},
                          {6, 2, 80, 80, 250, DType::kF16, kInterleaved},
                          {4, 4, 80, 80, 333, DType::kF32, kInterleaved},
                          {8, 2, 72, 64, 300, DType::kF32, kInterleaved}};
  for (const Shape& sh : shapes) {
    const std::string what = std::string(dtype_name(sh.dtype)) + ", D " + std::to_string(sh.dim) + ", rotary " +
                             std::to_string(sh.rotary_dim) + ", " + std::to_string(sh.k_len) + " keys" +
                             (sh.layout == kInterleaved ? ", interleaved" : "");
    const Problem p = make_problem(1, 1, sh.k_len, sh.heads, sh.kv_heads, sh.dim, sh.dtype);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = true;
    spec.groups = {{sh.heads, RotaryQK{RopeParams(sh.dim, sh.rotary_dim, 10000.0, sh.layout)}, {}}};
    expect_accurate(p, spec, what);
  }
}

TEST_P(AttentionForward, DecodeAddsEveryHeadsTableBiasAsOneRow) {
  // One query per sequence and every head tabulated (ALiBi and T5 groups here): decode adds each
  // key's biases for all heads as one row of a [δ][head] table. A packed spec (cu_seqlens) of the
  // same single sequence adds them lane by lane; both must agree to the bit, and with the fp64
  // reference. Caches long enough to be split, GQA with groups that straddle KV heads.
  for (const std::int64_t k_len : {std::int64_t{77}, std::int64_t{700}, std::int64_t{9000}}) {
    SCOPED_TRACE(std::to_string(k_len) + " keys");
    const Problem p = make_problem(1, 1, k_len, 12, 4, 64);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = true;
    std::vector<double> t5_table(32 * 6);
    for (std::size_t i = 0; i < t5_table.size(); ++i) t5_table[i] = 0.05 * static_cast<double>(i % 17) - 0.3;
    spec.groups = {{6, {}, AlibiParams(6)}, {6, {}, T5BiasParams(6, 32, 128, false, t5_table)}};
    expect_accurate(p, spec, "ALiBi and T5");
    Problem packed = p;
    packed.cu_q = {0, 1};
    packed.cu_k = {0, k_len};
    AttentionSpec packed_spec = spec_of(packed);
    packed_spec.mask = spec.mask;
    packed_spec.groups = spec.groups;
    const Outputs one_row = run_forward(p, Attention(spec), 0),
                  lane_by_lane = run_forward(packed, Attention(packed_spec), 0);
    for (std::size_t i = 0; i < one_row.out.size(); ++i) ASSERT_EQ(one_row.out[i], lane_by_lane.out[i]) << "out " << i;
    for (std::size_t i = 0; i < one_row.lse.size(); ++i) ASSERT_EQ(one_row.lse[i], lane_by_lane.lse[i]) << "lse " << i;
  }
}

TEST_P(AttentionForward, SixteenBitInputs) {
  for (const DType dt : {DType::kBF16, DType::kF16}) {
    Problem p = make_problem(1, 45, 61, 2, 1, 80, dt, true);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = true;
    spec.groups = {{2, RotaryQK{RopeParams(80, 80)}, {}}};
    expect_accurate(p, spec, std::string(dtype_name(dt)));
  }
}

TEST_P(AttentionForward, BF16ProductsOnHostsThatHaveThem) {
  // bf16 inputs take the host's bf16 dot products in prefill where bf16_dot_products() says so
  // (AVX512-BF16 under the avx512 target), each case then within the bound of docs/attention.md and
  // twice the naive bf16-product error (expect_accurate); elsewhere, or with bf16_products off, the
  // widened f32 products and their half-ulp bound. Odd head dims and key counts leave half pairs,
  // GQA shares a tile's pairs among query blocks, RoPE rounds rotated keys, ALiBi skips far tiles.
  const bool native = bf16_dot_products();
  for (int trial = 0; trial < 6; ++trial) {
    const std::int64_t dim = std::vector<std::int64_t>{64, 80, 128, 33, 24, 96}[static_cast<std::size_t>(trial)];
    const std::int64_t kv = uniform_int(1, 2), heads = kv * uniform_int(1, 4);
    const std::int64_t q_len = uniform_int(20, 200), k_len = q_len + uniform_int(0, 70);
    Problem p = make_problem(uniform_int(1, 2), q_len, k_len, heads, kv, dim, DType::kBF16, trial % 2 == 1);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = trial % 3 != 2;
    if (trial % 3 == 1) spec.groups = {{heads, RotaryQK{RopeParams(dim, dim)}, {}}};
    if (trial % 3 == 2) spec.groups = {{heads, {}, AlibiParams(heads)}};
    const std::string what = "D " + std::to_string(dim) + ", " + std::to_string(q_len) + " × " + std::to_string(k_len);
    expect_accurate(p, spec, what);
    const Attention att(spec);
    const Outputs two = run_forward(p, att, 0);
    EXPECT_EQ(two.stats.bf16_products, native) << what;
    set_num_threads(1);
    const Outputs one = run_forward(p, att, 0);
    set_num_threads(2);
    for (std::size_t i = 0; i < one.out.size(); ++i)
      ASSERT_EQ(std::bit_cast<std::uint64_t>(one.out[i]), std::bit_cast<std::uint64_t>(two.out[i]))
          << what << ", " << i;
    spec.bf16_products = false;
    const Attention widened(spec);
    EXPECT_FALSE(run_forward(p, widened, 0).stats.bf16_products) << what;
    expect_accurate(p, spec, what + ", widened");
  }
  // Grouped blocks share a tile's value pairs: with 5 query heads per KV head a block holds 25
  // queries, so the first causal block ends at key 25, inside the pair (24, 25) of the tile its
  // group of four loaded (32 blocks on one thread make groups of four). An infinite value at key
  // 25 must not reach the rows that cannot see it (0·inf).
  const std::int64_t kv_heads = 8, heads = 5 * kv_heads, dim = 64;
  Problem g = make_problem(1, 100, 100, heads, kv_heads, dim, DType::kBF16);
  for (std::int64_t d = 0; d < kv_heads * dim; ++d)
    g.v[static_cast<std::size_t>(25 * kv_heads * dim + d)] = std::numeric_limits<double>::infinity();
  g.vb = testing::to_dtype(g.v, g.dtype);
  AttentionSpec gs = spec_of(g);
  gs.mask.causal = true;
  set_num_threads(1);
  const Outputs grouped = run_forward(g, Attention(gs), 0);
  set_num_threads(2);
  for (std::int64_t i = 0; i < 25 * heads * dim; ++i)
    ASSERT_TRUE(std::isfinite(grouped.out[static_cast<std::size_t>(i)])) << "query " << i / (heads * dim);
  EXPECT_FALSE(std::isfinite(grouped.out[static_cast<std::size_t>(25 * heads * dim)]));  // key 25 sees itself
}

INSTANTIATE_TEST_SUITE_P(Targets, AttentionForward, ::testing::ValuesIn(testing::all_targets()));

// ─── The matrix kernel ───────────────────────────────────────────────────────────────────────
// attn_gemm splits deep products into passes over blocks of the depth (so that B's column strip
// stays in L1), storing C between passes. Every element must still be one chain of multiply-adds
// in t order, from C (accumulate) or from 0: the engine's bit-for-bit claims (thread counts,
// grouped blocks, skipped tiles) rest on it. The chain is fused on targets with FMA (AVX2,
// AVX-512) and a multiply then an add elsewhere (SSE4, scalar); the whole result must equal one
// of the two folds exactly. Depths straddle the pass sizes (128 on AVX-512 and AVX2, 256 on SSE4,
// 1024 on scalar); depth 0 must still set C to 0 when not accumulating.
class AttentionMatrixKernel : public EveryTarget {};

// One random problem of the matrix kernel: A(m, t) at m·a_row + t·a_depth (rows or columns
// contiguous, with a gap), B and C with padding, C's entries in [−c_range, c_range]; and the two
// results the kernel may give in `mode`, element by element: its multiply-adds in t order fused,
// or each product rounded on its own then added. kSet starts each chain from 0, kChain from C,
// kAddSum sums from 0 and adds the sum to C once (attn_gemm_add).
enum class GemmMode { kSet, kChain, kAddSum };
struct GemmCase {
  std::int64_t rows, cols, depth, a_row, a_depth, ldb, ldc;
  std::vector<float> a, b, c, fused, unfused;
  GemmCase(std::int64_t depth_, bool transposed_a, GemmMode mode, double c_range)
      : rows(uniform_int(1, 23)),
        cols(kernels::kAttnAlign * uniform_int(1, 6)),
        depth(depth_),
        a_row(transposed_a ? 1 : depth_ + 3),
        a_depth(transposed_a ? rows + 5 : 1),
        ldb(cols + 16),
        ldc(cols + 32) {
    a.resize(static_cast<std::size_t>(rows * a_row + depth * a_depth));
    b.resize(static_cast<std::size_t>(depth * ldb));
    c.resize(static_cast<std::size_t>(rows * ldc));
    for (auto& x : a) x = static_cast<float>(uniform(-1, 1));
    for (auto& x : b) x = static_cast<float>(uniform(-1, 1));
    for (auto& x : c) x = static_cast<float>(uniform(-c_range, c_range));
    fused = unfused = c;
    for (std::int64_t m = 0; m < rows; ++m) {
      for (std::int64_t n = 0; n < cols; ++n) {
        const auto at = static_cast<std::size_t>(m * ldc + n);
        float f = mode == GemmMode::kChain ? c[at] : 0.0f, u = f;
        for (std::int64_t t = 0; t < depth; ++t) {
          const float x = a[static_cast<std::size_t>(m * a_row + t * a_depth)],
                      y = b[static_cast<std::size_t>(t * ldb + n)];
          f = std::fma(x, y, f);
          // The product rounded on its own (exact in double, then one rounding to float), so that no
          // compiler setting can contract it with the add.
          const auto product = static_cast<float>(static_cast<double>(x) * y);
          u = product + u;
        }
        fused[at] = mode == GemmMode::kAddSum ? c[at] + f : f;
        unfused[at] = mode == GemmMode::kAddSum ? c[at] + u : u;
      }
    }
  }
  std::string describe() const {
    return "rows " + std::to_string(rows) + " cols " + std::to_string(cols) + " depth " + std::to_string(depth) +
           (a_row == 1 ? " A transposed" : "");
  }
  // The kernel's C equals one of the two folds, to the bit.
  bool matches(const std::vector<float>& out) const {
    return std::memcmp(out.data(), fused.data(), out.size() * sizeof(float)) == 0 ||
           std::memcmp(out.data(), unfused.data(), out.size() * sizeof(float)) == 0;
  }
};

TEST_P(AttentionMatrixKernel, EachElementIsOneChainInDepthOrder) {
  for (int trial = 0; trial < 36; ++trial) {
    const std::int64_t depth = std::vector<std::int64_t>{
        0, 1, 7, 127, 128, 129, 255, 256, 257, 1000, 1025, 2100}[static_cast<std::size_t>(trial % 12)];
    const bool accumulate = trial % 3 != 0;
    const GemmCase g(depth, trial % 2 == 1, accumulate ? GemmMode::kChain : GemmMode::kSet, 1.0);
    SCOPED_TRACE(g.describe() + (accumulate ? " accumulate" : ""));
    std::vector<float> out = g.c;
    kernels::attn_gemm(g.a.data(), g.a_row, g.a_depth, g.b.data(), g.ldb, out.data(), g.ldc, g.rows, g.cols, depth,
                       accumulate);
    EXPECT_TRUE(g.matches(out));
  }
}

// attn_gemm_add: C + (one chain from 0 in t order), added once; depths up to kAttnGemmAddDepth
// (one pass on every target), beyond that an Error naming the depth.
TEST_P(AttentionMatrixKernel, AddSumsEachElementFromZeroThenAddsIt) {
  for (int trial = 0; trial < 24; ++trial) {
    const std::int64_t depth =
        std::vector<std::int64_t>{0, 1, 7, 63, 64, 100, 127, 128}[static_cast<std::size_t>(trial % 8)];
    // C large against the sums, so that adding once differs from chaining from C.
    const GemmCase g(depth, trial % 2 == 1, GemmMode::kAddSum, 100.0);
    SCOPED_TRACE(g.describe());
    std::vector<float> out = g.c;
    kernels::attn_gemm_add(g.a.data(), g.a_row, g.a_depth, g.b.data(), g.ldb, out.data(), g.ldc, g.rows, g.cols, depth);
    EXPECT_TRUE(g.matches(out));
  }
  std::vector<float> a(200, 1.0f), b(200 * kernels::kAttnAlign, 1.0f), c(kernels::kAttnAlign, 0.0f);
  expect_error(
      [&] {
        kernels::attn_gemm_add(a.data(), 200, 1, b.data(), kernels::kAttnAlign, c.data(), kernels::kAttnAlign, 1,
                               kernels::kAttnAlign, 129);
      },
      {"attention kernel", "depth", "129", "<= 128"});
}

// FoX's differences: each row r0 + t takes f32(row − key) once rounded (decode: its own key
// column key[j·ld + t]; blocks: key[j] for every row), the same bits as the scalar expression,
// whole vectors and tails alike; rows outside the run stay as they were.
TEST_P(AttentionMatrixKernel, HeadDifferencesRoundOnceAndTouchOnlyTheirRows) {
  for (int trial = 0; trial < 40; ++trial) {
    const std::int64_t width = uniform_int(1, 40), r0 = uniform_int(0, width - 1), n = uniform_int(1, width - r0);
    const std::int64_t keys = uniform_int(1, 20), ld = n + uniform_int(0, 5);
    std::vector<double> row(static_cast<std::size_t>(width)), key(static_cast<std::size_t>(keys * ld));
    // Mostly decays of a few thousand, some ±inf, NaN and beyond f32's range (a −inf gate, f64
    // gates): those must round as the cast does, to ±inf, on every target.
    constexpr double kInf = std::numeric_limits<double>::infinity();
    const std::array<double, 5> extreme = {kInf, -kInf, std::nan(""), 1e300, -1e300};
    const auto draw = [&] {
      return uniform_int(0, 9) == 0 ? extreme[static_cast<std::size_t>(uniform_int(0, 4))] : uniform(-3000.0, 0.0);
    };
    for (double& x : row) x = draw();
    for (double& x : key) x = draw();
    std::vector<float> st(static_cast<std::size_t>(keys * width));
    for (float& x : st) x = static_cast<float>(uniform(-5.0, 5.0));
    std::vector<float> want = st;
    for (std::int64_t j = 0; j < keys; ++j) {
      for (std::int64_t t = 0; t < n; ++t) {
        want[static_cast<std::size_t>(j * width + r0 + t)] +=
            static_cast<float>(row[static_cast<std::size_t>(r0 + t)] - key[static_cast<std::size_t>(j * ld + t)]);
      }
    }
    // attn_add_differences: one key value per key for every row (key[j]).
    std::vector<float> st_one = st, want_one = st;
    for (std::int64_t j = 0; j < keys; ++j) {
      for (std::int64_t t = 0; t < n; ++t) {
        want_one[static_cast<std::size_t>(j * width + r0 + t)] +=
            static_cast<float>(row[static_cast<std::size_t>(r0 + t)] - key[static_cast<std::size_t>(j)]);
      }
    }
    kernels::attn_add_head_differences(st.data(), keys, width, r0, n, row.data(), key.data(), ld);
    kernels::attn_add_differences(st_one.data(), keys, width, r0, n, row.data(), key.data());
    SCOPED_TRACE("width " + std::to_string(width) + " r0 " + std::to_string(r0) + " n " + std::to_string(n));
    for (std::size_t i = 0; i < st.size(); ++i) {
      for (const auto& [got, expected] : {std::pair{st[i], want[i]}, std::pair{st_one[i], want_one[i]}}) {
        if (std::isnan(expected)) {
          EXPECT_TRUE(std::isnan(got)) << i;
        } else {
          EXPECT_EQ(std::bit_cast<std::uint32_t>(got), std::bit_cast<std::uint32_t>(expected)) << i;
        }
      }
    }
  }
}

TEST_P(AttentionMatrixKernel, BF16StoresRoundAsToBF16) {
  // attn_store's bf16 case a vector at a time: the bits of to_bf16 (ties to even, NaNs quiet with
  // their upper bits, overflow to inf, denormals kept), storing and accumulating, with tails.
  const std::vector<std::uint32_t> special = {0x7fc00001u, 0xff800001u, 0x7f800000u, 0xff800000u, 0x7f7fffffu,
                                              0x00000001u, 0x80007fffu, 0x3f808000u, 0x3f818000u, 0x3f807fffu,
                                              0x00000000u, 0x80000000u, 0x7f7f8000u, 0x7fbfffffu};
  for (int trial = 0; trial < 20; ++trial) {
    const std::int64_t n = uniform_int(1, 70);
    std::vector<float> src(static_cast<std::size_t>(n));
    std::vector<std::uint16_t> dst(src.size()), old(src.size());
    for (std::size_t i = 0; i < src.size(); ++i) {
      src[i] =
          uniform_int(0, 3) == 0
              ? std::bit_cast<float>(
                    special[static_cast<std::size_t>(uniform_int(0, static_cast<std::int64_t>(special.size()) - 1))])
              : static_cast<float>(uniform(-1e3, 1e3));
      old[i] = to_bf16(static_cast<float>(uniform(-10, 10))).bits;
    }
    for (const bool accumulate : {false, true}) {
      dst = old;
      kernels::attn_store(src.data(), n, DType::kBF16, dst.data(), accumulate);
      for (std::size_t i = 0; i < src.size(); ++i) {
        const float x = accumulate ? from_bf16(bf16{old[i]}) + src[i] : src[i];
        ASSERT_EQ(dst[i], to_bf16(x).bits) << "n " << n << ", " << i << ", accumulate " << accumulate;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, AttentionMatrixKernel, ::testing::ValuesIn(testing::all_targets()));

// The softmax's exp on AVX-512 (one vscalefps for 2^q) keeps the bits of Highway's Exp, which the
// avx2 target runs: one tile through both, lane for lane (a row is a lane on either), with −inf
// (masked keys, a row with no key yet), NaN, and logits down to −150 below the row's maximum.
TEST(AttentionSoftmaxKernel, AVX512ExpKeepsTheBitsOfHighwaysExp) {
  const std::vector<std::string> targets = available_targets();
  const auto has = [&](const char* t) { return std::find(targets.begin(), targets.end(), t) != targets.end(); };
  if (!has("avx512") || !has("avx2")) GTEST_SKIP() << "needs the avx512 and avx2 targets";
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const std::int64_t keys = 37, width = 64;
  std::vector<float> scores(static_cast<std::size_t>(keys * width)), m0(width), l0(width);
  for (auto& x : scores) x = static_cast<float>(uniform(-150, 30));
  scores[5] = -kInf;
  scores[70] = std::numeric_limits<float>::quiet_NaN();
  for (std::int64_t r = 0; r < width; ++r) {
    m0[static_cast<std::size_t>(r)] = r % 3 == 0 ? -kInf : static_cast<float>(uniform(-20, 40));
    l0[static_cast<std::size_t>(r)] = r % 3 == 0 ? 0.0f : static_cast<float>(uniform(0.5, 3));
  }
  // Rows 7 and 9 see no key (row 9's maximum stays −inf, row 7 keeps its earlier one); row 10's
  // logits step through the flush threshold, from 80 to 87.5 below its maximum 0.
  for (std::int64_t j = 0; j < keys; ++j) {
    scores[static_cast<std::size_t>(j * width + 7)] = -kInf;
    scores[static_cast<std::size_t>(j * width + 9)] = -kInf;
    scores[static_cast<std::size_t>(j * width + 10)] =
        j == 0 ? 0.0f : -80.0f - 7.5f * static_cast<float>(j) / (keys - 1);
  }
  m0[10] = -kInf;
  l0[10] = 0.0f;
  const auto run = [&](const char* target) {
    set_target(target);
    std::vector<float> st = scores, m = m0, l = l0, corr(width);
    kernels::attn_softmax_tile(st.data(), keys, width, m.data(), l.data(), corr.data());
    st.insert(st.end(), m.begin(), m.end());
    st.insert(st.end(), l.begin(), l.end());
    st.insert(st.end(), corr.begin(), corr.end());
    return st;
  };
  const std::vector<float> wide = run("avx512"), narrow = run("avx2");
  set_target("auto");
  for (std::size_t i = 0; i < wide.size(); ++i)
    ASSERT_EQ(std::bit_cast<std::uint32_t>(wide[i]), std::bit_cast<std::uint32_t>(narrow[i])) << i;
}

TEST(AttentionBF16Kernels, PairsAndProductsOrAClearError) {
  // The native bf16 products' kernels (attention_kernels.hpp): packing rounds as to_bf16 does
  // (normal values; the instruction flushes denormals) and pairs rows along the sum's index, an
  // odd count's last pair half 0; raw pairs are exact and flag non-finite values; the product sums
  // exact pair products in f32: within (pairs + 1)·2^-23 of Σ|a·b| of the fp64 result. Hosts
  // without AVX512-BF16: posenc::Error.
  const std::int64_t rows = 13, cols = 80, count = 21, pairs = (count + 1) / 2, ld = cols + 5;
  std::vector<float> src(static_cast<std::size_t>(count * ld));
  for (float& x : src) x = static_cast<float>(uniform(-4, 4));
  std::vector<std::uint32_t> packed(static_cast<std::size_t>(pairs * cols));
  if (!kernels::attn_bf16_supported()) {
    expect_error([&] { kernels::attn_pack_bf16_pairs(src.data(), ld, count, cols, packed.data(), cols); },
                 {"attn_pack_bf16_pairs", "AVX512-BF16"});
    GTEST_SKIP() << "no AVX512-BF16 on this host";
  }
  kernels::attn_pack_bf16_pairs(src.data(), ld, count, cols, packed.data(), cols);
  const auto half = [&](std::int64_t p, std::int64_t i, int h) {
    return static_cast<std::uint16_t>(packed[static_cast<std::size_t>(p * cols + i)] >> (16 * h));
  };
  for (std::int64_t p = 0; p < pairs; ++p) {
    for (std::int64_t i = 0; i < cols; ++i) {
      ASSERT_EQ(half(p, i, 0), to_bf16(src[static_cast<std::size_t>(2 * p * ld + i)]).bits);
      const std::uint16_t hi =
          2 * p + 1 < count ? to_bf16(src[static_cast<std::size_t>((2 * p + 1) * ld + i)]).bits : 0;
      ASSERT_EQ(half(p, i, 1), hi) << p << ", " << i;
    }
  }
  // Rows transposed into pairs along their columns: 32 rows of 2·pairs values, 13 and 16 pairs.
  for (const std::int64_t transposed_pairs : {13, 16, 20}) {
    const std::int64_t t_rows = 32, t_ld = 2 * transposed_pairs + 8, t_ldd = t_rows + 16;
    std::vector<float> rows_f32(static_cast<std::size_t>(t_rows * t_ld));
    for (float& x : rows_f32) x = static_cast<float>(uniform(-4, 4));
    std::vector<std::uint32_t> transposed(static_cast<std::size_t>(transposed_pairs * t_ldd), 0xdeadbeefu);
    kernels::attn_transpose_bf16_pairs(rows_f32.data(), t_ld, t_rows, transposed_pairs, transposed.data(), t_ldd);
    for (std::int64_t q = 0; q < transposed_pairs; ++q) {
      for (std::int64_t r = 0; r < t_rows; ++r) {
        const auto at = [&](std::int64_t c) -> std::uint32_t {
          return to_bf16(rows_f32[static_cast<std::size_t>(r * t_ld + c)]).bits;
        };
        ASSERT_EQ(transposed[static_cast<std::size_t>(q * t_ldd + r)], at(2 * q) | (at(2 * q + 1) << 16))
            << transposed_pairs << " pairs: " << q << ", " << r;
      }
    }
  }
  // Raw bf16 rows of 40 values padded to 80, one non-finite value flagged.
  std::vector<std::uint16_t> raw(static_cast<std::size_t>(count * ld));
  for (auto& x : raw) x = to_bf16(static_cast<float>(uniform(-4, 4))).bits;
  std::vector<std::uint32_t> raw_pairs(packed.size(), 0xdeadbeefu);
  EXPECT_TRUE(kernels::attn_pack_bf16_raw_pairs(raw.data(), ld, count, 40, cols, raw_pairs.data(), cols));
  for (std::int64_t p = 0; p < pairs; ++p) {
    for (std::int64_t i = 0; i < cols; ++i) {
      const auto at = [&](std::int64_t r) -> std::uint32_t {
        return r < count && i < 40 ? raw[static_cast<std::size_t>(r * ld + i)] : 0u;
      };
      ASSERT_EQ(raw_pairs[static_cast<std::size_t>(p * cols + i)], at(2 * p) | (at(2 * p + 1) << 16)) << p << ", " << i;
    }
  }
  raw[static_cast<std::size_t>(20 * ld + 39)] = 0x7f80;  // +inf in the last (odd) row
  EXPECT_FALSE(kernels::attn_pack_bf16_raw_pairs(raw.data(), ld, count, 40, cols, raw_pairs.data(), cols));
  raw[static_cast<std::size_t>(20 * ld + 39)] = 0;
  raw[static_cast<std::size_t>(3 * ld + 40)] = 0x7fc0;  // NaN beyond dim: never read
  EXPECT_TRUE(kernels::attn_pack_bf16_raw_pairs(raw.data(), ld, count, 40, cols, raw_pairs.data(), cols));
  // C (+)= A·B: A's rows of `pairs` pairs (bf16 values in place), B the packed rows above.
  std::vector<std::uint32_t> a(static_cast<std::size_t>(rows * (pairs + 1)));
  for (auto& x : a) {
    x = to_bf16(static_cast<float>(uniform(-4, 4))).bits |
        (static_cast<std::uint32_t>(to_bf16(static_cast<float>(uniform(-4, 4))).bits) << 16);
  }
  const auto value = [](std::uint32_t pair, int h) {
    return static_cast<double>(from_bf16(bf16{static_cast<std::uint16_t>(pair >> (16 * h))}));
  };
  for (const bool add_sum : {false, true}) {
    std::vector<float> c(static_cast<std::size_t>(rows * cols), 0.5f);
    kernels::attn_gemm_bf16(a.data(), pairs + 1, 1, packed.data(), cols, c.data(), cols, rows, cols, pairs, add_sum);
    for (std::int64_t m = 0; m < rows; ++m) {
      for (std::int64_t n = 0; n < cols; ++n) {
        double exact = add_sum ? 0.5 : 0.0, magnitude = 0;
        for (std::int64_t t = 0; t < pairs; ++t) {
          for (int h = 0; h < 2; ++h) {
            const double x = value(a[static_cast<std::size_t>(m * (pairs + 1) + t)], h) *
                             value(packed[static_cast<std::size_t>(t * cols + n)], h);
            exact += x;
            magnitude += std::fabs(x);
          }
        }
        EXPECT_NEAR(c[static_cast<std::size_t>(m * cols + n)], exact,
                    static_cast<double>(pairs + 1) * std::ldexp(1.0, -23) * (magnitude + 0.5))
            << m << ", " << n;
      }
    }
  }
}

}  // namespace
}  // namespace posenc
