"""Mamba-2 (Dao & Gu 2024): a stack of Mamba-2 mixers, no attention, no MLP.

Numbers from state-spaces/mamba2-2.7b ``config.json`` (d_model 2560, 64 layers, vocabulary 50277
padded to a multiple of 16 = 50288, tied embeddings) and the ``Mamba2`` defaults of mamba_ssm
(expand 2, head width 64, d_state 128, one group, conv width 4, chunk 256).
"""

from __future__ import annotations

from composer.config import ModelConfig
from composer.zoo import Preset
from composer.zoo.sections import MambaConfig


def mamba2(n_layers: int, d_model: int, d_state: int = 128, d_head: int = 64,
           n_groups: int = 1, vocab_size: int = 50288, chunk_size: int = 256) -> ModelConfig:
    return ModelConfig(
        pattern=f"(M)x{n_layers}",
        d_model=d_model,
        vocab_size=vocab_size,
        tie_embeddings=True,
        norm_eps=1e-5,
        attention=None,
        mamba=MambaConfig(n_heads=2 * d_model // d_head, d_head=d_head, n_groups=n_groups,
                          d_state=d_state, d_conv=4, chunk_size=chunk_size),
        mlp=None,
        moe=None,
    )


PRESETS = [
    Preset("mamba2-2.7b", "mamba2", "state-spaces/mamba2-2.7b",
           "config.json of state-spaces/mamba2-2.7b; mamba_ssm Mamba2 defaults",
           lambda: mamba2(64, 2560)),
    Preset("mamba2-debug", "mamba2", "(tiny random config)", "Mamba-2 layout, tiny sizes",
           lambda: mamba2(2, 64, d_state=16, d_head=16, n_groups=2, vocab_size=512,
                          chunk_size=16)),
]
