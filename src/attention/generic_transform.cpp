// A QKTransformScheme (posenc/scheme.hpp) tabulated from its fp64 definition for one call: the
// tables the built-in RoPE and Shortformer give (QKTables), so that the kernels run it as them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "attention/transforms.hpp"
#include "internal.hpp"
#include "posenc/error.hpp"
#include "posenc/scheme.hpp"

namespace posenc::detail {
namespace {

using Form = QKTransformScheme::Form;

// "groups[g].transform (NAME).method(position, …)", for errors.
std::string at(const std::string& name, const char* method, std::int64_t position, std::int64_t index) {
  return name + "." + method + "(" + std::to_string(position) + ", " + std::to_string(index) + ")";
}

// fill(row, scratch) for every table row on the threads. A definition's error reaches the caller
// as the lowest row's (found again in order), whatever the thread count.
template <class Fill>
void fill_rows(std::int64_t rows, std::int64_t work_per_row, std::int64_t scratch, const Fill& fill) {
  ParallelErrors errors;  // the scheme's own code runs on the threads
#pragma omp parallel num_threads(threads_for(rows* work_per_row))
  {
    std::vector<double> buffer(static_cast<std::size_t>(scratch));
#pragma omp for schedule(static)
    for (std::int64_t row = 0; row < rows; ++row) errors.run([&] { fill(row, buffer); });
  }
  try {
    errors.rethrow();
  } catch (...) {
    std::vector<double> buffer(static_cast<std::size_t>(scratch));
    for (std::int64_t row = 0; row < rows; ++row) fill(row, buffer);
    throw;
  }
}

// The rotation's cos θ and sin θ per table row ([cos | sin] of `pairs`), times s on queries and
// 1/s on keys where the scheme scales.
void rotation_tables(const QKTransformScheme& t, const std::string& name, const TransformRows& r, QKTables& out) {
  const std::int64_t pairs = out.half;
  const auto rows = static_cast<std::int64_t>(r.table_ids.size());
  const bool scaled = t.scaled();
  out.q_cos_sin.resize(static_cast<std::size_t>(rows * 2 * pairs));
  if (scaled) out.k_cos_sin.resize(out.q_cos_sin.size());
  fill_rows(rows, pairs * 64, 0, [&](std::int64_t row, std::vector<double>&) {
    const std::int64_t p = r.table_ids[static_cast<std::size_t>(row)];
    for (std::int64_t i = 0; i < pairs; ++i) {
      const double theta = t.angle(p, i);
      if (!std::isfinite(theta)) throw Error(r.where, at(name, "angle", p, i).c_str(), to_text(theta), "finite");
      double s = 1.0;
      if (scaled) {
        s = t.scale(p, i);
        if (!(std::isfinite(s) && s > 0))
          throw Error(r.where, at(name, "scale", p, i).c_str(), to_text(s), "finite and > 0");
      }
      const double c = std::cos(theta), sn = std::sin(theta);
      const auto cos_at = static_cast<std::size_t>(row * 2 * pairs + i),
                 sin_at = cos_at + static_cast<std::size_t>(pairs);
      out.q_cos_sin[cos_at] = static_cast<float>(c * s);
      out.q_cos_sin[sin_at] = static_cast<float>(sn * s);
      if (scaled) {
        out.k_cos_sin[cos_at] = static_cast<float>(c / s);
        out.k_cos_sin[sin_at] = static_cast<float>(sn / s);
      }
    }
  });
}

// The added row per table row.
void addition_tables(const QKTransformScheme& t, const std::string& name, const TransformRows& r, QKTables& out) {
  const std::int64_t d = r.head_dim;
  const auto rows = static_cast<std::int64_t>(r.table_ids.size());
  out.absolute.resize(static_cast<std::size_t>(rows * d));
  fill_rows(rows, d * 16, d, [&](std::int64_t row, std::vector<double>& added) {
    const std::int64_t p = r.table_ids[static_cast<std::size_t>(row)];
    std::fill(added.begin(), added.end(), 0.0);
    t.addition(p, added);
    for (std::int64_t j = 0; j < d; ++j) {
      const double v = added[static_cast<std::size_t>(j)];
      if (!std::isfinite(v)) throw Error(r.where, at(name, "addition", p, j).c_str(), to_text(v), "finite");
      out.absolute[static_cast<std::size_t>(row * d + j)] = static_cast<float>(v);
    }
  });
}

}  // namespace

QKTables qk_tables(const QKTransformRef& transform, const TransformRows& r) {
  if (!transform) throw Error(r.where, r.name.c_str(), "null", "a QKTransformScheme");
  const QKTransformScheme& t = *transform;
  const std::string name = r.name + " (" + std::string(t.scheme_name()) + ")";
  if (t.head_dim() != r.head_dim) {
    throw Error(r.where, (name + ".head_dim()").c_str(), std::to_string(t.head_dim()),
                "the head_dim of q, " + std::to_string(r.head_dim));
  }
  QKTables out;
  out.transform_keys = true;
  const Form form = t.form();
  if (form == Form::kAddition) {
    out.kind = QKTables::kAbsolute;
    addition_tables(t, name, r, out);
    return out;
  }
  if (form != Form::kRotation) {
    throw Error(r.where, (name + ".form()").c_str(), std::to_string(static_cast<int>(form)), "kRotation or kAddition");
  }
  const std::int64_t pairs = t.rotary_pairs(), offset = t.rotary_offset();
  if (offset < 0 || offset > r.head_dim) {
    throw Error(r.where, (name + ".rotary_offset()").c_str(), std::to_string(offset),
                "in [0, head_dim = " + std::to_string(r.head_dim) + "]");
  }
  if (pairs < 1 || pairs > (r.head_dim - offset) / 2) {
    throw Error(r.where, (name + ".rotary_pairs()").c_str(), std::to_string(pairs),
                "in [1, (head_dim − rotary_offset) / 2 = " + std::to_string((r.head_dim - offset) / 2) + "]");
  }
  out.kind = QKTables::kRope;
  out.interleaved = t.interleaved();
  out.half = pairs;
  out.offset = offset;
  rotation_tables(t, name, r, out);
  return out;
}

}  // namespace posenc::detail
