// Query-row blocks over key tiles walked from the diagonal leftwards: what the attention engines
// whose rows carry a running sum from their nearest key (stick-breaking, CoPE) share. Validation
// of q, k, v and their sequences; blocks of up to 64 rows of one KV head's group; f32 tiles of
// keys and values; the walks themselves (forward and backward), to which an engine gives only
// what it does with a tile's logits; the backward's work split and its dK, dV sums, whose rules
// look at the shapes only so that results are bitwise identical for any thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "internal.hpp"
#include "posenc/attention.hpp"
#include "posenc/tensor.hpp"

namespace posenc::detail {

// The shapes of validated q, k, v.
struct QkvShape {
  bool packed = false;
  DType dtype = DType::kF32;
  HeadsGrid qg, kg, vg;
  std::int64_t batch = 0, q_len = 0, k_len = 0, heads = 0, kv_heads = 0, group = 0, dim = 0, dim_v = 0;
  double scale = 0;  // resolved: 1/sqrt(D) for 0
  HeadsGrid out_grid() const {
    HeadsGrid g = qg;
    g.dim = dim_v;
    return g;
  }
};
// q [B, Sq, H, D] (packed [Tq, H, D] with cu_seqlens), k [B, Sk, G, D] with G dividing H,
// v [B, Sk, G, Dv]; f32, bf16, f16 or f64 alike; scale 0 or of a magnitude in f32's normal
// range (the logits are f32); cu_seqlens both or neither, each valid, with Lq <= Lk per sequence.
QkvShape check_qkv(const char* where, ConstTensorView q, ConstTensorView k, ConstTensorView v, double scale,
                   const std::vector<std::int64_t>& cu_seqlens_q, const std::vector<std::int64_t>& cu_seqlens_k);

// A per-row statistic ([B, Sq, H], packed [Tq, H], f32); element (b, s, h) at
// b·batch + s·seq + h·head.
struct RowStatGrid {
  std::int64_t batch = 0, seq = 0, head = 0;
  std::int64_t offset(std::int64_t b, std::int64_t s, std::int64_t h) const { return b * batch + s * seq + h * head; }
};
RowStatGrid check_row_stat(const char* where, const QkvShape& shape, const char* name, ConstTensorView view,
                           bool writable);
// out in the inputs' dtype, or f32 for any.
void check_out_dtype(const char* where, const QkvShape& shape, ConstTensorView out);
// A backward's out (q's layout, q's dtype or f32) and d_out (q's layout and dtype), and the
// gradients asked for (dq, dk, dv like q, k, v and writable; an empty grid when not given).
struct QkvBackwardGrids {
  HeadsGrid og, dog, dqg, dkg, dvg;
};
QkvBackwardGrids check_qkv_backward(const char* where, const QkvShape& shape, ConstTensorView out,
                                    ConstTensorView d_out, ConstTensorView dq, ConstTensorView dk, ConstTensorView dv);
inline bool given(ConstTensorView v) { return v.rank() > 0 && v.data() != nullptr; }

// A validated shape as the public objects report it (AttentionSizes).
inline AttentionSizes::Sizes sizes_of(const QkvShape& s) {
  return {s.batch, s.heads, s.kv_heads, s.dim, s.dim_v, s.q_len, s.k_len, s.scale};
}

namespace rows {

using Floats = AlignedFloats;

inline constexpr std::int64_t kBlockRows = 64;  // query rows per block (the lanes of a tile)
inline constexpr std::int64_t kKeyTile = 64;    // keys per tile (<= kernels::kAttnGemmAddDepth)

inline std::int64_t round_up(std::int64_t x, std::int64_t to) { return (x + to - 1) / to * to; }
// One cache line more than the rows need: see engine.hpp's padded_stride.
std::int64_t padded(std::int64_t w);

template <class V>
void grow(V& v, std::int64_t n) {
  if (static_cast<std::int64_t>(v.size()) < n) v.resize(static_cast<std::size_t>(n));
}

struct Sequence {
  std::int64_t b = 0, q0 = 0, lq = 0, k0 = 0, lk = 0;
};

// The rows of a block: (head, query) pairs of one KV head's group, padded to whole lane chunks.
struct Block {
  std::int64_t width = 0, valid = 0, key_end = 0;
  std::vector<std::int64_t> head, query;  // head −1: a padding row
  std::vector<std::int32_t> hi;           // the row sees keys [0, hi)
  bool any_masked(std::int64_t key_end_of_tile) const;
};

// Keys of a tile as f32 rows.
struct Tile {
  const float* k;
  std::int64_t ldk;
};

// Backward's work: per (sequence, KV head), query ranges; each unit sums its dK and dV from zero.
// A pair's only unit adds them to dk, dv itself (slab −1); the units of a split pair leave them in
// slabs of slab_row floats per key (dK's dp, then dV's dvp), added in range order by add_slabs.
struct Unit {
  std::int64_t seq, kvh, i0, i1, key_end, slab;
};
struct Split {
  std::vector<Unit> units;
  std::int64_t slab_floats = 0;
};

struct Geometry {
  ConstTensorView q, k, v;
  QkvShape shape;
  std::vector<Sequence> sequences;
  std::int64_t dp = 0, dvp = 0;  // D and Dv padded to lane chunks
  std::int64_t extra = 0;        // query t of a sequence sees keys [0, Lk − Lq + t + extra)

  Geometry() = default;
  Geometry(ConstTensorView q, ConstTensorView k, ConstTensorView v, QkvShape shape,
           const std::vector<std::int64_t>& cu_seqlens_q, const std::vector<std::int64_t>& cu_seqlens_k,
           std::int64_t extra);

  std::int64_t rows_per_block_queries() const { return std::max<std::int64_t>(1, kBlockRows / shape.group); }
  std::int64_t slab_row() const { return dp + dvp; }
  // The block of the group of KV head kvh over queries [i0, i1) of seq.
  void layout(const Sequence& seq, std::int64_t kvh, std::int64_t i0, std::int64_t i1, Block& blk) const;
  // The block's queries as rows times row_scale (qrows, dp wide) and transposed times t_scale (qt,
  // padded(width) apart); whether all are finite.
  bool load_q(const Sequence& seq, const Block& blk, float row_scale, float t_scale, Floats& qrows, Floats& qt) const;
  // Keys and values of the tile [k0, k0 + keys) of KV head kvh: keys read in place where they are
  // f32 rows of unit stride (the broadcast operand, as the softmax engine reads them), else into
  // kbuf; values always into vbuf, padded(dvp) apart (rows 4 KiB apart thrash L1 sets).
  Tile load_tile(const Sequence& seq, std::int64_t kvh, std::int64_t k0, std::int64_t keys, Floats& kbuf,
                 Floats& vbuf) const;
  // The key and value rows of keys [k0, k0 + keys) into L2, ahead of their tile: consecutive keys
  // of one head lie G·D elements apart in [B, S, G, D] memory, often a page, which the hardware
  // prefetchers do not cross (forward.cpp's prefetch_rows measured the same).
  void prefetch(const Sequence& seq, std::int64_t kvh, std::int64_t k0, std::int64_t keys) const;
  // Per (sequence, KV head): the first key whose key or value row holds an inf or NaN (Lk if none).
  std::vector<std::int64_t> scan_non_finite(int threads) const;
  // Threads for a pass over `units` units doing `passes` times the forward's products.
  int threads_for(std::size_t units, std::int64_t passes) const;
  // Forward's units: (sequence, KV head, query block).
  std::vector<Unit> forward_units() const;
  // Backward's units: one per pair when there are at least 8 pairs, else enough ranges (of at
  // least 256 queries) for 8 units.
  Split backward_split() const;
  // A unit's dK and dV sums (key_end rows of dp and then of dvp floats) into dk, dv (+=).
  void store_unit(const Unit& un, const float* dk_acc, const float* dv_acc, TensorView dk, const HeadsGrid& dkg,
                  TensorView dv, const HeadsGrid& dvg) const;
  // The slabs of each split pair, added in range order, into dk and dv.
  void add_slabs(const Split& split, const float* slabs, int threads, TensorView dk, const HeadsGrid& dkg,
                 TensorView dv, const HeadsGrid& dvg) const;
};

// out[r][c] (+)= Σ_j T[j][r]·B[j][c] (by_rows) or out[j][c] += Σ_r T[j][r]·B[r][c], over the
// pairs the block's rows see only: the matrix kernels' 0·inf would spread a non-finite operand of
// a masked pair to a row (or key) that must not meet it.
void add_visible(const Block& blk, std::int64_t k0, std::int64_t keys, const float* t, const float* b, std::int64_t ldb,
                 std::int64_t cols, float* out, std::int64_t ldo, bool by_rows);

// A tile's share of backward's products: dV_j += Σ_r P[j][r]·dO_r, dK_j += Σ_r dz[j][r]·qs_r and
// dQ_r += Σ_j dz[j][r]·k_j (p and dz transposed tiles, width apart; dorows dvp wide, qs and dq dp
// wide; dv_acc, dk_acc the tile's first key's rows). In a masked tile, an operand that is not
// finite goes through add_visible.
struct TileGradients {
  const float *p, *dz, *dorows, *qs;
  bool do_finite, q_finite;
  float *dv_acc, *dk_acc, *dq;
};
void add_tile_gradients(const Geometry& geo, const Block& blk, std::int64_t k0, std::int64_t keys, bool masked,
                        const Tile& tile, const TileGradients& t);

inline bool finite_floats(const float* x, std::int64_t n) { return !rows_non_finite(x, 0, 1, n); }

// ─── The walks ───────────────────────────────────────────────────────────────────────────────

// A thread's buffers for the walks, kept between calls (an engine keeps its own beside them).
struct WalkScratch {
  Floats qt, qrows, o, st, dpt, k, v, dot, dorows, dq, row, own;
  std::int64_t bytes() const;
};

// One thread's forward engine: what it does with its rows and with each tile's logits.
class ForwardRows {
 public:
  virtual ~ForwardRows() = default;
  // The block's queries into s.qrows and s.qt (Geometry::load_q), and its rows' state.
  virtual void start(const Unit& un, const Block& blk, WalkScratch& s) = 0;
  // Whether the walk may stop before the tile ending at tile_end.
  virtual bool vanished(const Block& /*blk*/, std::int64_t /*tile_end*/) const { return false; }
  // The tile's logits (s.st, keys × width) into its values' weights; may rescale s.o's rows.
  virtual void weigh(const Block& blk, std::int64_t k0, std::int64_t keys, bool masked, WalkScratch& s) = 0;
  // Row r's output (dvp floats, finished in place) once its walk is done; returns its statistic.
  virtual float finish(std::int64_t r, float* o) = 0;
  virtual std::int64_t bytes() const = 0;
};

// What the backward walk of one block hands its engine.
struct BlockWalk {
  const Geometry& geo;
  const Unit& un;
  const Sequence& seq;
  const Block& blk;
  WalkScratch& s;
  bool q_finite, do_finite;
  std::int64_t& tiles;
  std::int64_t n_tiles() const { return (blk.key_end + kKeyTile - 1) / kKeyTile; }
  // Tile t's keys [k0, k0 + keys).
  std::int64_t k0(std::int64_t t) const { return t * kKeyTile; }
  std::int64_t keys(std::int64_t t) const { return std::min(kKeyTile, blk.key_end - t * kKeyTile); }
  // The tile's logits into s.st and d_out·v into s.dpt (both keys × width); returns its keys.
  Tile scores(std::int64_t k0, std::int64_t keys) const;
};

// One thread's backward engine.
class BackwardRows {
 public:
  virtual ~BackwardRows() = default;
  // A run of units whose sums the engine keeps apart (runs depend on the shapes only).
  virtual void start_run(std::int64_t /*run*/) {}
  // The block's queries into s.qrows and s.qt; whether all are finite.
  virtual bool start(const Unit& un, const Block& blk, WalkScratch& s) = 0;
  // A padding row, or query `token` of head h whose Σ d_out·out is dot (fp64); returns whether
  // the row's own inputs are finite.
  virtual void pad_row(std::int64_t r) = 0;
  virtual bool row(std::int64_t r, std::int64_t b, std::int64_t token, std::int64_t h, double dot) = 0;
  // The engine's passes before the gradient walk (through walk.scores).
  virtual void prepare(BlockWalk& walk) = 0;
  virtual bool vanished(const Block& /*blk*/, std::int64_t /*tile_end*/) const { return false; }
  // Tile t's logits (s.st) and d_out·v (s.dpt) into P (s.st) and dz (s.dpt).
  virtual void tile(const BlockWalk& walk, std::int64_t t, bool masked) = 0;
  // The rows of q, times the scale, that dK sums.
  virtual const float* scaled_q(const WalkScratch& s) const = 0;
  // After the walk: s.dq's rows (Σ dz·k) into the rows' dq.
  virtual void finish(const Block& blk, WalkScratch& s, bool want_dq) = 0;
  virtual std::int64_t bytes() const = 0;
};

// out ([B, Sq, H, Dv] through og) and the rows' statistic (through sg; an empty view skips it).
AttentionStats walk_forward(const Geometry& geo, const std::function<std::unique_ptr<ForwardRows>()>& make,
                            TensorView out, const HeadsGrid& og, TensorView stat, const RowStatGrid& sg);
// dq, dk, dv (+=, each optional) over `split`, its units taken in `runs` fixed runs.
AttentionStats walk_backward(const Geometry& geo, const Split& split, std::int64_t runs,
                             const std::function<std::unique_ptr<BackwardRows>()>& make, const QkvBackwardGrids& g,
                             ConstTensorView out, ConstTensorView d_out, TensorView dq, TensorView dk, TensorView dv);

}  // namespace rows
}  // namespace posenc::detail
