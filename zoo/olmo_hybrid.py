"""OLMo-Hybrid (Ai2): three gated delta net layers per attention layer, each followed by a
SwiGLU MLP; GDN layers pre-norm, attention layers (and their MLPs) post-norm with qk-norm over
the whole projection (``post_norm_layers``, ``attention.qk_norm_scope: all``).

``olmo-hybrid-7b`` is transformers' ``OlmoHybridConfig`` with its defaults, which its docstring
gives as the configuration of ``allenai/Olmo-Hybrid-7B`` (3840 wide, 32 layers of which every
fourth is attention, 30 heads, 30 GDN heads of 96/192, 11008 MLP, 100352 vocab, RoPE theta 1e4).
The release's own ``config.json`` could not be read offline, and its RoPE differs between
sources (mlx-lm PR #1023: theta 1e4 for the base / SFT models, NoPE for DPO): converting a
checkpoint always takes the checkpoint's ``config.json``, never this preset.
"""

from __future__ import annotations

from composer.config import ModelConfig
from composer.zoo import Preset
from composer.zoo.sections import AttentionConfig, GDNConfig, MLPConfig

FAMILY = "olmo-hybrid"


def olmo_hybrid(n_blocks: int, d_model: int, d_ff: int, n_heads: int, n_kv_heads: int,
                gdn_heads: int, gdn_kv_heads: int, d_head_k: int, d_head_v: int,
                vocab_size: int, rope_theta: float = 10000.0) -> ModelConfig:
    """``n_blocks`` repeats of three GDN layers and one attention layer (transformers' default
    ``layer_types``), each HF layer two of ours."""
    pattern = "(G-G-G-*-)" + f"x{n_blocks}"
    post = tuple(j for b in range(n_blocks) for j in (8 * b + 6, 8 * b + 7))
    return ModelConfig(
        pattern=pattern,
        d_model=d_model,
        vocab_size=vocab_size,
        tie_embeddings=False,
        norm_eps=1e-6,
        post_norm_layers=post,
        attention=AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv_heads,
                                  d_head=d_model // n_heads, rope_theta=rope_theta,
                                  qk_norm=True, qk_norm_scope="all"),
        mamba=None,
        mlp=MLPConfig(d_ff=d_ff, activation="swiglu"),
        moe=None,
        gdn=GDNConfig(n_heads=gdn_heads, n_kv_heads=gdn_kv_heads, d_head_k=d_head_k,
                      d_head_v=d_head_v, norm_eps=1e-5, allow_neg_eigval=True),
    )


PRESETS = [
    Preset("olmo-hybrid-7b", FAMILY, "allenai/Olmo-Hybrid-7B",
           "transformers 5.24 OlmoHybridConfig defaults (documented as Olmo-Hybrid-7B)",
           lambda: olmo_hybrid(8, 3840, 11008, n_heads=30, n_kv_heads=30, gdn_heads=30,
                               gdn_kv_heads=30, d_head_k=96, d_head_v=192, vocab_size=100352)),
    Preset("olmo-hybrid-debug", FAMILY, "(tiny random config)",
           "OLMo-Hybrid layout (transformers 5.24 OlmoHybridConfig), tiny sizes",
           lambda: olmo_hybrid(2, 64, 128, n_heads=4, n_kv_heads=2, gdn_heads=4, gdn_kv_heads=2,
                               d_head_k=16, d_head_v=8, vocab_size=512)),
]
