"""posenc inside Hugging Face transformers (posenc.hf), against transformers' own model classes.

Each family is a model class of transformers built from the positional fields of a published
config.json (cited; kept as published unless a comment says otherwise), with 2 layers and a few
heads, random weights from a fixed seed. Its eager attention is the reference: the same weights with
attn_implementation="posenc" give the same logits (and a 0.1% change of the attention scale does
not, so the test sees the positions), the same 32 greedy tokens of generate(), padded batches
included, and the same gradients after one training step. posenc's own RoPE from the same config
(RotaryPositionalEncoding.from_hf_config) rotates as the model's rotary embedding does, at
positions up to its context length.

Random small models attend almost uniformly, where positions hardly change the logits: the query
and key projections are scaled up so that the scores spread.

Run: PYTHONPATH=build/python ~/.cache/posenc/venv-torch-2.15.0/bin/python -m pytest -q python/tests/test_hf.py
"""
import copy
import inspect

import pytest
import torch
import transformers

import posenc
import posenc.hf

posenc.hf.register()

VOCAB = 96

# microsoft/Phi-3-mini-128k-instruct's LongRoPE factors (config.json rope_scaling, the current revision's
# "longrope" lists; its first revision named the type "su" and had others).
PHI3_LONG = [
    1.0700000524520874, 1.1200000047683716, 1.149999976158142, 1.4199999570846558, 1.5699999332427979,
    1.7999999523162842, 2.129999876022339, 2.129999876022339, 3.009999990463257, 5.910000324249268,
    6.950000286102295, 9.070000648498535, 9.930000305175781, 10.710000038146973, 11.130000114440918,
    14.609999656677246, 15.409998893737793, 19.809999465942383, 37.279998779296875, 38.279998779296875,
    38.599998474121094, 40.12000274658203, 46.20000457763672, 50.940006256103516, 53.66000747680664,
    54.9373893737793, 56.89738845825195, 57.28738784790039, 59.98738479614258, 60.86738586425781,
    60.887386322021484, 61.71739196777344, 62.91739273071289, 62.957393646240234, 63.41739273071289,
    63.8173942565918, 63.83739471435547, 63.897396087646484, 63.93739700317383, 64.06739807128906,
    64.11434936523438, 64.12435150146484, 64.15435028076172, 64.19435119628906, 64.24435424804688,
    64.57435607910156, 64.69000244140625, 64.76000213623047
]
PHI3_SHORT = ([1.1, 1.1, 1.1, 1.3000000000000003, 1.3500000000000003, 1.3500000000000003, 1.4000000000000004,
               1.5500000000000005] + [2.000000000000001] * 17 + [2.0500000000000007] * 6 + [2.1000000000000005] * 2 +
              [2.1500000000000004, 2.25, 2.25, 2.25, 2.25, 2.25, 2.3999999999999995, 2.4499999999999993,
               2.499999999999999, 2.6999999999999984, 2.6999999999999984, 2.7499999999999982, 2.799999999999998,
               2.8999999999999977, 3.049999999999997])

# name: (model class, config class, published positional fields, shrunk widths).
FAMILIES = {
    # meta-llama/Llama-3.1-8B config.json: rope_theta, rope_scaling (llama3), max_position_embeddings;
    # head_dim 4096 / 32 = 128.
    "llama3.1": ("LlamaForCausalLM", "LlamaConfig", dict(
        rope_theta=500000.0, max_position_embeddings=131072, head_dim=128,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}), dict(num_attention_heads=4, num_key_value_heads=2)),
    # Qwen/Qwen2-7B config.json: rope_theta 1e6, max_position_embeddings 131072, no sliding window
    # in use; head_dim 3584 / 28 = 128.
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(
        rope_theta=1000000.0, max_position_embeddings=131072, use_sliding_window=False),
        dict(num_attention_heads=2, num_key_value_heads=1, hidden_size=256)),
    # Qwen/Qwen3-8B config.json: rope_theta 1e6, max_position_embeddings 40960, head_dim 128.
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(
        rope_theta=1000000.0, max_position_embeddings=40960, head_dim=128),
        dict(num_attention_heads=4, num_key_value_heads=2)),
    # mistralai/Mistral-7B-v0.1 config.json: rope_theta 10000, max_position_embeddings 32768;
    # its sliding_window 4096 is shrunk to 16 so that a 40-token test crosses it.
    "mistral-sliding": ("MistralForCausalLM", "MistralConfig", dict(
        rope_theta=10000.0, max_position_embeddings=32768, head_dim=128, sliding_window=16),
        dict(num_attention_heads=4, num_key_value_heads=2)),
    # EleutherAI/pythia-160m config.json: rotary_pct 0.25, rotary_emb_base 10000,
    # max_position_embeddings 2048; head_dim 768 / 12 = 64.
    "gpt-neox-partial": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(
        rotary_pct=0.25, rotary_emb_base=10000, max_position_embeddings=2048),
        dict(num_attention_heads=4, hidden_size=256)),
    # openai/gpt-oss-20b config.json: rope_theta 150000, YaRN (factor 32, beta_fast 32, beta_slow 1,
    # original_max_position_embeddings 4096, truncate false), sliding_window 128 on alternate layers,
    # head_dim 64, max_position_embeddings 131072; learned attention sinks. 4 experts, 2 per token.
    "gpt-oss-sinks": ("GptOssForCausalLM", "GptOssConfig", dict(
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
        sliding_window=128, head_dim=64, max_position_embeddings=131072),
        dict(num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
             length=150)),
    # google/gemma-3-1b-pt config.json: rope_theta 1e6 on full layers, rope_local_base_freq 10000 on
    # sliding ones, sliding_window_pattern 6 (every sixth layer full), head_dim 256,
    # query_pre_attn_scalar 256, 4 heads over 1 KV head, max_position_embeddings 32768; six layers
    # (five sliding, one full). Its sliding_window 512 is shrunk to 16 so that a 40-token test
    # crosses it (gpt-oss keeps its published 128, at 150 tokens).
    "gemma3-local-global": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window=16, sliding_window_pattern=6,
        head_dim=256, query_pre_attn_scalar=256, max_position_embeddings=32768),
        dict(num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=6)),
    # HuggingFaceTB/SmolLM3-3B config.json: rope_theta 5e6, max_position_embeddings 65536,
    # no_rope_layer_interval 4 (every fourth layer without RoPE); head_dim 2048 / 16 = 128; four
    # layers, the last without RoPE.
    "smollm3-nope-layers": ("SmolLM3ForCausalLM", "SmolLM3Config", dict(
        rope_theta=5000000.0, max_position_embeddings=65536, no_rope_layer_interval=4, use_sliding_window=False),
        dict(num_attention_heads=2, num_key_value_heads=1, hidden_size=256, num_hidden_layers=4)),
    # microsoft/Phi-3-mini-128k-instruct config.json: LongRoPE (short and long factors, 48 each),
    # original_max_position_embeddings 4096, max_position_embeddings 131072, rope_theta 10000;
    # head_dim 3072 / 32 = 96. Its sliding_window 262144 is far past the test's tokens.
    "phi3-longrope": ("Phi3ForCausalLM", "Phi3Config", dict(
        rope_theta=10000.0, max_position_embeddings=131072, original_max_position_embeddings=4096,
        sliding_window=262144, rope_scaling={"type": "longrope", "short_factor": PHI3_SHORT,
                                             "long_factor": PHI3_LONG}),
        dict(num_attention_heads=4, num_key_value_heads=4, hidden_size=384)),
    # deepseek-ai/DeepSeek-V3 config.json: MLA (qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim
    # 128: values narrower than queries and keys), rope_theta 10000, YaRN (factor 40, beta_fast 32,
    # beta_slow 1, mscale 1, mscale_all_dim 1, original_max_position_embeddings 4096),
    # max_position_embeddings 163840; latent ranks shrunk (kv_lora_rank 512 to 64, q_lora_rank 1536
    # to 64), dense layers instead of experts.
    "deepseek-v3-mla": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840,
        rope_scaling={"type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}),
        dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=64,
             first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, rope_table=False)),
    # google/gemma-4-E2B config.json's text_config (tests/data/gemma-4-e2b.json): sliding layers θ
    # 10000 over head_dim 256, full layers proportional RoPE (partial_rotary_factor 0.25, θ 1e6) over
    # global_head_dim 512, every fifth layer full, max_position_embeddings 131072, one KV head; five
    # layers (one full). Its sliding_window 512 is shrunk to 16 so that a 40-token test crosses it, and
    # the per-layer input embeddings to the test's vocabulary.
    "gemma4-proportional": ("Gemma4ForCausalLM", "Gemma4TextConfig", dict(
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1000000.0}},
        layer_types=["sliding_attention"] * 4 + ["full_attention"], head_dim=256, global_head_dim=512,
        sliding_window=16, max_position_embeddings=131072),
        dict(num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=5, vocab_size_per_layer_input=VOCAB,
             hidden_size_per_layer_input=16)),
    # meta-llama/Llama-4-Scout-17B-16E-Instruct config.json's text_config (tests/data/llama-4-scout.json):
    # llama3 RoPE ×16 (low_freq_factor = high_freq_factor = 1, original 8192), θ 5e5, head_dim 128,
    # max_position_embeddings 10485760, every fourth layer without RoPE (no_rope_layers), chunked
    # attention on the RoPE layers, the NoPE layers' temperature (attn_scale 0.1), qk-norm, one
    # expert of 16 per token. Shrunk: attention_chunk_size 8192 to 16 and floor_scale 8192 to 8, so
    # that a 40-token test crosses chunks and the temperature steps; attn_temperature_tuning 4 as
    # True (transformers 5.24 types it bool; the model's code tests its truth); 4 experts, 4 layers.
    "llama4-chunked-nope": ("Llama4ForCausalLM", "Llama4TextConfig", dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 1.0, "original_max_position_embeddings": 8192},
        head_dim=128, max_position_embeddings=10485760, no_rope_layers=[1, 1, 1, 0], attention_chunk_size=16,
        attn_temperature_tuning=True, floor_scale=8, attn_scale=0.1, use_qk_norm=True),
        dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, num_local_experts=4,
             num_experts_per_tok=1, intermediate_size_mlp=128)),
    # openai-community/gpt2 config.json: learned absolute positions (n_positions 1024), 12 heads of 64
    # (n_embd 768), scale_attn_weights true; its dropouts (0.1) set to 0 so that a training step is
    # deterministic, n_embd shrunk to 256 (4 heads of 64).
    "gpt2-learned": ("GPT2LMHeadModel", "GPT2Config", dict(n_positions=1024, scale_attn_weights=True),
                     dict(num_attention_heads=4, hidden_size=256, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                          rope_table=False)),
}


def build(family, implementation, seed=0):
    model_name, config_name, positional, widths = FAMILIES[family]
    widths = {k: v for k, v in widths.items() if k not in ("length", "rope_table")}
    base = dict(vocab_size=VOCAB, hidden_size=widths.get("hidden_size", 256), intermediate_size=128,
                num_hidden_layers=2, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config = getattr(transformers, config_name)(**{**base, **widths, **positional})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)._from_config(copy.deepcopy(config),
                                                           attn_implementation=implementation)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in ("q_proj", "k_proj", "qkv_proj", "query_key_value", "q_b_proj", "kv_b_proj",
                                       "kv_a_proj_with_mqa", "attn.c_attn")) and p.dim() == 2:
                p.mul_(8.0)  # spread the scores: positions must matter
    return model.eval()


def pair(family):
    eager = build(family, "eager")
    fused = build(family, "posenc")
    fused.load_state_dict(eager.state_dict())
    return eager, fused


def tokens(batch=2, length=40, seed=1, family=None):
    """Random tokens; a family's own length where its positional pattern needs one (a sliding
    window to cross)."""
    if family is not None:
        length = FAMILIES[family][3].get("length", length)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)  # no pad, bos or eos id (0, 1, 2)


def scaled(model, factor):
    """The model with every attention layer's scale multiplied by factor."""
    model = copy.deepcopy(model)
    for module in model.modules():
        if hasattr(module, "scaling") and isinstance(module.scaling, float):
            module.scaling *= factor
        elif hasattr(module, "norm_factor"):
            module.norm_factor /= factor
    return model


# float32 logits of the same weights through two attention kernels: summation orders differ.
ATOL = 2e-4


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_equal_eager_and_see_the_positions(family):
    eager, fused = pair(family)
    x = tokens(family=family)
    with torch.no_grad():
        want, got = eager(x).logits, fused(x).logits
        off = scaled(eager, 1.001)(x).logits
        fused_off = scaled(fused, 1.001)(x).logits
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    assert (off - want).abs().max() > 2 * ATOL, "a 0.1% change of the scale must fail the comparison"
    torch.testing.assert_close(fused_off, off, rtol=0, atol=ATOL)  # posenc takes the layer's scaling


@pytest.mark.parametrize("family", list(FAMILIES))
def test_padded_batch_equals_eager_on_its_tokens(family):
    eager, fused = pair(family)
    x = tokens(family=family)
    mask = torch.ones_like(x)
    mask[1, :9] = 0  # left padding
    with torch.no_grad():
        want, got = eager(x, attention_mask=mask).logits, fused(x, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=0, atol=ATOL)


def assert_same_generation(eager, other, x):
    """32 greedy tokens of generate() identical, without and with left padding."""
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    for kwargs in ({}, {"attention_mask": mask}):
        want = eager.generate(x, max_new_tokens=32, do_sample=False, pad_token_id=0, **kwargs)
        got = other.generate(x, max_new_tokens=32, do_sample=False, pad_token_id=0, **kwargs)
        assert torch.equal(got, want), kwargs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_32_greedy_tokens_identical(family):
    assert_same_generation(*pair(family), tokens(length=12))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_training_step_gives_eager_gradients(family):
    eager, fused = pair(family)
    eager.train(), fused.train()
    x = tokens(family=family)
    grads = []
    for model in (eager, fused):
        model.zero_grad()
        model(x, labels=x).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    # Each parameter's gradient within 10^-3 of eager's in norm: float32 sums over every token.
    for name, g in grads[0].items():
        assert (grads[1][name] - g).norm() <= 1e-3 * g.norm(), name


def test_refusals_name_what_the_kernel_cannot_honour_and_sdpa_takes_them_only_when_asked():
    eager, fused = pair("llama3.1")
    x = tokens()
    layer = fused.model.layers[0].self_attn
    q = torch.randn(2, 4, 40, 128)
    kv = torch.randn(2, 2, 40, 128)
    dense = torch.zeros(2, 1, 40, 40)
    with pytest.raises(ValueError, match=r"posenc attention: a 4-D mask of shape \(2, 1, 40, 40\)"):
        posenc.hf.attention_forward(layer, q, kv, kv, dense, scaling=layer.scaling)
    with pytest.raises(ValueError, match="posenc attention: output_attentions = True"):
        posenc.hf.attention_forward(layer, q, kv, kv, None, output_attentions=True)
    with pytest.raises(ValueError, match="posenc attention: sliding_window = 8 on a bidirectional layer"):
        posenc.hf.attention_forward(layer, q, kv, kv, None, is_causal=False, sliding_window=8)
    fused.train()
    for module in fused.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.1
    with pytest.raises(ValueError, match="posenc attention: dropout = 0.1 while training"):
        fused(x)
    with pytest.raises(ValueError, match="posenc.hf.register: fallback = 'flash'"):
        posenc.hf.register(fallback="flash")
    try:
        posenc.hf.register(fallback="sdpa")
        out, _ = posenc.hf.attention_forward(layer, q, kv, kv, dense, scaling=layer.scaling)
        want = torch.nn.functional.scaled_dot_product_attention(q, kv.repeat_interleave(2, 1),
                                                                 kv.repeat_interleave(2, 1), attn_mask=dense,
                                                                 scale=layer.scaling)
        torch.testing.assert_close(out, want.transpose(1, 2), rtol=1e-5, atol=1e-5)
    finally:
        posenc.hf.register()


def twins(model_class, config):
    eager = model_class._from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    fused = model_class._from_config(copy.deepcopy(config), attn_implementation="posenc").eval()
    fused.load_state_dict(eager.state_dict())
    return eager, fused


def test_bidirectional_encoder_and_cross_attention_with_padding():
    """BERT's encoder over right-padded rows, and BART's decoder attending to a padded encoder (a
    bidirectional layer whose keys are another sequence): eager's outputs at the real tokens."""
    torch.manual_seed(4)
    x = tokens(length=20)
    mask = torch.ones_like(x)
    mask[1, 14:] = 0
    bert = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=128)
    eager, fused = twins(transformers.BertModel, bert)
    with torch.no_grad():
        want = eager(x, attention_mask=mask).last_hidden_state
        got = fused(x, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=0, atol=ATOL)
    bart = transformers.BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=1, decoder_layers=1,
                                   encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                   decoder_ffn_dim=128, max_position_embeddings=64)
    eager, fused = twins(transformers.BartForConditionalGeneration, bart)
    y = tokens(length=25, seed=2)
    with torch.no_grad():
        want = eager(input_ids=x, attention_mask=mask, decoder_input_ids=y).logits
        got = fused(input_ids=x, attention_mask=mask, decoder_input_ids=y).logits
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("family", ["llama3.1", "mistral-sliding", "gemma3-local-global", "llama4-chunked-nope",
                                    "gpt-oss-sinks", "llama3.1 patched"])
def test_a_static_cache_generates_eager_tokens(family):
    """A static cache (cache_implementation="static": preallocated slots, sliding and chunked
    layers' rolling buffers) gives eager's 32 greedy tokens with and without padding: the slots
    past the written keys are no keys."""
    name, _, patched = family.partition(" ")
    eager, fused = pair(name)
    if patched:
        fused = posenc.hf.patch(fused)
    x = tokens(length=12)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    for kwargs in ({}, {"attention_mask": mask}):
        want = eager.generate(x, max_new_tokens=32, do_sample=False, pad_token_id=0, **kwargs)
        got = fused.generate(x, max_new_tokens=32, do_sample=False, pad_token_id=0, cache_implementation="static",
                             **kwargs)
        assert torch.equal(got, want), kwargs


def test_what_posenc_would_get_wrong_is_refused():
    """A model whose attention bypasses the interface (BLOOM), a sliding layer that does not pass
    its window, and the sdpa fallback for a layer with sinks (sdpa has none)."""
    bloom = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)
    model = transformers.BloomForCausalLM._from_config(bloom, attn_implementation="posenc")
    with pytest.raises(ValueError, match="posenc attention: model_type = 'bloom', whose attention does not go"):
        model(tokens())
    # An overlay (here one key hidden from every query) that no [S, S] mask would carry: refused,
    # or with the fallback given to sdpa's mask.
    from transformers.masking_utils import and_masks, causal_mask_function, sdpa_mask
    overlay = and_masks(causal_mask_function, lambda b, h, q, kv: kv != 3)
    with pytest.raises(ValueError, match=r"posenc attention: mask_function = .*<lambda>; expected transformers'"):
        posenc.hf._key_mask(1, 8, 8, mask_function=overlay)
    # A sequence mask without the positions' remap: not transformers' packing.
    from transformers.masking_utils import packed_sequence_mask_function
    lone = and_masks(causal_mask_function, packed_sequence_mask_function(torch.zeros(1, 8, dtype=torch.long)))
    with pytest.raises(ValueError, match="posenc attention: mask_function of parts .*expected packed sequences with"):
        posenc.hf._key_mask(1, 8, 8, mask_function=lone)
    try:
        posenc.hf.register(fallback="sdpa")
        want = sdpa_mask(1, 8, 8, mask_function=overlay, allow_is_causal_skip=False)
        assert torch.equal(posenc.hf._key_mask(1, 8, 8, mask_function=overlay), want)
    finally:
        posenc.hf.register()
    _, gemma = pair("gemma3-local-global")
    layer = gemma.model.layers[0].self_attn
    q, kv = torch.randn(1, 4, 8, 256), torch.randn(1, 1, 8, 256)
    with pytest.raises(ValueError, match="posenc attention: sliding_window = None on layer 0, a sliding-window layer"):
        posenc.hf.attention_forward(layer, q, kv, kv, None, scaling=layer.scaling)
    _, oss = pair("gpt-oss-sinks")
    layer = oss.model.layers[0].self_attn
    q, kv = torch.randn(1, 4, 8, 64), torch.randn(1, 2, 8, 64)
    try:
        posenc.hf.register(fallback="sdpa")
        with pytest.raises(ValueError, match="a 4-D mask .*; sdpa has no attention sinks"):
            posenc.hf.attention_forward(layer, q, kv, kv, torch.zeros(1, 1, 8, 8), scaling=layer.scaling,
                                        sliding_window=128, s_aux=layer.sinks)
    finally:
        posenc.hf.register()


def model_module(model):
    """The modeling_<family> module of a model class (its apply_rotary_pos_emb)."""
    import sys
    return sys.modules[type(model).__module__]


# DeepSeek-V3 rotates the trailing 64 entries of its 192 (MLA) with interleaved weights inside the
# layer, which apply_rotary_pos_emb alone does not show: its RoPE is compared elsewhere
# (python/tests/test_ops.py, from_hf_config's MLA fields).
@pytest.mark.parametrize("family", [f for f in FAMILIES if FAMILIES[f][3].get("rope_table", True)])
def test_from_hf_config_rotates_as_the_models_rotary_embedding(family):
    """posenc's RoPE from the model's config against the model's own rotary embedding and
    apply_rotary_pos_emb, at positions up to its context length. transformers forms the angles
    ω·p in float32, so it may differ from posenc's exact fp64 angles by about p·2^-23 radians; a
    wrong frequency would differ by O(1) at such positions."""
    model = build(family, "eager")
    config = model.config
    # Per layer type where the model has several RoPEs (Gemma 3: sliding and full layers).
    layer_types = getattr(config, "layer_types", None) or [None]
    for layer_type in dict.fromkeys(layer_types):
        layer = None if layer_type is None else layer_types.index(layer_type)
        if getattr(config, "no_rope_layers", None) and layer is not None and not config.no_rope_layers[layer]:
            continue
        per_type = layer_type in (getattr(config, "rope_parameters", None) or {})
        rotary_args = (layer_type,) if per_type else ()
        check_rope_table(model, config, layer, rotary_args)


def check_rope_table(model, config, layer, rotary_args):
    rope = posenc.RotaryPositionalEncoding.from_hf_config(config.to_dict(), layer)
    # The same with θ 0.1% off: the bound below must catch it.
    wrong = config.to_dict()
    for fields in (wrong, *(v for v in (wrong.get("rope_parameters") or {}).values() if isinstance(v, dict)),
                   wrong.get("rope_parameters") or {}):
        if "rope_theta" in fields:
            fields["rope_theta"] *= 1.001
    wrong_rope = posenc.RotaryPositionalEncoding.from_hf_config(wrong, layer)
    top = config.max_position_embeddings - 1
    heads = config.num_attention_heads
    # The layer's own width (Gemma 4's full layers are wider than its config's head_dim).
    # Llama 4's base_model_prefix names its multimodal parent's attribute: its stack is .model.
    base = model.base_model if hasattr(model.base_model, "layers") else model.model
    attn = base.layers[layer or 0]
    attn = getattr(attn, "self_attn", None) or attn.attention
    head_dim = getattr(attn, "head_dim", None) or attn.head_size
    # LongRoPE and dynamic scalings choose their factors by length: within the original context too.
    original = (getattr(config, "rope_parameters", None) or {}).get("original_max_position_embeddings")
    for last in ([top] if not original or original > top else [original - 1, top]):
        positions = torch.unique(torch.cat([torch.arange(8), torch.linspace(0, last, 57).round().long()]))
        torch.manual_seed(3)
        q = torch.randn(1, heads, positions.numel(), head_dim)
        rotary = base.rotary_emb
        module = model_module(model)
        # Llama 4 rotates pairs (2i, 2i + 1) as complex numbers (apply_rotary_emb, [B, S, H, D]).
        interleaved = not hasattr(module, "apply_rotary_pos_emb")
        if interleaved:
            x = q.transpose(1, 2)
            want = module.apply_rotary_emb(x, x, rotary(q, positions[None], *rotary_args))[0].transpose(1, 2)
        else:
            cos, sin = rotary(q, positions[None], *rotary_args)
            apply = module.apply_rotary_pos_emb
            # Gemma 4 rotates one tensor at a time.
            want = apply(q, cos, sin) if "k" not in inspect.signature(apply).parameters else apply(q, q, cos, sin)[0]
        # Per entry: transformers' float32 angle ω·p carries about ω·p·2^-23 of rounding (ω and the
        # product), times the pair's size and the attention factor; the pass-through entries none.
        inv = getattr(rotary, f"{rotary_args[0]}_inv_freq" if rotary_args else "inv_freq").double()
        omega = torch.zeros(head_dim, dtype=torch.float64)
        size = q.abs().amax(dim=(0, 1)).double()
        if interleaved:
            omega[:2 * inv.numel()] = inv.repeat_interleave(2)
            pair_size = size + size.reshape(len(positions), -1, 2).flip(-1).reshape(size.shape)
        else:
            omega[:2 * inv.numel()] = torch.cat([inv, inv])
            pair_size = size + torch.cat([size[:, inv.numel():2 * inv.numel()], size[:, :inv.numel()],
                                          size[:, 2 * inv.numel():]], dim=1)
        bound = 2 * pair_size * omega * positions.double()[:, None] * 2.0 ** -22 + 1e-6

        def error(module):
            got, _ = module(q.transpose(1, 2).double(), None, positions)
            return (got.transpose(1, 2) - want.double()).abs().amax(dim=(0, 1))

        assert (error(rope) <= bound).all(), (layer, last, (error(rope) / bound).max())
        assert (error(wrong_rope) > bound).any(), (layer, last)


# Qwen-VL's M-RoPE: each rotary pair turns by the position of one axis (time, height, width),
# which an image's tokens make differ. name: (model class, config class, the text config's
# published positional fields, a one-block vision tower).
VL_FAMILIES = {
    # Qwen/Qwen2-VL-7B-Instruct config.json (tests/data/qwen2-vl-mrope.json): θ 1e6, mrope_section
    # [16, 24, 24] (blocks of pairs for time, height, width), max_position_embeddings 32768; head_dim
    # 3584 / 28 = 128.
    "qwen2-vl-mrope": ("Qwen2VLForConditionalGeneration", "Qwen2VLConfig", dict(
        rope_theta=1000000.0, max_position_embeddings=32768, head_dim=128,
        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
        dict(depth=1, embed_dim=32, hidden_size=256, num_heads=2, mlp_ratio=1)),
    # Qwen/Qwen3-VL-30B-A3B config.json's text_config (tests/data/qwen3-vl.json): θ 5e6, head_dim 128,
    # mrope_section [24, 20, 20] interleaved (pair i follows height when i % 3 == 1, width when
    # i % 3 == 2), max_position_embeddings 262144; built as the dense Qwen3-VL, whose attention and
    # rotary embedding the MoE model shares.
    "qwen3-vl-interleaved": ("Qwen3VLForConditionalGeneration", "Qwen3VLConfig", dict(
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                         "mrope_interleaved": True}, max_position_embeddings=262144, head_dim=128),
        dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=256,
             deepstack_visual_indexes=[])),
}


def build_vl(family, implementation):
    model_name, config_name, positional, vision = VL_FAMILIES[family]
    text = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                **positional)
    config = getattr(transformers, config_name)(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)._from_config(config, attn_implementation=implementation)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("q_proj" in name or "k_proj" in name) and "visual" not in name and p.dim() == 2:
                p.mul_(8.0)  # spread the scores: positions must matter
    return model.eval()


def image_positions(batch, length, start=5, grid=(4, 6)):
    """[3, B, S] positions of a text prompt with an image of grid (h, w) tokens from ``start``:
    the image's tokens share a time, their height and width follow the grid, and the text after it
    resumes past the grid's largest position (transformers' get_rope_index rule)."""
    positions = torch.arange(length).repeat(3, batch, 1)
    rows, cols = grid
    cells = torch.arange(rows * cols)
    image = slice(start, start + rows * cols)
    positions[0, :, image] = start
    positions[1, :, image] = start + cells // cols
    positions[2, :, image] = start + cells % cols
    after = image.stop
    positions[:, :, after:] = torch.arange(length - after) + start + max(rows, cols)
    return positions


@pytest.mark.parametrize("family", list(VL_FAMILIES))
def test_vl_mrope_logits_generation_and_gradients_equal_eager(family):
    eager = build_vl(family, "eager")
    fused = build_vl(family, "posenc")
    fused.load_state_dict(eager.state_dict())
    x = tokens()
    positions = image_positions(*x.shape)
    with torch.no_grad():
        want = eager(x, position_ids=positions).logits
        got = fused(x, position_ids=positions).logits
        text = eager(x).logits
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    assert (text - want).abs().max() > 2 * ATOL, "the image's positions per axis must change the logits"
    assert_same_generation(eager, fused, tokens(length=12))
    eager.train(), fused.train()
    grads = []
    for model in (eager, fused):
        model.zero_grad()
        model(x, position_ids=positions, labels=x).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        assert (grads[1][name] - g).norm() <= 1e-3 * g.norm(), name


@pytest.mark.parametrize("family", list(VL_FAMILIES))
def test_from_hf_config_mrope_rotates_as_the_models_rotary_embedding(family):
    """from_hf_config's M-RoPE (mrope_section, mrope_interleaved) against the model's rotary
    embedding and apply_rotary_pos_emb, at three differing axes up to its context length, with the
    bound of test_from_hf_config_rotates_as_the_models_rotary_embedding; the misreadings fail it:
    the sections dropped (1-D RoPE at the time axis's positions), Qwen3-VL's axes in blocks instead
    of interleaved, θ off by 0.1%."""
    model = build_vl(family, "eager")
    config = model.config.text_config
    rope = posenc.RotaryPositionalEncoding.from_hf_config(config.to_dict())
    assert rope.mrope_section == list(VL_FAMILIES[family][2].get("rope_scaling", VL_FAMILIES[family][2].get(
        "rope_parameters"))["mrope_section"])
    fields = config.to_dict()
    fields["rope_parameters"] = {**fields["rope_parameters"], "rope_theta": fields["rope_parameters"]["rope_theta"] * 1.001}
    wrong = posenc.RotaryPositionalEncoding.from_hf_config(fields)
    heads, head_dim = config.num_attention_heads, config.head_dim
    top = config.max_position_embeddings - 1
    g = torch.Generator().manual_seed(5)
    count = 64
    positions = torch.stack([torch.randint(0, top + 1, (count,), generator=g).sort().values for _ in range(3)])
    positions[:, :4] = torch.tensor([0, 1, 2, 3])
    torch.manual_seed(3)
    q = torch.randn(1, heads, count, head_dim)
    language_model = model.model.language_model
    cos, sin = language_model.rotary_emb(q, positions[:, None])
    want, _ = model_module(model).apply_rotary_pos_emb(q, q, cos, sin)
    inv = language_model.rotary_emb.inv_freq.double()
    omega = torch.cat([inv, inv])
    size = q.abs().amax(dim=(0, 1)).double()
    half = head_dim // 2
    pair_size = size + torch.cat([size[:, half:], size[:, :half]], dim=1)
    bound = 2 * pair_size * omega * positions.max(0).values.double()[:, None] * 2.0 ** -22 + 1e-6

    def error(module):
        got, _ = module(q.transpose(1, 2).double(), None, positions)
        return (got.transpose(1, 2) - want.double()).abs().amax(dim=(0, 1))

    assert (error(rope) <= bound).all(), (error(rope) / bound).max()
    assert (error(wrong) > bound).any()
    dropped, _ = posenc.RotaryPositionalEncoding(head_dim, base=rope.base)(q.transpose(1, 2).double(), None,
                                                                            positions[0])
    assert ((dropped.transpose(1, 2) - want.double()).abs().amax(dim=(0, 1)) > bound).any()
    if rope.mrope_interleaved:
        blocks = copy.copy(rope)
        blocks.mrope_interleaved = False
        assert (error(blocks) > bound).any()
    with pytest.raises(ValueError, match=r"attention: a RotaryPositionalEncoding with mrope_section = \["):
        posenc.attention(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), rope)


PACKED_FAMILIES = ["llama3.1", "mistral-sliding", "gemma3-local-global", "gpt-oss-sinks", "llama4-chunked-nope",
                   "llama3.1 patched"]


@pytest.mark.parametrize("family", PACKED_FAMILIES)
def test_packed_position_ids_give_eager_logits_and_gradients(family):
    """Sequences packed into a row, marked by position_ids that restart (transformers'
    padding-free format, DataCollatorWithFlattening's): transformers folds their boundaries into
    the mask function, whose sequences and positions posenc's mask hands to the kernel. Three
    sequences in one row, two in the other, across the 16-token windows and chunks: eager's logits
    (which differ from one unpacked sequence's by far more than the tolerance) and one training
    step's gradients."""
    name, _, patched = family.partition(" ")
    eager, fused = pair(name)
    if patched:
        fused = posenc.hf.patch(fused)
    x = tokens(length=60)
    packed = torch.stack([torch.cat([torch.arange(15), torch.arange(25), torch.arange(20)]),
                          torch.cat([torch.arange(40), torch.arange(20)])])
    with torch.no_grad():
        want = eager(x, position_ids=packed, use_cache=False).logits
        got = fused(x, position_ids=packed, use_cache=False).logits
        whole = eager(x, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    assert (whole - want).abs().max() > 2 * ATOL, "the sequences' boundaries must change the logits"
    eager.train(), fused.train()
    grads = []
    for model in (eager, fused):
        model.zero_grad()
        model(x, position_ids=packed, labels=x, use_cache=False).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    for n, g in grads[0].items():
        assert (grads[1][n] - g).norm() <= 1e-3 * g.norm(), n


def test_llama4_chunks_matter_and_cross_a_cache_that_dropped_keys():
    """Llama 4's chunked layers: without chunks (one chunk of 10^6) eager's logits move by more than
    the tolerance, and posenc follows the change; generate() crosses chunk boundaries through a
    chunked layer's cache, which keeps only the last C - 1 keys (so key positions come from the mask,
    not from the cache's slots); a gap inside a row is allowed (chunks count cache slots from the
    row's first token, as transformers' do); a chunked layer called without its keys' positions is
    refused."""
    eager, fused = pair("llama4-chunked-nope")
    x = tokens()
    unchunked = [copy.deepcopy(m) for m in (eager, fused)]
    for m in unchunked:
        m.config.attention_chunk_size = 1_000_000
    with torch.no_grad():
        want = eager(x).logits
        off, fused_off = (m(x).logits for m in unchunked)
    assert (off - want).abs().max() > 2 * ATOL, "one chunk instead of 16-token ones must fail the comparison"
    torch.testing.assert_close(fused_off, off, rtol=0, atol=ATOL)
    mask = torch.ones_like(x)
    mask[0, 20:23] = 0
    with torch.no_grad():
        torch.testing.assert_close(fused(x, attention_mask=mask).logits[mask.bool()],
                                   eager(x, attention_mask=mask).logits[mask.bool()], rtol=0, atol=ATOL)
    out = fused.generate(x[:, :12], max_new_tokens=32, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    assert out.cache.layers[0].keys.shape[2] == 15 < out.sequences.shape[1] - 1  # C - 1 keys kept
    layer = fused.model.layers[0].self_attn
    q, kv = torch.randn(1, 4, 8, 128), torch.randn(1, 2, 8, 128)
    with pytest.raises(ValueError, match="posenc attention: layer 0, a chunked layer of config.attention_chunk_size"):
        posenc.hf.attention_forward(layer, q, kv, kv, None, scaling=layer.scaling)


def test_a_gap_inside_a_row_is_refused_on_sliding_layers():
    eager, fused = pair("mistral-sliding")
    x = tokens()
    mask = torch.ones_like(x)
    mask[0, 20:23] = 0
    with pytest.raises(ValueError, match="posenc attention: sliding_window = 16 with padding inside a row"):
        fused(x, attention_mask=mask)


# posenc.hf.patch: the model's positional scheme inside the kernel. RoPE families whose rotation
# the layer does in the model's own way (DeepSeek-V3's interleaved MLA rotation) are refused.
ROPE_PATCHED = [f for f in FAMILIES if FAMILIES[f][3].get("rope_table", True)]


def check_patched(eager, patched, inputs, generate_inputs, atol=ATOL):
    """The patched model against eager: logits (padded batch included, at its tokens), 32 greedy
    tokens of generate() with and without padding, and one training step's gradients."""
    x, mask = inputs["x"], inputs["mask"]
    extra = inputs.get("extra", {})
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": mask}):
            want = eager(x, **kwargs, **extra).logits
            got = patched(x, **kwargs, **extra).logits
            keep = mask.bool() if kwargs and not extra else torch.ones(want.shape[:2], dtype=torch.bool)
            torch.testing.assert_close(got[keep], want[keep], rtol=0, atol=atol)
    assert_same_generation(eager, patched, generate_inputs)
    eager.train(), patched.train()
    grads = []
    for model in (eager, patched):
        model.zero_grad()
        # No label is predicted from padding, whose outputs differ (eager's attend to masked keys,
        # posenc's are zero): a causal LM predicts token t from position t - 1.
        labels = extra.get("decoder_input_ids")
        if labels is None:
            known = mask.bool()
            known[:, 1:] &= mask[:, :-1].bool()
            labels = x.masked_fill(~known, -100)
        model(x, attention_mask=mask, labels=labels).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        assert (grads[1][name] - grad).norm() <= 1e-3 * grad.norm(), name
    return grads


def padded(x):
    mask = torch.ones_like(x)
    mask[1, :9] = 0
    return mask


@pytest.mark.parametrize("family", ROPE_PATCHED)
def test_patch_moves_the_rotation_into_the_kernel(family):
    """The model's rotary embedding gives the identity, its cache holds unrotated keys, and posenc
    rotates q and k from the config's exact fp64 angles: eager's logits, tokens and gradients."""
    eager = build(family, "eager")
    patched = posenc.hf.patch(build(family, "eager"))
    patched.load_state_dict(eager.state_dict())
    layers = [m for m in patched.modules() if hasattr(m, "_posenc_scheme")]
    assert layers and any(isinstance(m._posenc_scheme, posenc.RotaryPositionalEncoding) for m in layers)
    x = tokens(family=family)
    check_patched(eager, patched, {"x": x, "mask": padded(x)}, tokens(length=12))


def test_patch_runs_bloom_alibi_in_the_kernel():
    """BLOOM (bigscience/bloom-560m config.json: 16 heads, ALiBi; widths shrunk, 6 heads so that
    the slopes take the paper's non-power-of-two rule) with its slopes inside the kernel: eager's
    logits over a batch with padding inside a row too (BLOOM counts tokens, as packing does)."""
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=96, n_layer=2, n_head=6, pad_token_id=0)
    torch.manual_seed(0)
    eager = transformers.BloomForCausalLM._from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in eager.named_parameters():
            if "query_key_value.weight" in name:
                p.mul_(4.0)
    patched = posenc.hf.patch(transformers.BloomForCausalLM._from_config(copy.deepcopy(config),
                                                                        attn_implementation="eager"))
    patched.load_state_dict(eager.state_dict())
    want_slopes = posenc.alibi_slopes(6).to(torch.float32)
    for layer in patched.transformer.h:
        torch.testing.assert_close(layer.self_attention._posenc_scheme.slopes, want_slopes, rtol=0, atol=0)
    x = tokens()
    check_patched(eager, patched, {"x": x, "mask": padded(x)}, tokens(length=12))
    gap = torch.ones_like(x)
    gap[0, 10:14] = 0
    with torch.no_grad():
        want, got = eager(x, attention_mask=gap).logits, patched(x, attention_mask=gap).logits
    torch.testing.assert_close(got[gap.bool()], want[gap.bool()], rtol=0, atol=ATOL)


def test_patch_runs_t5_buckets_in_the_kernel_and_trains_the_models_table():
    """T5 (google-t5/t5-small config.json: 32 buckets, max_distance 128, bidirectional in the
    encoder, causal in the decoder; widths shrunk) with its bucket table inside the kernel: eager's
    logits and generate(), and the table's gradient is the model's parameter's."""
    config = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, num_heads=4, num_layers=2, d_ff=128,
                                   relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.0,
                                   pad_token_id=0, decoder_start_token_id=0)
    eager, patched = twins(transformers.T5ForConditionalGeneration, config)
    patched = posenc.hf.patch(patched)
    torch.manual_seed(5)
    tables = {"encoder": torch.randn(32, 4), "decoder": torch.randn(32, 4)}  # T5 initialises them near zero
    with torch.no_grad():
        for model in (eager, patched):
            for stack, table in tables.items():
                getattr(model, stack).block[0].layer[0].SelfAttention.relative_attention_bias.weight.copy_(table)
    x = tokens(length=30)
    mask = torch.ones_like(x)
    mask[1, 22:] = 0  # right padding, as T5's tokenizer pads
    y = tokens(length=25, seed=2)
    grads = check_patched(eager, patched, {"x": x, "mask": mask, "extra": {"decoder_input_ids": y}},
                          tokens(length=12))
    for stack in ("encoder", "decoder"):
        name = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        assert grads[1][name].norm() > 0, name


def test_patch_adds_gpt2_learned_positions_in_the_kernel_and_trains_the_models_table():
    """GPT-2 (the gpt2-learned family) with its position table added by posenc's learned kernel:
    the embeddings bit for bit (one rounding either way), eager's logits, generate() and gradients,
    the table's among them; a position past the table, or tensors off the CPU, are refused by name."""
    eager = build("gpt2-learned", "eager")
    patched = posenc.hf.patch(build("gpt2-learned", "eager"))
    patched.load_state_dict(eager.state_dict())
    x = tokens()
    for positions in (torch.arange(40).unsqueeze(0), torch.arange(80).view(2, 40)):
        want = eager.transformer.wte(x) + eager.transformer.wpe(positions)
        got = patched.transformer.wte(x) + patched.transformer.wpe(positions)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    grads = check_patched(eager, patched, {"x": x, "mask": padded(x)}, tokens(length=12))
    assert grads[1]["transformer.wpe.weight"].norm() > 0
    too_long = torch.full((1, 1025), 5)
    with pytest.raises(ValueError, match="position = 1024; expected a position < max_len = 1024"):
        patched(too_long)
    lookup = patched.transformer.wpe(torch.arange(4))
    with pytest.raises(ValueError, match="GPT-2's learned positions run on posenc's CPU kernel; the embeddings are on meta"):
        torch.empty(4, 256, device="meta") + lookup


def test_patch_refuses_what_it_cannot_move():
    for model in (transformers.MptForCausalLM._from_config(transformers.MptConfig(
            vocab_size=VOCAB, d_model=64, n_layers=1, n_heads=4)), build("deepseek-v3-mla", "eager")):
        with pytest.raises(ValueError, match=f"posenc.hf.patch: model_type = '{model.config.model_type}'; expected"):
            posenc.hf.patch(model)
    patched = posenc.hf.patch(build("llama3.1", "eager"))
    try:
        posenc.hf.register(fallback="sdpa")
        layer = patched.model.layers[0].self_attn
        q, kv = torch.randn(1, 4, 8, 128), torch.randn(1, 2, 8, 128)
        with pytest.raises(ValueError, match="a 4-D mask .*; sdpa cannot run a patched layer"):
            posenc.hf.attention_forward(layer, q, kv, kv, torch.zeros(1, 1, 8, 8), scaling=layer.scaling)
    finally:
        posenc.hf.register()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_right_padded_batch_equals_eager_on_its_tokens(family):
    """Decoders with right padding (as a batch of prompts padded at the end, or labels in training):
    the real tokens see only real tokens before them, so their logits are eager's."""
    eager, fused = pair(family)
    x = tokens(family=family)
    mask = torch.ones_like(x)
    mask[1, -11:] = 0
    with torch.no_grad():
        want, got = eager(x, attention_mask=mask).logits, fused(x, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=0, atol=ATOL)


def test_gpt_oss_window_slides_inside_generate():
    """gpt-oss's 128-token window on alternate layers, crossed inside generate(): a 120-token prompt
    and 32 greedy tokens, with and without left padding, identical to eager."""
    eager, fused = pair("gpt-oss-sinks")
    assert_same_generation(eager, fused, tokens(length=120))


@pytest.mark.parametrize("family", ["llama3.1", "gemma3-local-global", "gpt2-learned"])
def test_bf16_model_logits_near_eager(family):
    """The same models in bfloat16 (posenc's attention computes in f32 and rounds its output once;
    eager rounds after each product), both against the float32 model: posenc's logits no farther
    from it than 1.5 times eager's (measured: 0.75-1.13 times; a wrong scale or position would be
    many times). gpt-oss is left out: in bfloat16 its experts' routing flips, and both errors are
    half the logits' scale."""
    eager, fused = pair(family)
    x = tokens(family=family)
    with torch.no_grad():
        reference = eager(x).logits
        eager, fused = eager.to(torch.bfloat16), fused.to(torch.bfloat16)
        want, got = eager(x).logits.float(), fused(x).logits.float()
    err_eager = (want - reference).abs().max().item()
    err_posenc = (got - reference).abs().max().item()
    assert err_posenc <= 1.5 * err_eager + 1e-6, (err_posenc, err_eager)


def bf16_gradient_errors(family):
    """One training step's gradients of the bfloat16 models (eager, posenc) against the float32
    model's: each one's distance from them, all parameters together, relative to their norm."""
    eager, fused = pair(family)
    x = tokens(family=family)
    grads = []
    reference = copy.deepcopy(eager).train()
    reference.zero_grad()
    reference(x, labels=x).loss.backward()
    want = torch.cat([p.grad.reshape(-1) for p in reference.parameters() if p.grad is not None])
    for model in (eager, fused):
        model = model.to(torch.bfloat16).train()
        model.zero_grad()
        model(x, labels=x).loss.backward()
        grads.append(torch.cat([p.grad.float().reshape(-1) for p in model.parameters() if p.grad is not None]))
    return [((g - want).norm() / want.norm()).item() for g in grads]


@pytest.mark.parametrize("family", ["llama3.1", "gemma3-local-global", "gpt2-learned", "llama4-chunked-nope"])
def test_bf16_training_step_near_eager(family):
    """One training step of the bfloat16 models (posenc's backward: float32 math on bfloat16 q, k,
    v, dO; gradients rounded once): posenc's gradients no farther from the float32 model's than
    1.5 times eager's bfloat16 gradients are (measured 0.80-0.97 times). gpt-oss and Gemma 4 are
    left out: both models' bfloat16 gradients are farther from float32's than their own norm."""
    err_eager, err_posenc = bf16_gradient_errors(family)
    assert err_posenc <= 1.5 * err_eager + 1e-6, (err_posenc, err_eager)


# ─── A corpus of published positional bugs ──────────────────────────────────────────────────────
# Each test names the bug, the config and field that was misread, and checks posenc's answer against
# transformers' (the model's own modules) and against the misreading, which must fail the same check.

def rope_error(model, module, positions, rotary_args=(), interleaved=False):
    """posenc's rotation by `module` against the model's rotary embedding and apply_rotary_pos_emb,
    as a multiple of the float32 rounding bound of check_rope_table (<= 1: the same rotation); with
    `interleaved`, the model's pairs are (2i, 2i + 1)."""
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    torch.manual_seed(3)
    q = torch.randn(1, heads, positions.numel(), head_dim)
    rotary = model.base_model.rotary_emb
    cos, sin = rotary(q, positions[None], *rotary_args)
    want, _ = model_module(model).apply_rotary_pos_emb(q, q, cos, sin)
    inv = rotary.inv_freq.double()
    n = inv.numel()
    omega = torch.zeros(head_dim, dtype=torch.float64)
    omega[:2 * n] = inv.repeat_interleave(2) if interleaved else torch.cat([inv, inv])
    size = q.abs().amax(dim=(0, 1)).double()
    if interleaved:
        partner = torch.cat([size[:, :2 * n].view(-1, n, 2).flip(-1).reshape(-1, 2 * n), size[:, 2 * n:]], dim=1)
    else:
        partner = torch.cat([size[:, n:2 * n], size[:, :n], size[:, 2 * n:]], dim=1)
    bound = 2 * (size + partner) * omega * positions.double()[:, None] * 2.0 ** -22 + 1e-6
    got, _ = module(q.transpose(1, 2).double(), None, positions)
    return ((got.transpose(1, 2) - want.double()).abs().amax(dim=(0, 1)) / bound).max().item()


def test_bug_theta_inside_rope_parameters_is_read():
    """transformers v5 moved rope_theta into rope_parameters, and vLLM, sglang and DeepSpeed fell
    back to θ = 10000 without a word. Qwen3-8B's θ 1e6, given only as rope_parameters.rope_theta:
    posenc reads 1e6, the model rotates by 1e6, and θ = 10000 fails the comparison."""
    fields = dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, max_position_embeddings=40960,
                  head_dim=128)
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, **fields)
    assert "rope_theta" not in config.to_dict()  # only inside rope_parameters, as v5 writes it
    model = transformers.Qwen3ForCausalLM._from_config(config)
    rope = posenc.RotaryPositionalEncoding.from_hf_config(config.to_dict())
    assert rope.base == 1000000.0
    positions = torch.linspace(0, 40959, 33).round().long()
    assert rope_error(model, rope, positions) <= 1
    misread = posenc.RotaryPositionalEncoding(128, 128, 10000.0)
    assert rope_error(model, misread, positions) > 1


def test_bug_yarn_attention_factor_is_applied_once():
    """TensorRT-LLM applied YaRN's attention factor (0.1·ln(s) + 1) twice. gpt-oss-20b's YaRN
    (factor 32): transformers scales cos and sin by 1.3466 once, so a rotated vector's norm grows by
    that factor; posenc's rotation does the same, and the square (1.8133) would be caught."""
    model = build("gpt-oss-sinks", "eager")
    rope = posenc.RotaryPositionalEncoding.from_hf_config(model.config.to_dict())
    want = model.base_model.rotary_emb.attention_scaling
    assert abs(want - (0.1 * torch.log(torch.tensor(32.0)).item() + 1)) < 1e-6
    x = torch.randn(1, 64, 4, 64, dtype=torch.float64)
    got, _ = rope(x, None, torch.arange(64))
    ratio = (got.norm(dim=-1) / x.norm(dim=-1))
    torch.testing.assert_close(ratio, torch.full_like(ratio, want), rtol=1e-6, atol=0)
    assert (ratio - want ** 2).abs().min() > 0.4
    assert rope_error(model, rope, torch.linspace(0, 131071, 33).round().long()) <= 1


def test_bug_longrope_factors_follow_the_sequence_not_the_allocation():
    """llama.cpp chose LongRoPE's factors by the context allocated (131072 for Phi-3-mini-128k)
    instead of the sequence's length. A 100-token sequence of Phi-3 takes the short factors in
    transformers and in posenc; the long factors (what the allocation picks) fail the comparison."""
    model = build("phi3-longrope", "eager")
    fields = model.config.to_dict()
    rope = posenc.RotaryPositionalEncoding.from_hf_config(fields)
    positions = torch.arange(100)
    assert rope_error(model, rope, positions) <= 1
    misread = copy.deepcopy(fields)
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(misread.get(key), dict) and "long_factor" in misread[key]:
            misread[key]["short_factor"] = list(misread[key]["long_factor"])
    assert rope_error(model, posenc.RotaryPositionalEncoding.from_hf_config(misread), positions) > 1


def test_bug_no_rope_layer_flags_are_not_inverted():
    """transformers #43756: SmolLM3's no_rope_layers holds 1 where a layer rotates, and was read
    inverted. SmolLM3-3B's no_rope_layer_interval 4: the model rotates in layers 0-2 and not in
    layer 3 (its use_rope); posenc's patch puts RoPE in exactly those layers."""
    model = build("smollm3-nope-layers", "eager")
    want = [bool(layer.self_attn.use_rope) for layer in model.model.layers]
    assert want == [True, True, True, False]
    patched = posenc.hf.patch(build("smollm3-nope-layers", "eager"))
    got = [layer.self_attn._posenc_scheme is not None for layer in patched.model.layers]
    assert got == want
    assert got != [not w for w in want]


@pytest.mark.parametrize("config_name, model_name", [("GlmConfig", "GlmForCausalLM"),
                                                     ("CohereConfig", "CohereForCausalLM"),
                                                     ("HeliumConfig", "HeliumForCausalLM")])
def test_bug_interleaved_models_rotate_interleaved_pairs(config_name, model_name):
    """GLM's interleave was ignored (transformers PR #46842): the layout of these models is in their
    code (pairs (2i, 2i + 1)), not in their config. THUDM/glm-4-9b's partial rotary (half the head),
    Cohere's and Helium's full rotary, at their defaults: posenc's RoPE from the config rotates
    interleaved pairs as the model does, and the half-split reading fails the comparison."""
    config = getattr(transformers, config_name)(vocab_size=VOCAB, hidden_size=256, intermediate_size=128,
                                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                                head_dim=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = getattr(transformers, model_name)._from_config(config)
    rope = posenc.RotaryPositionalEncoding.from_hf_config(config.to_dict())
    assert rope.layout == "interleaved"
    positions = torch.unique(torch.cat([torch.arange(8), torch.linspace(0, 8191, 33).round().long()]))
    assert rope_error(model, rope, positions, interleaved=True) <= 1
    half_split = posenc.RotaryPositionalEncoding(rope.head_dim, rope.rotary_dim, rope.base, "half-split", rope.scaling,
                                                 rope.max_position_embeddings)
    assert rope_error(model, half_split, positions, interleaved=True) > 1


def test_bug_deepseek_v32_indexer_rotates_half_split():
    """DeepSeek-V3.2's sparse-attention indexer rotates its 64 RoPE entries NeoX-style (half-split),
    unlike the main attention's interleaved MLA weights; sglang rotated it interleaved (PR #30342,
    GSM8K 0.955 to 0.931). deepseek-ai/DeepSeek-V3.2-Exp's positional fields are DeepSeek-V3's
    (tests/data/deepseek-v3.json: YaRN ×40, mscale 1, θ 10000, qk_rope_head_dim 64): posenc's RoPE
    from the config rotates as transformers' indexer does (the module's apply_rotary_pos_emb, which
    DeepseekV32Indexer calls on its q and k), and the interleaved reading fails the comparison."""
    config = transformers.DeepseekV32Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, index_n_heads=2, index_head_dim=128, index_topk=8, max_position_embeddings=163840,
        rope_scaling={"type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096})
    model = transformers.DeepseekV32ForCausalLM._from_config(config)
    indexer = model.model.layers[0].self_attn.indexer
    assert indexer.qk_rope_head_dim == 64
    rope = posenc.RotaryPositionalEncoding.from_hf_config(config.to_dict())
    assert (rope.head_dim, rope.layout) == (64, "half-split")
    positions = torch.unique(torch.cat([torch.arange(8), torch.linspace(0, 163839, 33).round().long()]))
    assert rope_error(model, rope, positions) <= 1
    interleaved = posenc.RotaryPositionalEncoding(rope.head_dim, rope.rotary_dim, rope.base, "interleaved",
                                                  rope.scaling, rope.max_position_embeddings)
    assert rope_error(model, interleaved, positions) > 1
