// The typed arguments of posenc's torch ops: TorchScript classes that C++ (libtorch) and Python
// build with named, typed fields, validated when they are made.
//
//   torch.classes.posenc.Rope(head_dim, rotary_dim, base, layout, max_position_embeddings,
//       rotary_offset, rope_type, scaling: Dict[str, float], factors: Dict[str, List[float]],
//       xpos: List[float])                          RoPE's parameters (posenc/rotary.hpp)
//   torch.classes.posenc.Scheme(name, heads, options: Dict[str, float], rope: Rope?)
//                                                   one head group's registered scheme (registry.hpp)
//   torch.classes.posenc.Temperature(kind, values: Dict[str, float])
//                                                   a position temperature (posenc/temperature.hpp)
//
// From C++ (find_package(posenc COMPONENTS torch), posenc::torch):
//
//   c10::List<c10::intrusive_ptr<posenc::torch_adapter::SchemeClass>> schemes;
//   schemes.push_back(c10::make_intrusive<posenc::torch_adapter::SchemeClass>(
//       "alibi", 8, c10::Dict<std::string, double>(), c10::nullopt));
//
// and pass `schemes` to posenc::attention through the dispatcher (torch/ops.cpp lists the ops).
#pragma once

#include <torch/custom_class.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <optional>
#include <string>
#include <vector>

#include "posenc/posenc.hpp"

namespace posenc::torch_adapter {

struct RopeClass : torch::CustomClassHolder {
  // scaling: rope_type's numbers by Hugging Face's names (factor, original_max_position_embeddings,
  // beta_fast, beta_slow, mscale, mscale_all_dim, truncate as 0 or 1, attention_factor,
  // low_freq_factor, high_freq_factor, partial_rotary_factor); factors: short_factor,
  // long_factor, freq_factors; xpos: [] or [scale_base, center]. Other names are refused.
  RopeClass(std::int64_t head_dim, std::int64_t rotary_dim, double base, const std::string& layout,
            std::int64_t max_position_embeddings, std::int64_t rotary_offset, const std::string& rope_type,
            const c10::Dict<std::string, double>& scaling, const c10::Dict<std::string, std::vector<double>>& factors,
            const std::vector<double>& xpos);
  explicit RopeClass(RopeParams p) : params(std::move(p)) {}
  RopeParams params;
  // The first constructor's arguments, which pickling (and so copy.deepcopy) stores; a Rope made
  // from RopeParams in C++ has none and cannot be pickled.
  using State =
      std::tuple<std::int64_t, std::int64_t, double, std::string, std::int64_t, std::int64_t, std::string,
                 c10::Dict<std::string, double>, c10::Dict<std::string, std::vector<double>>, std::vector<double>>;
  std::optional<State> state;
};

struct SchemeClass : torch::CustomClassHolder {
  // A registered scheme by name; option names are checked here, their values (which may depend on
  // q's head_dim) when the attention completes them.
  SchemeClass(const std::string& name, std::int64_t heads, const c10::Dict<std::string, double>& options,
              const c10::optional<c10::intrusive_ptr<RopeClass>>& rope);
  // The registry's arguments for q's head size and the attention's scale (0: 1/sqrt(head_dim)), as
  // given (make_head_group completes them), and completed with the defaults and checked.
  SchemeArgs given_args(std::int64_t head_dim, double scale) const;
  SchemeArgs args(std::int64_t head_dim, double scale) const;
  // The learned parameters' shape, and their initial values in that shape (float64).
  std::vector<std::int64_t> parameter_shape(std::int64_t head_dim) const;
  at::Tensor initial_parameters(std::int64_t head_dim) const;

  const SchemeEntry* entry;
  std::int64_t heads;
  std::map<std::string, double, std::less<>> options;
  std::optional<RopeParams> rope;
  c10::optional<c10::intrusive_ptr<RopeClass>> rope_object;  // as given: pickling stores it
};

struct TemperatureClass : torch::CustomClassHolder {
  // kind "llama4": floor_scale and attn_scale; kind "mistral": beta and
  // original_max_position_embeddings (an integer). Each required, no other.
  TemperatureClass(const std::string& kind, const c10::Dict<std::string, double>& values);
  PositionTemperature temperature;
  std::string kind;  // as given: pickling stores them
  c10::Dict<std::string, double> values;
};

void define_classes(torch::Library& m);

}  // namespace posenc::torch_adapter
