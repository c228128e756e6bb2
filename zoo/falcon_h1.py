"""Falcon-H1 (TII, 2025): every layer is Mamba-2 and attention side by side, then a SwiGLU MLP,
``[M*]-`` (docs/patterns.md "Parallel groups"), with µP multipliers kept as config numbers.

Each preset is the published ``config.json`` (the subset of fields composer models, numbers copied
verbatim) read by the converter's own mapping, ``FalconH1Adapter.config_from_hf``
(tools/convert/falcon_h1.py), so a preset and a converted checkpoint read every field the same
way, and a field a source leaves out means what it means to transformers (``FalconH1Config``'s
default). Sources, per id:

- tiiuae/Falcon-H1-0.5B-Instruct: its config.json as vendored in NVIDIA-NeMo/Megatron-Bridge,
  tests/unit_tests/models/falcon_h1/test_falcon_h1_bridge.py (commit ebd91e97,
  ``FALCON_H1_500M_CONFIG``; ``max_position_embeddings`` 16384 is the 16K SFT context, so the
  Instruct model), every µP multiplier included. That copy drops ``mamba_d_ssm``; 1536 is from
  the 0.5B config transcribed as the defaults of ml-explore/mlx-lm mlx_lm/models/falcon_h1.py
  ``ModelArgs`` (commit 129480e0), and equals 24 Mamba heads of 64 (transformers' model table).
  That transcription agrees on every other multiplier but writes ``key_multiplier`` 0.390625,
  one ulp above Megatron-Bridge's 0.39062499999999994 (kept here: it is the unrounded form).
- tiiuae/Falcon-H1-1.5B-Base and -3B-Base: the dimensions as transcribed from their config.json
  in third-party test fixtures (1.5B: hidden 2048, ``intermediate_size`` 4608, vocabulary 65537,
  ``mamba_d_ssm`` 3072, 48 Mamba heads of 64; 3B: hidden 2560, ``intermediate_size`` 6144,
  vocabulary 65536, ``mamba_d_ssm`` 4096, 32 heads of 128, chunk 128) and transformers' model
  table (https://huggingface.co/docs/transformers/model_doc/falcon_h1).
- tiiuae/Falcon-H1-1.5B-Deep-Instruct, -7B-Instruct and -34B-Instruct: the dimensions of
  Megatron-Bridge's ``FalconH1ModelProvider1P5BDeep`` / ``7B`` / ``34B``
  (src/megatron/bridge/models/falcon_h1/falconh1_provider.py, commit 070c45b7, "model
  architecture from config.json"): depth, width, ``intermediate_size``, heads, Mamba heads,
  head widths, groups, state, chunk, ``mamba_rms_norm`` true, vocabulary; ``mamba_d_ssm`` is
  heads x head width (as Megatron-Bridge writes it back). A fixture elsewhere gives the 7B 130048
  tokens and chunk 128 where Megatron-Bridge has 130049 and 256: the preset keeps the latter,
  whose source names the id.

Not found in any source searched: the µP multipliers of every size but 0.5B,
``mamba_norm_before_gate`` of every size but 0.5B and ``mamba_rms_norm`` of 1.5B and 3B. Those
presets take transformers' defaults (multipliers 1, norm before the gate, no gated norm): their
parameter counts are the published model's, their logits with its weights would not be; a
converted checkpoint carries its own numbers from its config.json.
The fields every preset shares (``_COMMON``) are the 0.5B config's, which the other sources do
not contradict and Megatron-Bridge's ``FalconH1ModelProvider`` defaults agree with: RoPE theta
1e11, RMSNorm eps 1e-5, untied embeddings, no biases, conv width 4 with a bias.
"""

from __future__ import annotations

from typing import Any

from composer.config import ModelConfig
from composer.zoo import Preset
from composer.zoo.sections import (
    AttentionConfig,
    BranchScale,
    MambaConfig,
    MLPConfig,
    ParallelConfig,
)

FAMILY = "falcon-h1"

# The 0.5B config's fields that every size shares (see the docstring).
_COMMON: dict[str, Any] = dict(
    rope_theta=100000000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
    attention_bias=False, mlp_bias=False, mamba_proj_bias=False, projectors_bias=False,
    mamba_conv_bias=True, mamba_d_conv=4)

# The published config.json of each id: the fields composer models, as the source writes them.
CONFIGS: dict[str, dict[str, Any]] = {
    "tiiuae/Falcon-H1-0.5B-Instruct": dict(
        _COMMON, vocab_size=32784, hidden_size=1024, intermediate_size=2048,
        num_hidden_layers=36, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        initializer_range=0.02, mamba_d_ssm=1536, mamba_n_heads=24, mamba_d_head=64,
        mamba_n_groups=1, mamba_d_state=128, mamba_chunk_size=128, mamba_rms_norm=False,
        mamba_norm_before_gate=False, embedding_multiplier=5.656854249492381,
        lm_head_multiplier=0.0390625, key_multiplier=0.39062499999999994,
        attention_in_multiplier=1.0, attention_out_multiplier=0.9375, ssm_in_multiplier=1.25,
        ssm_out_multiplier=0.23570226039551587, mlp_multipliers=[0.8838834764831844, 0.5859375],
        ssm_multipliers=[0.3535533905932738, 0.25, 0.3535533905932738, 0.5,
                         0.3535533905932738]),
    "tiiuae/Falcon-H1-1.5B-Base": dict(
        _COMMON, vocab_size=65537, hidden_size=2048, intermediate_size=4608,
        num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
        mamba_d_ssm=3072, mamba_n_heads=48, mamba_d_head=64, mamba_n_groups=1,
        mamba_d_state=256, mamba_chunk_size=128),
    "tiiuae/Falcon-H1-1.5B-Deep-Instruct": dict(
        _COMMON, vocab_size=65537, hidden_size=1280, intermediate_size=3072,
        num_hidden_layers=66, num_attention_heads=6, num_key_value_heads=2, head_dim=128,
        mamba_d_ssm=1536, mamba_n_heads=24, mamba_d_head=64, mamba_n_groups=1,
        mamba_d_state=256, mamba_chunk_size=128, mamba_rms_norm=True),
    "tiiuae/Falcon-H1-3B-Base": dict(
        _COMMON, vocab_size=65536, hidden_size=2560, intermediate_size=6144,
        num_hidden_layers=32, num_attention_heads=10, num_key_value_heads=2, head_dim=128,
        mamba_d_ssm=4096, mamba_n_heads=32, mamba_d_head=128, mamba_n_groups=1,
        mamba_d_state=256, mamba_chunk_size=128),
    "tiiuae/Falcon-H1-7B-Instruct": dict(
        _COMMON, vocab_size=130049, hidden_size=3072, intermediate_size=12288,
        num_hidden_layers=44, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
        mamba_d_ssm=3072, mamba_n_heads=24, mamba_d_head=128, mamba_n_groups=1,
        mamba_d_state=256, mamba_chunk_size=256, mamba_rms_norm=True),
    "tiiuae/Falcon-H1-34B-Instruct": dict(
        _COMMON, vocab_size=261120, hidden_size=5120, intermediate_size=21504,
        num_hidden_layers=72, num_attention_heads=20, num_key_value_heads=4, head_dim=128,
        mamba_d_ssm=4096, mamba_n_heads=32, mamba_d_head=128, mamba_n_groups=2,
        mamba_d_state=256, mamba_chunk_size=128, mamba_rms_norm=True),
}
SOURCES = {
    "tiiuae/Falcon-H1-0.5B-Instruct": "its config.json as vendored in NVIDIA-NeMo/Megatron-Bridge "
    "tests/unit_tests/models/falcon_h1/test_falcon_h1_bridge.py (mamba_d_ssm from ml-explore/"
    "mlx-lm mlx_lm/models/falcon_h1.py)",
    "tiiuae/Falcon-H1-1.5B-Base": "its config.json as transcribed in third-party test fixtures "
    "(µP multipliers not found: 1)",
    "tiiuae/Falcon-H1-1.5B-Deep-Instruct": "NVIDIA-NeMo/Megatron-Bridge "
    "FalconH1ModelProvider1P5BDeep (µP multipliers not found: 1)",
    "tiiuae/Falcon-H1-3B-Base": "its config.json as transcribed in third-party test fixtures "
    "(µP multipliers not found: 1)",
    "tiiuae/Falcon-H1-7B-Instruct": "NVIDIA-NeMo/Megatron-Bridge FalconH1ModelProvider7B "
    "(µP multipliers not found: 1)",
    "tiiuae/Falcon-H1-34B-Instruct": "NVIDIA-NeMo/Megatron-Bridge FalconH1ModelProvider34B "
    "(µP multipliers not found: 1)",
}


def from_config_json(hf: dict[str, Any]) -> ModelConfig:
    """A Falcon-H1 ``config.json`` as composer reads it: the converter's mapping, the only one."""
    from composer.convert.falcon_h1 import FalconH1Adapter

    return FalconH1Adapter().config_from_hf(hf)


def _debug() -> ModelConfig:
    """Tiny, with every µP multiplier away from 1 and the gated norm on, so that a dropped one
    shows in logits."""
    return ModelConfig(
        pattern="[M*]-" * 2, d_model=64, vocab_size=512, tie_embeddings=False, norm_eps=1e-5,
        embedding_multiplier=2.0, logits_scaling=4.0,
        attention=AttentionConfig(n_heads=4, n_kv_heads=2, d_head=16, rope_theta=1e11,
                                  key_multiplier=0.625),
        mamba=MambaConfig(n_heads=4, d_head=16, n_groups=2, d_state=8, d_conv=4, chunk_size=16,
                          gated_norm=True, multipliers=[0.5, 1.25, 0.75, 1.5, 0.875]),
        mlp=MLPConfig(d_ff=128, activation="swiglu", gate_multiplier=0.75,
                      down_multiplier=1.125),
        parallel=ParallelConfig(branches=[BranchScale("M", 1.0, 0.5),
                                          BranchScale("*", 0.75, 1.25)]))


def _p(name: str, hf_id: str) -> Preset:
    return Preset(name, FAMILY, hf_id, SOURCES[hf_id], lambda: from_config_json(CONFIGS[hf_id]))


PRESETS = [
    _p("falcon-h1-0.5b", "tiiuae/Falcon-H1-0.5B-Instruct"),
    _p("falcon-h1-1.5b", "tiiuae/Falcon-H1-1.5B-Base"),
    _p("falcon-h1-1.5b-deep", "tiiuae/Falcon-H1-1.5B-Deep-Instruct"),
    _p("falcon-h1-3b", "tiiuae/Falcon-H1-3B-Base"),
    _p("falcon-h1-7b", "tiiuae/Falcon-H1-7B-Instruct"),
    _p("falcon-h1-34b", "tiiuae/Falcon-H1-34B-Instruct"),
    Preset("falcon-h1-debug", FAMILY, "(tiny random config)",
           "Falcon-H1 layout, tiny sizes, every multiplier set", _debug),
]
