"""Kimi Linear (Moonshot AI, 2025): Kimi delta attention (``K``) and NoPE multi-latent attention
(``+``) in a 3:1 ratio, every layer followed by a SwiGLU MLP (``-``, the first) or a
DeepSeek-V3-style MoE (``E``).

Numbers from the HF ``config.json`` of ``moonshotai/Kimi-Linear-48B-A3B-Instruct``
(https://huggingface.co/moonshotai/Kimi-Linear-48B-A3B-Instruct/blob/main/config.json):
``hidden_size`` 2304, 27 layers, ``linear_attn_config`` ``{num_heads: 32, head_dim: 128,
short_conv_kernel_size: 4, full_attn_layers: [4, 8, 12, 16, 20, 24, 27], kda_layers: the
other 20}`` (1-based), MLA with 32 heads, ``q_lora_rank`` null, ``kv_lora_rank`` 512,
``qk_nope_head_dim`` 128, ``qk_rope_head_dim`` 64, ``v_head_dim`` 128, ``mla_use_nope`` true;
``first_k_dense_replace`` 1 (``intermediate_size`` 9216), then 256 experts of 1024
(``moe_intermediate_size``), top 8 (``num_experts_per_token``), 1 shared expert, sigmoid
scores with the correction bias, renormalised, ``routed_scaling_factor`` 2.446, one expert
group; vocabulary 163840, untied embeddings, ``rms_norm_eps`` 1e-5. The same values are
``KimiLinearConfig``'s defaults in transformers 5.24.
"""

from __future__ import annotations

from composer.config import ModelConfig
from composer.zoo import Preset
from composer.zoo.sections import KDAConfig, MLAConfig, MLPConfig, MoEConfig

FAMILY = "kimi-linear"
HF_ID = "moonshotai/Kimi-Linear-48B-A3B-Instruct"
FULL_48B = (4, 8, 12, 16, 20, 24, 27)


def kimi_pattern(n_layers: int, full: tuple[int, ...], n_dense: int) -> str:
    """Per HF layer (``full``: the 1-based MLA layers) ``K`` or ``+``, then ``-`` for the first
    ``n_dense`` and ``E`` after."""
    return "".join(("+" if i + 1 in full else "K") + ("-" if i < n_dense else "E")
                   for i in range(n_layers))


def kimi_linear(n_layers: int, full: tuple[int, ...], d_model: int, kda: KDAConfig,
                mla: MLAConfig, d_ff: int, moe: MoEConfig, vocab_size: int = 163840,
                n_dense: int = 1) -> ModelConfig:
    return ModelConfig(
        pattern=kimi_pattern(n_layers, full, n_dense),
        d_model=d_model,
        vocab_size=vocab_size,
        tie_embeddings=False,
        norm_eps=1e-5,
        attention=None,
        mamba=None,
        mlp=MLPConfig(d_ff=d_ff, activation="swiglu"),
        moe=moe,
        mla=mla,
        kda=kda,
    )


def kimi_moe(n_experts: int, top_k: int, d_ff: int, scale: float = 2.446) -> MoEConfig:
    return MoEConfig(n_experts=n_experts, top_k=top_k, d_ff=d_ff, activation="swiglu",
                     n_shared_experts=1, score_func="sigmoid", renormalize=True,
                     score_correction_bias=True, routed_scaling_factor=scale)


def kimi_mla(n_heads: int, kv_lora_rank: int, d_nope: int, d_rope: int, d_v: int) -> MLAConfig:
    """NoPE MLA (``mla_use_nope``); transformers' latent norms use eps 1e-6."""
    return MLAConfig(n_heads=n_heads, q_lora_rank=None, kv_lora_rank=kv_lora_rank,
                     d_head_nope=d_nope, d_head_rope=d_rope, d_head_v=d_v, rope=False,
                     norm_eps=1e-6)


PRESETS = [
    Preset("kimi-linear-48b-a3b", FAMILY, HF_ID, f"HF config.json of {HF_ID}",
           lambda: kimi_linear(27, FULL_48B, 2304, KDAConfig(n_heads=32, d_head=128, d_conv=4,
                                                             norm_eps=1e-5),
                               kimi_mla(32, 512, 128, 64, 128), 9216, kimi_moe(256, 8, 1024))),
    Preset("kimi-linear-debug", FAMILY, "(tiny random config)", "Kimi Linear layout, tiny sizes",
           lambda: kimi_linear(4, (4,), 64, KDAConfig(n_heads=2, d_head=16, d_conv=4,
                                                      norm_eps=1e-5),
                               kimi_mla(4, 32, 16, 8, 16), 128, kimi_moe(8, 2, 32),
                               vocab_size=512)),
]
