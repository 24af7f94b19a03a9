// Chunked attention (AttentionMask::chunk_size, Llama 4's attention_chunk_size): the fused forward,
// decode and backward against the fp64 reference on every target — chunks aligned and not aligned
// with the tiles, causal and bidirectional, with windows, soft-caps, RoPE, ALiBi and sinks, cache
// offsets, packed sequences and 16-bit inputs —, the tiles it never visits, thread counts, and bad
// input.
#include <cstdint>
#include <memory>
#include <vector>

#include "attention_testing.hpp"
#include "posenc/sinks.hpp"
#include "testing.hpp"

namespace posenc {
namespace {

using namespace attention_testing;

class AttentionChunkTargets : public testing::EveryTarget {};

TEST_P(AttentionChunkTargets, MatchTheReference) {
  struct Case {
    const char* what;
    std::int64_t batch, q_len, k_len, heads, kv_heads, dim, chunk;
    DType dtype;
    bool causal;
    std::int64_t window_left;
    double softcap;
    int extra;  // 0 none, 1 RoPE, 2 ALiBi (far-tile skip on) with sinks
  };
  const Case cases[] = {
      {"causal MHA, chunks of two tiles", 1, 300, 300, 2, 2, 32, 128, DType::kF32, true, -1, 0.0, 0},
      {"bidirectional GQA, chunks across tiles", 2, 200, 200, 4, 2, 32, 50, DType::kF32, false, -1, 0.0, 0},
      {"window inside the chunks, soft-cap", 1, 150, 150, 2, 1, 16, 40, DType::kF32, true, 7, 5.0, 0},
      {"RoPE, queries at the end of a cache", 1, 40, 140, 4, 2, 32, 64, DType::kF32, true, -1, 0.0, 1},
      {"ALiBi and sinks", 1, 260, 260, 4, 4, 32, 100, DType::kF32, true, -1, 0.0, 2},
      {"decode from a long cache", 2, 1, 9000, 8, 2, 64, 2048, DType::kF32, true, -1, 0.0, 0},
      {"decode of 3 queries across a chunk boundary", 1, 3, 4098, 4, 2, 32, 2048, DType::kF32, true, -1, 0.0, 1},
      {"bf16", 1, 100, 100, 4, 2, 32, 33, DType::kBF16, true, -1, 0.0, 1},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Problem p = make_problem(c.batch, c.q_len, c.k_len, c.heads, c.kv_heads, c.dim, c.dtype);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = c.causal;
    spec.mask.window_left = c.window_left;
    spec.mask.softcap = c.softcap;
    spec.mask.chunk_size = c.chunk;
    HeadGroup group{c.heads, {}, {}};
    if (c.extra == 1) group.transform = RotaryQK{RopeParams(c.dim, c.dim)};
    if (c.extra == 2) {
      group.bias = AlibiParams(std::vector<double>(static_cast<std::size_t>(c.heads), 2.0));  // steep: tiles vanish
      group.terms = {std::make_shared<AttentionSinks>(std::vector<double>(static_cast<std::size_t>(c.heads), 1.5))};
    }
    spec.groups = {group};
    expect_forward_and_backward_accurate(p, spec, c.what);
  }
}

// Packed sequences restart their positions (and so their chunks) at 0; a ragged batch of caches
// puts its queries at Lk − Lq + i; explicit positions move the boundaries off the tiles.
TEST_P(AttentionChunkTargets, ChunksFollowEachSequencesPositions) {
  {
    Problem p = make_packed({{100, 100}, {1, 37}, {0, 5}, {70, 70}}, 4, 2, 32);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = true;
    spec.mask.chunk_size = 32;
    expect_accurate(p, spec, "packed");
    expect_backward_matches_reference(p, Attention(spec), random_values(static_cast<std::size_t>(p.q_count())));
  }
  {
    Problem p = make_problem(2, 2, 300, 4, 4, 16);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = true;
    spec.mask.key_lengths = {300, 130};
    spec.mask.chunk_size = 64;
    expect_accurate(p, spec, "key_lengths");
  }
  {
    Problem p = make_problem(1, 90, 90, 2, 1, 16);
    std::vector<std::int64_t> ids(90);
    for (std::size_t j = 0; j < ids.size(); ++j) ids[j] = 1000 + 3 * static_cast<std::int64_t>(j) / 2;  // repeats
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = true;
    spec.mask.chunk_size = 25;
    spec.q_positions = Positions::ids(ids);
    spec.k_positions = Positions::ids(ids);
    expect_accurate(p, spec, "explicit positions");
    expect_backward_matches_reference(p, Attention(spec), random_values(static_cast<std::size_t>(p.q_count())));
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, AttentionChunkTargets, ::testing::ValuesIn(testing::all_targets()));

// Key tiles outside every row's chunk are not visited: with chunks of 128 a causal 1024-token call
// meets about an eighth of the causal call's key tiles (forward, and backward's steps).
TEST(AttentionChunks, VisitsNoTileOutsideTheChunks) {
  Problem p = make_problem(1, 1024, 1024, 2, 2, 32);
  AttentionSpec causal = spec_of(p);
  causal.mask.causal = true;
  AttentionSpec chunked = causal;
  chunked.mask.chunk_size = 128;
  const Attention full(causal), local(chunked);
  const std::vector<double> d_out = random_values(static_cast<std::size_t>(p.q_count()));
  const std::int64_t tiles = run_forward(p, full, 0).stats.tiles, chunk_tiles = run_forward(p, local, 0).stats.tiles;
  EXPECT_GT(chunk_tiles, 0);
  EXPECT_LE(3 * chunk_tiles, tiles) << "forward key tiles";
  const std::int64_t steps = run_backward(p, full, d_out, false).stats.tiles;
  const std::int64_t chunk_steps = run_backward(p, local, d_out, false).stats.tiles;
  EXPECT_GT(chunk_steps, 0);
  EXPECT_LE(3 * chunk_steps, steps) << "backward steps";
}

TEST(AttentionChunks, BitwiseIdenticalForAnyThreadCount) {
  Problem p = make_problem(1, 700, 700, 4, 2, 32);
  AttentionSpec spec = spec_of(p);
  spec.mask.causal = true;
  spec.mask.chunk_size = 200;
  const Attention att(spec);
  Problem d = make_problem(1, 1, 30000, 4, 2, 32);
  AttentionSpec ds = spec_of(d);
  ds.mask.causal = true;
  ds.mask.chunk_size = 20000;  // the last chunk (10000 keys) splits into several decode chunks
  const Attention dec(ds);
  expect_same_bits_for_any_thread_count(p, att, d, &dec);
}

TEST(AttentionChunks, RefusesBadInput) {
  Problem p = make_problem(1, 6, 6, 2, 1, 8);
  for (const std::int64_t bad : {std::int64_t{0}, std::int64_t{-3}}) {
    AttentionSpec spec = spec_of(p);
    spec.mask.chunk_size = bad;
    testing::expect_error([&] { Attention att(spec); }, {"mask.chunk_size", std::to_string(bad)});
  }
  const std::vector<std::int64_t> ids = {0, 1, 2, 5, 4, 6};
  AttentionSpec spec = spec_of(p);
  spec.mask.chunk_size = 4;
  spec.k_positions = Positions::ids(ids);
  testing::expect_error([&] { Attention att(spec); }, {"k_positions", "[4] = 4", "non-decreasing"});
  spec.mask.chunk_size.reset();
  EXPECT_NO_THROW(Attention att(spec));  // any order without chunks
}

}  // namespace
}  // namespace posenc
