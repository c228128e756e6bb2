"""Falcon-H1 (TII, 2025): every layer is Mamba-2 and attention side by side, then a SwiGLU MLP,
``[M*]-`` (docs/patterns.md "Parallel groups"), with µP multipliers kept as config numbers.

Shared by the family (transformers 5.24's ``FalconH1Config`` and the model table of its
documentation, https://huggingface.co/docs/transformers/model_doc/falcon_h1): RoPE theta 1e11,
RMSNorm eps 1e-5, untied embeddings, no biases, Mamba-2 with conv width 4 and one group, no
gated norm in the mixer (``mamba_rms_norm: false``), chunk 128.

Sizes: the documentation's table (depth, width, attention / kv heads, Mamba heads, attention /
Mamba head widths, state size) and the ``config.json`` fields it leaves out (vocabulary,
``intermediate_size``, ``mamba_d_ssm``) as transcribed from the HF ``config.json`` of each id in
third-party test fixtures (1.5B: hidden 2048, ``intermediate_size`` 4608, vocabulary 65537,
``mamba_d_ssm`` 3072; 3B: hidden 2560, ``intermediate_size`` 6144, vocabulary 65536,
``mamba_d_ssm`` 4096, chunk 128). The published µP multipliers were not in the sources found:
these presets leave them at 1 (a converted checkpoint carries its own from its config.json).

Left out: Falcon-H1-0.5B, -1.5B-Deep, -7B and -34B, whose vocabulary and MLP widths could not be
found in the sources searched (the documentation's table gives the rest).
"""

from __future__ import annotations

from composer.config import ModelConfig
from composer.zoo import Preset
from composer.zoo.sections import AttentionConfig, MambaConfig, MLPConfig

FAMILY = "falcon-h1"
SOURCE = ("transformers' FalconH1 model table (https://huggingface.co/docs/transformers/"
          "model_doc/falcon_h1) and the HF config.json of {} as transcribed in third-party "
          "test fixtures")


def falcon_h1(n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, d_head: int,
              mamba_heads: int, mamba_d_head: int, d_state: int, d_ff: int, vocab_size: int,
              chunk_size: int = 128, n_groups: int = 1) -> ModelConfig:
    return ModelConfig(
        pattern="[M*]-" * n_layers,
        d_model=d_model,
        vocab_size=vocab_size,
        tie_embeddings=False,
        norm_eps=1e-5,
        attention=AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=d_head,
                                  rope_theta=1e11),
        mamba=MambaConfig(n_heads=mamba_heads, d_head=mamba_d_head, n_groups=n_groups,
                          d_state=d_state, d_conv=4, chunk_size=chunk_size, gated_norm=False),
        mlp=MLPConfig(d_ff=d_ff, activation="swiglu"),
    )


def _debug() -> ModelConfig:
    """Tiny, with every µP multiplier away from 1 and the gated norm on, so that a dropped one
    shows in logits."""
    from composer.config import BranchScale, ParallelConfig

    cfg = falcon_h1(2, 64, 4, 2, 16, 4, 16, 8, 128, 512, chunk_size=16, n_groups=2)
    cfg.mamba.gated_norm = True
    cfg.mamba.multipliers = [0.5, 1.25, 0.75, 1.5, 0.875]
    cfg.attention.key_multiplier = 0.625
    cfg.mlp.gate_multiplier, cfg.mlp.down_multiplier = 0.75, 1.125
    cfg.embedding_multiplier, cfg.logits_scaling = 2.0, 4.0
    cfg.parallel = ParallelConfig(branches=[BranchScale("M", 1.0, 0.5),
                                            BranchScale("*", 0.75, 1.25)])
    return cfg


def _p(name: str, hf_id: str, make) -> Preset:
    return Preset(name, FAMILY, hf_id, SOURCE.format(hf_id), make)


PRESETS = [
    _p("falcon-h1-1.5b", "tiiuae/Falcon-H1-1.5B-Base",
       lambda: falcon_h1(24, 2048, 8, 2, 128, 48, 64, 256, 4608, 65537)),
    _p("falcon-h1-3b", "tiiuae/Falcon-H1-3B-Base",
       lambda: falcon_h1(32, 2560, 10, 2, 128, 32, 128, 256, 6144, 65536)),
    Preset("falcon-h1-debug", FAMILY, "(tiny random config)",
           "Falcon-H1 layout, tiny sizes, every multiplier set", _debug),
]
