"""Nemotron-H, Nemotron Nano v2 and Nemotron 3 Nano (NVIDIA): hybrid Mamba-2 / attention / MLP.

Shared by the family (Megatron-LM examples, Megatron-Bridge providers, the HF ``config.json`` of
each id): RMSNorm eps 1e-5, squared-ReLU MLP without gate or bias, attention without position
embedding, GQA with head width 128, Mamba-2 with 8 groups, conv width 4, chunk 128, gated norm
per group, vocabulary 131072, untied embeddings.
"""

from __future__ import annotations

from composer.config import ModelConfig
from composer.zoo import Preset
from composer.zoo.sections import AttentionConfig, MambaConfig, MLPConfig, MoEConfig

FAMILY = "nemotron-h"
SOURCE = "Megatron-Bridge nemotronh providers; HF config.json of {}"


def nemotron_h(pattern: str, d_model: int, n_heads: int, n_kv_heads: int, d_ff: int,
               mamba_heads: int, mamba_d_head: int, d_state: int, vocab_size: int = 131072,
               moe: MoEConfig | None = None) -> ModelConfig:
    return ModelConfig(
        pattern=pattern,
        d_model=d_model,
        vocab_size=vocab_size,
        tie_embeddings=False,
        norm_eps=1e-5,
        attention=AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=128,
                                  position="none"),
        # dt is clamped to time_step_limit: [0.0, Infinity] in the published configs.
        mamba=MambaConfig(n_heads=mamba_heads, d_head=mamba_d_head, n_groups=8, d_state=d_state,
                          d_conv=4, chunk_size=128),
        mlp=MLPConfig(d_ff=d_ff, activation="relu2") if "-" in pattern else None,
        moe=moe,
    )


def nemotron3_moe(n_experts: int, top_k: int, d_ff: int, d_ff_shared: int,
                  scaling: float) -> MoEConfig:
    """Nemotron 3 MoE: sigmoid router with score-correction bias, renormalised top-k, scaled;
    trained with aux-loss-free balancing (the bias moved at Megatron-Core's default rate 1e-3)
    next to a small load-balancing loss."""
    return MoEConfig(n_experts=n_experts, top_k=top_k, d_ff=d_ff, activation="relu2",
                     n_shared_experts=1, d_ff_shared=d_ff_shared, score_func="sigmoid",
                     renormalize=True, score_correction_bias=True, routed_scaling_factor=scaling,
                     aux_loss_coeff=1e-4, bias_update_rate=1e-3)


P_4B_8B = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
P_47B = ("M-M-M-M-M-M-M-M-M*-M-M-M-M-M-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-M-M---MM---M-M*"
         "-M-M-M-M-M-")
P_56B = "M-M-M-M*-(M-M-M-M-M*-)x9M-M-M-M-M-"
P_NANO_9B = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"
P_NANO_12B = "M-M-M-M*-(M-M-M-M*-)x5M-M-M-M-"
P_NANO3_30B = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"


def _p(name: str, hf_id: str, make) -> Preset:
    return Preset(name, FAMILY, hf_id, SOURCE.format(hf_id), make)


PRESETS = [
    _p("nemotron-h-4b", "nvidia/Nemotron-H-4B-Base-8K",
       lambda: nemotron_h(P_4B_8B, 3072, 32, 8, 12288, 112, 64, 128)),
    _p("nemotron-h-8b", "nvidia/Nemotron-H-8B-Base-8K",
       lambda: nemotron_h(P_4B_8B, 4096, 32, 8, 21504, 128, 64, 128)),
    _p("nemotron-h-47b", "nvidia/Nemotron-H-47B-Base-8K",
       lambda: nemotron_h(P_47B, 8192, 64, 8, 30720, 256, 64, 256)),
    _p("nemotron-h-56b", "nvidia/Nemotron-H-56B-Base-8K",
       lambda: nemotron_h(P_56B, 8192, 64, 8, 32768, 256, 64, 256)),
    _p("nemotron-nano-9b-v2", "nvidia/NVIDIA-Nemotron-Nano-9B-v2",
       lambda: nemotron_h(P_NANO_9B, 4480, 40, 8, 15680, 128, 80, 128)),
    _p("nemotron-nano-12b-v2", "nvidia/NVIDIA-Nemotron-Nano-12B-v2",
       lambda: nemotron_h(P_NANO_12B, 5120, 40, 8, 20480, 128, 80, 128)),
    _p("nemotron-3-nano-30b-a3b", "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
       lambda: nemotron_h(P_NANO3_30B, 2688, 32, 2, 1856, 64, 64, 128,
                          moe=nemotron3_moe(128, 6, 1856, 3712, 2.5))),
    Preset("nemotron-h-debug", FAMILY, "(tiny random config)", "Nemotron-H layout, tiny sizes",
           lambda: nemotron_h("M-M*-M-", 64, 4, 2, 128, 8, 16, 16, vocab_size=512)),
    Preset("nemotron-3-nano-debug", FAMILY, "(tiny random config)",
           "Nemotron 3 Nano MoE layout, tiny sizes",
           lambda: nemotron_h("MEM*EME", 64, 4, 2, 32, 8, 16, 16, vocab_size=512,
                              moe=nemotron3_moe(8, 2, 32, 64, 2.5))),
]
