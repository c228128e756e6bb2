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

The vision-language forms (``VL_PRESETS``; the Hub checkpoints of these ids are
``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``): the text model
above plus the tower of ``vision_config``. Its numbers are transformers 5.24's
``Qwen3_5VisionConfig`` / ``Qwen3_5MoeVisionConfig`` defaults, the classes' documented
configuration of ``Qwen/Qwen3.5-27B`` / ``Qwen/Qwen3.5-35B-A3B`` (``@auto_docstring(checkpoint=
...)``): depth 27, width 1152, 16 heads, MLP 4304 (GELU-tanh), patches 16 x 16 x 2 frames,
merge 2 x 2, 2304 (48 x 48) learned positions; ``out_hidden_size`` is the text width (5120,
2048; the merger's output replaces token embeddings, so the published configs must say so; the
class default 3584 is another model's). Placeholder ids: ``Qwen3_5Config`` defaults
(``image_token_id`` 248056, ``vision_start_token_id`` 248053, ``vision_end_token_id`` 248054).
M-RoPE: ``mrope_section`` [11, 11, 10] interleaved over the 32 rotary frequencies (64 of 256
head dims), the value ``modeling_qwen3_5``'s rotary embedding falls back to
(``rope_parameters.get("mrope_section", [11, 11, 10])``). They are in ``PRESETS``; their counts
(the model's, tower included) are checked against transformers' VL classes in
tests/convert/test_qwen3_5_vl.py.

All ship one multi-token-prediction layer (``mtp.*``) that transformers does not build; these
presets leave it out (append ``/*E``, ``/*-`` for Qwen3.5 dense, to build it); a converted
checkpoint whose config declares it gets it (:mod:`composer.convert.qwen3_next`).
"""

from __future__ import annotations

import dataclasses

from composer.config import ModelConfig, VisionConfig
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


def vl(text: ModelConfig, vision: VisionConfig, mrope_section: list[int]) -> ModelConfig:
    """``text`` with the tower ``vision`` and interleaved M-RoPE ``mrope_section``."""
    attention = dataclasses.replace(text.attention, mrope_section=mrope_section,
                                    mrope_interleaved=True)
    return dataclasses.replace(text, vision=vision, attention=attention)


def qwen3_5_tower(d_out: int) -> VisionConfig:
    """The published Qwen3.5 tower (see the module docstring), projecting to ``d_out``."""
    return VisionConfig(depth=27, d_model=1152, n_heads=16, d_ff=4304, activation="gelu_tanh",
                        patch_size=16, temporal_patch_size=2, in_channels=3, merge_size=2,
                        d_out=d_out, n_position_embeddings=2304, image_token_id=248056,
                        vision_start_token_id=248053, vision_end_token_id=248054)


def debug_tower(d_out: int) -> VisionConfig:
    return VisionConfig(depth=2, d_model=32, n_heads=2, d_ff=48, patch_size=4,
                        temporal_patch_size=2, merge_size=2, d_out=d_out,
                        n_position_embeddings=16, image_token_id=508, vision_start_token_id=505,
                        vision_end_token_id=506)


_BY_NAME = {p.name: p for p in PRESETS}
MROPE = [11, 11, 10]
VL_PRESETS = [
    Preset("qwen3.5-27b-vl", "qwen3.5-vl", "Qwen/Qwen3.5-27B",
           "text_config as qwen3.5-27b; vision_config: transformers 5.24 Qwen3_5VisionConfig "
           "defaults (documented as Qwen/Qwen3.5-27B), out_hidden_size 5120",
           lambda: vl(_BY_NAME["qwen3.5-27b"].config(), qwen3_5_tower(5120), MROPE)),
    Preset("qwen3.5-35b-a3b-vl", "qwen3.5-moe-vl", "Qwen/Qwen3.5-35B-A3B",
           "text_config as qwen3.5-35b-a3b; vision_config: transformers 5.24 "
           "Qwen3_5MoeVisionConfig defaults (documented as Qwen/Qwen3.5-35B-A3B), "
           "out_hidden_size 2048",
           lambda: vl(_BY_NAME["qwen3.5-35b-a3b"].config(), qwen3_5_tower(2048), MROPE)),
    Preset("qwen3.5-vl-debug", "qwen3.5-vl", "(tiny random config)",
           "Qwen3.5-VL layout (qwen3.5-debug plus a 2-block tower), tiny sizes",
           lambda: vl(_BY_NAME["qwen3.5-debug"].config(), debug_tower(64), [1, 1, 0])),
    Preset("qwen3.5-moe-vl-debug", "qwen3.5-moe-vl", "(tiny random config)",
           "Qwen3.5-MoE-VL layout (qwen3.5-moe-debug plus a 2-block tower), tiny sizes",
           lambda: vl(_BY_NAME["qwen3.5-moe-debug"].config(), debug_tower(64), [1, 1, 0])),
]
PRESETS += VL_PRESETS
"""Registered like the others; their counts are checked against transformers' VL classes (text
plus tower) in tests/convert/test_qwen3_5_vl.py, not tests/zoo (whose counts use
``AutoModelForCausalLM``, the text class for these configs)."""
