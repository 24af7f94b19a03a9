// fp64 reference of the score biases: one element at a time, straight from the definitions in
// posenc/bias.hpp (bias_value per element; gradients summed per element in b, h, i, j order).
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "bias_checks.hpp"
#include "posenc/reference.hpp"

namespace posenc::ref {
namespace {

// Calls fn(h, offset, r) for every element of a score grid, r = k_pos − q_pos (and fn may use
// the positions through the 4-argument form below).
template <class Fn>
void for_each_score(const detail::ScoreGrid& g, const Positions& q_positions, const Positions& k_positions, Fn fn) {
  for (std::int64_t b = 0; b < g.batch; ++b) {
    for (std::int64_t h = 0; h < g.heads; ++h) {
      for (std::int64_t i = 0; i < g.q_len; ++i) {
        const std::int64_t q = q_positions.at(b, i);
        for (std::int64_t j = 0; j < g.k_len; ++j) {
          if constexpr (std::is_invocable_v<Fn, std::int64_t, std::int64_t, std::int64_t, std::int64_t>) {
            fn(h, g.offset(b, h, i) + j * g.k_stride, q, k_positions.at(b, j));
          } else {
            fn(h, g.offset(b, h, i) + j * g.k_stride, k_positions.at(b, j) - q);
          }
        }
      }
    }
  }
}

}  // namespace

void bias_materialize(const BiasScheme& scheme, const Positions& q_positions, const Positions& k_positions,
                      TensorView out) {
  const detail::ScoreGrid g = detail::check_scores("bias_materialize", "out", ConstTensorView(out), bias_heads(scheme),
                                                   q_positions, k_positions);
  detail::check_writable("bias_materialize", "out", ConstTensorView(out));
  for_each_score(g, q_positions, k_positions, [&](std::int64_t h, std::int64_t offset, std::int64_t q, std::int64_t k) {
    detail::store(out.data(), out.dtype(), offset, bias_value(scheme, h, q, k));
  });
}

void alibi_backward(const AlibiParams& params, const Positions& q_positions, const Positions& k_positions,
                    ConstTensorView d_scores, std::span<double> d_slopes) {
  detail::check_gradient_size("alibi_backward", "d_slopes", d_slopes.size(), params.heads());
  const detail::ScoreGrid g =
      detail::check_scores("alibi_backward", "d_scores", d_scores, params.heads(), q_positions, k_positions);
  for_each_score(g, q_positions, k_positions, [&](std::int64_t h, std::int64_t offset, std::int64_t r) {
    d_slopes[static_cast<std::size_t>(h)] +=
        detail::load(d_scores.data(), d_scores.dtype(), offset) * detail::alibi_derivative(params.form(), r);
  });
}

void t5_bias_backward(const T5BiasParams& params, const Positions& q_positions, const Positions& k_positions,
                      ConstTensorView d_scores, std::span<double> d_table) {
  detail::check_gradient_size("t5_bias_backward", "d_table", d_table.size(), params.num_buckets() * params.heads());
  const detail::ScoreGrid g =
      detail::check_scores("t5_bias_backward", "d_scores", d_scores, params.heads(), q_positions, k_positions);
  for_each_score(g, q_positions, k_positions, [&](std::int64_t h, std::int64_t offset, std::int64_t r) {
    d_table[static_cast<std::size_t>(params.bucket(r) * params.heads() + h)] +=
        detail::load(d_scores.data(), d_scores.dtype(), offset);
  });
}

void kerple_backward(const KerpleParams& params, const Positions& q_positions, const Positions& k_positions,
                     ConstTensorView d_scores, std::span<double> d_r1, std::span<double> d_r2) {
  detail::check_gradient_size("kerple_backward", "d_r1", d_r1.size(), params.heads());
  detail::check_gradient_size("kerple_backward", "d_r2", d_r2.size(), params.heads());
  const detail::ScoreGrid g =
      detail::check_scores("kerple_backward", "d_scores", d_scores, params.heads(), q_positions, k_positions);
  for_each_score(g, q_positions, k_positions, [&](std::int64_t h, std::int64_t offset, std::int64_t r) {
    double g1 = 0, g2 = 0;
    detail::kerple_derivatives(params, h, r, &g1, &g2);
    const double ds = detail::load(d_scores.data(), d_scores.dtype(), offset);
    d_r1[static_cast<std::size_t>(h)] += ds * g1;
    d_r2[static_cast<std::size_t>(h)] += ds * g2;
  });
}

void relative_bias_backward(const RelativeBias& scheme, const Positions& q_positions, const Positions& k_positions,
                            ConstTensorView d_scores, std::span<double> d_params) {
  detail::check_gradient_size("relative_bias_backward", "d_params", d_params.size(), scheme.parameter_count());
  const detail::ScoreGrid g =
      detail::check_scores("relative_bias_backward", "d_scores", d_scores, scheme.heads(), q_positions, k_positions);
  for_each_score(g, q_positions, k_positions, [&](std::int64_t h, std::int64_t offset, std::int64_t r) {
    scheme.accumulate_gradient(h, r, detail::load(d_scores.data(), d_scores.dtype(), offset), d_params);
  });
}

void bias_backward(const BiasScheme& scheme, const Positions& q_positions, const Positions& k_positions,
                   ConstTensorView d_scores, std::span<double> d_params) {
  detail::check_gradient_size("bias_backward", "d_params", d_params.size(), bias_parameter_count(scheme));
  if (const PositionBias* pb = scheme.position()) {
    pb->reference_backward(q_positions, k_positions, d_scores, d_params);
  } else if (const auto* alibi = scheme.get_if<AlibiParams>()) {
    // The built-in relative biases by their own oracles, independent of their accumulate_gradient.
    ref::alibi_backward(*alibi, q_positions, k_positions, d_scores, d_params);
  } else if (const auto* t5 = scheme.get_if<T5BiasParams>()) {
    ref::t5_bias_backward(*t5, q_positions, k_positions, d_scores, d_params);
  } else if (const auto* kerple = scheme.get_if<KerpleParams>()) {
    const auto h = static_cast<std::size_t>(kerple->heads());
    ref::kerple_backward(*kerple, q_positions, k_positions, d_scores, d_params.first(h), d_params.subspan(h));
  } else if (const RelativeBias* relative = scheme.relative()) {
    ref::relative_bias_backward(*relative, q_positions, k_positions, d_scores, d_params);
  }
}

}  // namespace posenc::ref

namespace posenc {
namespace {

// The PositionBias whose default gradient form runs on this thread: a scheme that overrides
// neither accumulate_gradient nor reference_backward is refused by name instead of recursing.
thread_local const PositionBias* running_default = nullptr;

class DefaultForm {
 public:
  DefaultForm(const PositionBias& bias, const char* where) : saved_(running_default) {
    if (running_default == &bias) {
      throw Error(where, "scheme", std::string(bias.scheme_name()) + ", a PositionBias that overrides neither",
                  "accumulate_gradient or reference_backward (scheme.hpp): one defines the other");
    }
    running_default = &bias;
  }
  DefaultForm(const DefaultForm&) = delete;
  DefaultForm& operator=(const DefaultForm&) = delete;
  ~DefaultForm() { running_default = saved_; }

 private:
  const PositionBias* saved_;
};

}  // namespace

// One pair's gradient by the scheme's block definition: a [heads, 1, 1] block of score gradients,
// zero but at `head`.
void PositionBias::accumulate_gradient(std::int64_t head, std::int64_t q_position, std::int64_t k_position,
                                       double weight, std::span<double> grads) const {
  const char* const where = "PositionBias::accumulate_gradient";
  if (head < 0 || head >= heads())
    throw Error(where, "head", std::to_string(head), "in [0, " + std::to_string(heads()) + ")");
  const DefaultForm running(*this, where);
  std::vector<double> d_scores(static_cast<std::size_t>(heads()), 0.0);
  d_scores[static_cast<std::size_t>(head)] = weight;
  reference_backward(Positions::ids(std::span<const std::int64_t>(&q_position, 1)),
                     Positions::ids(std::span<const std::int64_t>(&k_position, 1)),
                     ConstTensorView::of(d_scores.data(), {heads(), 1, 1}), grads);
}

// The block's gradient pair by pair, in b, h, i, j order.
void PositionBias::reference_backward(const Positions& q_positions, const Positions& k_positions,
                                      ConstTensorView d_scores, std::span<double> grads) const {
  const char* const where = "PositionBias::reference_backward";
  detail::check_gradient_size(where, "grads", grads.size(), parameter_count());
  const detail::ScoreGrid g = detail::check_scores(where, "d_scores", d_scores, heads(), q_positions, k_positions);
  if (g.q_len * g.k_len > 0) check_positions(where, q_positions, k_positions);
  const DefaultForm running(*this, where);
  ref::for_each_score(g, q_positions, k_positions,
                      [&](std::int64_t h, std::int64_t offset, std::int64_t q, std::int64_t k) {
                        accumulate_gradient(h, q, k, detail::load(d_scores.data(), d_scores.dtype(), offset), grads);
                      });
}

void PositionBias::backward(const Positions& q_positions, const Positions& k_positions, ConstTensorView d_scores,
                            std::span<double> grads) const {
  reference_backward(q_positions, k_positions, d_scores, grads);
}

// value() per element, rounded once to out's dtype.
void PositionBias::materialize(const Positions& q_positions, const Positions& k_positions, TensorView out) const {
  const char* const where = "PositionBias::materialize";
  const detail::ScoreGrid g =
      detail::check_scores(where, "out", ConstTensorView(out), heads(), q_positions, k_positions);
  detail::check_writable(where, "out", ConstTensorView(out));
  if (g.q_len * g.k_len > 0) check_positions(where, q_positions, k_positions);
  ref::for_each_score(g, q_positions, k_positions,
                      [&](std::int64_t h, std::int64_t offset, std::int64_t q, std::int64_t k) {
                        detail::store(out.data(), out.dtype(), offset, value(h, q, k));
                      });
}

}  // namespace posenc
