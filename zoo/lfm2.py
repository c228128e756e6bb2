"""LFM2 (Liquid AI, 2025): gated short convolutions (``C``) and grouped-query attention with
per-head qk-norm (``*``), every layer followed by a SwiGLU MLP (``-``).

Numbers from the HF ``config.json`` of each id (``LiquidAI/LFM2-350M``, ``-700M``, ``-1.2B``,
``-2.6B``), shared by the family: vocabulary 65536, tied embeddings, RMSNorm eps 1e-5, RoPE theta
1e6, head width 64, 8 kv heads, ``conv_L_cache`` 3 without biases. The MLP width is what
transformers builds (``tools/convert/lfm2.py``): the three 16-layer models set
``block_ff_dim`` 6656 / 10240 / 12288 with ``block_auto_adjust_ff_dim``, which gives 4608 / 6912 /
8192; LFM2-2.6B sets 10752 with the adjustment off. Attention layers: 2, 5, 8, 10, 12, 14 of 16
(``full_attn_idxs``), and 2, 5, 9, 13, 17, 21, 24, 27 of LFM2-2.6B's 30 (``layer_types``).

LFM2-MoE (``Lfm2MoeForCausalLM``; HF ``config.json`` of ``LiquidAI/LFM2-8B-A1B``): the same
mixers over 24 layers (attention at 2, 6, 10, 14, 18, 21), the first two MLPs dense (7168 wide,
no width rule), the others 32 experts of 1792, top 4, sigmoid scores with an expert bias for
choosing, renormalised, unscaled.
"""

from __future__ import annotations

from composer.config import ModelConfig
from composer.zoo import Preset
from composer.zoo.sections import AttentionConfig, MLPConfig, MoEConfig, ShortConvConfig

FAMILY = "lfm2"
SOURCE = "HF config.json of {}"
ATTN_16 = (2, 5, 8, 10, 12, 14)
ATTN_30 = (2, 5, 9, 13, 17, 21, 24, 27)
ATTN_MOE = (2, 6, 10, 14, 18, 21)


def lfm2_pattern(n_layers: int, attention: tuple[int, ...]) -> str:
    """One ``C-`` or ``*-`` per HF layer (``layer_types``: ``conv`` / ``full_attention``)."""
    return "".join("*-" if i in attention else "C-" for i in range(n_layers))


def lfm2(n_layers: int, attention: tuple[int, ...], d_model: int, n_heads: int, d_ff: int,
         n_kv_heads: int = 8, d_head: int = 64, vocab_size: int = 65536,
         moe: MoEConfig | None = None, n_dense: int = 0) -> ModelConfig:
    pattern = lfm2_pattern(n_layers, attention)
    if moe is not None:  # LFM2-MoE: the MLPs after the first n_dense layers are MoE
        pattern = pattern[:2 * n_dense] + pattern[2 * n_dense:].replace("-", "E")
    return ModelConfig(
        pattern=pattern,
        d_model=d_model,
        vocab_size=vocab_size,
        tie_embeddings=True,
        norm_eps=1e-5,
        attention=AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=d_head,
                                  rope_theta=1e6, qk_norm=True),
        mamba=None,
        mlp=MLPConfig(d_ff=d_ff, activation="swiglu") if "-" in pattern else None,
        moe=moe,
        shortconv=ShortConvConfig(d_conv=3, bias=False),
    )


def lfm2_moe(n_experts: int, top_k: int, d_ff: int) -> MoEConfig:
    """Sigmoid scores, the top k chosen with a per-expert bias, renormalised; transformers has
    no load-balancing loss for it (none here either)."""
    return MoEConfig(n_experts=n_experts, top_k=top_k, d_ff=d_ff, activation="swiglu",
                     score_func="sigmoid", renormalize=True, score_correction_bias=True)


def _p(name: str, hf_id: str, make) -> Preset:
    return Preset(name, FAMILY, hf_id, SOURCE.format(hf_id), make)


PRESETS = [
    _p("lfm2-350m", "LiquidAI/LFM2-350M", lambda: lfm2(16, ATTN_16, 1024, 16, 4608)),
    _p("lfm2-700m", "LiquidAI/LFM2-700M", lambda: lfm2(16, ATTN_16, 1536, 24, 6912)),
    _p("lfm2-1.2b", "LiquidAI/LFM2-1.2B", lambda: lfm2(16, ATTN_16, 2048, 32, 8192)),
    _p("lfm2-2.6b", "LiquidAI/LFM2-2.6B", lambda: lfm2(30, ATTN_30, 2048, 32, 10752)),
    Preset("lfm2-debug", FAMILY, "(tiny random config)", "LFM2 layout, tiny sizes",
           lambda: lfm2(4, (1,), 64, 4, 128, n_kv_heads=2, d_head=16, vocab_size=512)),
    Preset("lfm2-8b-a1b", "lfm2-moe", "LiquidAI/LFM2-8B-A1B",
           SOURCE.format("LiquidAI/LFM2-8B-A1B"),
           lambda: lfm2(24, ATTN_MOE, 2048, 32, 7168, moe=lfm2_moe(32, 4, 1792), n_dense=2)),
    Preset("lfm2-moe-debug", "lfm2-moe", "(tiny random config)", "LFM2-MoE layout, tiny sizes",
           lambda: lfm2(4, (2,), 64, 4, 128, n_kv_heads=2, d_head=16, vocab_size=512,
                        moe=lfm2_moe(8, 2, 32), n_dense=1)),
]
