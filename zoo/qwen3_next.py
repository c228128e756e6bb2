"""Qwen3-Next and Qwen3.5 (Alibaba Qwen): gated-delta-net / gated-attention hybrids, three GDN
layers then one attention layer, repeated; every RMSNorm zero-centred; attention with per-head
qk-norm, RoPE on a quarter of each head and a sigmoid output gate; MoE layers with a softmax
top-k router and one sigmoid-gated shared expert.

Numbers from the HF ``config.json`` of each id:

* ``Qwen/Qwen3-Next-80B-A3B-Instruct`` as mirrored in NVIDIA Megatron-Bridge's Qwen3-Next bridge
  unit test (``qwen3_next_80b_a3b_config_dict``): 48 layers of width 2048, 16 query / 2 kv heads
  of 256, GDN 16 key / 32 value heads of 128, 512 experts of 512 (top-10, renormalised) and a
  512-wide shared expert, vocabulary 151936, untied, RoPE theta 1e7 on 0.25 of each head.
* ``Qwen/Qwen3.5-27B`` (text model) as in its ``text_config`` and THUDM slime's
  ``scripts/models/qwen3.5-27B.sh``: 64 layers of width 5120, SwiGLU 17408, 24 query / 4 kv
  heads of 256, GDN 16 key / 48 value heads of 128, vocabulary 248320, untied.
* ``Qwen/Qwen3.5-35B-A3B`` (text model) as in slime's ``scripts/models/qwen3.5-35B-A3B.sh``:
  40 layers of width 2048, 16 / 2 heads of 256, GDN 16 / 32 heads of 128, 256 experts of 512
  (top-8) and a 512-wide shared expert, vocabulary 248320, untied.

All ship one multi-token-prediction layer (``mtp.*``) that transformers does not build; these
presets leave it out (append ``/*E``, ``/*-`` for Qwen3.5 dense, to build it); a converted
checkpoint whose config declares it gets it (:mod:`composer.convert.qwen3_next`).
"""

from __future__ import annotations

from composer.config import ModelConfig
from composer.zoo import Preset
from composer.zoo.sections import AttentionConfig, GDNConfig, MLPConfig, MoEConfig


def qwen3_next(n_layers: int, d_model: int, *, n_heads: int, n_kv_heads: int, d_head: int,
               gdn_heads: tuple[int, int], d_head_gdn: int, vocab_size: int,
               d_ff: int | None = None, moe: tuple[int, int, int, int] | None = None,
               dense_layers: tuple[int, ...] = (), interval: int = 4,
               rope_theta: float = 1e7) -> ModelConfig:
    """``gdn_heads`` = (key heads, value heads); ``moe`` = (experts, top-k, d_ff, shared d_ff);
    without ``moe`` every layer is dense (Qwen3.5)."""
    mixers = ["*" if (i + 1) % interval == 0 else "G" for i in range(n_layers)]
    ffns = ["-" if moe is None or i in dense_layers else "E" for i in range(n_layers)]
    return ModelConfig(
        pattern="".join(m + f for m, f in zip(mixers, ffns, strict=True)),
        d_model=d_model, vocab_size=vocab_size, tie_embeddings=False, norm_eps=1e-6,
        norm_zero_centered=True,
        attention=AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=d_head,
                                  rope_theta=rope_theta, rotary_fraction=0.25, qk_norm=True,
                                  output_gate=True),
        mamba=None,
        gdn=GDNConfig(n_heads=gdn_heads[1], n_kv_heads=gdn_heads[0], d_head_k=d_head_gdn,
                      d_head_v=d_head_gdn, d_conv=4, norm_eps=1e-6),
        mlp=MLPConfig(d_ff=d_ff, activation="swiglu") if d_ff is not None else None,
        moe=None if moe is None else MoEConfig(
            n_experts=moe[0], top_k=moe[1], d_ff=moe[2], activation="swiglu", n_shared_experts=1,
            d_ff_shared=moe[3], shared_expert_gate=True, score_func="softmax", renormalize=True,
            aux_loss_coeff=0.001),
    )


PRESETS = [
    Preset("qwen3-next-80b-a3b", "qwen3-next", "Qwen/Qwen3-Next-80B-A3B-Instruct",
           "HF config.json of Qwen/Qwen3-Next-80B-A3B-Instruct (Megatron-Bridge Qwen3-Next test)",
           lambda: qwen3_next(48, 2048, n_heads=16, n_kv_heads=2, d_head=256,
                              gdn_heads=(16, 32), d_head_gdn=128, vocab_size=151936,
                              moe=(512, 10, 512, 512))),
    Preset("qwen3-next-debug", "qwen3-next", "(tiny random config)",
           "Qwen3-Next layout (one mlp_only layer), tiny sizes",
           lambda: qwen3_next(4, 64, n_heads=4, n_kv_heads=2, d_head=16, gdn_heads=(2, 4),
                              d_head_gdn=8, vocab_size=512, d_ff=96, moe=(8, 2, 32, 48),
                              dense_layers=(1,))),
    Preset("qwen3.5-27b", "qwen3.5", "Qwen/Qwen3.5-27B",
           "text_config of Qwen/Qwen3.5-27B; THUDM slime scripts/models/qwen3.5-27B.sh",
           lambda: qwen3_next(64, 5120, n_heads=24, n_kv_heads=4, d_head=256,
                              gdn_heads=(16, 48), d_head_gdn=128, vocab_size=248320,
                              d_ff=17408)),
    Preset("qwen3.5-debug", "qwen3.5", "(tiny random config)", "Qwen3.5 dense layout, tiny sizes",
           lambda: qwen3_next(4, 64, n_heads=4, n_kv_heads=2, d_head=16, gdn_heads=(2, 4),
                              d_head_gdn=8, vocab_size=512, d_ff=96)),
    Preset("qwen3.5-35b-a3b", "qwen3.5-moe", "Qwen/Qwen3.5-35B-A3B",
           "text_config of Qwen/Qwen3.5-35B-A3B; THUDM slime scripts/models/qwen3.5-35B-A3B.sh",
           lambda: qwen3_next(40, 2048, n_heads=16, n_kv_heads=2, d_head=256,
                              gdn_heads=(16, 32), d_head_gdn=128, vocab_size=248320,
                              moe=(256, 8, 512, 512))),
    Preset("qwen3.5-moe-debug", "qwen3.5-moe", "(tiny random config)",
           "Qwen3.5-MoE layout, tiny sizes",
           lambda: qwen3_next(4, 64, n_heads=4, n_kv_heads=2, d_head=16, gdn_heads=(2, 4),
                              d_head_gdn=8, vocab_size=512, moe=(8, 2, 32, 48))),
]
