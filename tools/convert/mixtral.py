"""Mixtral (``MixtralForCausalLM``): the decoder of :mod:`composer.convert.decoder` with every
feed-forward a softmax top-k MoE (``*E`` per HF layer), always renormalised; experts per expert on
disk (``block_sparse_moe.experts.{e}.{w1,w3,w2}``). Sliding-window attention is refused."""

from __future__ import annotations

from typing import Any

from composer.config import ConfigError, ModelConfig, MoEConfig
from composer.convert.base import GATED_TO_HF_ACT, gated_activation, layer_pattern_error, require
from composer.convert.decoder import DecoderAdapter, check_softmax_moe


class MixtralAdapter(DecoderAdapter):
    family = "mixtral"
    symbols = "*E"
    max_positions = 131072
    architectures = ("MixtralForCausalLM",)
    model_type = "mixtral"
    moe_key = "block_sparse_moe"
    expert_names = {"gate": "w1", "up": "w3", "down": "w2"}

    def is_sparse(self, hf: dict[str, Any], layer: int) -> bool:
        return True

    def layer_kinds(self, cfg: ModelConfig) -> list[bool]:
        kinds = super().layer_kinds(cfg)
        if not all(kinds):
            raise layer_pattern_error(self.family, cfg.pattern, "every Mixtral layer is '*E'")
        return kinds

    def moe_from_hf(self, hf: dict[str, Any]) -> MoEConfig:
        return MoEConfig(
            n_experts=require(hf, "num_local_experts"), top_k=require(hf, "num_experts_per_tok"),
            d_ff=require(hf, "intermediate_size"),
            activation=gated_activation(hf.get("hidden_act", "silu")),
            score_func="softmax", renormalize=True,
            aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.02)))

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        if hf.get("sliding_window"):
            raise ConfigError(f"config.json: sliding_window={hf['sliding_window']} is not "
                              "supported yet (full causal attention only)")
        return super().config_from_hf(hf)

    def moe_to_hf(self, cfg: ModelConfig, sparse: list[bool], out: dict[str, Any]) -> None:
        check_softmax_moe(self.family, cfg)
        if not cfg.moe.renormalize:
            raise ConfigError("Mixtral renormalises its top-k weights (moe.renormalize=true)")
        moe = cfg.moe
        out.update(num_local_experts=moe.n_experts, num_experts_per_tok=moe.top_k,
                   intermediate_size=moe.d_ff, router_aux_loss_coef=moe.aux_loss_coeff,
                   hidden_act=GATED_TO_HF_ACT[moe.activation])
        out.pop("mlp_bias", None)
