"""Zoo presets: every preset builds on meta quickly, and its size matches transformers exactly.

The full-size presets are checked against the published Hugging Face ``config.json`` of their id,
written out below as literal kwargs *independently of* ``composer.zoo`` (sources next to each
entry); the ``-debug`` presets against an HF config derived from our :class:`ModelConfig` by a
small mapping per family. Every count is the number of distinct parameters (tied weights once)
of both models built on the meta device, so no memory is allocated.
"""

from __future__ import annotations

import time

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    FalconH1Config,
    Gemma3TextConfig,
    Glm4MoeConfig,
    GptOssConfig,
    JambaConfig,
    KimiLinearConfig,
    Lfm2Config,
    Lfm2MoeConfig,
    LlamaConfig,
    Mamba2Config,
    MiniMaxM2Config,
    MixtralConfig,
    NemotronHConfig,
    OlmoHybridConfig,
    PreTrainedConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
    Zamba2Config,
)

import composer
from composer.config import ModelConfig, d_ff_shared_of, d_head_of
from composer.zoo import get_preset, presets

# ---------------------------------------------------------------- published configs
# Nemotron-H fields shared by every published Nemotron-H / Nano v2 / Nemotron 3 Nano config.json.
_NEMOTRON_COMMON = dict(
    vocab_size=131072, tie_word_embeddings=False, head_dim=128, n_groups=8, conv_kernel=4,
    expand=2, chunk_size=128, use_conv_bias=True, mamba_proj_bias=False, use_bias=False,
    mlp_bias=False, attention_bias=False, mlp_hidden_act="relu2", layer_norm_epsilon=1e-5,
    num_nextn_predict_layers=0,
)
_P_H_4B_8B = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"

# Fields shared by every LFM2 config.json (LiquidAI/LFM2-350M, -700M, -1.2B, -2.6B).
_LFM2_COMMON = dict(
    vocab_size=65536, num_hidden_layers=16, num_key_value_heads=8, norm_eps=1e-5,
    conv_L_cache=3, conv_bias=False, block_multiple_of=256, block_ffn_dim_multiplier=1.0,
    block_auto_adjust_ff_dim=True, rope_theta=1000000.0, tie_embedding=True,
    max_position_embeddings=128000)
_LFM2_ATTN_16 = [2, 5, 8, 10, 12, 14]

# Fields shared by openai/gpt-oss-20b's and openai/gpt-oss-120b's config.json (without the
# quantization_config of their MXFP4 experts: the count is the plain model's).
_GPT_OSS_COMMON = dict(
    vocab_size=201088, hidden_size=2880, intermediate_size=2880, head_dim=64,
    num_attention_heads=64, num_key_value_heads=8, num_experts_per_tok=4, sliding_window=128,
    attention_bias=True, rms_norm_eps=1e-5, rope_theta=150000, swiglu_limit=7.0,
    tie_word_embeddings=False, max_position_embeddings=131072, router_aux_loss_coef=0.9,
    rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                  "truncate": False, "original_max_position_embeddings": 4096})

# Fields every Falcon-H1 source gives alike (tiiuae/Falcon-H1-*: no biases, untied, theta 1e11).
_FALCON_H1_COMMON = dict(
    rope_theta=100000000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
    attention_bias=False, mlp_bias=False, mamba_proj_bias=False, projectors_bias=False,
    mamba_conv_bias=True, mamba_d_conv=4)

# name -> (transformers config class, kwargs as in the id's config.json)
PUBLISHED: dict[str, tuple[type[PreTrainedConfig], dict]] = {
    # Nemotron-H base models (nvidia/Nemotron-H-{4B,8B,47B,56B}-Base-8K). Values from the
    # Megatron-Bridge NemotronHModelProvider{4B,8B,47B,56B} (which mirror the HF configs) and
    # docs/patterns.md (Nemotron-H dimensions). The older remote-code configs may spell the head
    # width `attention_head_dim`; transformers 5 takes it as `head_dim`.
    "nemotron-h-4b": (NemotronHConfig, dict(
        _NEMOTRON_COMMON, hidden_size=3072, hybrid_override_pattern=_P_H_4B_8B,
        num_attention_heads=32, num_key_value_heads=8, intermediate_size=12288,
        mamba_num_heads=112, mamba_head_dim=64, ssm_state_size=128)),
    "nemotron-h-8b": (NemotronHConfig, dict(
        _NEMOTRON_COMMON, hidden_size=4096, hybrid_override_pattern=_P_H_4B_8B,
        num_attention_heads=32, num_key_value_heads=8, intermediate_size=21504,
        mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128)),
    "nemotron-h-47b": (NemotronHConfig, dict(
        _NEMOTRON_COMMON, hidden_size=8192,
        hybrid_override_pattern="M-M-M-M-M-M-M-M-M*-M-M-M-M-M-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*"
                                "-M-M-M-M-M-M-M---MM---M-M*-M-M-M-M-M-",
        num_attention_heads=64, num_key_value_heads=8, intermediate_size=30720,
        mamba_num_heads=256, mamba_head_dim=64, ssm_state_size=256)),
    "nemotron-h-56b": (NemotronHConfig, dict(
        _NEMOTRON_COMMON, hidden_size=8192,
        hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*"
                                "-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        num_attention_heads=64, num_key_value_heads=8, intermediate_size=32768,
        mamba_num_heads=256, mamba_head_dim=64, ssm_state_size=256)),
    # nvidia/NVIDIA-Nemotron-Nano-{9B,12B}-v2 config.json (also Megatron-Bridge
    # NemotronNanoModelProvider{9Bv2,12Bv2}).
    "nemotron-nano-9b-v2": (NemotronHConfig, dict(
        _NEMOTRON_COMMON, hidden_size=4480,
        hybrid_override_pattern="M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
        num_attention_heads=40, num_key_value_heads=8, intermediate_size=15680,
        mamba_num_heads=128, mamba_head_dim=80, ssm_state_size=128)),
    "nemotron-nano-12b-v2": (NemotronHConfig, dict(
        _NEMOTRON_COMMON, hidden_size=5120,
        hybrid_override_pattern="M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-",
        num_attention_heads=40, num_key_value_heads=8, intermediate_size=20480,
        mamba_num_heads=128, mamba_head_dim=80, ssm_state_size=128)),
    # nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 config.json.
    "nemotron-3-nano-30b-a3b": (NemotronHConfig, dict(
        _NEMOTRON_COMMON, hidden_size=2688,
        hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        num_attention_heads=32, num_key_value_heads=2, intermediate_size=1856,
        mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128,
        n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
        n_shared_experts=1, moe_shared_expert_intermediate_size=3712, routed_scaling_factor=2.5,
        n_group=1, topk_group=1, norm_topk_prob=True)),
    # meta-llama/Llama-3.1-8B and Llama-3.2-1B config.json.
    "llama-3.1-8b": (LlamaConfig, dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192),
        max_position_embeddings=131072, attention_bias=False, mlp_bias=False,
        tie_word_embeddings=False)),
    "llama-3.2-1b": (LlamaConfig, dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=dict(
            rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192),
        max_position_embeddings=131072, attention_bias=False, mlp_bias=False,
        tie_word_embeddings=True)),
    # Qwen/Qwen3-0.6B, Qwen/Qwen3-8B and Qwen/Qwen3-30B-A3B config.json.
    "qwen3-0.6b": (Qwen3Config, dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, attention_bias=False,
        tie_word_embeddings=True)),
    "qwen3-8b": (Qwen3Config, dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, attention_bias=False,
        tie_word_embeddings=False)),
    "qwen3-30b-a3b": (Qwen3MoeConfig, dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, attention_bias=False,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        router_aux_loss_coef=0.001, tie_word_embeddings=False)),
    # mistralai/Mixtral-8x7B-v0.1 config.json.
    "mixtral-8x7b": (MixtralConfig, dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1e6,
        max_position_embeddings=32768, num_local_experts=8, num_experts_per_tok=2,
        router_aux_loss_coef=0.02, tie_word_embeddings=False)),
    # state-spaces/mamba2-2.7b ships a mamba_ssm config (d_model 2560, n_layer 64, vocab 50277
    # padded to a multiple of 16, tied); the rest are mamba_ssm's Mamba2 defaults.
    "mamba2-2.7b": (Mamba2Config, dict(
        vocab_size=50288, hidden_size=2560, num_hidden_layers=64, state_size=128, expand=2,
        head_dim=64, num_heads=80, n_groups=1, conv_kernel=4, use_bias=False,
        use_conv_bias=True, tie_word_embeddings=True)),
    # deepseek-ai/DeepSeek-V3 config.json (the MTP layer 61 is not built by transformers).
    "deepseek-v3-671b": (DeepseekV3Config, dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, first_k_dense_replace=3, num_attention_heads=128,
        num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8,
        n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
        norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    # moonshotai/Kimi-K2-Instruct-0905 config.json (DeepseekV3ForCausalLM).
    "kimi-k2": (DeepseekV3Config, dict(
        vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, first_k_dense_replace=1, num_attention_heads=64,
        num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=384, num_experts_per_tok=8,
        n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.827,
        norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    # zai-org/GLM-4.5 and zai-org/GLM-4.5-Air config.json (also Megatron-Bridge
    # GLM45ModelProvider355B / GLM45AirModelProvider106B). transformers builds no MTP layer.
    "glm-4.5": (Glm4MoeConfig, dict(
        vocab_size=151552, hidden_size=5120, intermediate_size=12288, num_hidden_layers=92,
        num_attention_heads=96, num_key_value_heads=8, head_dim=128, attention_bias=True,
        use_qk_norm=True, partial_rotary_factor=0.5, rope_theta=1000000, rms_norm_eps=1e-5,
        moe_intermediate_size=1536, n_routed_experts=160, n_shared_experts=1,
        num_experts_per_tok=8, first_k_dense_replace=3, n_group=1, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=2.5, num_nextn_predict_layers=1,
        tie_word_embeddings=False)),
    "glm-4.5-air": (Glm4MoeConfig, dict(
        vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46,
        num_attention_heads=96, num_key_value_heads=8, head_dim=128, attention_bias=True,
        use_qk_norm=False, partial_rotary_factor=0.5, rope_theta=1000000, rms_norm_eps=1e-5,
        moe_intermediate_size=1408, n_routed_experts=128, n_shared_experts=1,
        num_experts_per_tok=8, first_k_dense_replace=1, n_group=1, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=1.0, num_nextn_predict_layers=1,
        tie_word_embeddings=False)),
    # MiniMaxAI/MiniMax-M2 config.json (MTP modules are not built by transformers).
    "minimax-m2": (MiniMaxM2Config, dict(
        vocab_size=200064, hidden_size=3072, intermediate_size=1536, num_hidden_layers=62,
        num_attention_heads=48, num_key_value_heads=8, head_dim=128, rotary_dim=64,
        rope_theta=5000000, rms_norm_eps=1e-6, num_local_experts=256, num_experts_per_tok=8,
        router_aux_loss_coef=0.001, tie_word_embeddings=False)),
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json (as in Megatron-Bridge's Qwen3-Next test);
    # the MTP layer is not built by transformers.
    "qwen3-next-80b-a3b": (Qwen3NextConfig, dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, full_attention_interval=4,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=32, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, num_experts=512, num_experts_per_tok=10,
        norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1, rms_norm_eps=1e-6,
        rope_theta=10000000, partial_rotary_factor=0.25, tie_word_embeddings=False)),
    # transformers' OlmoHybridConfig defaults, documented as allenai/Olmo-Hybrid-7B.
    "olmo-hybrid-7b": (OlmoHybridConfig, dict()),
    # text_config of Qwen/Qwen3.5-27B and Qwen/Qwen3.5-35B-A3B (THUDM slime's
    # scripts/models/qwen3.5-27B.sh and qwen3.5-35B-A3B.sh); the text models only.
    # ai21labs/AI21-Jamba-1.5-Mini config.json (transcribed in sdpython/experimental-experiment,
    # torch_models/llm_model_helper.py).
    "jamba-1.5-mini": (JambaConfig, dict(
        vocab_size=65536, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, attn_layer_offset=4, attn_layer_period=8,
        expert_layer_offset=1, expert_layer_period=2, num_experts=16, num_experts_per_tok=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_dt_rank=256, mamba_expand=2,
        mamba_conv_bias=True, mamba_proj_bias=False, rms_norm_eps=1e-6,
        tie_word_embeddings=False)),
    "qwen3.5-27b": (Qwen3_5TextConfig, dict(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, full_attention_interval=4,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=48, rms_norm_eps=1e-6,
        tie_word_embeddings=False)),
    "qwen3.5-35b-a3b": (Qwen3_5MoeTextConfig, dict(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, full_attention_interval=4,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=32, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, num_experts=256, num_experts_per_tok=8,
        rms_norm_eps=1e-6, tie_word_embeddings=False)),
    # LiquidAI/LFM2-{350M,700M,1.2B} config.json (the older field names: block_ff_dim,
    # full_attn_idxs, tie_embedding, a top-level rope_theta) and LiquidAI/LFM2-2.6B's
    # (layer_types, the width adjustment off).
    "lfm2-350m": (Lfm2Config, dict(_LFM2_COMMON, hidden_size=1024, num_attention_heads=16,
                                   block_ff_dim=6656, full_attn_idxs=_LFM2_ATTN_16)),
    "lfm2-700m": (Lfm2Config, dict(_LFM2_COMMON, hidden_size=1536, num_attention_heads=24,
                                   block_ff_dim=10240, full_attn_idxs=_LFM2_ATTN_16)),
    "lfm2-1.2b": (Lfm2Config, dict(_LFM2_COMMON, hidden_size=2048, num_attention_heads=32,
                                   block_ff_dim=12288, full_attn_idxs=_LFM2_ATTN_16)),
    "lfm2-2.6b": (Lfm2Config, dict(
        _LFM2_COMMON, hidden_size=2048, num_attention_heads=32, num_hidden_layers=30,
        block_ff_dim=10752, intermediate_size=10752, block_auto_adjust_ff_dim=False,
        layer_types=["full_attention" if i in (2, 5, 9, 13, 17, 21, 24, 27) else "conv"
                     for i in range(30)])),
    # moonshotai/Kimi-Linear-48B-A3B-Instruct config.json (its fields as published: the
    # linear_attn_config block, num_experts / num_experts_per_token / num_shared_experts).
    "kimi-linear-48b-a3b": (KimiLinearConfig, dict(
        vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024,
        num_hidden_layers=27, num_attention_heads=32, num_key_value_heads=32, head_dim=72,
        kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, mla_use_nope=True, first_k_dense_replace=1, moe_layer_freq=1,
        num_experts=256, num_experts_per_token=8, num_shared_experts=1, moe_renormalize=True,
        moe_router_activation_func="sigmoid", routed_scaling_factor=2.446, num_expert_group=1,
        topk_group=1, use_grouped_topk=True, rms_norm_eps=1e-5, tie_word_embeddings=False,
        hidden_act="silu", model_max_length=1048576, bos_token_id=163584, eos_token_id=163586,
        pad_token_id=163839, linear_attn_config={
            "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
            "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
            "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)]})),
    # LiquidAI/LFM2-8B-A1B config.json (Lfm2MoeForCausalLM).
    "lfm2-8b-a1b": (Lfm2MoeConfig, dict(
        vocab_size=65536, hidden_size=2048, intermediate_size=7168, moe_intermediate_size=1792,
        num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=8, norm_eps=1e-5,
        conv_L_cache=3, conv_bias=False, rope_theta=1000000.0, num_dense_layers=2,
        num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, use_expert_bias=True,
        routed_scaling_factor=1.0, max_position_embeddings=128000, tie_word_embeddings=True,
        layer_types=["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv"
                     for i in range(24)])),
    # google/gemma-3-1b-it config.json (Gemma3ForCausalLM), and the text_config of
    # google/gemma-3-{4b,12b,27b}-it's (Gemma3ForConditionalGeneration; the fields it leaves out
    # are Gemma3TextConfig's defaults: vocab 262208, head_dim 256, 8 / 4 heads).
    "gemma3-1b": (Gemma3TextConfig, dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
        sliding_window_pattern=6, query_pre_attn_scalar=256, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, max_position_embeddings=32768)),
    "gemma3-4b": (Gemma3TextConfig, dict(
        hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, sliding_window=1024,
        rope_scaling={"factor": 8.0, "rope_type": "linear"})),
    "gemma3-12b": (Gemma3TextConfig, dict(
        hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=8, sliding_window=1024,
        rope_scaling={"factor": 8.0, "rope_type": "linear"})),
    "gemma3-27b": (Gemma3TextConfig, dict(
        head_dim=128, hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
        num_attention_heads=32, num_key_value_heads=16, query_pre_attn_scalar=168,
        sliding_window=1024, rope_scaling={"factor": 8.0, "rope_type": "linear"})),
    # openai/gpt-oss-20b and openai/gpt-oss-120b config.json (GptOssForCausalLM).
    "gpt-oss-20b": (GptOssConfig, dict(
        _GPT_OSS_COMMON, num_hidden_layers=24, num_local_experts=32,
        layer_types=["sliding_attention", "full_attention"] * 12)),
    "gpt-oss-120b": (GptOssConfig, dict(
        _GPT_OSS_COMMON, num_hidden_layers=36, num_local_experts=128,
        layer_types=["sliding_attention", "full_attention"] * 18)),
    # Falcon-H1 (the sources of zoo/falcon_h1.py, written out again here). tiiuae/Falcon-H1-
    # 0.5B-Instruct config.json as vendored in NVIDIA-NeMo/Megatron-Bridge's
    # tests/unit_tests/models/falcon_h1/test_falcon_h1_bridge.py (mamba_d_ssm from mlx-lm's
    # transcription), every µP multiplier included; -1.5B-Base and -3B-Base as transcribed in
    # third-party test fixtures; -1.5B-Deep, -7B and -34B (Instruct) from Megatron-Bridge's
    # FalconH1ModelProvider1P5BDeep / 7B / 34B.
    "falcon-h1-0.5b": (FalconH1Config, dict(
        _FALCON_H1_COMMON, vocab_size=32784, hidden_size=1024, intermediate_size=2048,
        num_hidden_layers=36, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        mamba_d_ssm=1536, mamba_n_heads=24, mamba_d_head=64, mamba_n_groups=1,
        mamba_d_state=128, mamba_chunk_size=128, mamba_rms_norm=False,
        mamba_norm_before_gate=False, embedding_multiplier=5.656854249492381,
        lm_head_multiplier=0.0390625, key_multiplier=0.39062499999999994,
        attention_in_multiplier=1.0, attention_out_multiplier=0.9375, ssm_in_multiplier=1.25,
        ssm_out_multiplier=0.23570226039551587, mlp_multipliers=[0.8838834764831844, 0.5859375],
        ssm_multipliers=[0.3535533905932738, 0.25, 0.3535533905932738, 0.5,
                         0.3535533905932738])),
    "falcon-h1-1.5b": (FalconH1Config, dict(
        _FALCON_H1_COMMON, vocab_size=65537, hidden_size=2048, intermediate_size=4608,
        num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
        mamba_d_ssm=3072, mamba_n_heads=48, mamba_d_head=64, mamba_n_groups=1,
        mamba_d_state=256, mamba_chunk_size=128)),
    "falcon-h1-1.5b-deep": (FalconH1Config, dict(
        _FALCON_H1_COMMON, vocab_size=65537, hidden_size=1280, intermediate_size=3072,
        num_hidden_layers=66, num_attention_heads=6, num_key_value_heads=2, head_dim=128,
        mamba_d_ssm=1536, mamba_n_heads=24, mamba_d_head=64, mamba_n_groups=1,
        mamba_d_state=256, mamba_chunk_size=128, mamba_rms_norm=True)),
    "falcon-h1-3b": (FalconH1Config, dict(
        _FALCON_H1_COMMON, vocab_size=65536, hidden_size=2560, intermediate_size=6144,
        num_hidden_layers=32, num_attention_heads=10, num_key_value_heads=2, head_dim=128,
        mamba_d_ssm=4096, mamba_n_heads=32, mamba_d_head=128, mamba_n_groups=1,
        mamba_d_state=256, mamba_chunk_size=128)),
    "falcon-h1-7b": (FalconH1Config, dict(
        _FALCON_H1_COMMON, vocab_size=130049, hidden_size=3072, intermediate_size=12288,
        num_hidden_layers=44, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
        mamba_d_ssm=3072, mamba_n_heads=24, mamba_d_head=128, mamba_n_groups=1,
        mamba_d_state=256, mamba_chunk_size=256, mamba_rms_norm=True)),
    "falcon-h1-34b": (FalconH1Config, dict(
        _FALCON_H1_COMMON, vocab_size=261120, hidden_size=5120, intermediate_size=21504,
        num_hidden_layers=72, num_attention_heads=20, num_key_value_heads=4, head_dim=128,
        mamba_d_ssm=4096, mamba_n_heads=32, mamba_d_head=128, mamba_n_groups=2,
        mamba_d_state=256, mamba_chunk_size=128, mamba_rms_norm=True)),
    # Zyphra/Zamba2-1.2B config.json (revision 4f8e85c; older names: ffn_hidden_size,
    # state_size, lora_rank, use_shared_attention_lora, m/g layer types), Zyphra/Zamba2-2.7B's
    # (as Zamba2-2.7B-Instruct-v2's config.json writes it in transformers' names) and
    # Zyphra/Zamba2-7B's (its copy in subho406/mlstm_kernels' huggingface_model_benchmark.py).
    "zamba2-1.2b": (Zamba2Config, dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=38,
        layers_block_type=["hybrid" if i % 6 == 5 else "mamba" for i in range(38)],
        num_attention_heads=32, num_key_value_heads=32, num_mem_blocks=1, adapter_rank=128,
        use_shared_attention_adapter=True, use_mem_rope=True, mamba_d_state=128,
        n_mamba_heads=64, mamba_ngroups=1, vocab_size=32000, rms_norm_eps=1e-5)),
    "zamba2-2.7b": (Zamba2Config, dict(
        hidden_size=2560, intermediate_size=10240, num_hidden_layers=54,
        layers_block_type=["hybrid" if i in (6, 12, 18, 24, 30, 36, 42, 47, 51) else "mamba"
                           for i in range(54)],
        num_attention_heads=32, num_key_value_heads=32, num_mem_blocks=2, adapter_rank=128,
        use_shared_attention_adapter=False, use_mem_rope=False, mamba_d_state=64,
        n_mamba_heads=80, mamba_ngroups=1, vocab_size=32000, rms_norm_eps=1e-5)),
    "zamba2-7b": (Zamba2Config, dict(
        hidden_size=3584, intermediate_size=14336, num_hidden_layers=81,
        layers_block_type=["hybrid" if i == 6 or (i > 6 and i % 6 == 5) else "mamba"
                           for i in range(81)],
        num_attention_heads=32, num_key_value_heads=32, num_mem_blocks=2, adapter_rank=128,
        use_shared_attention_adapter=False, use_mem_rope=True, mamba_d_state=64,
        n_mamba_heads=112, mamba_ngroups=2, vocab_size=32000, rms_norm_eps=1e-5)),
}

LLAMA_3_1_8B_TOTAL = 8_030_261_248


# ---------------------------------------------------------------- HF configs of the debug presets


def _layers(cfg: ModelConfig, block: str) -> int:
    """Number of HF decoder layers in a homogeneous pattern of ``block`` repeated."""
    layers = "".join(cfg.parsed.layers)
    n = len(layers) // len(block)
    assert layers == block * n, f"{cfg.pattern!r} is not a stack of {block!r}"
    return n


def _pairs(cfg: ModelConfig) -> list[str]:
    """The pattern as consecutive two-symbol strings (``["*-", "*E", ...]``)."""
    layers = cfg.parsed.layers
    return ["".join(layers[i:i + 2]) for i in range(0, len(layers), 2)]


def _attention_kwargs(cfg: ModelConfig) -> dict:
    a = cfg.attention
    assert a is not None and not a.out_bias
    return dict(hidden_size=cfg.d_model, vocab_size=cfg.vocab_size,
                num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads or a.n_heads,
                head_dim=d_head_of(cfg), tie_word_embeddings=cfg.tie_embeddings)


def nemotron_h_kwargs(cfg: ModelConfig) -> dict:
    a, m = cfg.attention, cfg.mamba
    assert a is not None and m is not None and a.position == "none"
    kw = dict(_attention_kwargs(cfg), hybrid_override_pattern="".join(cfg.parsed.layers),
              attention_bias=a.qkv_bias, layer_norm_epsilon=cfg.norm_eps,
              mamba_num_heads=m.n_heads, mamba_head_dim=m.d_head, n_groups=m.n_groups,
              ssm_state_size=m.d_state, conv_kernel=m.d_conv, chunk_size=m.chunk_size,
              use_conv_bias=m.conv_bias, mamba_proj_bias=m.proj_bias, use_bias=m.proj_bias,
              num_nextn_predict_layers=0)
    if cfg.mlp is not None:
        assert cfg.mlp.activation == "relu2"
        kw.update(intermediate_size=cfg.mlp.d_ff, mlp_bias=cfg.mlp.bias, mlp_hidden_act="relu2")
    if cfg.moe is not None:
        e = cfg.moe
        assert e.activation == "relu2" and e.score_func == "sigmoid" and e.n_shared_experts == 1
        kw.update(n_routed_experts=e.n_experts, num_experts_per_tok=e.top_k,
                  moe_intermediate_size=e.d_ff, n_shared_experts=e.n_shared_experts,
                  moe_shared_expert_intermediate_size=d_ff_shared_of(e),
                  routed_scaling_factor=e.routed_scaling_factor, n_group=e.n_expert_groups,
                  topk_group=e.topk_groups, norm_topk_prob=e.renormalize)
        kw.setdefault("intermediate_size", e.d_ff)
    return kw


def llama_kwargs(cfg: ModelConfig) -> dict:
    a, mlp = cfg.attention, cfg.mlp
    assert a is not None and mlp is not None and mlp.activation == "swiglu" and not a.qk_norm
    kw = dict(_attention_kwargs(cfg), num_hidden_layers=_layers(cfg, "*-"),
              intermediate_size=mlp.d_ff, rms_norm_eps=cfg.norm_eps, rope_theta=a.rope_theta,
              attention_bias=a.qkv_bias, mlp_bias=mlp.bias)
    if a.rope_scaling is not None:
        s = a.rope_scaling
        kw["rope_scaling"] = dict(rope_type="llama3", factor=s.factor,
                                  low_freq_factor=s.low_freq_factor,
                                  high_freq_factor=s.high_freq_factor,
                                  original_max_position_embeddings=s.original_max_position)
        kw["max_position_embeddings"] = int(s.original_max_position * s.factor)
    return kw


def qwen3_kwargs(cfg: ModelConfig) -> dict:
    a, mlp = cfg.attention, cfg.mlp
    assert a is not None and mlp is not None and mlp.activation == "swiglu" and a.qk_norm
    return dict(_attention_kwargs(cfg), num_hidden_layers=_layers(cfg, "*-"),
                intermediate_size=mlp.d_ff, rms_norm_eps=cfg.norm_eps, rope_theta=a.rope_theta,
                attention_bias=a.qkv_bias)


def qwen3_moe_kwargs(cfg: ModelConfig) -> dict:
    a, e = cfg.attention, cfg.moe
    assert a is not None and e is not None and a.qk_norm
    assert e.activation == "swiglu" and e.score_func == "softmax" and e.n_shared_experts == 0
    return dict(_attention_kwargs(cfg), num_hidden_layers=_layers(cfg, "*E"),
                intermediate_size=e.d_ff, moe_intermediate_size=e.d_ff, num_experts=e.n_experts,
                num_experts_per_tok=e.top_k, decoder_sparse_step=1, mlp_only_layers=[],
                norm_topk_prob=e.renormalize, rms_norm_eps=cfg.norm_eps,
                rope_theta=a.rope_theta, attention_bias=a.qkv_bias)


def mixtral_kwargs(cfg: ModelConfig) -> dict:
    a, e = cfg.attention, cfg.moe
    assert a is not None and e is not None and not a.qk_norm and not a.qkv_bias
    assert e.activation == "swiglu" and e.score_func == "softmax" and e.n_shared_experts == 0
    return dict(_attention_kwargs(cfg), num_hidden_layers=_layers(cfg, "*E"),
                intermediate_size=e.d_ff, num_local_experts=e.n_experts,
                num_experts_per_tok=e.top_k, rms_norm_eps=cfg.norm_eps, rope_theta=a.rope_theta)


def mamba2_kwargs(cfg: ModelConfig) -> dict:
    m = cfg.mamba
    assert m is not None
    d_inner = m.n_heads * m.d_head
    assert d_inner % cfg.d_model == 0, "transformers' Mamba2 needs d_inner = expand * d_model"
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                num_hidden_layers=_layers(cfg, "M"), state_size=m.d_state,
                expand=d_inner // cfg.d_model, head_dim=m.d_head, num_heads=m.n_heads,
                n_groups=m.n_groups, conv_kernel=m.d_conv, chunk_size=m.chunk_size,
                use_bias=m.proj_bias, use_conv_bias=m.conv_bias,
                layer_norm_epsilon=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings)


def deepseek_v3_kwargs(cfg: ModelConfig) -> dict:
    m, e = cfg.mla, cfg.moe
    assert m is not None and e is not None and cfg.mlp is not None
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                intermediate_size=cfg.mlp.d_ff, moe_intermediate_size=e.d_ff,
                num_hidden_layers="".join(cfg.parsed.layers).count("+"),
                first_k_dense_replace="".join(cfg.parsed.layers).count("-"),
                num_attention_heads=m.n_heads, num_key_value_heads=m.n_heads,
                q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                qk_nope_head_dim=m.d_head_nope, qk_rope_head_dim=m.d_head_rope,
                v_head_dim=m.d_head_v, n_routed_experts=e.n_experts, num_experts_per_tok=e.top_k,
                n_shared_experts=e.n_shared_experts, n_group=e.n_expert_groups,
                topk_group=e.topk_groups, tie_word_embeddings=cfg.tie_embeddings)


def glm4_moe_kwargs(cfg: ModelConfig) -> dict:
    a, mlp, e = cfg.attention, cfg.mlp, cfg.moe
    assert a is not None and mlp is not None and e is not None and not a.out_bias
    assert e.score_func == "sigmoid" and e.score_correction_bias and e.d_ff_shared is None
    kinds = _pairs(cfg)
    return dict(_attention_kwargs(cfg), num_hidden_layers=len(kinds),
                first_k_dense_replace=kinds.count("*-"), intermediate_size=mlp.d_ff,
                attention_bias=a.qkv_bias, use_qk_norm=a.qk_norm,
                partial_rotary_factor=a.rotary_fraction, rms_norm_eps=cfg.norm_eps,
                moe_intermediate_size=e.d_ff, n_routed_experts=e.n_experts,
                n_shared_experts=e.n_shared_experts, num_experts_per_tok=e.top_k,
                n_group=e.n_expert_groups, topk_group=e.topk_groups)


def minimax_m2_kwargs(cfg: ModelConfig) -> dict:
    a, e = cfg.attention, cfg.moe
    assert a is not None and e is not None and a.qk_norm_scope == "all"
    assert e.score_func == "sigmoid" and e.n_shared_experts == 0
    return dict(_attention_kwargs(cfg), num_hidden_layers=_layers(cfg, "*E"),
                intermediate_size=e.d_ff, num_local_experts=e.n_experts,
                num_experts_per_tok=e.top_k, rotary_dim=int(d_head_of(cfg) * a.rotary_fraction),
                rms_norm_eps=cfg.norm_eps)


def olmo_hybrid_kwargs(cfg: ModelConfig) -> dict:
    a, mlp, d = cfg.attention, cfg.mlp, cfg.gdn
    assert a is not None and mlp is not None and d is not None and a.qk_norm_scope == "all"
    kinds = _pairs(cfg)
    assert set(kinds) == {"G-", "*-"} and mlp.activation == "swiglu"
    return dict(_attention_kwargs(cfg), num_hidden_layers=len(kinds),
                layer_types=["linear_attention" if k == "G-" else "full_attention"
                             for k in kinds],
                intermediate_size=mlp.d_ff, rms_norm_eps=cfg.norm_eps,
                attention_bias=a.qkv_bias, linear_num_key_heads=d.n_kv_heads or d.n_heads,
                linear_num_value_heads=d.n_heads, linear_key_head_dim=d.d_head_k,
                linear_value_head_dim=d.d_head_v, linear_conv_kernel_dim=d.d_conv,
                pad_token_id=None, eos_token_id=None)


def qwen3_next_kwargs(cfg: ModelConfig) -> dict:
    a, d, e, mlp = cfg.attention, cfg.gdn, cfg.moe, cfg.mlp
    assert a is not None and d is not None and a.output_gate and cfg.norm_zero_centered
    kinds = _pairs(cfg)
    out = dict(_attention_kwargs(cfg), num_hidden_layers=len(kinds),
               layer_types=["linear_attention" if k[0] == "G" else "full_attention"
                            for k in kinds], rms_norm_eps=cfg.norm_eps,
               linear_num_key_heads=d.n_kv_heads or d.n_heads, linear_num_value_heads=d.n_heads,
               linear_key_head_dim=d.d_head_k, linear_value_head_dim=d.d_head_v,
               linear_conv_kernel_dim=d.d_conv)
    if mlp is not None:
        out["intermediate_size"] = mlp.d_ff
    if e is not None:
        assert e.shared_expert_gate and e.n_shared_experts == 1
        out.update(num_experts=e.n_experts, num_experts_per_tok=e.top_k,
                   moe_intermediate_size=e.d_ff, shared_expert_intermediate_size=e.d_ff_shared,
                   mlp_only_layers=[i for i, k in enumerate(kinds) if k[1] == "-"])
    return out


def jamba_kwargs(cfg: ModelConfig) -> dict:
    """The debug preset's layers as JambaConfig's periods: attention every 4th HF layer from 2,
    a MoE every 2nd from 1."""
    a, m, e = cfg.attention, cfg.mamba1, cfg.moe
    assert a is not None and m is not None and e is not None and a.position == "none"
    assert m.inner_norms == "learned" and not e.renormalize and e.d_ff == cfg.mlp.d_ff
    layers = "".join(cfg.parsed.layers)
    assert layers == "S-SE*-SE", "the mapping below is this pattern's"
    return dict(_attention_kwargs(cfg), num_hidden_layers=len(layers) // 2,
                attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2,
                expert_layer_offset=1, num_experts=e.n_experts, num_experts_per_tok=e.top_k,
                intermediate_size=e.d_ff, mamba_d_state=m.d_state, mamba_d_conv=m.d_conv,
                mamba_expand=m.d_inner // cfg.d_model, mamba_dt_rank=m.dt_rank,
                mamba_conv_bias=m.conv_bias, mamba_proj_bias=m.proj_bias,
                rms_norm_eps=cfg.norm_eps)


def qwen3_5_moe_kwargs(cfg: ModelConfig) -> dict:
    out = qwen3_next_kwargs(cfg)
    assert out.pop("mlp_only_layers") == []
    return out


def lfm2_kwargs(cfg: ModelConfig) -> dict:
    a, mlp, s = cfg.attention, cfg.mlp, cfg.shortconv
    assert a is not None and mlp is not None and s is not None and a.qk_norm
    kinds = _pairs(cfg)
    assert set(kinds) == {"C-", "*-"} and mlp.activation == "swiglu"
    return dict(_attention_kwargs(cfg), num_hidden_layers=len(kinds),
                layer_types=["conv" if k == "C-" else "full_attention" for k in kinds],
                intermediate_size=mlp.d_ff, block_auto_adjust_ff_dim=False,
                norm_eps=cfg.norm_eps, conv_L_cache=s.d_conv, conv_bias=s.bias)


def lfm2_moe_kwargs(cfg: ModelConfig) -> dict:
    a, mlp, e, s = cfg.attention, cfg.mlp, cfg.moe, cfg.shortconv
    assert a is not None and e is not None and s is not None and a.qk_norm
    assert e.score_func == "sigmoid" and e.n_shared_experts == 0
    kinds = _pairs(cfg)
    return dict(_attention_kwargs(cfg), num_hidden_layers=len(kinds),
                layer_types=["conv" if k[0] == "C" else "full_attention" for k in kinds],
                num_dense_layers=sum(k[1] == "-" for k in kinds),
                intermediate_size=mlp.d_ff if mlp is not None else e.d_ff,
                moe_intermediate_size=e.d_ff, num_experts=e.n_experts,
                num_experts_per_tok=e.top_k, norm_topk_prob=e.renormalize,
                use_expert_bias=e.score_correction_bias, norm_eps=cfg.norm_eps,
                conv_L_cache=s.d_conv, conv_bias=s.bias)


def gemma3_kwargs(cfg: ModelConfig) -> dict:
    a, mlp = cfg.attention, cfg.mlp
    assert a is not None and mlp is not None and a.qk_norm and cfg.sandwich_norm
    kinds = _pairs(cfg)
    assert set(kinds) <= {"W-", "*-"} and mlp.activation == "geglu_tanh"
    return dict(_attention_kwargs(cfg), num_hidden_layers=len(kinds),
                layer_types=["sliding_attention" if k == "W-" else "full_attention"
                             for k in kinds],
                intermediate_size=mlp.d_ff, sliding_window=a.window, rms_norm_eps=cfg.norm_eps)


def gpt_oss_kwargs(cfg: ModelConfig) -> dict:
    a, e = cfg.attention, cfg.moe
    assert a is not None and e is not None and a.sinks and a.qkv_bias and a.out_bias
    kinds = _pairs(cfg)
    assert set(kinds) <= {"WE", "*E"} and e.expert_bias and e.router_bias
    return dict(hidden_size=cfg.d_model, vocab_size=cfg.vocab_size,
                num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads,
                head_dim=d_head_of(cfg), tie_word_embeddings=cfg.tie_embeddings,
                num_hidden_layers=len(kinds), sliding_window=a.window,
                layer_types=["sliding_attention" if k[0] == "W" else "full_attention"
                             for k in kinds],
                intermediate_size=e.d_ff, num_local_experts=e.n_experts,
                num_experts_per_tok=e.top_k)


def kimi_linear_kwargs(cfg: ModelConfig) -> dict:
    k, m, mlp, e = cfg.kda, cfg.mla, cfg.mlp, cfg.moe
    assert k is not None and m is not None and not m.rope and e.score_func == "sigmoid"
    kinds = _pairs(cfg)
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=len(kinds),
        tie_word_embeddings=cfg.tie_embeddings, rms_norm_eps=cfg.norm_eps, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, layer_types=[
            "linear_attention" if p[0] == "K" else "full_attention" for p in kinds],
        mlp_layer_types=["dense" if p[1] == "-" else "sparse" for p in kinds],
        linear_num_heads=k.n_heads, linear_head_dim=k.d_head, linear_conv_kernel_dim=k.d_conv,
        num_attention_heads=m.n_heads, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.d_head_nope, qk_rope_head_dim=m.d_head_rope, v_head_dim=m.d_head_v,
        intermediate_size=mlp.d_ff, moe_intermediate_size=e.d_ff, num_experts=e.n_experts,
        num_experts_per_token=e.top_k, num_shared_experts=e.n_shared_experts)


def falcon_h1_kwargs(cfg: ModelConfig) -> dict:
    a, m, mlp = cfg.attention, cfg.mamba, cfg.mlp
    assert a is not None and m is not None and mlp is not None
    assert cfg.parsed.layers == ("[M*]", "-") * (len(cfg.parsed.layers) // 2)
    return dict(_attention_kwargs(cfg), num_hidden_layers=len(cfg.parsed.layers) // 2,
                intermediate_size=mlp.d_ff, mlp_bias=mlp.bias, mamba_d_ssm=m.n_heads * m.d_head,
                mamba_n_heads=m.n_heads, mamba_d_head=m.d_head, mamba_n_groups=m.n_groups,
                mamba_d_state=m.d_state, mamba_d_conv=m.d_conv, mamba_rms_norm=m.gated_norm,
                mamba_conv_bias=m.conv_bias, mamba_proj_bias=m.proj_bias,
                projectors_bias=m.proj_bias if m.out_proj_bias is None else m.out_proj_bias,
                rms_norm_eps=cfg.norm_eps)


def zamba2_kwargs(cfg: ModelConfig) -> dict:
    a, m, mlp, z = cfg.attention, cfg.mamba, cfg.mlp, cfg.zamba
    assert a is not None and m is not None and mlp is not None and z is not None
    layers = cfg.parsed.layers
    labels = [cfg.parsed.shared[i] for i, t in enumerate(layers) if t == "Z"]
    return dict(hidden_size=cfg.d_model, vocab_size=cfg.vocab_size,
                num_hidden_layers=len(layers),
                layers_block_type=["hybrid" if t == "Z" else "mamba" for t in layers],
                num_mem_blocks=len(set(labels)), num_attention_heads=a.n_heads,
                num_key_value_heads=a.n_kv_heads or a.n_heads, intermediate_size=mlp.d_ff,
                adapter_rank=z.adapter_rank, use_shared_attention_adapter=z.attention_adapters,
                use_mem_rope=a.position == "rope", mamba_d_state=m.d_state,
                n_mamba_heads=m.n_heads, mamba_ngroups=m.n_groups,
                mamba_expand=m.n_heads * m.d_head // cfg.d_model, rms_norm_eps=cfg.norm_eps,
                tie_word_embeddings=cfg.tie_embeddings)


DEBUG: dict[str, tuple[type[PreTrainedConfig], object]] = {
    "nemotron-h-debug": (NemotronHConfig, nemotron_h_kwargs),
    "nemotron-3-nano-debug": (NemotronHConfig, nemotron_h_kwargs),
    "llama-debug": (LlamaConfig, llama_kwargs),
    "qwen3-debug": (Qwen3Config, qwen3_kwargs),
    "qwen3-moe-debug": (Qwen3MoeConfig, qwen3_moe_kwargs),
    "mixtral-debug": (MixtralConfig, mixtral_kwargs),
    "mamba2-debug": (Mamba2Config, mamba2_kwargs),
    "deepseek-v3-debug": (DeepseekV3Config, deepseek_v3_kwargs),
    "glm4-moe-debug": (Glm4MoeConfig, glm4_moe_kwargs),
    "minimax-m2-debug": (MiniMaxM2Config, minimax_m2_kwargs),
    "olmo-hybrid-debug": (OlmoHybridConfig, olmo_hybrid_kwargs),
    "qwen3-next-debug": (Qwen3NextConfig, qwen3_next_kwargs),
    "jamba-debug": (JambaConfig, jamba_kwargs),
    "qwen3.5-debug": (Qwen3_5TextConfig, qwen3_next_kwargs),
    "qwen3.5-moe-debug": (Qwen3_5MoeTextConfig, qwen3_5_moe_kwargs),
    "lfm2-debug": (Lfm2Config, lfm2_kwargs),
    "lfm2-moe-debug": (Lfm2MoeConfig, lfm2_moe_kwargs),
    "gemma3-debug": (Gemma3TextConfig, gemma3_kwargs),
    "kimi-linear-debug": (KimiLinearConfig, kimi_linear_kwargs),
    "gpt-oss-debug": (GptOssConfig, gpt_oss_kwargs),
    "falcon-h1-debug": (FalconH1Config, falcon_h1_kwargs),
    "zamba2-debug": (Zamba2Config, zamba2_kwargs),
}


# ---------------------------------------------------------------- helpers


def our_count(name: str) -> int:
    model = composer.build_model(get_preset(name).config(), device="meta")
    return sum(p.numel() for p in model.parameters())


def hf_model(config_cls: type[PreTrainedConfig], kwargs: dict) -> torch.nn.Module:
    cfg = config_cls(**kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    if cfg.tie_word_embeddings:  # then parameters() yields the shared tensor once
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return model


def hf_count(config_cls: type[PreTrainedConfig], kwargs: dict) -> int:
    return sum(p.numel() for p in hf_model(config_cls, kwargs).parameters())


# ---------------------------------------------------------------- tests


def test_every_preset_is_checked_against_transformers() -> None:
    from composer.zoo.qwen3_next import VL_PRESETS  # counted against the VL classes in
    # tests/convert/test_qwen3_5_vl.py (AutoModelForCausalLM is their text class)
    assert set(presets()) == set(PUBLISHED) | set(DEBUG) | {p.name for p in VL_PRESETS}


@pytest.mark.parametrize("name", sorted(presets()))
def test_preset_builds_on_meta_quickly(name: str) -> None:
    start = time.perf_counter()
    model = composer.build_model(get_preset(name).config(), device="meta")
    elapsed = time.perf_counter() - start
    assert elapsed < 10.0, f"{name}: meta build took {elapsed:.1f} s"
    assert all(p.device.type == "meta" for p in model.parameters())
    assert composer.model_stats(model).n_params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_preset_matches_transformers_count(name: str) -> None:
    config_cls, kwargs = PUBLISHED[name]
    hf = hf_model(config_cls, kwargs)
    if config_cls is NemotronHConfig:  # same layer order, and no MTP layers on either side
        assert hf.config.hybrid_override_pattern == "".join(get_preset(name).config().parsed.layers)
        assert not get_preset(name).config().parsed.mtp
        assert not any(n.startswith(("mtp", "model.mtp")) for n, _ in hf.named_parameters())
    assert our_count(name) == sum(p.numel() for p in hf.parameters())


def test_llama_3_1_8b_well_known_total() -> None:
    assert our_count("llama-3.1-8b") == LLAMA_3_1_8B_TOTAL
    assert hf_count(*PUBLISHED["llama-3.1-8b"]) == LLAMA_3_1_8B_TOTAL


@pytest.mark.parametrize("name", list(DEBUG))
def test_debug_preset_matches_transformers_count(name: str) -> None:
    config_cls, to_kwargs = DEBUG[name]
    kwargs = to_kwargs(get_preset(name).config())
    assert our_count(name) == hf_count(config_cls, kwargs)


@pytest.mark.parametrize("name", [n for n, (c, _) in PUBLISHED.items() if c is FalconH1Config])
def test_falcon_h1_preset_writes_back_its_published_config(name, tmp_path) -> None:
    """The export's config path (the checkpoint's config.yaml read back, then the adapter's
    ``config_to_hf`` with no source config) writes every published field of the preset's id
    back unchanged: the µP multipliers are its config.json's numbers, float for float."""
    from composer.convert.falcon_h1 import FalconH1Adapter

    get_preset(name).config().save(tmp_path / "config.yaml")
    out = FalconH1Adapter().config_to_hf(ModelConfig.load(tmp_path / "config.yaml"), {})
    out["rope_theta"] = out.pop("rope_parameters")["rope_theta"]  # transformers 5's form
    published = PUBLISHED[name][1]
    assert {k: out.get(k) for k in published} == published
