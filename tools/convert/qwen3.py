"""Qwen3 (``Qwen3ForCausalLM``) and Qwen3-MoE (``Qwen3MoeForCausalLM``): the decoder of
:mod:`composer.convert.decoder` with per-head qk-norm; Qwen3-MoE's softmax top-k experts are per
expert on disk (``mlp.experts.{e}.{gate,up,down}_proj``), dense layers from ``mlp_only_layers``
and ``decoder_sparse_step``."""

from __future__ import annotations

from typing import Any

from composer.config import ModelConfig, MoEConfig
from composer.convert.base import GATED_TO_HF_ACT, gated_activation, layer_pattern_error, require
from composer.convert.decoder import DecoderAdapter, check_softmax_moe


class Qwen3Adapter(DecoderAdapter):
    family = "qwen3"
    symbols = "*-"
    max_positions = 32768
    architectures = ("Qwen3ForCausalLM",)
    model_type = "qwen3"
    qk_norm = True

    def config_to_hf(self, cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
        if cfg.attention is None or not cfg.attention.qk_norm:
            raise layer_pattern_error(self.family, cfg.pattern, "Qwen3 attention has qk-norm")
        out = super().config_to_hf(cfg, base)
        out.pop("mlp_bias", None)
        return out


class Qwen3MoeAdapter(Qwen3Adapter):
    family = "qwen3-moe"
    symbols = "*-E"
    max_positions = 32768
    architectures = ("Qwen3MoeForCausalLM",)
    model_type = "qwen3_moe"

    def is_sparse(self, hf: dict[str, Any], layer: int) -> bool:
        step = hf.get("decoder_sparse_step", 1) or 1
        return (layer not in (hf.get("mlp_only_layers") or [])
                and require(hf, "num_experts", "num_local_experts") > 0
                and (layer + 1) % step == 0)

    def moe_from_hf(self, hf: dict[str, Any]) -> MoEConfig:
        return MoEConfig(
            n_experts=require(hf, "num_experts", "num_local_experts"),
            top_k=require(hf, "num_experts_per_tok"),
            d_ff=require(hf, "moe_intermediate_size"),
            activation=gated_activation(hf.get("hidden_act", "silu")),
            score_func="softmax", renormalize=bool(hf.get("norm_topk_prob", False)),
            aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)))

    def moe_to_hf(self, cfg: ModelConfig, sparse: list[bool], out: dict[str, Any]) -> None:
        check_softmax_moe(self.family, cfg)
        moe = cfg.moe
        dense = [i for i, s in enumerate(sparse) if not s]
        out.update(num_experts=moe.n_experts, num_experts_per_tok=moe.top_k,
                   moe_intermediate_size=moe.d_ff, norm_topk_prob=moe.renormalize,
                   router_aux_loss_coef=moe.aux_loss_coeff, mlp_only_layers=dense,
                   decoder_sparse_step=1, hidden_act=GATED_TO_HF_ACT[moe.activation])
        out.pop("num_local_experts", None)
        if cfg.mlp is None:
            out.setdefault("intermediate_size", moe.d_ff)
