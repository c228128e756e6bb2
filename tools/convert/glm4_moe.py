"""GLM-4.5 / GLM-4.5-Air (``Glm4MoeForCausalLM``).

A Llama-shaped decoder (each HF layer ``L`` is our ``2L`` attention and ``2L + 1`` MLP or
MoE, see :mod:`composer.convert.decoder`) with partial rotate-half RoPE and a sigmoid router whose
``e_score_correction_bias`` is our ``router.score_bias``.

GLM-4.5 (transformers 5.24 ``modeling_glm4_moe``, checked): q/k/v biases (``attention_bias``) but
never an o bias; per-head qk-norm when ``use_qk_norm``; RoPE on the first
``partial_rotary_factor`` (default 0.5) of each head; the first ``first_k_dense_replace`` layers
dense, the rest MoE with DeepSeek-V3 routing (groups scored by their top 2, ``norm_topk_prob``,
``routed_scaling_factor``) and one shared-expert MLP of ``moe_intermediate_size *
n_shared_experts``; all MLPs share ``hidden_act``. Router tensors are kept in fp32 on disk.
The Hub layout is per expert (``mlp.experts.{e}.{gate,up,down}_proj``) under ``mlp.gate`` /
``mlp.shared_experts``.

Multi-token prediction: GLM-4.5 checkpoints hold ``num_nextn_predict_layers`` extra decoder
layers at ``model.layers.{num_hidden_layers + i}`` (``eh_proj``, ``enorm``, ``hnorm``,
``shared_head``, ...). transformers never loads them and no block of ours reads them yet: they
are kept aside byte for byte (``hf/aside/``) and written back on export.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from composer.config import AttentionConfig, ConfigError, ModelConfig, MoEConfig
from composer.convert.base import (
    GATED_TO_HF_ACT,
    attention_to_hf,
    common_to_hf,
    gated_activation,
    gated_mlp_links,
    is_mtp_tensor,
    layer_pattern_error,
    require,
    rotary_fraction,
    rotary_to_hf,
)
from composer.convert.decoder import DecoderAdapter, expert_links
from composer.convert.plan import Link

# Defaults of transformers 5.24's Glm4MoeConfig: a field missing from config.json means these.
GLM4_MOE_DEFAULTS: dict[str, Any] = dict(
    intermediate_size=10944, num_attention_heads=96, num_key_value_heads=8, hidden_act="silu",
    initializer_range=0.02, rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
    moe_intermediate_size=1408, num_experts_per_tok=8, n_shared_experts=1, n_routed_experts=128,
    routed_scaling_factor=1.0, n_group=1, topk_group=1, first_k_dense_replace=1,
    norm_topk_prob=True, use_qk_norm=False, num_nextn_predict_layers=1)
GLM4_MOE_ROTARY = 0.5
"""Glm4MoeConfig's ``partial_rotary_factor`` when config.json gives none."""


def _attention_links(ours: str, hf: str, a: AttentionConfig) -> list[Link]:
    links = [Link(f"{ours}.{p}.weight", f"{hf}.{p}.weight")
             for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    if a.qkv_bias:
        links += [Link(f"{ours}.{p}.bias", f"{hf}.{p}.bias") for p in ("q_proj", "k_proj",
                                                                       "v_proj")]
    if a.qk_norm:
        links += [Link(f"{ours}.{n}.weight", f"{hf}.{n}.weight") for n in ("q_norm", "k_norm")]
    return links


def _check_groups(family: str, n_experts: int, n_groups: int) -> None:
    if n_experts // n_groups < 2:
        raise ConfigError(f"transformers' {family} router scores each expert group by its top 2; "
                          f"{n_experts} experts in {n_groups} groups leave fewer than 2 per group")


class Glm4MoeAdapter(DecoderAdapter):
    family = "glm4-moe"
    symbols = "*-E"
    max_positions = 131072
    architectures = ("Glm4MoeForCausalLM",)
    model_type = "glm4_moe"
    hf_keep_fp32 = ("mlp.gate.weight", "gate.e_score_correction_bias")

    # ---- config
    def is_sparse(self, hf: dict[str, Any], layer: int) -> bool:
        return layer >= hf["first_k_dense_replace"]

    def moe_from_hf(self, hf: dict[str, Any]) -> MoEConfig:
        if not hf["n_shared_experts"]:
            raise ConfigError("config.json: n_shared_experts=0; transformers' Glm4MoeMoE always "
                              "builds a shared-expert MLP (of width 0 here), which we do not")
        _check_groups("Glm4Moe", hf["n_routed_experts"], hf["n_group"])
        return MoEConfig(
            n_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"],
            d_ff=hf["moe_intermediate_size"], activation=gated_activation(hf["hidden_act"]),
            n_shared_experts=hf["n_shared_experts"], score_func="sigmoid",
            renormalize=bool(hf["norm_topk_prob"]), score_correction_bias=True,
            routed_scaling_factor=float(hf["routed_scaling_factor"]),
            n_expert_groups=hf["n_group"], topk_groups=hf["topk_group"],
            # Not a Glm4MoeConfig field (transformers computes no aux loss); kept to round-trip.
            aux_loss_coeff=float(hf.get("router_aux_loss_coef") or 0.0))

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        h = {**GLM4_MOE_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
        cfg = super().config_from_hf(h)
        cfg.attention = dataclasses.replace(
            cfg.attention, qk_norm=bool(h["use_qk_norm"]), out_bias=False,
            rotary_fraction=rotary_fraction(h, GLM4_MOE_ROTARY))
        return cfg

    def layer_kinds(self, cfg: ModelConfig) -> list[bool]:
        kinds = super().layer_kinds(cfg)
        k = kinds.index(True) if True in kinds else len(kinds)
        if not all(kinds[k:]):
            raise layer_pattern_error(self.family, cfg.pattern, "the dense '*-' layers must all "
                                      "come first (first_k_dense_replace), then '*E' layers")
        return kinds

    def config_to_hf(self, cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
        if cfg.parsed.mtp:
            raise layer_pattern_error(self.family, cfg.pattern,
                                      "multi-token-prediction parts are not supported yet")
        sparse = self.layer_kinds(cfg)
        a = cfg.attention
        if a.out_bias or a.qk_norm_scope != "head":
            raise ConfigError("GLM-4 MoE attention has no o_proj bias and per-head qk-norm; "
                              "attention.out_bias must be false and qk_norm_scope 'head'")
        out = common_to_hf(cfg, base, self.architectures[0], self.model_type)
        out.setdefault("num_nextn_predict_layers", 0)  # a fresh export holds no MTP layers
        out.update(num_hidden_layers=len(sparse), rms_norm_eps=cfg.norm_eps,
                   first_k_dense_replace=sparse.index(True) if any(sparse) else len(sparse),
                   use_qk_norm=a.qk_norm)
        # attention_to_hf writes one attention_bias for q/k/v/o; GLM's covers q/k/v only.
        attention_to_hf(dataclasses.replace(
            cfg, attention=dataclasses.replace(a, out_bias=a.qkv_bias)), out)
        rotary_to_hf(cfg, out)
        acts = set()
        if not all(sparse):
            if cfg.mlp.bias:
                raise ConfigError("GLM-4 MoE MLPs have no biases; mlp.bias must be false")
            acts.add(cfg.mlp.activation)
            out["intermediate_size"] = cfg.mlp.d_ff
        if any(sparse):
            self.moe_to_hf(cfg, sparse, out)
            acts.add(cfg.moe.activation)
        if len(acts) > 1 or not acts <= set(GATED_TO_HF_ACT):
            raise ConfigError(f"GLM-4 MoE has one gated hidden_act for every MLP; got "
                              f"{', '.join(sorted(acts))}")
        out["hidden_act"] = GATED_TO_HF_ACT[acts.pop()]
        for key in ("dtype", "torch_dtype", "mlp_bias"):
            out.pop(key, None)
        return out

    def moe_to_hf(self, cfg: ModelConfig, sparse: list[bool], out: dict[str, Any]) -> None:
        moe = cfg.moe
        missing = [what for what, ok in (
            ("score_func=sigmoid", moe.score_func == "sigmoid"),
            ("score_correction_bias=true", moe.score_correction_bias),
            ("n_shared_experts>=1", moe.n_shared_experts >= 1),
            ("d_ff_shared=null (d_ff * n_shared_experts)",
             moe.d_ff_shared in (None, moe.d_ff * moe.n_shared_experts))) if not ok]
        if missing:
            raise ConfigError(f"a GLM-4 MoE layer has a sigmoid router with score-correction "
                              f"bias and d_ff-wide shared experts; set "
                              f"moe.{', moe.'.join(missing)}")
        _check_groups("Glm4Moe", moe.n_experts, moe.n_expert_groups)
        out.update(n_routed_experts=moe.n_experts, num_experts_per_tok=moe.top_k,
                   moe_intermediate_size=moe.d_ff, n_shared_experts=moe.n_shared_experts,
                   norm_topk_prob=moe.renormalize,
                   routed_scaling_factor=moe.routed_scaling_factor, n_group=moe.n_expert_groups,
                   topk_group=moe.topk_groups)
        out.pop("num_local_experts", None)
        if moe.aux_loss_coeff or "router_aux_loss_coef" in out:
            out["router_aux_loss_coef"] = moe.aux_loss_coeff

    # ---- tensors
    def aside(self, name: str, hf: dict[str, Any]) -> bool:
        return is_mtp_tensor(name, require(hf, "num_hidden_layers"))

    def links(self, cfg: ModelConfig, fused_experts: bool) -> list[Link]:
        links = [Link("embed.weight", "model.embed_tokens.weight"),
                 Link("final_norm.weight", "model.norm.weight")]
        if not cfg.tie_embeddings:
            links.append(Link("lm_head.weight", "lm_head.weight"))
        for i, is_sparse in enumerate(self.layer_kinds(cfg)):
            hf, a, m = f"model.layers.{i}", f"layers.{2 * i}", f"layers.{2 * i + 1}"
            links.append(Link(f"{a}.norm.weight", f"{hf}.input_layernorm.weight"))
            links.append(Link(f"{m}.norm.weight", f"{hf}.post_attention_layernorm.weight"))
            links += _attention_links(f"{a}.mixer", f"{hf}.self_attn", cfg.attention)
            if is_sparse:
                moe = cfg.moe
                links += [Link(f"{m}.mixer.router.weight", f"{hf}.mlp.gate.weight"),
                          Link(f"{m}.mixer.router.score_bias",
                               f"{hf}.mlp.gate.e_score_correction_bias")]
                links += gated_mlp_links(f"{m}.mixer.shared_experts", f"{hf}.mlp.shared_experts",
                                         False)
                links += expert_links(f"{m}.mixer", f"{hf}.mlp", moe.n_experts, moe.d_ff,
                                      fused_experts, self.expert_names)
            else:
                links += gated_mlp_links(f"{m}.mixer", f"{hf}.mlp", False)
        return links
