"""Zamba2 (Zyphra, 2024): a Mamba-2 backbone (``M``) whose hybrid layers (``Z``) add the output of
a shared transformer block used in turn across depth (``{a:Z} ... {a}``; two blocks ABAB for
2.7B and 7B), with per-site low-rank adapters on the block's MLP (and on q/k/v for 1.2B).

Numbers from the HF ``config.json`` of each id, as Zyphra published them (older field names:
``ffn_hidden_size`` = ``intermediate_size``, ``state_size`` = ``mamba_d_state``, ``lora_rank`` =
``adapter_rank``, ``use_shared_attention_lora`` = ``use_shared_attention_adapter``, ``m`` / ``g``
= ``mamba`` / ``hybrid``):

- Zyphra/Zamba2-1.2B (https://huggingface.co/Zyphra/Zamba2-1.2B/blob/4f8e85cd31975fe07d8fc3145239d58913192294/config.json):
  hidden 2048, ffn 8192, 38 layers, hybrid every sixth from 5 (5, 11, ..., 35), one block,
  32 heads (32 kv), ``mamba_headdim`` 64 (so 64 Mamba heads of ``2 * 2048``), state 128, adapter
  rank 128 on the MLP and q/k/v, RoPE (``use_mem_rope``), vocabulary 32000.
- Zyphra/Zamba2-2.7B (https://huggingface.co/Zyphra/Zamba2-2.7B-Instruct-v2/blob/main/config.json,
  the same architecture in transformers' names): hidden 2560, ``intermediate_size`` 10240, 54
  layers, hybrid at 6, 12, 18, 24, 30, 36, 42, 47, 51, two blocks, 32 heads (32 kv), 80 Mamba
  heads of 64, ``mamba_ngroups`` 1, state 64, adapter rank 128 on the MLP only, no RoPE.
- Zyphra/Zamba2-7B (https://huggingface.co/Zyphra/Zamba2-7B/blob/main/config.json, Zyphra's
  field names and ``transformers_version`` 4.43.0.dev0, read from its copy ``zamba_config`` in
  subho406/mlstm_kernels mlstm_kernels/utils/benchmark/benchmarks/huggingface_model_benchmark.py,
  commit 90263b80): hidden 3584, ``ffn_hidden_size`` 14336, 81 layers, ``layers_block_type``
  hybrid at 6, 11, 17, 23, ..., 77 (every sixth after 11), ``num_mem_blocks`` 2, 32 heads (32
  kv), ``mamba_headdim`` 64 (112 heads of ``2 * 3584``), ``mamba_ngroups`` 2, ``state_size`` 64,
  ``lora_rank`` 128 on the MLP only (``use_shared_block_lora``, not
  ``use_shared_attention_lora``), RoPE (``use_mem_rope``, theta 10000), eps 1e-5, vocabulary
  32000, no ``tie_word_embeddings`` field (so tied), no bias; every field the preset models
  agrees with it.

Shared by the family (``Zamba2Config`` defaults where a config is silent): RMSNorm eps 1e-5,
gated GELU MLP, conv width 4 with bias, Mamba expansion 2, chunk 256, ``dt`` clamped below at
``time_step_min`` 0.001, tied embeddings, RoPE theta 10000, heads ``2 * hidden / 32`` wide.
"""

from __future__ import annotations

from composer.config import ModelConfig
from composer.zoo import Preset
from composer.zoo.sections import AttentionConfig, MambaConfig, MLPConfig, ZambaConfig

FAMILY = "zamba2"
SOURCE = "HF config.json of {}"
HYBRID_27B = (6, 12, 18, 24, 30, 36, 42, 47, 51)
HYBRID_7B = (6, 11, 17, 23, 29, 35, 41, 47, 53, 59, 65, 71, 77)


def zamba2_pattern(n_layers: int, hybrid: tuple[int, ...], n_blocks: int) -> str:
    """``M`` per Mamba layer, the ``k``-th hybrid layer a use of block ``k % n_blocks``."""
    out, seen = [], set()
    for i in range(n_layers):
        if i not in hybrid:
            out.append("M")
            continue
        label = "abcdefghijklmnopqrstuvwxyz"[hybrid.index(i) % n_blocks]
        out.append(f"{{{label}}}" if label in seen else f"{{{label}:Z}}")
        seen.add(label)
    return "".join(out)


def zamba2(n_layers: int, hybrid: tuple[int, ...], n_blocks: int, d_model: int, d_ff: int,
           n_heads: int, mamba_heads: int, d_state: int, n_groups: int, rope: bool,
           qkv_adapters: bool, rank: int = 128, vocab_size: int = 32000,
           chunk_size: int = 256) -> ModelConfig:
    d_head = 2 * d_model // n_heads
    return ModelConfig(
        pattern=zamba2_pattern(n_layers, hybrid, n_blocks),
        d_model=d_model,
        vocab_size=vocab_size,
        tie_embeddings=True,
        norm_eps=1e-5,
        attention=AttentionConfig(n_heads=n_heads, n_kv_heads=n_heads, d_head=d_head,
                                  position="rope" if rope else "none", rope_theta=10000.0,
                                  softmax_scale=(d_head / 2) ** -0.5),
        mamba=MambaConfig(n_heads=mamba_heads, d_head=2 * d_model // mamba_heads,
                          n_groups=n_groups, d_state=d_state, d_conv=4, chunk_size=chunk_size,
                          dt_limit=(0.001, float("inf"))),
        mlp=MLPConfig(d_ff=d_ff, activation="geglu"),
        zamba=ZambaConfig(adapter_rank=rank, attention_adapters=qkv_adapters),
    )


def _p(name: str, hf_id: str, make) -> Preset:
    return Preset(name, FAMILY, hf_id, SOURCE.format(hf_id), make)


PRESETS = [
    _p("zamba2-1.2b", "Zyphra/Zamba2-1.2B",
       lambda: zamba2(38, tuple(range(5, 38, 6)), 1, 2048, 8192, 32, 64, 128, 1, rope=True,
                      qkv_adapters=True)),
    _p("zamba2-2.7b", "Zyphra/Zamba2-2.7B",
       lambda: zamba2(54, HYBRID_27B, 2, 2560, 10240, 32, 80, 64, 1, rope=False,
                      qkv_adapters=False)),
    _p("zamba2-7b", "Zyphra/Zamba2-7B",
       lambda: zamba2(81, HYBRID_7B, 2, 3584, 14336, 32, 112, 64, 2, rope=True,
                      qkv_adapters=False)),
    Preset("zamba2-debug", FAMILY, "(tiny random config)", "Zamba2 layout (two blocks), tiny sizes",
           lambda: zamba2(6, (1, 3, 4), 2, 64, 128, 4, 8, 16, 2, rope=True, qkv_adapters=True,
                          rank=8, vocab_size=512, chunk_size=16)),
]
