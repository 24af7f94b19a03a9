// RoPE (posenc/rotary.hpp) as the fused attention's query/key transform (attention/transforms.hpp).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "attention/transforms.hpp"
#include "posenc/error.hpp"
#include "rotary_checks.hpp"

namespace posenc::detail {

namespace {

// Rows [0, n) of `out` ([cos | sin] of `half` pairs per row) for the n `positions`, in f32.
void fill_cos_sin(const RopeParams& rp, const Positions& positions, std::int64_t n, std::int64_t seq_len, float* out) {
  const std::int64_t half = rp.rotary_dim() / 2;
  TableFloats c32(static_cast<std::size_t>(n * half)), s32(c32.size());
  rope_cos_sin(rp, positions, TensorView::of(c32.data(), {n, half}), TensorView::of(s32.data(), {n, half}), seq_len);
#pragma omp parallel for schedule(static) num_threads(threads_for(n* half * 2))
  for (std::int64_t row = 0; row < n; ++row) {
    std::copy_n(c32.data() + row * half, half, out + row * 2 * half);
    std::copy_n(s32.data() + row * half, half, out + row * 2 * half + half);
  }
}

// RoPE's rows for positions 0 … count − 1 under one set of frequencies, kept across calls. Each
// decode step over an un-rotated cache is a new call that meets every cache position again, and a
// row depends only on its position, the frequencies ω and the factor α (rope_cos_sin), so the
// rows of the step before are this step's. Tables are found by ω and α bit for bit, and made by
// the active target's kernels (set_target empties the cache). A table is
// made an eighth longer than asked (at least 1024 rows), so that a growing cache is tabulated
// anew rarely, and then copies the rows it has. At most kTableCacheBytes / 2 in all (one table
// beyond the rest), the oldest dropped first; posenc::empty_cache() empties it.
class RopeRowCache {
 public:
  struct Table {
    std::vector<double> w;
    double alpha = 1.0;
    std::int64_t count = 0;  // positions [0, count)
    std::shared_ptr<const TableFloats> rows;
  };
  static RopeRowCache& instance() {
    static RopeRowCache* cache = new RopeRowCache();  // never destroyed: plans may outlive static destruction
    return *cache;
  }
  // The table of (ω, α) with the most rows (count 0: none).
  Table find(const std::vector<double>& w, double alpha) {
    const std::lock_guard<std::mutex> lock(mutex_);
    Table best;
    for (const Table& t : tables_) {
      if (t.count > best.count && same(t, w, alpha)) best = t;
    }
    return best;
  }
  void keep(Table table) {
    const std::size_t bytes = table.rows->size() * sizeof(float);
    const std::lock_guard<std::mutex> lock(mutex_);
    // A shorter table of the same ω and α is now of no use.
    for (auto it = tables_.begin(); it != tables_.end();) {
      if (same(*it, table.w, table.alpha) && it->count <= table.count) {
        bytes_ -= it->rows->size() * sizeof(float);
        it = tables_.erase(it);
      } else {
        ++it;
      }
    }
    tables_.push_back(std::move(table));
    bytes_ += bytes;
    while (bytes_ > kTableCacheBytes / 2 && tables_.size() > 1) {
      bytes_ -= tables_.front().rows->size() * sizeof(float);
      tables_.pop_front();
    }
  }
  void clear() {
    const std::lock_guard<std::mutex> lock(mutex_);
    tables_.clear();
    bytes_ = 0;
  }

 private:
  static bool same(const Table& t, const std::vector<double>& w, double alpha) {
    return t.w.size() == w.size() && std::memcmp(t.w.data(), w.data(), w.size() * sizeof(double)) == 0 &&
           std::memcmp(&t.alpha, &alpha, sizeof(double)) == 0;
  }
  std::mutex mutex_;
  std::deque<Table> tables_;  // oldest first
  std::size_t bytes_ = 0;
};

// The shared rows covering positions [0, need) under seq_len's frequencies, or null where sharing
// does not pay: frequencies that move with the length (dynamic scalings, past their switch) or a
// table beyond the cache's size.
std::shared_ptr<const TableFloats> shared_rows(const RopeParams& rp, std::int64_t seq_len, std::int64_t need) {
  const std::int64_t half = rp.rotary_dim() / 2;
  const std::int64_t count = need + std::max<std::int64_t>(1024, need / 8);
  if (static_cast<double>(count) * static_cast<double>(2 * half) * sizeof(float) > kTableCacheBytes / 2) return nullptr;
  const std::vector<double> w = rp.inv_frequencies(seq_len);
  if (rp.inv_frequencies(std::max(seq_len, count)) != w) return nullptr;
  const double alpha = rp.attention_factor();
  RopeRowCache& cache = RopeRowCache::instance();
  RopeRowCache::Table have = cache.find(w, alpha);
  if (have.count >= need) return have.rows;
  auto rows = std::make_shared<TableFloats>(static_cast<std::size_t>(count * 2 * half));
  if (have.count > 0) std::copy_n(have.rows->data(), have.count * 2 * half, rows->data());
  fill_cos_sin(rp, Positions::range(count - have.count, have.count), count - have.count, seq_len,
               rows->data() + have.count * 2 * half);
  std::shared_ptr<const TableFloats> shared = std::move(rows);
  cache.keep({w, alpha, count, shared});
  return shared;
}

// Whether the table rows are positions first … first + n − 1, with first >= 0 and no more rows
// before them than in them (a table from position 0 then costs at most twice the rows asked).
bool from_small_position(const std::vector<std::int64_t>& ids) {
  if (ids.empty() || ids.front() < 0) return false;
  for (std::size_t i = 1; i < ids.size(); ++i) {
    if (ids[i] != ids[0] + static_cast<std::int64_t>(i)) return false;
  }
  return ids.front() <= static_cast<std::int64_t>(ids.size());
}

}  // namespace

void empty_rope_row_cache() { RopeRowCache::instance().clear(); }

// RoPE's tables for the table rows (QKTables): [cos | sin] per row, ζ^(±e) folded in under xPos.
QKTables qk_tables(const RotaryQK& rope, const TransformRows& r) {
  QKTables t;
  const std::vector<std::int64_t>& table_ids = r.table_ids;
  const Positions& table_positions = r.table_positions;
  const std::int64_t p_max = r.p_max;
  const auto rows = static_cast<std::int64_t>(table_ids.size());
  const RopeParams& rp = rope.params;
  if (rp.head_dim() != r.head_dim) {
    throw Error(r.where, (r.name + ".params.head_dim").c_str(), std::to_string(rp.head_dim()),
                "the head_dim of q, " + std::to_string(r.head_dim));
  }
  if (rp.xpos()) {
    check_xpos_range(rp, r.q_positions, r.batch_rows, r.q_len);
    check_xpos_range(rp, r.k_positions, r.batch_rows, r.k_len);
  }
  t.kind = QKTables::kRope;
  t.transform_keys = !rope.keys_rotated;
  t.interleaved = rp.layout() == RopeLayout::kInterleaved;
  t.half = rp.rotary_dim() / 2;
  t.offset = rp.rotary_offset();
  const std::int64_t half = t.half;
  const std::int64_t seq_len = rope.seq_len > 0 ? rope.seq_len : p_max + 1;
  if (!rp.xpos()) {
    // Positions from (near) 0, as a decode step's: rows shared with the calls before.
    if (from_small_position(table_ids)) {
      t.shared = shared_rows(rp, seq_len, table_ids.back() + 1);
      if (t.shared) {
        t.shared_rows = t.shared->data() + table_ids.front() * 2 * half;
        return t;
      }
    }
    t.q_cos_sin.resize(static_cast<std::size_t>(rows * 2 * half));
    fill_cos_sin(rp, table_positions, rows, seq_len, t.q_cos_sin.data());
    return t;
  }
  std::vector<double, TableAllocator<double>> c64(static_cast<std::size_t>(rows * half)), s64(c64.size());
  rope_cos_sin(rp, table_positions, TensorView::of(c64.data(), {rows, half}), TensorView::of(s64.data(), {rows, half}),
               seq_len);
  t.q_cos_sin.resize(static_cast<std::size_t>(rows * 2 * half));
  t.k_cos_sin.resize(t.q_cos_sin.size());
#pragma omp parallel for schedule(static) num_threads(threads_for(rows* half * 64))
  for (std::int64_t row = 0; row < rows; ++row) {
    const double e = rp.xpos_exponent(static_cast<double>(table_ids[static_cast<std::size_t>(row)]));
    for (std::int64_t i = 0; i < half; ++i) {
      const auto at = static_cast<std::size_t>(row * half + i);
      const auto out = static_cast<std::size_t>(row * 2 * half + i);
      // xPos (rotary.hpp): ζ_i^(+e) on queries, ζ_i^(−e) on keys.
      const double zeta = rp.xpos_zeta(i);
      const double up = std::pow(zeta, e), down = std::pow(zeta, -e);
      t.q_cos_sin[out] = static_cast<float>(c64[at] * up);
      t.q_cos_sin[out + static_cast<std::size_t>(half)] = static_cast<float>(s64[at] * up);
      t.k_cos_sin[out] = static_cast<float>(c64[at] * down);
      t.k_cos_sin[out + static_cast<std::size_t>(half)] = static_cast<float>(s64[at] * down);
    }
  }
  return t;
}

}  // namespace posenc::detail
