// The study's language model: a byte-level decoder-only transformer (pre-LayerNorm, GELU MLP),
// identical for every positional scheme except for how positions enter:
//
//   sinusoidal, learned      added to the byte embeddings (learned: a table of train_length rows;
//                            positions past it use the last row — it has nothing else): the
//                            study's own, since the registry holds terms of the attention
//   every other scheme       inside the fused attention, held as its registry entry says
//                            (posenc/registry.hpp): its decoder_preset, training,
//                            parameters_fixed, decoder_statistic_bias and its inputs'
//                            decoder_log_sigmoid, and <scheme>-<variant> for its length variants
//
// The default arms (all_schemes) are rope, rope-ntk and rope-yarn (dynamic NTK or YaRN past the
// training length, from the one model trained as rope), xpos, t5, alibi, kerple, fire and nope
// (the registry's none); fox, stickbreaking (with rem·b_h, a learned per-head vector for the stick
// left over, as its authors' models add) and cope (a table of train_length + 1 positions, since
// position 0 occurs) train with --schemes. This file names none of them.
// Attention, its backward and every scheme's gradients are posenc's fused op (posenc::attention,
// torch/ops.cpp), called through the dispatcher as Python calls it; the linear layers' products are
// posenc::matmul (linear.hpp), so that no BLAS picks their summation order by CPU.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "posenc/registry.hpp"
#include "posenc/torch/classes.hpp"

namespace posenc::study {

struct ModelConfig {
  std::string scheme = "rope";
  std::int64_t width = 128, layers = 3, heads = 4, train_length = 64;
};

// The schemes the study knows, in report order.
const std::vector<std::string>& all_schemes();
// The scheme a scheme's model is trained as: the scheme of a length variant (rope for rope-ntk and
// rope-yarn), else itself.
std::string training_scheme(const std::string& scheme);
// Every scheme the study can train: all_schemes(), the registry's other schemes of the
// relative-bias family (posenc/registry.hpp), each with its defaults and initial parameters, then
// the registry's schemes of the token-term and normaliser families that a decoder can train (fox,
// stickbreaking, cope), then the other transforms and their length variants (absolute): later
// ones, so that the others keep their seeds.
const std::vector<std::string>& known_schemes();
// Whether the scheme replaces the softmax (a registered normaliser: stick-breaking, CoPE), so that
// no quantized cache can stand for its k and v.
bool replaces_softmax(const std::string& scheme);
// "one of …" for an error message.
std::string known_schemes_text();

class LanguageModelImpl : public torch::nn::Module {
 public:
  explicit LanguageModelImpl(const ModelConfig& config);
  // Logits [B, S, 256] for the bytes [B, S] (int64), positions 0 … S − 1; context_length: the
  // length the model is evaluated at (the test-time RoPE scalings use it; 0: S).
  torch::Tensor forward(const torch::Tensor& bytes, std::int64_t context_length = 0);
  // Switches between schemes that share the parameters (rope, rope-ntk, rope-yarn: they differ
  // only at test lengths): one trained model is evaluated under each.
  void set_scheme(const std::string& scheme);
  // Evaluation against a quantized KV cache (posenc/quantized.hpp: "q8_0", "q4_0", "fp8_e4m3"; ""
  // turns it off): each layer's keys and values quantized, and attention reading them from the
  // cache. A scheme with RoPE stores its keys rotated (post_rope, ggml's convention) or as
  // projected, rotated after dequantisation. Schemes that replace the softmax (stickbreaking,
  // cope) are refused; a head size that is not a multiple of 32 is refused for q8_0 and q4_0.
  void set_kv_cache(const std::string& format, bool post_rope);
  // Whether the scheme rotates q and k (so that post- and pre-RoPE caches differ).
  bool has_rope() const;

 private:
  struct Layer {
    torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
    torch::nn::Linear qkv{nullptr}, out{nullptr}, up{nullptr}, down{nullptr};
    std::vector<torch::nn::Linear> inputs;  // the per-token inputs' maps (fox: the forget gates' logits)
    torch::Tensor statistic_bias;           // b_h [heads, head_dim] (SchemeEntry::decoder_statistic_bias)
    std::vector<torch::Tensor> raw;         // the scheme's trained slices (SchemeEntry::training)
  };
  // The scheme's arguments at an evaluation length (a length variant's past the training length:
  // rope-ntk, rope-yarn).
  posenc::SchemeArgs attention_args(std::int64_t context_length) const;
  // The attention's scheme at an evaluation length.
  c10::intrusive_ptr<torch_adapter::SchemeClass> attention_scheme(std::int64_t context_length) const;
  // The rotation of q and k at an evaluation length, for a scheme that rotates them (RotaryQK).
  std::optional<RopeParams> rotation(std::int64_t context_length) const;
  torch::Tensor layer_bias_params(const Layer& layer) const;

  ModelConfig config_;
  std::string kv_format_;
  bool kv_post_rope_ = false;
  torch::nn::Embedding embed_{nullptr}, positions_{nullptr};
  std::vector<Layer> layers_;
  torch::nn::LayerNorm final_norm_{nullptr};
  torch::nn::Linear head_{nullptr};
};
TORCH_MODULE(LanguageModel);

}  // namespace posenc::study
