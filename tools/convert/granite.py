"""Bamba and Granite-4.0-H (``GraniteMoeHybrid``): Mamba-2 / attention hybrids, an MLP per layer.

Each HF layer ``L`` is two of our layers: ``2L`` is the mixer (``M`` under ``model.L.mamba.*`` or
``*`` under ``model.L.self_attn.*``, norm ``input_layernorm``) and ``2L + 1`` is the MLP part.

- Bamba: ``model.L.feed_forward.{gate,up,down}_proj`` (``-``, norm ``pre_ff_layernorm``);
  attention layers come from ``attn_layer_indices``; RoPE rotates half of each head
  (``partial_rotary_factor`` defaults to 0.5 in ``BambaConfig``, a value in ``rope_parameters``
  wins); final norm ``model.final_layernorm``.
- GraniteMoeHybrid: ``post_attention_layernorm``, then a gated ``shared_mlp`` (``input_linear``
  rows are gate then up, ``.chunk(2)``) plus, when ``num_local_experts > 0``, a softmax top-k
  MoE whose experts are fused on disk (``block_sparse_moe.input_linear [E, 2I, H]`` gate then up,
  ``output_linear [E, H, I]``). With experts this is our ``E`` with one shared expert; without, our
  ``-``. µP multipliers (docs/conversion.md): ``embedding_multiplier``, ``residual_multiplier``
  (on both residual branches), ``attention_multiplier`` (the score scale itself) and
  ``logits_scaling`` (logits are divided by it). Final norm ``model.norm``.

Both Mamba mixers are transformers' Mamba-2 torch path with the gated RMSNorm per group of
``d_inner / n_groups`` (docs/conversion.md) and ``hidden_act`` as the convolution's activation too.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

from composer.config import (
    AttentionConfig,
    ConfigError,
    MambaConfig,
    MLPConfig,
    ModelConfig,
    MoEConfig,
    d_ff_shared_of,
    d_head_of,
    d_inner_of,
)
from composer.convert.base import (
    GATED_TO_HF_ACT,
    Adapter,
    attention_from_hf,
    attention_links,
    attention_to_hf,
    common_to_hf,
    gated_activation,
    gated_mlp_links,
    layer_pattern_error,
    mamba_links,
    require,
    rope_parameters,
)
from composer.convert.plan import Link

MAMBA_INIT_DEFAULTS = {"time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 1e-4}
MIXER_OF_TYPE = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*"}
SECTION_OF_MIXER = {"M": "mamba", "*": "attention"}
LEGACY_TYPE = {"M": "mamba", "*": "attention"}
NEW_TYPE = {"M": "linear_attention", "*": "full_attention"}
# transformers' in-memory names (written by save_pretrained(save_original_format=False)).
GRANITE_MEMORY_NAMES = {
    ".block_sparse_moe.experts.gate_up_proj": ".block_sparse_moe.input_linear.weight",
    ".block_sparse_moe.experts.down_proj": ".block_sparse_moe.output_linear.weight",
    ".block_sparse_moe.router.weight": ".block_sparse_moe.router.layer.weight",
}


# ---------------------------------------------------------------- config helpers


def mamba_from_hf(hf: dict[str, Any]) -> MambaConfig:
    d_model = require(hf, "hidden_size")
    n_heads = require(hf, "mamba_n_heads")
    d_inner = int((hf.get("mamba_expand") or 2) * d_model)
    d_head = hf.get("mamba_d_head", "auto")
    if d_head in ("auto", None):
        d_head = d_inner // n_heads
    if n_heads * d_head != d_inner:
        raise ConfigError(f"config.json: mamba_n_heads * mamba_d_head ({n_heads} * {d_head}) must "
                          f"equal mamba_expand * hidden_size ({d_inner})")
    limit = hf.get("time_step_limit") or (0.0, float("inf"))
    return MambaConfig(
        n_heads=n_heads, d_head=d_head, n_groups=hf.get("mamba_n_groups") or 1,
        d_state=require(hf, "mamba_d_state"), d_conv=hf.get("mamba_d_conv") or 4,
        chunk_size=require(hf, "mamba_chunk_size"),
        conv_bias=bool(hf.get("mamba_conv_bias", True)),
        proj_bias=bool(hf.get("mamba_proj_bias", False)),
        # Init-only fields: BambaConfig/GraniteMoeHybridConfig do not declare them, but we carry
        # them when a config has them (Mamba2Config's names).
        dt_min=float(hf.get("time_step_min", MAMBA_INIT_DEFAULTS["time_step_min"])),
        dt_max=float(hf.get("time_step_max", MAMBA_INIT_DEFAULTS["time_step_max"])),
        dt_init_floor=float(hf.get("time_step_floor", MAMBA_INIT_DEFAULTS["time_step_floor"])),
        dt_limit=(float(limit[0]), float(limit[1])))


def mamba_to_hf(cfg: ModelConfig, family: str, out: dict[str, Any]) -> None:
    m = cfg.mamba
    assert m is not None
    d_inner = d_inner_of(m)
    if d_inner % cfg.d_model:
        raise ConfigError(f"{family} derives the Mamba width as mamba_expand * hidden_size with an "
                          f"integer mamba_expand; n_heads*d_head={d_inner} is not a multiple of "
                          f"d_model={cfg.d_model}")
    if m.norm_group_size is not None and m.norm_group_size != d_inner // m.n_groups:
        raise ConfigError(f"{family} normalises the gated RMSNorm per group of d_inner/n_groups = "
                          f"{d_inner // m.n_groups} channels, not {m.norm_group_size}")
    if tuple(m.a_init_range) != MambaConfig().a_init_range:
        raise ConfigError(f"mamba.a_init_range {list(m.a_init_range)} has no {family} config "
                          "field (transformers initialises A_log as log(1..n_heads))")
    out.update(mamba_n_heads=m.n_heads, mamba_d_head=m.d_head, mamba_n_groups=m.n_groups,
               mamba_d_state=m.d_state, mamba_d_conv=m.d_conv, mamba_expand=d_inner // cfg.d_model,
               mamba_chunk_size=m.chunk_size, mamba_conv_bias=m.conv_bias,
               mamba_proj_bias=m.proj_bias, time_step_limit=list(m.dt_limit))
    for key, value in zip(MAMBA_INIT_DEFAULTS, (m.dt_min, m.dt_max, m.dt_init_floor), strict=True):
        if key in out or value != MAMBA_INIT_DEFAULTS[key]:
            out[key] = value


def activation_from_hf(hf: dict[str, Any], mixers: str) -> str:
    activation = gated_activation(hf.get("hidden_act", "silu"))
    if "M" in mixers and activation != "swiglu":
        raise ConfigError(f"config.json: hidden_act={hf.get('hidden_act')!r} is also the Mamba "
                          "convolution's activation; ours is SiLU (hidden_act 'silu')")
    return activation


def activation_to_hf(family: str, activation: str, mixers: str) -> str:
    if activation not in GATED_TO_HF_ACT:
        raise ConfigError(f"{family} needs a gated MLP, not {activation!r}")
    if "M" in mixers and activation != "swiglu":
        raise ConfigError(f"{family} uses hidden_act for the Mamba convolution too, so the MLP "
                          f"must be swiglu, not {activation!r}")
    return GATED_TO_HF_ACT[activation]


def check_sections(family: str, cfg: ModelConfig, mixers: str, mlp_section: str) -> None:
    """A section the pattern does not use cannot be stored in the HF config (nor read back)."""
    used = {mlp_section, *(SECTION_OF_MIXER[s] for s in mixers)}
    for name in ("attention", "mamba", "mlp", "moe"):
        if getattr(cfg, name) is not None and name not in used:
            raise ConfigError(f"{family}: the '{name}' section is set but no layer of pattern "
                              f"{cfg.pattern!r} uses it; set {name}=null")


def check_no_multipliers(family: str, cfg: ModelConfig) -> None:
    scaled = [f"{k}={getattr(cfg, k)}" for k in ("embedding_multiplier", "residual_multiplier",
                                                 "logits_scaling") if getattr(cfg, k) != 1.0]
    if cfg.attention is not None and cfg.attention.softmax_scale is not None:
        scaled.append(f"attention.softmax_scale={cfg.attention.softmax_scale}")
    if scaled:
        raise ConfigError(f"{family} has no multipliers; cannot express {', '.join(scaled)}")


def hybrid_attention_to_hf(family: str, cfg: ModelConfig, base: dict[str, Any],
                           out: dict[str, Any]) -> None:
    a = cfg.attention
    if a.qk_norm:
        raise ConfigError(f"{family} attention has no qk-norm")
    attention_to_hf(cfg, out)
    # Neither config class declares head_dim (the models read it with getattr): write it only
    # when the source had it or it differs from hidden_size // num_attention_heads.
    if "head_dim" not in base and d_head_of(cfg) == cfg.d_model // a.n_heads:
        out.pop("head_dim", None)


# ---------------------------------------------------------------- links


class HybridMambaAdapter(Adapter):
    """What Bamba and GraniteMoeHybrid share: ``(M|*)`` then one MLP symbol per HF layer."""

    final_norm = ""
    mlp_norm = ""
    mlp_symbols = "-"

    def split_pattern(self, cfg: ModelConfig) -> tuple[str, str]:
        """The mixer symbols and the one MLP symbol; raises unless the pattern is ``((M|*)X)*``
        with the same ``X`` (one of ``mlp_symbols``) in every layer."""
        layers = cfg.parsed.layers
        mixers, mlps = "".join(layers[0::2]), set(layers[1::2])
        if (len(layers) % 2 or set(mixers) - set("M*") or len(mlps) != 1
                or not mlps <= set(self.mlp_symbols)):
            want = " or ".join(f"'M{s}'/'*{s}'" for s in self.mlp_symbols)
            raise layer_pattern_error(self.family, cfg.pattern,
                                      f"every layer must be {want}, the same MLP kind throughout")
        return mixers, mlps.pop()

    @abc.abstractmethod
    def mlp_links(self, cfg: ModelConfig, ours: str, hf: str, fused_experts: bool) -> list[Link]:
        """The MLP part of one HF layer (Bamba: dense; Granite: shared MLP and MoE)."""

    def links(self, cfg: ModelConfig, fused_experts: bool) -> list[Link]:
        links = [Link("embed.weight", "model.embed_tokens.weight"),
                 Link("final_norm.weight", f"model.{self.final_norm}.weight")]
        if not cfg.tie_embeddings:
            links.append(Link("lm_head.weight", "lm_head.weight"))
        mixers, _ = self.split_pattern(cfg)
        for i, mixer in enumerate(mixers):
            hf, a, m = f"model.layers.{i}", f"layers.{2 * i}", f"layers.{2 * i + 1}"
            links.append(Link(f"{a}.norm.weight", f"{hf}.input_layernorm.weight"))
            links.append(Link(f"{m}.norm.weight", f"{hf}.{self.mlp_norm}.weight"))
            if mixer == "M":
                links += mamba_links(f"{a}.mixer", f"{hf}.mamba", cfg.mamba)
            else:
                links += attention_links(f"{a}.mixer", f"{hf}.self_attn", cfg.attention)
            links += self.mlp_links(cfg, f"{m}.mixer", hf, fused_experts)
        return links


# ---------------------------------------------------------------- Bamba


class BambaAdapter(HybridMambaAdapter):
    family = "bamba"
    symbols = "M*-"
    max_positions = 262144
    architectures = ("BambaForCausalLM",)
    model_type = "bamba"
    final_norm = "final_layernorm"
    mlp_norm = "pre_ff_layernorm"

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        n_layers = require(hf, "num_hidden_layers")
        attn = set(hf.get("attn_layer_indices") or [])
        if any(not 0 <= i < n_layers for i in attn):
            raise ConfigError(f"config.json: attn_layer_indices {sorted(attn)} must lie in "
                              f"[0, {n_layers})")
        mixers = "".join("*" if i in attn else "M" for i in range(n_layers))
        attention = None
        if attn:
            # BambaConfig passes partial_rotary_factor=0.5 as a default that rope_parameters
            # overrides (a top-level partial_rotary_factor in config.json is overwritten by it).
            fraction = float(rope_parameters(hf).get("partial_rotary_factor", 0.5))
            attention = dataclasses.replace(attention_from_hf(hf), rotary_fraction=fraction)
        return ModelConfig(
            pattern="".join(f"{s}-" for s in mixers),
            d_model=require(hf, "hidden_size"), vocab_size=require(hf, "vocab_size"),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            init_std=float(hf.get("initializer_range", 0.02)),
            attention=attention, mamba=mamba_from_hf(hf) if "M" in mixers else None,
            mlp=MLPConfig(d_ff=require(hf, "intermediate_size"),
                          activation=activation_from_hf(hf, mixers),
                          bias=bool(hf.get("mlp_bias", False))),
            moe=None)

    def config_to_hf(self, cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
        mixers, _ = self.split_pattern(cfg)
        check_sections(self.family, cfg, mixers, "mlp")
        check_no_multipliers(self.family, cfg)
        out = common_to_hf(cfg, base, self.architectures[0], self.model_type)
        out.update(num_hidden_layers=len(mixers), rms_norm_eps=cfg.norm_eps,
                   attn_layer_indices=[i for i, s in enumerate(mixers) if s == "*"],
                   intermediate_size=cfg.mlp.d_ff, mlp_bias=cfg.mlp.bias,
                   hidden_act=activation_to_hf(self.family, cfg.mlp.activation, mixers))
        for key in ("layer_types", "layers_block_type", "dtype", "torch_dtype"):
            out.pop(key, None)  # derived from attn_layer_indices / set by the writer
        if "*" in mixers:
            a = cfg.attention
            if a.position != "rope":
                raise ConfigError("Bamba attention always applies RoPE (position: rope)")
            hybrid_attention_to_hf(self.family, cfg, base, out)
            # Written even when 1.0: a missing value means 0.5 to BambaConfig.
            out["rope_parameters"]["partial_rotary_factor"] = a.rotary_fraction
        if "M" in mixers:
            mamba_to_hf(cfg, self.family, out)
        return out

    def mlp_links(self, cfg: ModelConfig, ours: str, hf: str, fused_experts: bool) -> list[Link]:
        return gated_mlp_links(ours, f"{hf}.feed_forward", cfg.mlp.bias)


# ---------------------------------------------------------------- GraniteMoeHybrid


class GraniteMoeHybridAdapter(HybridMambaAdapter):
    family = "granite-h"
    symbols = "M*-E"
    max_positions = 2048
    architectures = ("GraniteMoeHybridForCausalLM",)
    model_type = "granitemoehybrid"
    save_fused_experts = True
    final_norm = "norm"
    mlp_norm = "post_attention_layernorm"
    mlp_symbols = "E-"

    def normalize(self, name: str) -> str:
        for memory, disk in GRANITE_MEMORY_NAMES.items():
            if name.endswith(memory):
                return name.removesuffix(memory) + disk
        return name

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        n_layers = require(hf, "num_hidden_layers")
        types = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * n_layers
        unknown = sorted(set(types) - set(MIXER_OF_TYPE))
        if unknown or len(types) != n_layers:
            raise ConfigError(f"config.json: layer_types must list {n_layers} entries from "
                              f"{', '.join(MIXER_OF_TYPE)}; got {types}")
        mixers = "".join(MIXER_OF_TYPE[t] for t in types)
        n_experts = require(hf, "num_local_experts")
        activation = activation_from_hf(hf, mixers)
        d_shared = require(hf, "shared_intermediate_size")
        moe = mlp = None
        if n_experts > 0:
            d_ff = require(hf, "intermediate_size")
            moe = MoEConfig(
                n_experts=n_experts, top_k=require(hf, "num_experts_per_tok"), d_ff=d_ff,
                activation=activation, n_shared_experts=1,
                d_ff_shared=None if d_shared == d_ff else d_shared,
                # softmax over the top-k logits == softmax over all, then renormalised top-k
                score_func="softmax", renormalize=True,
                aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)))
        else:
            mlp = MLPConfig(d_ff=d_shared, activation=activation, bias=False)
        return ModelConfig(
            pattern="".join(s + ("E" if n_experts > 0 else "-") for s in mixers),
            d_model=require(hf, "hidden_size"), vocab_size=require(hf, "vocab_size"),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            init_std=float(hf.get("initializer_range", 0.02)),
            embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
            logits_scaling=float(hf.get("logits_scaling", 1.0)),
            attention=self.attention_from_hf(hf) if "*" in mixers else None,
            mamba=mamba_from_hf(hf) if "M" in mixers else None, mlp=mlp, moe=moe)

    def attention_from_hf(self, hf: dict[str, Any]) -> AttentionConfig:
        # Only "rope" builds a rotary embedding; None and "nope" mean no position encoding.
        position = "rope" if hf.get("position_embedding_type") == "rope" else "none"
        a = attention_from_hf(hf, position=position)
        params = rope_parameters(hf)
        # The model's default-RoPE function ignores partial_rotary_factor; scaled types honour it.
        if position == "none" or params.get("rope_type", "default") == "default":
            a = dataclasses.replace(a, rotary_fraction=1.0)
        scale = float(hf.get("attention_multiplier", 1.0))
        # None means 1/sqrt(d_head) for us; keep that form so that configs round-trip.
        return dataclasses.replace(a, softmax_scale=None if scale == a.d_head**-0.5 else scale)

    def config_to_hf(self, cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
        mixers, symbol = self.split_pattern(cfg)
        check_sections(self.family, cfg, mixers, "moe" if symbol == "E" else "mlp")
        out = common_to_hf(cfg, base, self.architectures[0], self.model_type)
        out.update(num_hidden_layers=len(mixers), rms_norm_eps=cfg.norm_eps,
                   embedding_multiplier=cfg.embedding_multiplier,
                   residual_multiplier=cfg.residual_multiplier, logits_scaling=cfg.logits_scaling)
        for key in ("dtype", "torch_dtype"):
            out.pop(key, None)
        self.layer_types_to_hf(mixers, base, out)
        if symbol == "E":
            self.moe_to_hf(cfg, mixers, out)
        else:
            if cfg.mlp.bias:
                raise ConfigError("GraniteMoeHybrid's shared_mlp has no bias (mlp.bias=false)")
            out.update(num_local_experts=0, shared_intermediate_size=cfg.mlp.d_ff,
                       hidden_act=activation_to_hf(self.family, cfg.mlp.activation, mixers))
        if "*" in mixers:
            self.attention_to_hf(cfg, base, out)
        if "M" in mixers:
            mamba_to_hf(cfg, self.family, out)
        return out

    @staticmethod
    def layer_types_to_hf(mixers: str, base: dict[str, Any], out: dict[str, Any]) -> None:
        """``layer_types`` in the source's vocabulary (Hub configs say mamba/attention,
        transformers 5 writes linear_attention/full_attention); both are read."""
        keys = [k for k in ("layer_types", "layers_block_type") if base.get(k)] or ["layer_types"]
        legacy = any(t in LEGACY_TYPE.values() for k in keys for t in base.get(k) or [])
        names = LEGACY_TYPE if legacy else NEW_TYPE
        for key in keys:
            out[key] = [names[s] for s in mixers]

    def moe_to_hf(self, cfg: ModelConfig, mixers: str, out: dict[str, Any]) -> None:
        moe = cfg.moe
        problems = {
            "a router other than softmax with renormalised top-k":
                moe.score_func != "softmax" or not moe.renormalize,
            "score_correction_bias": moe.score_correction_bias,
            f"n_shared_experts={moe.n_shared_experts} (exactly 1)": moe.n_shared_experts != 1,
            "routed_scaling_factor": moe.routed_scaling_factor != 1.0,
            "expert groups": moe.n_expert_groups != 1,
        }
        unsupported = [what for what, bad in problems.items() if bad]
        if unsupported:
            raise ConfigError(f"GraniteMoeHybrid MoE cannot express: {', '.join(unsupported)}")
        out.update(num_local_experts=moe.n_experts, num_experts_per_tok=moe.top_k,
                   intermediate_size=moe.d_ff, shared_intermediate_size=d_ff_shared_of(moe),
                   router_aux_loss_coef=moe.aux_loss_coeff,
                   hidden_act=activation_to_hf(self.family, moe.activation, mixers))

    @staticmethod
    def attention_to_hf(cfg: ModelConfig, base: dict[str, Any], out: dict[str, Any]) -> None:
        a = cfg.attention
        if a.position == "rope" and a.rope_scaling is None and a.rotary_fraction != 1.0:
            raise ConfigError("GraniteMoeHybrid's default RoPE rotates every channel; "
                              f"rotary_fraction={a.rotary_fraction} needs a scaled rope type")
        hybrid_attention_to_hf("GraniteMoeHybrid", cfg, base, out)
        out["attention_multiplier"] = a.softmax_scale if a.softmax_scale is not None \
            else d_head_of(cfg) ** -0.5
        if a.position == "rope":
            out["position_embedding_type"] = "rope"
        else:
            # Keep the source's spelling of "no RoPE" (None or "nope"); Granite-4.0-H says "nope".
            kept = base.get("position_embedding_type", "nope")
            out["position_embedding_type"] = "nope" if kept == "rope" else kept
            # rope_theta is unused without RoPE but part of our config: carry it.
            out["rope_parameters"] = {"rope_type": "default", **rope_parameters(base),
                                      "rope_theta": a.rope_theta}
            out.pop("rope_theta", None)
            out.pop("rope_scaling", None)

    def mlp_links(self, cfg: ModelConfig, ours: str, hf: str, fused_experts: bool) -> list[Link]:
        # One layout whatever ``fused_experts`` says: Granite's experts are fused on disk too.
        if cfg.moe is None:
            d, shared = cfg.mlp.d_ff, ours
        else:
            d, shared = d_ff_shared_of(cfg.moe), f"{ours}.shared_experts"
        mlp_in = f"{hf}.shared_mlp.input_linear.weight"
        links = [Link(f"{shared}.gate_proj.weight", mlp_in, (), ((0, d),)),
                 Link(f"{shared}.up_proj.weight", mlp_in, (), ((d, 2 * d),)),
                 Link(f"{shared}.down_proj.weight", f"{hf}.shared_mlp.output_linear.weight")]
        if cfg.moe is None:
            return links
        moe, f = f"{hf}.block_sparse_moe", cfg.moe.d_ff
        links += [Link(f"{ours}.router.weight", f"{moe}.router.layer.weight"),
                  Link(f"{ours}.experts.down_proj", f"{moe}.output_linear.weight")]
        for e in range(cfg.moe.n_experts):
            links += [Link(f"{ours}.experts.gate_proj", f"{moe}.input_linear.weight",
                           (e,), (e, (0, f))),
                      Link(f"{ours}.experts.up_proj", f"{moe}.input_linear.weight",
                           (e,), (e, (f, 2 * f)))]
        return links
