// The typed arguments of the torch ops (classes.hpp).
#include "posenc/torch/classes.hpp"

#include <cmath>
#include <string>
#include <vector>

#include "adapter.hpp"

namespace posenc::torch_adapter {
namespace {

// A number that must hold an integer (Dict[str, float] carries every number as a double).
std::int64_t integer_of(const char* where, const std::string& name, double value) {
  constexpr double kLargest = 9007199254740992.0;  // 2^53: beyond, doubles skip integers
  if (!(value == std::trunc(value) && std::fabs(value) <= kLargest))
    throw Error(where, name, c10::str(value), "an integer");
  return static_cast<std::int64_t>(value);
}

RopeScaling scaling_of(const std::string& rope_type, const c10::Dict<std::string, double>& numbers,
                       const c10::Dict<std::string, std::vector<double>>& factors) {
  const char* where = "Rope";
  RopeScaling s;
  // Hugging Face's legacy names, as rope_params_from_hf reads them: Phi-3's "su" is longrope,
  // Qwen2-VL's "mrope" the default frequencies.
  s.type = rope_type_from_name(rope_type == "su" ? "longrope" : rope_type == "mrope" ? "default" : rope_type);
  for (const auto& item : numbers) {
    const std::string& key = item.key();
    const double value = item.value();
    if (key == "factor") {
      s.factor = value;
    } else if (key == "original_max_position_embeddings") {
      s.original_max_position_embeddings = integer_of(where, "scaling." + key, value);
    } else if (key == "beta_fast") {
      s.beta_fast = value;
    } else if (key == "beta_slow") {
      s.beta_slow = value;
    } else if (key == "mscale") {
      s.mscale = value;
    } else if (key == "mscale_all_dim") {
      s.mscale_all_dim = value;
    } else if (key == "truncate") {
      if (value != 0.0 && value != 1.0) throw Error(where, "scaling.truncate", c10::str(value), "0 or 1");
      s.truncate = value == 1.0;
    } else if (key == "attention_factor") {
      s.attention_factor = value;
    } else if (key == "low_freq_factor") {
      s.low_freq_factor = value;
    } else if (key == "high_freq_factor") {
      s.high_freq_factor = value;
    } else if (key == "partial_rotary_factor") {
      s.partial_rotary_factor = value;
    } else {
      throw Error(where, "scaling", key,
                  "factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim, truncate, "
                  "attention_factor, low_freq_factor, high_freq_factor or partial_rotary_factor");
    }
  }
  for (const auto& item : factors) {
    if (item.key() == "short_factor") {
      s.short_factor = item.value();
    } else if (item.key() == "long_factor") {
      s.long_factor = item.value();
    } else if (item.key() != "freq_factors") {
      throw Error(where, "factors", item.key(), "short_factor, long_factor or freq_factors");
    }
  }
  return s;
}

PositionTemperature temperature_of(const std::string& kind, const c10::Dict<std::string, double>& values) {
  const char* where = "PositionTemperature";
  const auto keys = kind == "llama4"    ? std::vector<std::string>{"floor_scale", "attn_scale"}
                    : kind == "mistral" ? std::vector<std::string>{"beta", "original_max_position_embeddings"}
                                        : std::vector<std::string>{};
  if (keys.empty()) throw Error(where, "kind", kind, "llama4 or mistral");
  for (const auto& item : values) {
    if (std::find(keys.begin(), keys.end(), item.key()) == keys.end())
      throw Error(where, item.key(), "given", "only " + keys[0] + " and " + keys[1] + " for " + kind);
  }
  for (const std::string& key : keys) {
    if (!values.contains(key)) throw Error(where, key, "missing", "a number for " + kind);
  }
  if (kind == "llama4") return PositionTemperature::llama4(values.at("floor_scale"), values.at("attn_scale"));
  return PositionTemperature::mistral(values.at("beta"), integer_of(where, "original_max_position_embeddings",
                                                                    values.at("original_max_position_embeddings")));
}

}  // namespace

RopeClass::RopeClass(std::int64_t head_dim, std::int64_t rotary_dim, double base, const std::string& layout,
                     std::int64_t max_position_embeddings, std::int64_t rotary_offset, const std::string& rope_type,
                     const c10::Dict<std::string, double>& scaling,
                     const c10::Dict<std::string, std::vector<double>>& factors, const std::vector<double>& xpos)
    : params([&] {
        if (layout != "half-split" && layout != "interleaved")
          throw Error("Rope", "layout", layout, "half-split or interleaved");
        if (!xpos.empty() && xpos.size() != 2)
          throw Error("Rope", "xpos", std::to_string(xpos.size()) + " values", "none, or [scale_base, center]");
        RopeParams p(head_dim, rotary_dim, base,
                     layout == "interleaved" ? RopeLayout::kInterleaved : RopeLayout::kHalfSplit,
                     scaling_of(rope_type, scaling, factors), max_position_embeddings,
                     factors.contains("freq_factors") ? factors.at("freq_factors") : std::vector<double>{});
        if (rotary_offset != 0) p = p.with_rotary_offset(rotary_offset);
        if (!xpos.empty()) p = p.with_xpos(xpos[0], xpos[1]);
        return p;
      }()),
      state(State{head_dim, rotary_dim, base, layout, max_position_embeddings, rotary_offset, rope_type, scaling.copy(),
                  factors.copy(), xpos}) {}

SchemeClass::SchemeClass(const std::string& name, std::int64_t heads_, const c10::Dict<std::string, double>& options_,
                         const c10::optional<c10::intrusive_ptr<RopeClass>>& rope_)
    : entry(&find_scheme(name)), heads(heads_) {
  if (heads < 1 || heads > static_cast<std::int64_t>(SchemeOption::kMaxSize))
    throw Error("Scheme", "heads", std::to_string(heads), "in [1, 2^31]");
  for (const auto& item : options_) options.emplace(item.key(), item.value());
  if (rope_) rope = (*rope_)->params;
  rope_object = rope_;
  // Option names and values now, with a stand-in head size: the attention checks them again with q's.
  (void)args(rope ? rope->head_dim() : 2, 0.0);
}

SchemeArgs SchemeClass::given_args(std::int64_t head_dim, double scale) const {
  SchemeArgs a;
  a.heads = heads;
  a.head_dim = head_dim;
  a.scale = scale;
  a.options = options;
  a.rope = rope;
  return a;
}

SchemeArgs SchemeClass::args(std::int64_t head_dim, double scale) const {
  return complete_scheme_args(*entry, given_args(head_dim, scale));
}

std::vector<std::int64_t> SchemeClass::parameter_shape(std::int64_t head_dim) const {
  return entry->parameter_shape(args(head_dim, 0.0));
}

at::Tensor SchemeClass::initial_parameters(std::int64_t head_dim) const {
  const SchemeArgs a = args(head_dim, 0.0);
  const std::vector<std::int64_t> shape = entry->parameter_shape(a);
  // A scheme that reads per-token inputs cannot be made without them: without learned parameters
  // it has nothing to initialise, and with them its initial values would need its inputs.
  if (!entry->inputs.empty()) {
    if (shape.empty()) return at::empty({0}, at::kDouble);
    throw Error("scheme " + entry->name, "initial_parameters", "asked without its per-token inputs",
                "parameters given with the scheme (its initial values depend on its inputs)");
  }
  const std::vector<double> values = scheme_parameters(*entry, entry->make(a));
  return at::tensor(values, at::kDouble).reshape(shape.empty() ? std::vector<std::int64_t>{0} : shape);
}

TemperatureClass::TemperatureClass(const std::string& kind_, const c10::Dict<std::string, double>& values_)
    : temperature(temperature_of(kind_, values_)), kind(kind_), values(values_.copy()) {}

void define_classes(torch::Library& m) {
  // Constructors and methods turn posenc::Error into ValueError, as the ops do. Each class is an
  // immutable value that pickles (and so deep-copies) as its constructor's arguments. While
  // torch.compile or opcheck traces, the ops' fake kernels receive the objects themselves
  // (tracing_mode "real"), and objects compare by identity.
  const auto real = [](const auto&) { return std::string("real"); };
  using DoubleDict = c10::Dict<std::string, double>;
  using ListDict = c10::Dict<std::string, std::vector<double>>;
  m.class_<RopeClass>("Rope")
      .def(
          torch::init([](std::int64_t head_dim, std::int64_t rotary_dim, double base, const std::string& layout,
                         std::int64_t max_position_embeddings, std::int64_t rotary_offset, const std::string& rope_type,
                         const DoubleDict& scaling, const ListDict& factors, const std::vector<double>& xpos) {
            return translating([&] {
              return c10::make_intrusive<RopeClass>(head_dim, rotary_dim, base, layout, max_position_embeddings,
                                                    rotary_offset, rope_type, scaling, factors, xpos);
            });
          }))
      .def("tracing_mode", [real](const c10::intrusive_ptr<RopeClass>& self) { return real(self); })
      .def("__eq__", [](const c10::intrusive_ptr<RopeClass>& self,
                        const c10::intrusive_ptr<RopeClass>& other) { return self.get() == other.get(); })
      .def("head_dim", [](const c10::intrusive_ptr<RopeClass>& self) { return self->params.head_dim(); })
      .def("rotary_dim", [](const c10::intrusive_ptr<RopeClass>& self) { return self->params.rotary_dim(); })
      .def("inv_frequencies",
           [](const c10::intrusive_ptr<RopeClass>& self, std::int64_t seq_len) {
             return translating([&] { return at::tensor(self->params.inv_frequencies(seq_len), at::kDouble); });
           })
      .def_pickle(
          [](const c10::intrusive_ptr<RopeClass>& self) {
            TORCH_CHECK_VALUE(self->state.has_value(),
                              "Rope: made from RopeParams in C++; expected one made from its "
                              "arguments to pickle or copy it");
            return *self->state;
          },
          [](RopeClass::State s) {
            return translating([&] {
              return c10::make_intrusive<RopeClass>(std::get<0>(s), std::get<1>(s), std::get<2>(s), std::get<3>(s),
                                                    std::get<4>(s), std::get<5>(s), std::get<6>(s), std::get<7>(s),
                                                    std::get<8>(s), std::get<9>(s));
            });
          });
  m.class_<SchemeClass>("Scheme")
      .def(torch::init([](const std::string& name, std::int64_t heads, const DoubleDict& options,
                          const c10::optional<c10::intrusive_ptr<RopeClass>>& rope) {
        return translating([&] { return c10::make_intrusive<SchemeClass>(name, heads, options, rope); });
      }))
      .def("tracing_mode", [real](const c10::intrusive_ptr<SchemeClass>& self) { return real(self); })
      .def("__eq__", [](const c10::intrusive_ptr<SchemeClass>& self,
                        const c10::intrusive_ptr<SchemeClass>& other) { return self.get() == other.get(); })
      .def("name", [](const c10::intrusive_ptr<SchemeClass>& self) { return self->entry->name; })
      .def("heads", [](const c10::intrusive_ptr<SchemeClass>& self) { return self->heads; })
      .def("parameter_shape",
           [](const c10::intrusive_ptr<SchemeClass>& self, std::int64_t head_dim) {
             return translating([&] { return self->parameter_shape(head_dim); });
           })
      .def("initial_parameters",
           [](const c10::intrusive_ptr<SchemeClass>& self, std::int64_t head_dim) {
             return translating([&] { return self->initial_parameters(head_dim); });
           })
      .def_pickle(
          [](const c10::intrusive_ptr<SchemeClass>& self) {
            DoubleDict options;
            for (const auto& [key, value] : self->options) options.insert(key, value);
            return std::make_tuple(self->entry->name, self->heads, options, self->rope_object);
          },
          [](std::tuple<std::string, std::int64_t, DoubleDict, c10::optional<c10::intrusive_ptr<RopeClass>>> s) {
            return translating([&] {
              return c10::make_intrusive<SchemeClass>(std::get<0>(s), std::get<1>(s), std::get<2>(s), std::get<3>(s));
            });
          });
  m.class_<TemperatureClass>("Temperature")
      .def(torch::init([](const std::string& kind, const DoubleDict& values) {
        return translating([&] { return c10::make_intrusive<TemperatureClass>(kind, values); });
      }))
      .def("tracing_mode", [real](const c10::intrusive_ptr<TemperatureClass>& self) { return real(self); })
      .def("__eq__", [](const c10::intrusive_ptr<TemperatureClass>& self,
                        const c10::intrusive_ptr<TemperatureClass>& other) { return self.get() == other.get(); })
      .def("factor",
           [](const c10::intrusive_ptr<TemperatureClass>& self, std::int64_t position) {
             return translating([&] { return self->temperature.factor(position); });
           })
      .def_pickle(
          [](const c10::intrusive_ptr<TemperatureClass>& self) { return std::make_tuple(self->kind, self->values); },
          [](std::tuple<std::string, DoubleDict> s) {
            return translating([&] { return c10::make_intrusive<TemperatureClass>(std::get<0>(s), std::get<1>(s)); });
          });
}

}  // namespace posenc::torch_adapter
