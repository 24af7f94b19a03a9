// Stick-breaking and CoPE as registered schemes (src/schemes/row_normalisers.cpp): an Attention
// whose group the registry makes gives the bits of the schemes' own classes, forward and backward,
// in f32 and bf16, packed or not, and refuses by name what they do not combine with. (The generic
// matrix, test_schemes.cpp, holds both against their fp64 references.)
#include <cstdint>
#include <cstring>
#include <vector>

#include "testing.hpp"

namespace posenc {
namespace {

using testing::EveryTarget;
using testing::expect_error;
using testing::uniform;

constexpr std::int64_t kB = 2, kSq = 37, kSk = 45, kH = 4, kG = 2, kD = 16;

struct Buffers {
  DType dt;
  std::vector<unsigned char> q, k, v, d_out;
  Buffers(DType dtype, std::int64_t q_tokens, std::int64_t k_tokens) : dt(dtype) {
    const auto fill = [&](std::int64_t n, double scale) {
      std::vector<double> x(static_cast<std::size_t>(n));
      for (double& e : x) e = uniform(-scale, scale);
      return testing::to_dtype(x, dt);
    };
    q = fill(q_tokens * kH * kD, 2.0);
    k = fill(k_tokens * kG * kD, 2.0);
    v = fill(k_tokens * kG * kD, 1.0);
    d_out = fill(q_tokens * kH * kD, 1.0);
  }
};

// The same call as Attention takes it and as the scheme's own class does: [B, S, H, D], or packed
// [T, H, D] with cu_seqlens.
struct Shapes {
  std::vector<std::int64_t> q, k, cu_q, cu_k;
  std::int64_t q_tokens() const { return q[0] * (q.size() == 4 ? q[1] : 1); }
  std::int64_t k_tokens() const { return k[0] * (k.size() == 4 ? k[1] : 1); }
};
Shapes batched() { return {{kB, kSq, kH, kD}, {kB, kSk, kG, kD}, {}, {}}; }
Shapes packed() { return {{kSq, kH, kD}, {kSk, kG, kD}, {0, 0, 1, 30, kSq}, {0, 3, 5, 38, kSk}}; }

AttentionSpec attention_spec(const Buffers& b, const Shapes& s, HeadGroup group) {
  AttentionSpec spec;
  spec.q = ConstTensorView::contiguous(b.q.data(), b.dt, s.q);
  spec.k = ConstTensorView::contiguous(b.k.data(), b.dt, s.k);
  spec.v = ConstTensorView::contiguous(b.v.data(), b.dt, s.k);
  spec.groups = {std::move(group)};
  spec.mask.causal = true;
  spec.cu_seqlens_q = s.cu_q;
  spec.cu_seqlens_k = s.cu_k;
  return spec;
}

// Attention's statistic [B, H, Sq] ([H, Tq]) and the row engines' [B, Sq, H] ([Tq, H]).
std::vector<std::int64_t> attention_stat_shape(const Shapes& s) {
  return s.q.size() == 4 ? std::vector<std::int64_t>{kB, kH, kSq} : std::vector<std::int64_t>{kH, kSq};
}
std::vector<std::int64_t> row_stat_shape(const Shapes& s) {
  return s.q.size() == 4 ? std::vector<std::int64_t>{kB, kSq, kH} : std::vector<std::int64_t>{kSq, kH};
}
// Where Attention's statistic keeps (token t, head h); the row engines' keep it at t·H + h.
std::size_t attention_stat_at(const Shapes& s, std::int64_t t, std::int64_t h) {
  return static_cast<std::size_t>(s.q.size() == 4 ? ((t / kSq) * kH + h) * kSq + t % kSq : h * kSq + t);
}

struct Outputs {
  std::vector<unsigned char> out, dq, dk, dv;
  std::vector<float> stat;
  std::vector<double> d_params;
};

Outputs zeroed(const Buffers& b, const Shapes& s) {
  Outputs o;
  o.out = testing::garbage_buffer(b.dt, s.q_tokens() * kH * kD);
  o.dq.assign(b.q.size(), 0);
  o.dk.assign(b.k.size(), 0);
  o.dv.assign(b.v.size(), 0);
  o.stat.assign(static_cast<std::size_t>(s.q_tokens() * kH), 0.0f);
  return o;
}

// Forward, then backward from b.d_out (and d_stat, in the row engines' [B, Sq, H] order, when
// given), through Attention.
Outputs through_attention(const Buffers& b, const Shapes& s, const HeadGroup& group,
                          const std::vector<float>& d_stat = {}) {
  const Attention att(attention_spec(b, s, group));
  Outputs o = zeroed(b, s);
  const TensorView out = TensorView::contiguous(o.out.data(), b.dt, s.q);
  const TensorView stat = TensorView::contiguous(o.stat.data(), DType::kF32, attention_stat_shape(s));
  att.forward(out, stat);
  AttentionGradients grads = att.zero_gradients();
  std::vector<float> d_lse(d_stat.size());
  for (std::int64_t t = 0; t < s.q_tokens() && !d_stat.empty(); ++t) {
    for (std::int64_t h = 0; h < kH; ++h)
      d_lse[attention_stat_at(s, t, h)] = d_stat[static_cast<std::size_t>(t * kH + h)];
  }
  att.backward(out, stat, ConstTensorView::contiguous(b.d_out.data(), b.dt, s.q),
               TensorView::contiguous(o.dq.data(), b.dt, s.q), TensorView::contiguous(o.dk.data(), b.dt, s.k),
               TensorView::contiguous(o.dv.data(), b.dt, s.k), &grads,
               d_stat.empty() ? ConstTensorView{}
                              : ConstTensorView::contiguous(d_lse.data(), DType::kF32, attention_stat_shape(s)));
  o.d_params = grads.groups[0].normaliser;
  return o;
}

void expect_same(const Outputs& a, const Outputs& b, const Shapes& s) {
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.dq, b.dq);
  EXPECT_EQ(a.dk, b.dk);
  EXPECT_EQ(a.dv, b.dv);
  EXPECT_EQ(a.d_params, b.d_params);
  for (std::int64_t t = 0; t < s.q_tokens(); ++t) {
    for (std::int64_t h = 0; h < kH; ++h) {
      ASSERT_EQ(a.stat[attention_stat_at(s, t, h)], b.stat[static_cast<std::size_t>(t * kH + h)]) << t << ", " << h;
    }
  }
}

class RegisteredNormalisers : public EveryTarget {};

// 16-bit inputs: the classes' backwards read an f32 out (stickbreaking.hpp), which Attention's
// runs the forward again to make.
TEST_P(RegisteredNormalisers, StickBreakingIsItsOwnClassBitForBit) {
  for (const DType dt : {DType::kF32, DType::kBF16}) {
    for (const Shapes& s : {batched(), packed()}) {
      for (const bool current : {false, true}) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + (s.cu_q.empty() ? "" : ", packed") + (current ? ", current" : ""));
        const Buffers b(dt, s.q_tokens(), s.k_tokens());
        const HeadGroup g =
            make_head_group("stickbreaking", {.heads = kH, .head_dim = kD, .options = {{"attend_current", current}}});
        // rem's gradient (Attention's d_lse) on every other case.
        std::vector<float> d_rem(current ? static_cast<std::size_t>(s.q_tokens() * kH) : 0);
        for (float& x : d_rem) x = static_cast<float>(uniform(-1, 1));
        const Outputs via = through_attention(b, s, g, d_rem);

        const AttentionSpec a = attention_spec(b, s, g);
        const StickBreakingAttention sb(
            {a.q, a.k, a.v, 0.0, current, a.cu_seqlens_q, a.cu_seqlens_k, a.skip_vanishing_tiles});
        Outputs own = zeroed(b, s);
        std::vector<float> wide(static_cast<std::size_t>(s.q_tokens() * kH * kD));
        const TensorView out = TensorView::contiguous(own.out.data(), dt, s.q);
        const TensorView rem = TensorView::contiguous(own.stat.data(), DType::kF32, row_stat_shape(s));
        sb.forward(out, rem);
        const TensorView out32 = TensorView::contiguous(wide.data(), DType::kF32, s.q);
        sb.forward(out32, {});
        sb.backward(dt == DType::kF32 ? ConstTensorView(out) : ConstTensorView(out32), rem,
                    ConstTensorView::contiguous(b.d_out.data(), dt, s.q),
                    d_rem.empty() ? ConstTensorView{}
                                  : ConstTensorView::contiguous(d_rem.data(), DType::kF32, row_stat_shape(s)),
                    TensorView::contiguous(own.dq.data(), dt, s.q), TensorView::contiguous(own.dk.data(), dt, s.k),
                    TensorView::contiguous(own.dv.data(), dt, s.k));
        expect_same(via, own, s);
      }
    }
  }
}

TEST_P(RegisteredNormalisers, CopeIsItsOwnClassBitForBit) {
  constexpr std::int64_t npos = 9;
  std::vector<double> table(static_cast<std::size_t>(npos * kD));
  for (double& x : table) x = uniform(-1, 1);
  const std::vector<float> table32(table.begin(), table.end());
  for (const DType dt : {DType::kF32, DType::kBF16}) {
    for (const Shapes& s : {batched(), packed()}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + (s.cu_q.empty() ? "" : ", packed"));
      const Buffers b(dt, s.q_tokens(), s.k_tokens());
      const HeadGroup g =
          make_head_group("cope", {.heads = kH, .head_dim = kD, .options = {{"positions", npos}}, .parameters = table});
      const Outputs via = through_attention(b, s, g);

      const AttentionSpec a = attention_spec(b, s, g);
      const CopeAttention cope(
          {a.q, a.k, a.v, ConstTensorView::of(table32.data(), {npos, kD}), 0.0, a.cu_seqlens_q, a.cu_seqlens_k});
      Outputs own = zeroed(b, s);
      std::vector<float> d_table(table.size(), 0.0f);
      const TensorView out = TensorView::contiguous(own.out.data(), dt, s.q);
      const TensorView lse = TensorView::contiguous(own.stat.data(), DType::kF32, row_stat_shape(s));
      cope.forward(out, lse);
      std::vector<float> wide(static_cast<std::size_t>(s.q_tokens() * kH * kD));
      const TensorView out32 = TensorView::contiguous(wide.data(), DType::kF32, s.q);
      cope.forward(out32, {});
      cope.backward(dt == DType::kF32 ? ConstTensorView(out) : ConstTensorView(out32), lse,
                    ConstTensorView::contiguous(b.d_out.data(), dt, s.q),
                    TensorView::contiguous(own.dq.data(), dt, s.q), TensorView::contiguous(own.dk.data(), dt, s.k),
                    TensorView::contiguous(own.dv.data(), dt, s.k), TensorView::of(d_table.data(), {npos, kD}));
      own.d_params.assign(d_table.begin(), d_table.end());
      expect_same(via, own, s);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, RegisteredNormalisers, ::testing::ValuesIn(testing::all_targets()));

// Positions equal to the tokens' order (a cache's, as posenc.nn passes them) change nothing.
TEST(RegisteredNormaliserCalls, PositionsOfTheTokensOrderAreAccepted) {
  const Buffers b(DType::kF32, kB * kSq, kB * kSk);
  const Shapes s = batched();
  const HeadGroup g = make_head_group("stickbreaking", {.heads = kH, .head_dim = kD});
  AttentionSpec plain = attention_spec(b, s, g), given = plain;
  given.q_positions = Positions::range(kSq, kSk - kSq);
  given.k_positions = Positions::range(kSk);
  std::vector<float> a(static_cast<std::size_t>(kB * kSq * kH * kD)), c(a.size());
  Attention(plain).forward(TensorView::of(a.data(), {kB, kSq, kH, kD}));
  Attention(given).forward(TensorView::of(c.data(), {kB, kSq, kH, kD}));
  EXPECT_EQ(a, c);
}

// One query per sequence sees no later key under any mask: decode needs no causal flag.
TEST(RegisteredNormaliserCalls, DecodeRunsWithoutTheCausalFlag) {
  const Buffers b(DType::kF32, kB, kB * kSk);
  const Shapes s{{kB, 1, kH, kD}, {kB, kSk, kG, kD}, {}, {}};
  const HeadGroup g = make_head_group("stickbreaking", {.heads = kH, .head_dim = kD});
  AttentionSpec causal = attention_spec(b, s, g), open = causal;
  open.mask.causal = false;
  std::vector<float> a(static_cast<std::size_t>(kB * kH * kD)), c(a.size());
  Attention(causal).forward(TensorView::of(a.data(), {kB, 1, kH, kD}));
  Attention(open).forward(TensorView::of(c.data(), {kB, 1, kH, kD}));
  EXPECT_EQ(a, c);
}

TEST(RegisteredNormaliserCalls, RefuseWhatTheyDoNotCombineWith) {
  const Buffers b(DType::kF32, kB * kSq, kB * kSk);
  const Shapes s = batched();
  const HeadGroup g = make_head_group("cope", {.heads = kH, .head_dim = kD});
  const auto refused = [&](const std::function<void(AttentionSpec&)>& change,
                           std::initializer_list<std::string> fragments) {
    AttentionSpec spec = attention_spec(b, s, g);
    change(spec);
    expect_error([&] { const Attention att(spec); }, fragments);
  };
  refused([](AttentionSpec& a) { a.mask.causal = false; }, {"mask.causal", "false", "a causal mask", "cope"});
  refused([](AttentionSpec& a) { a.mask.window_left = 8; }, {"mask.window_left", "8", "-1"});
  refused([](AttentionSpec& a) { a.mask.softcap = 30; }, {"mask.softcap", "0", "replaces the softmax"});
  refused([](AttentionSpec& a) { a.mask.chunk_size = 16; }, {"mask.chunk_size", "16", "unset"});
  refused([](AttentionSpec& a) { a.q_positions = Positions::range(kSq); },
          {"q_positions", "0 at query 0", "8, the tokens' order"});
  refused([](AttentionSpec& a) { a.k_positions = Positions::range(kSk, 1); },
          {"k_positions", "1 at key 0", "0, the tokens' order"});
  refused([](AttentionSpec& a) { a.temperature = PositionTemperature::llama4(); }, {"temperature", "unset"});
  refused(
      [](AttentionSpec& a) {
        HeadGroup half = a.groups[0];
        half.heads = kH / 2;
        a.groups = {half, HeadGroup{kH / 2, {}, {}}};
      },
      {"groups", "2 groups", "one group"});
  refused([](AttentionSpec& a) { a.groups[0].bias = AlibiParams(kH); }, {"groups[0].bias", "none"});
  refused(
      [](AttentionSpec& a) {
        a.groups[0].terms.push_back(make_head_group("sinks", {.heads = kH, .head_dim = kD}).terms[0]);
      },
      {"groups[0].terms", "1 terms", "sinks included"});
  // The scheme's own checks run when the Attention is built, not at its first call.
  refused(
      [&](AttentionSpec& a) {
        const std::vector<std::int64_t> few = {kB, 5, kG, kD};
        a.k = ConstTensorView::contiguous(b.k.data(), b.dt, few);
        a.v = ConstTensorView::contiguous(b.v.data(), b.dt, few);
      },
      {"cope_attention", "at most as many queries as keys"});
  refused([&](AttentionSpec& a) { a.groups = {make_head_group("cope", {.heads = kH, .head_dim = kD / 2})}; },
          {"cope_attention", "table", std::to_string(kD / 2)});
  // CoPE's lse, and the softmax's, take no gradient.
  {
    const Attention cope(attention_spec(b, s, g));
    const Attention softmax(attention_spec(b, s, make_head_group("none", {.heads = kH, .head_dim = kD})));
    std::vector<float> out(static_cast<std::size_t>(kB * kSq * kH * kD)), lse(static_cast<std::size_t>(kB * kH * kSq));
    const TensorView o = TensorView::of(out.data(), {kB, kSq, kH, kD});
    const TensorView l = TensorView::of(lse.data(), {kB, kH, kSq});
    for (const Attention* att : {&cope, &softmax}) {
      att->forward(o, l);
      expect_error([&] { att->backward(o, l, o, {}, {}, {}, nullptr, l); }, {"d_lse", "empty", "takes no gradient"});
    }
  }
  // The fp64 reference has no naive f32 form for them.
  const Attention att(attention_spec(b, s, g));
  std::vector<float> out(static_cast<std::size_t>(kB * kSq * kH * kD));
  expect_error(
      [&] {
        ref::attention_forward(att, TensorView::of(out.data(), {kB, kSq, kH, kD}), {}, true);
      },
      {"naive_f32", "true", "fp64 only", "cope"});
}

}  // namespace
}  // namespace posenc
