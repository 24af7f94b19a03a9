"""posenc: positional encodings for transformer models, as PyTorch ops and modules.

The ops run posenc's C++ kernels (``torch.ops.posenc.*``, loaded from the ``libposenc_torch.so``
next to this file) and differentiate through ``torch.autograd``. Tensors must be on the CPU;
positions are int64 tensors ``[S]`` (shared by the batch) or ``[B, S]``. Bad arguments raise
``ValueError`` (bad values or shapes; the message names the parameter, its value and what was
expected) or ``TypeError`` (wrong device or dtype).

Use with the set-up's environment (torch from PyPI) after either set-up command (a build with
``-DPOSENC_BUILD_TORCH=ON``), or install its wheel or ``cmake --install`` it (README)::

    PYTHONPATH=build/python ~/.cache/posenc/venv-torch-2.15.0/bin/python -c "import posenc"
"""
from ._functional import (alibi_bias, alibi_slopes, bf16_dot_products, cope_attention, dequantize_kv, empty_cache,
                          fire_bias, floater_table, huge_page_zeros, kerple_bias, learned, quantize_kv, rope, rope_,
                          rope_multi, shaw_scores, shaw_values, sinusoidal_table, stickbreaking_attention, t5_bias,
                          tupe_bias, xl_scores)
from ._modules import (ALiBi, CoPE, FIRE, FLOATER, Forgetting, Kerple, LearnedPositionalEncoding, PositionTemperature,
                       RotaryPositionalEncoding, ShawRelativePositions, SinusoidalPositionalEncoding, T5RelativeBias,
                       TransformerXLRelative, TUPE)
from ._attention import attention, forgetting_attention
from .registry import RelativeBias, Sandwich, Scheme, schemes
from . import nn, distributed
from .nn import KVCache

# The classes pickle (torch.save of a model) under the package's name, not the part that defines
# them, so that saved models outlive a move between parts.
for _class in (ALiBi, CoPE, FIRE, FLOATER, Forgetting, Kerple, LearnedPositionalEncoding, PositionTemperature,
               RotaryPositionalEncoding, ShawRelativePositions, SinusoidalPositionalEncoding, T5RelativeBias,
               TransformerXLRelative, TUPE):
    _class.__module__ = __name__
del _class

__all__ = [
    "empty_cache", "bf16_dot_products", "huge_page_zeros", "sinusoidal_table", "rope", "alibi_slopes", "alibi_bias", "t5_bias", "kerple_bias", "fire_bias",
    "tupe_bias", "learned", "floater_table", "shaw_scores", "shaw_values", "xl_scores", "attention", "rope_",
    "rope_multi",
    "SinusoidalPositionalEncoding", "LearnedPositionalEncoding", "RotaryPositionalEncoding", "ALiBi",
    "T5RelativeBias", "Kerple", "FIRE", "TUPE", "FLOATER", "ShawRelativePositions", "TransformerXLRelative",
    "schemes", "Scheme", "RelativeBias", "Sandwich", "Forgetting", "forgetting_attention", "PositionTemperature",
    "stickbreaking_attention", "CoPE", "cope_attention",
    "nn", "KVCache", "distributed", "quantize_kv", "dequantize_kv",
]
