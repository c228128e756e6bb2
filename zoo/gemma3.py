"""Gemma 3 text decoders (Google DeepMind, 2025): five local sliding-window attention layers
(``W``) to one global (``*``), each followed by a GeGLU MLP (``-``), every block sandwich-normed
with zero-centred RMSNorms; per-head qk-norm, the embedding scaled by ``sqrt(d_model)``, scores
by ``query_pre_attn_scalar ** -0.5``, tied head.

Numbers from the HF ``config.json`` of each id. ``google/gemma-3-1b-it`` is a text model
(``Gemma3ForCausalLM``): 26 layers of width 1152, MLP 6912, 4 heads of 256 with one kv head,
window 512, vocabulary 262144, RoPE theta 1e6 (global) and 1e4 (local), no scaling. The 4B, 12B
and 27B checkpoints are multimodal (``Gemma3ForConditionalGeneration``: a SigLIP tower and a
projector around this decoder); the presets here are their ``text_config``, which sets only what
differs from ``Gemma3TextConfig``'s defaults (vocabulary 262208, 8 heads and 4 kv heads of 256,
``query_pre_attn_scalar`` 256, RMSNorm eps 1e-6, RoPE theta 1e6 / 1e4): width, MLP, depth,
window 1024 and linear RoPE scaling by 8 on the global layers; 12B sets 16 / 8 heads, 27B
32 / 16 heads of 128 and ``query_pre_attn_scalar`` 168. In every one ``sliding_window_pattern``
is 6 (layer ``i`` is global when ``(i + 1) % 6 == 0``).
"""

from __future__ import annotations

from composer.config import ModelConfig
from composer.zoo import Preset
from composer.zoo.sections import AttentionConfig, MLPConfig, RopeScaling

FAMILY = "gemma3"
SOURCE = "HF config.json of {}"
SOURCE_MM = "text_config of the HF config.json of {} (Gemma3ForConditionalGeneration)"


def gemma3_pattern(n_layers: int, every: int = 6) -> str:
    """``W-`` per local layer, ``*-`` per global one (every ``every``-th)."""
    return "".join("*-" if (i + 1) % every == 0 else "W-" for i in range(n_layers))


def gemma3(n_layers: int, d_model: int, d_ff: int, n_heads: int = 8, n_kv_heads: int = 4,
           d_head: int = 256, window: int = 1024, query_scalar: int = 256,
           vocab_size: int = 262208, linear_factor: float | None = 8.0) -> ModelConfig:
    scaling = RopeScaling(rope_type="linear", factor=linear_factor) if linear_factor else None
    return ModelConfig(
        pattern=gemma3_pattern(n_layers),
        d_model=d_model,
        vocab_size=vocab_size,
        tie_embeddings=True,
        norm_eps=1e-6,
        embedding_multiplier=d_model**0.5,
        embedding_multiplier_in_dtype=True,
        norm_zero_centered=True,
        sandwich_norm=True,
        attention=AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=d_head,
                                  rope_theta=1e6, rope_scaling=scaling, qk_norm=True,
                                  softmax_scale=query_scalar**-0.5, window=window,
                                  window_rope_theta=1e4),
        mamba=None,
        mlp=MLPConfig(d_ff=d_ff, activation="geglu_tanh"),
    )


def _mm(name: str, hf_id: str, make) -> Preset:
    return Preset(name, FAMILY, hf_id, SOURCE_MM.format(hf_id), make)


PRESETS = [
    Preset("gemma3-1b", FAMILY, "google/gemma-3-1b-it", SOURCE.format("google/gemma-3-1b-it"),
           lambda: gemma3(26, 1152, 6912, n_heads=4, n_kv_heads=1, window=512,
                          vocab_size=262144, linear_factor=None)),
    _mm("gemma3-4b", "google/gemma-3-4b-it", lambda: gemma3(34, 2560, 10240)),
    _mm("gemma3-12b", "google/gemma-3-12b-it",
        lambda: gemma3(48, 3840, 15360, n_heads=16, n_kv_heads=8)),
    _mm("gemma3-27b", "google/gemma-3-27b-it",
        lambda: gemma3(62, 5376, 21504, n_heads=32, n_kv_heads=16, d_head=128,
                       query_scalar=168)),
    Preset("gemma3-debug", FAMILY, "(tiny random config)", "Gemma 3 layout, tiny sizes",
           lambda: gemma3(6, 64, 128, n_heads=4, n_kv_heads=2, d_head=16, window=8,
                          query_scalar=16, vocab_size=512)),
]
