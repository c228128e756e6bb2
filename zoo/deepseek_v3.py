"""DeepSeek-V3 (DeepSeek-AI, arXiv 2412.19437) and Kimi-K2 (Moonshot AI, whose text model is
DeepSeek-V3's ``DeepseekV3ForCausalLM`` with other sizes): multi-latent attention, the first
``first_k_dense_replace`` layers dense SwiGLU, the others sigmoid-routed MoE with score-correction
bias, expert groups, a routed scaling factor and one shared expert.

Shared (HF ``config.json`` of each id): hidden 7168, 61 layers, q rank 1536, kv rank 512, head
widths 128 (nope) + 64 (rope) and 128 (value), dense FFN 18432, expert FFN 2048, 8 routed experts
per token, RMSNorm eps 1e-6, YaRN RoPE with ``mscale = mscale_all_dim = 1``, untied embeddings.
The presets leave out DeepSeek-V3's MTP module (``model.layers.61.*``,
``num_nextn_predict_layers: 1``; transformers' ``DeepseekV3ForCausalLM`` does not build it):
append ``/+E`` to the pattern to build it (:mod:`composer.blocks.mtp`); a converted checkpoint
that holds it gets it (:mod:`composer.convert.deepseek_v3`).
"""

from __future__ import annotations

from composer.config import ModelConfig
from composer.zoo import Preset
from composer.zoo.sections import MLAConfig, MLPConfig, MoEConfig, YarnScaling

FAMILY = "deepseek-v3"


def deepseek_v3(n_layers: int, n_dense: int, d_model: int, n_heads: int, d_ff: int,
                moe: MoEConfig, mla: MLAConfig, vocab_size: int) -> ModelConfig:
    return ModelConfig(
        pattern=f"(+-)x{n_dense}(+E)x{n_layers - n_dense}" if n_dense else f"(+E)x{n_layers}",
        d_model=d_model, vocab_size=vocab_size, tie_embeddings=False, norm_eps=1e-6,
        attention=None, mamba=None, mlp=MLPConfig(d_ff=d_ff, activation="swiglu"), moe=moe,
        mla=mla)


def mla(n_heads: int, theta: float, yarn: YarnScaling | None, q_rank: int | None = 1536,
        kv_rank: int = 512, nope: int = 128, rope: int = 64, v: int = 128) -> MLAConfig:
    return MLAConfig(n_heads=n_heads, q_lora_rank=q_rank, kv_lora_rank=kv_rank, d_head_nope=nope,
                     d_head_rope=rope, d_head_v=v, rope_theta=theta, rope_scaling=yarn)


def moe(n_experts: int, groups: int, topk_groups: int, scaling: float, top_k: int = 8,
        d_ff: int = 2048) -> MoEConfig:
    """The training of DeepSeek-V3 §4.2: aux-loss-free balancing at bias update speed 0.001 and
    the sequence-wise balance loss at alpha = 0.0001 (not in the HF config)."""
    return MoEConfig(n_experts=n_experts, top_k=top_k, d_ff=d_ff, activation="swiglu",
                     n_shared_experts=1, score_func="sigmoid", renormalize=True,
                     score_correction_bias=True, routed_scaling_factor=scaling,
                     n_expert_groups=groups, topk_groups=topk_groups, bias_update_rate=1e-3,
                     seq_aux_loss_coeff=1e-4)


PRESETS = [
    Preset("deepseek-v3-671b", FAMILY, "deepseek-ai/DeepSeek-V3",
           "HF config.json of deepseek-ai/DeepSeek-V3 (also DeepSeek-V3-0324, -Base)",
           lambda: deepseek_v3(61, 3, 7168, 128, 18432, moe(256, 8, 4, 2.5),
                               mla(128, 10000.0, YarnScaling(
                                   factor=40.0, original_max_position=4096, beta_fast=32.0,
                                   beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
                               vocab_size=129280)),
    Preset("kimi-k2", FAMILY, "moonshotai/Kimi-K2-Instruct-0905",
           "HF config.json of moonshotai/Kimi-K2-Instruct-0905 (Kimi-K2-Base/-Instruct: the "
           "same sizes, YaRN factor 32)",
           lambda: deepseek_v3(61, 1, 7168, 64, 18432, moe(384, 1, 1, 2.827),
                               mla(64, 50000.0, YarnScaling(
                                   factor=64.0, original_max_position=4096, beta_fast=1.0,
                                   beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
                               vocab_size=163840)),
    Preset("deepseek-v3-debug", FAMILY, "(tiny random config)", "DeepSeek-V3 layout, tiny sizes",
           lambda: deepseek_v3(3, 1, 64, 4, 128, moe(8, 2, 1, 2.5, top_k=2, d_ff=32),
                               mla(4, 10000.0, YarnScaling(factor=4.0, original_max_position=64,
                                                           mscale=1.0, mscale_all_dim=1.0),
                                   q_rank=32, kv_rank=16, nope=16, rope=8, v=16),
                               vocab_size=512)),
]
