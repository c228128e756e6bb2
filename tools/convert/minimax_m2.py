"""MiniMax-M2 (``MiniMaxM2ForCausalLM``): a Llama-shaped decoder (see
:mod:`composer.convert.decoder`) with partial rotate-half RoPE and a sigmoid router whose
``e_score_correction_bias`` is our ``router.score_bias``; its tensors are Mixtral's
(:mod:`composer.convert.mixtral`).

MiniMax-M2 (``modeling_minimax_m2``): no biases, qk-norm over the whole q / k projection
(``attention.qk_norm_scope: all``), RoPE on ``rotary_dim`` channels (``partial_rotary_factor``
in transformers 5), every layer MoE with ``intermediate_size``-wide experts, always renormalised,
no scaling, no groups, no shared experts. On disk (Mixtral's layout):
``block_sparse_moe.{gate.weight, e_score_correction_bias, experts.{e}.{w1,w3,w2}.weight}``;
fused in memory under ``mlp.``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from composer.config import ConfigError, ModelConfig, MoEConfig
from composer.convert.base import (
    GATED_TO_HF_ACT,
    gated_activation,
    is_mtp_tensor,
    layer_pattern_error,
    require,
    rotary_fraction,
    rotary_to_hf,
)
from composer.convert.decoder import DecoderAdapter
from composer.convert.mixtral import MixtralAdapter
from composer.convert.plan import Link

MINIMAX_M2_DEFAULTS: dict[str, Any] = dict(
    intermediate_size=1536, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
    hidden_act="silu", initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=False,
    num_experts_per_tok=8, num_local_experts=256, router_aux_loss_coef=0.001,
    router_jitter_noise=0.0, rope_theta=5e6)



class MiniMaxM2Adapter(MixtralAdapter):
    family = "minimax-m2"
    symbols = "*E"
    max_positions = 196608
    architectures = ("MiniMaxM2ForCausalLM",)
    model_type = "minimax_m2"

    def moe_from_hf(self, hf: dict[str, Any]) -> MoEConfig:
        if hf["router_jitter_noise"]:
            raise ConfigError(f"config.json: router_jitter_noise={hf['router_jitter_noise']} is "
                              "not supported (training-time input jitter)")
        return MoEConfig(
            n_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
            d_ff=hf["intermediate_size"], activation=gated_activation(hf["hidden_act"]),
            score_func="sigmoid", renormalize=True, score_correction_bias=True,
            aux_loss_coeff=float(hf["router_aux_loss_coef"]))

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        h = {**MINIMAX_M2_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
        cfg = DecoderAdapter.config_from_hf(self, h)
        # transformers' MiniMaxM2Attention has no biases and always whole-width qk-norms.
        cfg.attention = dataclasses.replace(
            cfg.attention, qk_norm=True, qk_norm_scope="all", qkv_bias=False, out_bias=False,
            rotary_fraction=rotary_fraction(h, 1.0))
        return cfg

    def config_to_hf(self, cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
        if cfg.parsed.mtp:
            raise layer_pattern_error(self.family, cfg.pattern,
                                      "multi-token-prediction parts are not supported yet")
        a = cfg.attention
        if a is None:
            raise layer_pattern_error(self.family, cfg.pattern, "every layer must be '*-' or '*E'")
        if not a.qk_norm or a.qk_norm_scope != "all" or a.qkv_bias or a.out_bias:
            raise ConfigError("MiniMax-M2 attention has no biases and a qk-norm over the whole "
                              "projection; set attention.qk_norm=true, qk_norm_scope='all', "
                              "qkv_bias=false, out_bias=false")
        base = {**base, "rotary_dim": base.get("rotary_dim", 0)}  # always written
        out = super().config_to_hf(cfg, base)
        rotary_to_hf(cfg, out)
        out.pop("attention_bias", None)  # not a MiniMaxM2Config field
        return out

    def moe_to_hf(self, cfg: ModelConfig, sparse: list[bool], out: dict[str, Any]) -> None:
        moe = cfg.moe
        problems = [what for what, ok in (
            ("score_func=sigmoid", moe.score_func == "sigmoid"),
            ("score_correction_bias=true", moe.score_correction_bias),
            ("renormalize=true", moe.renormalize), ("n_shared_experts=0", not moe.n_shared_experts),
            ("routed_scaling_factor=1.0", moe.routed_scaling_factor == 1.0),
            ("n_expert_groups=1", moe.n_expert_groups == 1),
            ("a gated activation", moe.activation in GATED_TO_HF_ACT)) if not ok]
        if problems:
            raise ConfigError(f"a MiniMax-M2 MoE layer is a renormalised sigmoid router with "
                              f"score-correction bias and no shared experts; needs moe."
                              f"{', moe.'.join(problems)}")
        out.update(num_local_experts=moe.n_experts, num_experts_per_tok=moe.top_k,
                   intermediate_size=moe.d_ff, router_aux_loss_coef=moe.aux_loss_coeff,
                   hidden_act=GATED_TO_HF_ACT[moe.activation])
        out.pop("mlp_bias", None)

    def aside(self, name: str, hf: dict[str, Any]) -> bool:
        return is_mtp_tensor(name, require(hf, "num_hidden_layers"))

    def links(self, cfg: ModelConfig, fused_experts: bool) -> list[Link]:
        links = super().links(cfg, fused_experts)
        moe_key = "mlp" if fused_experts else self.moe_key
        for i in range(len(self.layer_kinds(cfg))):
            links.append(Link(f"layers.{2 * i + 1}.mixer.router.score_bias",
                              f"model.layers.{i}.{moe_key}.e_score_correction_bias"))
        return links
