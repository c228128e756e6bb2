"""Nemotron-H (``NemotronHForCausalLM``): Mamba-2 / attention / MLP / MoE hybrids, one layer
kind per HF layer.

One HF layer is one of our layers (one pattern symbol): pre-norm ``backbone.L.norm`` then
``backbone.L.mixer.*``, whose names are ours except for the MoE router (``gate`` <-> ``router``,
``gate.e_score_correction_bias`` <-> ``router.score_bias``). Embeddings ``backbone.embeddings``,
final norm ``backbone.norm_f``. The Hub layout is written; on read ``backbone.embedding.``
(mamba_ssm, Mamba2's load hook) and Nemotron-H's in-memory ``model.`` prefix (transformers 5
renames ``backbone.`` -> ``model.``, docs/conversion.md) are accepted.

Nemotron-H experts are non-gated: per expert on disk (``mixer.experts.{e}.{up,down}_proj.weight``)
or fused as transformers 5 holds them (``mixer.experts.up_proj [E, I, H]``, ``down_proj
[E, H, I]``), exactly our shapes.

Quirks of transformers 5.25 that decide the mapping (checked in its source):
- ``NemotronHMamba2Mixer`` clamps dt to ``time_step_limit`` (our ``dt_limit``; the published
  configs write ``[0.0, Infinity]``), as Megatron's mixer does. transformers up to 5.24 clamped
  to ``(time_step_min, inf)`` instead and ignored ``time_step_limit``; parity is checked against
  5.25 and later (the ``test`` extra's floor).
- Nemotron-H's mixer bias follows ``use_bias``; ``mamba_proj_bias`` is unused (both are written).
- ``NemotronHAttention`` has no biases whatever ``attention_bias`` says; ``lm_head`` is never tied
  (no tied keys); every MoE layer has exactly one shared expert (``n_shared_experts`` is unused)
  that takes ``mlp_bias`` like the dense MLP; routed and shared experts and the dense MLP share
  ``mlp_hidden_act``; the router is sigmoid with a score-correction bias, and takes the top 2 of
  each expert group (so a group needs two experts).
- Mamba2 sizes its mixer as ``expand * hidden_size`` (an int ``expand``), Nemotron-H as
  ``mamba_num_heads * mamba_head_dim``. Both norm the gate per group of ``d_inner / n_groups``.
"""

from __future__ import annotations

import math
from typing import Any

from composer.config import (
    ConfigError,
    MLPConfig,
    ModelConfig,
    MoEConfig,
    d_ff_shared_of,
    d_inner_of,
)
from composer.convert.base import (
    Adapter,
    attention_from_hf,
    attention_links,
    attention_to_hf,
    common_to_hf,
    layer_pattern_error,
    mamba_links,
    require,
)
from composer.convert.mamba_common import check_plain, mamba_common_to_hf, mamba_from_hf
from composer.convert.plan import Link

HF_TO_ACT = {"relu2": "relu2", "relu": "relu", "silu": "silu", "swish": "silu", "gelu": "gelu",
             "gelu_pytorch_tanh": "gelu_tanh"}
ACT_TO_HF = {"relu2": "relu2", "relu": "relu", "silu": "silu", "gelu": "gelu",
             "gelu_tanh": "gelu_pytorch_tanh"}

# Defaults of transformers 5.25's NemotronHConfig: a field missing from config.json means these.
NEMOTRON_H_DEFAULTS: dict[str, Any] = dict(
    tie_word_embeddings=False, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    attention_bias=False, intermediate_size=21504, mlp_hidden_act="relu2", mlp_bias=False,
    ssm_state_size=128, mamba_num_heads=128, mamba_head_dim=64, mamba_hidden_act="silu",
    n_groups=8, conv_kernel=4, time_step_min=0.001, time_step_max=0.1, time_step_floor=1e-4,
    time_step_limit=(0.0, math.inf), use_conv_bias=True, chunk_size=128,
    use_bias=False, n_routed_experts=8,
    moe_intermediate_size=7688, moe_shared_expert_intermediate_size=7688, moe_latent_size=None,
    num_experts_per_tok=2, routed_scaling_factor=1.0, n_group=1, topk_group=1,
    norm_topk_prob=True, num_nextn_predict_layers=0, initializer_range=0.02,
    layer_norm_epsilon=1e-5)
# NemotronHConfig pops these older names and lets them win over the new ones.
NEMOTRON_H_LEGACY = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv",
                     "expand": "mamba_expand", "time_step_min": "mamba_dt_min",
                     "time_step_max": "mamba_dt_max", "time_step_limit": "mamba_dt_limit",
                     "time_step_floor": "mamba_dt_init_floor", "use_conv_bias": "mamba_conv_bias",
                     "chunk_size": "mamba_chunk_size"}
TYPE_TO_SYMBOL = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*",
                  "mlp": "-", "moe": "E"}
SYMBOL_TO_TYPE = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def _dt_limit(h: dict[str, Any]) -> tuple[float, float]:
    lo, hi = h["time_step_limit"] or NEMOTRON_H_DEFAULTS["time_step_limit"]
    return float(lo), float(hi)


def _activation(hf_act: str, field: str) -> str:
    if hf_act not in HF_TO_ACT:
        raise ConfigError(f"config.json: {field}={hf_act!r} is not supported (supported: "
                          f"{', '.join(HF_TO_ACT)})")
    return HF_TO_ACT[hf_act]


def _hf_activation(act: str, family: str) -> str:
    if act not in ACT_TO_HF:
        raise ConfigError(f"{family} MLPs are not gated; activation {act!r} cannot be written "
                          f"(supported: {', '.join(ACT_TO_HF)})")
    return ACT_TO_HF[act]


def nemotron_h_pattern(hf: dict[str, Any]) -> str:
    """Our pattern from ``layers_block_type`` (old or new names; it wins, as in transformers) or
    the legacy ``hybrid_override_pattern`` string (``|`` stage marks dropped, the MTP part after
    ``/`` left to ``num_nextn_predict_layers``)."""
    types = hf.get("layers_block_type") or hf.get("layer_types")
    if types is not None:
        if not isinstance(types, list):
            raise ConfigError(f"config.json: layers_block_type must be a list, not {types!r}")
        unknown = [t for t in types if t not in TYPE_TO_SYMBOL]
        if unknown:
            raise ConfigError(f"config.json: layers_block_type has unknown layer type "
                              f"{unknown[0]!r} (known: {', '.join(TYPE_TO_SYMBOL)})")
        pattern = "".join(TYPE_TO_SYMBOL[t] for t in types)
    elif hf.get("hybrid_override_pattern") is not None:
        pattern = str(hf["hybrid_override_pattern"]).split("/")[0].replace("|", "")
        bad = [c for c in pattern if c not in SYMBOL_TO_TYPE]
        if bad:
            raise ConfigError(f"config.json: hybrid_override_pattern has symbol {bad[0]!r} "
                              f"(known: {' '.join(SYMBOL_TO_TYPE)})")
    else:
        raise ConfigError("config.json: missing field 'layers_block_type' (or "
                          "'hybrid_override_pattern')")
    if not pattern:
        raise ConfigError("config.json: the Nemotron-H layer list is empty")
    return pattern


class NemotronHAdapter(Adapter):
    family = "nemotron-h"
    symbols = "M*-E"
    max_positions = 4096
    architectures = ("NemotronHForCausalLM",)
    model_type = "nemotron_h"
    hf_keep_fp32 = ("gate.weight", "gate.e_score_correction_bias")

    # ---- config
    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        h = {**NEMOTRON_H_DEFAULTS, **hf}
        h.update({new: hf[old] for new, old in NEMOTRON_H_LEGACY.items() if old in hf})
        pattern = nemotron_h_pattern(hf)
        if h["num_nextn_predict_layers"]:
            raise ConfigError(f"config.json: num_nextn_predict_layers="
                              f"{h['num_nextn_predict_layers']}: multi-token-prediction layers "
                              "(mtp.*) are not supported yet")
        if h["tie_word_embeddings"]:
            raise ConfigError("config.json: tie_word_embeddings=true, but transformers' "
                              "NemotronHForCausalLM never ties lm_head to the embeddings")
        attention = None
        if "*" in pattern:
            if h["attention_bias"]:
                raise ConfigError("config.json: attention_bias=true, but transformers' "
                                  "NemotronHAttention has no biases")
            attention = attention_from_hf(h, position="none")
        mamba = None
        if "M" in pattern:
            mamba = mamba_from_hf(h, h["mamba_num_heads"], h["mamba_head_dim"],
                                   h["ssm_state_size"], _dt_limit(h),
                                   "mamba_hidden_act")
        mlp = moe = None
        if "-" in pattern or "E" in pattern:
            act = _activation(h["mlp_hidden_act"], "mlp_hidden_act")
            if "-" in pattern:
                mlp = MLPConfig(d_ff=h["intermediate_size"], activation=act,
                                bias=bool(h["mlp_bias"]))
            if "E" in pattern:
                moe = self._moe_from_hf(h, act)
        return ModelConfig(
            pattern=pattern, d_model=require(hf, "hidden_size"),
            vocab_size=require(hf, "vocab_size"), tie_embeddings=False,
            norm_eps=float(h["layer_norm_epsilon"]), init_std=float(h["initializer_range"]),
            attention=attention, mamba=mamba, mlp=mlp, moe=moe)

    def _moe_from_hf(self, h: dict[str, Any], act: str) -> MoEConfig:
        if h["moe_latent_size"] is not None:
            raise ConfigError(f"config.json: moe_latent_size={h['moe_latent_size']}: latent MoE "
                              "projections (fc1/fc2_latent_proj) are not supported yet")
        if h["mlp_bias"]:
            raise ConfigError("config.json: mlp_bias=true gives Nemotron-H's shared experts "
                              "biases, which our shared experts do not have")
        n_experts = h.get("num_local_experts") or h["n_routed_experts"]
        _check_groups(n_experts, h["n_group"])
        return MoEConfig(
            n_experts=n_experts, top_k=h["num_experts_per_tok"], d_ff=h["moe_intermediate_size"],
            activation=act, n_shared_experts=1,  # transformers always builds one
            d_ff_shared=h["moe_shared_expert_intermediate_size"], score_func="sigmoid",
            renormalize=bool(h["norm_topk_prob"]), score_correction_bias=True,
            routed_scaling_factor=float(h["routed_scaling_factor"]),
            n_expert_groups=h["n_group"], topk_groups=h["topk_group"],
            # Not a transformers field (it computes no aux loss); kept so that ours round-trips.
            aux_loss_coeff=float(h.get("router_aux_loss_coef") or 0.0))

    def config_to_hf(self, cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
        pattern = cfg.parsed
        if pattern.mtp:
            raise layer_pattern_error(self.family, cfg.pattern,
                                      "multi-token-prediction parts are not supported yet")
        if cfg.tie_embeddings:
            raise ConfigError("transformers' NemotronHForCausalLM never ties lm_head to the "
                              "embeddings; tie_embeddings must be false")
        check_plain(cfg, self.family)
        symbols = pattern.layers
        unknown = sorted(set(symbols) - set(SYMBOL_TO_TYPE))
        if unknown:
            raise layer_pattern_error(self.family, cfg.pattern, f"it has no {unknown[0]!r} layers")
        out = common_to_hf(cfg, base, self.architectures[0], self.model_type)
        for old in (*NEMOTRON_H_LEGACY.values(), "layer_types"):
            out.pop(old, None)  # they would override what we write
        out["layers_block_type"] = [SYMBOL_TO_TYPE[s] for s in symbols]
        # Not read by transformers 5.24 (which writes only the list) but by older loaders.
        if not base or "hybrid_override_pattern" in base:
            out["hybrid_override_pattern"] = "".join(symbols)
        if not base or "num_hidden_layers" in base:
            out["num_hidden_layers"] = len(symbols)
        out["layer_norm_epsilon"] = cfg.norm_eps
        if "*" in symbols:
            self._attention_to_hf(cfg, out)
        if "M" in symbols:
            self._mamba_to_hf(cfg, out)
        if "-" in symbols:
            mlp = cfg.mlp
            out.update(intermediate_size=mlp.d_ff, mlp_bias=mlp.bias,
                       mlp_hidden_act=_hf_activation(mlp.activation, self.family))
        if "E" in symbols:
            self._moe_to_hf(cfg, "-" in symbols, out)
        return out

    def _attention_to_hf(self, cfg: ModelConfig, out: dict[str, Any]) -> None:
        a = cfg.attention
        if a.position != "none":
            raise ConfigError(f"Nemotron-H attention has no position embedding; attention."
                              f"position must be 'none', not {a.position!r}")
        if a.qkv_bias or a.out_bias:
            raise ConfigError("transformers' NemotronHAttention has no biases")
        attention_to_hf(cfg, out)

    def _mamba_to_hf(self, cfg: ModelConfig, out: dict[str, Any]) -> None:
        m = mamba_common_to_hf(cfg, self.family, out)
        d_inner = d_inner_of(m)
        out.update(mamba_num_heads=m.n_heads, mamba_head_dim=m.d_head, ssm_state_size=m.d_state,
                   mamba_proj_bias=m.proj_bias, mamba_hidden_act="silu",
                   time_step_limit=list(m.dt_limit))
        if d_inner % cfg.d_model == 0:  # unused by transformers; kept consistent for other tools
            out["expand"] = d_inner // cfg.d_model

    def _moe_to_hf(self, cfg: ModelConfig, has_mlp: bool, out: dict[str, Any]) -> None:
        moe = cfg.moe
        missing = [what for what, ok in (
            ("score_func=sigmoid", moe.score_func == "sigmoid"),
            ("score_correction_bias=true", moe.score_correction_bias),
            ("n_shared_experts=1", moe.n_shared_experts == 1)) if not ok]
        if missing:
            raise ConfigError(f"a Nemotron-H MoE layer has a sigmoid router with score-correction "
                              f"bias and one shared expert; set moe.{', moe.'.join(missing)}")
        act = _hf_activation(moe.activation, self.family)
        if has_mlp and out["mlp_hidden_act"] != act:
            raise ConfigError(f"Nemotron-H has one mlp_hidden_act; mlp.activation "
                              f"({cfg.mlp.activation}) and moe.activation ({moe.activation}) "
                              "differ")
        if has_mlp and cfg.mlp.bias:
            raise ConfigError("Nemotron-H's mlp_bias would give the shared experts biases too; "
                              "mlp.bias must be false in a model with MoE layers")
        _check_groups(moe.n_experts, moe.n_expert_groups)
        out.update(n_routed_experts=moe.n_experts, num_experts_per_tok=moe.top_k,
                   moe_intermediate_size=moe.d_ff, n_shared_experts=1,
                   moe_shared_expert_intermediate_size=d_ff_shared_of(moe), moe_latent_size=None,
                   norm_topk_prob=moe.renormalize,
                   routed_scaling_factor=moe.routed_scaling_factor, n_group=moe.n_expert_groups,
                   topk_group=moe.topk_groups, mlp_hidden_act=act, mlp_bias=False)
        out.pop("num_local_experts", None)
        if moe.aux_loss_coeff or "router_aux_loss_coef" in out:
            out["router_aux_loss_coef"] = moe.aux_loss_coeff

    # ---- tensors
    def normalize(self, name: str) -> str:
        if name.startswith("model."):
            name = "backbone." + name.removeprefix("model.")
        return name.replace("backbone.embedding.", "backbone.embeddings.")

    def links(self, cfg: ModelConfig, fused_experts: bool) -> list[Link]:
        links = [Link("embed.weight", "backbone.embeddings.weight"),
                 Link("final_norm.weight", "backbone.norm_f.weight"),
                 Link("lm_head.weight", "lm_head.weight")]
        for i, sym in enumerate(cfg.parsed.layers):
            ours, hf = f"layers.{i}.mixer", f"backbone.layers.{i}.mixer"
            links.append(Link(f"layers.{i}.norm.weight", f"backbone.layers.{i}.norm.weight"))
            if sym == "M":
                links += mamba_links(ours, hf, cfg.mamba)
            elif sym == "*":
                links += attention_links(ours, hf, cfg.attention)
            elif sym == "-":
                suffixes = ("weight", "bias") if cfg.mlp.bias else ("weight",)
                links += [Link(f"{ours}.{p}.{s}", f"{hf}.{p}.{s}")
                          for p in ("up_proj", "down_proj") for s in suffixes]
            else:
                links += moe_links(ours, hf, cfg.moe, fused_experts)
        return links


def moe_links(ours: str, hf: str, moe: MoEConfig, fused: bool) -> list[Link]:
    links = [Link(f"{ours}.router.weight", f"{hf}.gate.weight"),
             Link(f"{ours}.router.score_bias", f"{hf}.gate.e_score_correction_bias")]
    links += [Link(f"{ours}.shared_experts.{p}.weight", f"{hf}.shared_experts.{p}.weight")
              for p in ("up_proj", "down_proj")]
    for proj in ("up_proj", "down_proj"):
        if fused:  # transformers 5's in-memory [E, out, in] is our layout exactly
            links.append(Link(f"{ours}.experts.{proj}", f"{hf}.experts.{proj}"))
        else:
            links += [Link(f"{ours}.experts.{proj}", f"{hf}.experts.{e}.{proj}.weight", (e,), ())
                      for e in range(moe.n_experts)]
    return links


def _check_groups(n_experts: int, n_groups: int) -> None:
    if n_experts // n_groups < 2:
        raise ConfigError(f"transformers' Nemotron-H router scores each expert group by its top 2; "
                          f"{n_experts} experts in {n_groups} groups leave fewer than 2 per group")
