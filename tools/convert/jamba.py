"""Jamba (``JambaForCausalLM``, AI21): Mamba-1 / attention layers, each followed by an MLP or a
mixture of experts.

Each HF layer ``L`` is two of our layers: ``2L`` is the mixer (``S`` under ``model.L.mamba.*`` or
``*`` under ``model.L.self_attn.*``, norm ``input_layernorm``) and ``2L + 1`` the feed-forward part
(``-`` or ``E`` under ``model.L.feed_forward.*``, norm ``pre_ff_layernorm``), so a layer is one of
``S-``, ``SE``, ``*-``, ``*E``. Embeddings ``model.embed_tokens``, final norm
``model.final_layernorm``, head ``lm_head`` (absent when tied).

Quirks of transformers 5.24 that decide the mapping (checked in its source):
- Layer kinds come from periods: layer ``i`` is attention when ``i % attn_layer_period ==
  attn_layer_offset`` and a MoE when ``num_experts > 1`` and ``i % expert_layer_period ==
  expert_layer_offset`` (offsets below their periods); on export the smallest periods that give
  the pattern are written, the source's when they still do.
- The Mamba mixer is Mamba-1 with learned RMSNorms on dt, B and C (``rms_norm_eps``), its width
  ``mamba_expand * hidden_size``, ``mamba_dt_rank`` "auto" = ``ceil(hidden_size / 16)``, and
  ``hidden_act`` is the convolution's activation too (ours is SiLU).
- Attention has no position embedding and no biases; its head width is ``head_dim`` when the
  config has one, else ``hidden_size / num_attention_heads``.
- The router is a softmax top-k whose weights are not renormalised; the MLP and the experts
  share ``intermediate_size`` and ``hidden_act``. Experts are per expert on disk
  (``feed_forward.experts.{e}.{gate,up,down}_proj.weight``) and fused in memory
  (``experts.gate_up_proj [E, 2I, H]`` gate first, ``experts.down_proj [E, H, I]``).
"""

from __future__ import annotations

import math
from typing import Any

from composer.blocks.mamba1 import Mamba1Config
from composer.config import ConfigError, MLPConfig, ModelConfig, MoEConfig, d_head_of
from composer.convert.base import (
    Adapter,
    attention_from_hf,
    attention_links,
    attention_to_hf,
    common_to_hf,
    gated_activation,
    gated_mlp_links,
    layer_pattern_error,
    require,
)
from composer.convert.decoder import check_softmax_moe, expert_links
from composer.convert.mamba_common import check_plain
from composer.convert.plan import Link

# Defaults of transformers 5.24's JambaConfig: a field missing from config.json means these.
JAMBA_DEFAULTS: dict[str, Any] = dict(
    vocab_size=65536, tie_word_embeddings=False, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
    initializer_range=0.02, rms_norm_eps=1e-6, router_aux_loss_coef=0.001,
    num_experts_per_tok=2, num_experts=16, expert_layer_period=2, expert_layer_offset=1,
    attn_layer_period=8, attn_layer_offset=4, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
    mamba_dt_rank="auto", mamba_conv_bias=True, mamba_proj_bias=False)
MAMBA1_LINKS = ("in_proj.weight", "conv1d.weight", "x_proj.weight", "dt_proj.weight",
                "dt_proj.bias", "A_log", "D", "out_proj.weight", "dt_layernorm.weight",
                "b_layernorm.weight", "c_layernorm.weight")


def _periodic(flags: list[bool], period: int, offset: int) -> bool:
    return 0 <= offset < period and all(f == (i % period == offset) for i, f in enumerate(flags))


def periods_of(flags: list[bool], base: tuple[int, int] | None) -> tuple[int, int] | None:
    """``(period, offset)`` with ``flags[i] == (i % period == offset)``: the source's ``base``
    when it fits, else the smallest; None when no period gives ``flags``. No flag set at all is
    a period longer than the model."""
    if base is not None and _periodic(flags, *base):
        return base
    n = len(flags)
    if not any(flags):
        return n + 1, n
    return next(((p, o) for p in range(1, n + 1) for o in range(p) if _periodic(flags, p, o)),
                None)


def mamba1_links(ours: str, hf: str, m: Mamba1Config) -> list[Link]:
    names = list(MAMBA1_LINKS)
    if m.conv_bias:
        names.append("conv1d.bias")
    if m.proj_bias:
        names += ["in_proj.bias", "out_proj.bias"]
    return [Link(f"{ours}.{n}", f"{hf}.{n}") for n in names]


class JambaAdapter(Adapter):
    family = "jamba"
    symbols = "S*-E"
    max_positions = 262144
    architectures = ("JambaForCausalLM",)
    model_type = "jamba"

    # ---- config
    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        h = {**JAMBA_DEFAULTS, **hf}
        n_layers, d_model = require(hf, "num_hidden_layers"), require(hf, "hidden_size")
        for kind in ("attn", "expert"):
            period, offset = h[f"{kind}_layer_period"], h[f"{kind}_layer_offset"]
            if not 0 <= offset < period:
                raise ConfigError(f"config.json: {kind}_layer_offset ({offset}) must be in "
                                  f"[0, {kind}_layer_period ({period}))")
        attn = [i % h["attn_layer_period"] == h["attn_layer_offset"] for i in range(n_layers)]
        sparse = [h["num_experts"] > 1 and i % h["expert_layer_period"] == h["expert_layer_offset"]
                  for i in range(n_layers)]
        pattern = "".join(("*" if a else "S") + ("E" if e else "-")
                          for a, e in zip(attn, sparse, strict=True))
        activation = gated_activation(h["hidden_act"])
        if activation != "swiglu":
            raise ConfigError(f"config.json: hidden_act={h['hidden_act']!r} is also the Mamba "
                              "convolution's activation; ours is SiLU (hidden_act 'silu')")
        mlp = moe = None
        if not all(sparse):
            mlp = MLPConfig(d_ff=h["intermediate_size"], activation=activation)
        if any(sparse):
            moe = MoEConfig(n_experts=h["num_experts"], top_k=h["num_experts_per_tok"],
                            d_ff=h["intermediate_size"], activation=activation,
                            score_func="softmax", renormalize=False,
                            aux_loss_coeff=float(h["router_aux_loss_coef"]))
        dt_rank = h["mamba_dt_rank"]
        mamba1 = Mamba1Config(
            d_inner=int(h["mamba_expand"] * d_model), d_state=h["mamba_d_state"],
            d_conv=h["mamba_d_conv"], dt_rank=math.ceil(d_model / 16) if dt_rank == "auto"
            else dt_rank, conv_bias=bool(h["mamba_conv_bias"]),
            proj_bias=bool(h["mamba_proj_bias"]), inner_norms="learned")
        return ModelConfig(
            pattern=pattern, d_model=d_model, vocab_size=require(hf, "vocab_size"),
            tie_embeddings=bool(h["tie_word_embeddings"]), norm_eps=float(h["rms_norm_eps"]),
            init_std=float(h["initializer_range"]),
            attention=attention_from_hf(h, position="none") if any(attn) else None,
            mamba=None, mamba1=mamba1 if not all(attn) else None, mlp=mlp, moe=moe)

    def split_pattern(self, cfg: ModelConfig) -> tuple[list[bool], list[bool]]:
        """Per HF layer: attention or not, MoE or not; raises unless the pattern is made of
        ``S-``, ``SE``, ``*-``, ``*E``."""
        layers = cfg.parsed.layers
        pairs = ["".join(layers[i:i + 2]) for i in range(0, len(layers), 2)]
        if cfg.parsed.mtp or len(layers) % 2 or any(
                p[0] not in "S*" or p[1] not in "-E" for p in pairs):
            raise layer_pattern_error(self.family, cfg.pattern, "every layer must be 'S-', "
                                      "'SE', '*-' or '*E'")
        return [p[0] == "*" for p in pairs], [p[1] == "E" for p in pairs]

    def config_to_hf(self, cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
        attn, sparse = self.split_pattern(cfg)
        check_plain(cfg, self.family)
        self._check_sections(cfg, attn, sparse)
        out = common_to_hf(cfg, base, self.architectures[0], self.model_type)
        for key in ("dtype", "torch_dtype", "layers_block_type", "layer_types"):
            out.pop(key, None)
        out.update(num_hidden_layers=len(attn), rms_norm_eps=cfg.norm_eps, hidden_act="silu")
        for kind, flags in (("attn", attn), ("expert", sparse)):
            keys = (f"{kind}_layer_period", f"{kind}_layer_offset")
            given = tuple(base[k] for k in keys) if all(k in base for k in keys) else None
            found = periods_of(flags, given)
            if found is None:
                what = "attention" if kind == "attn" else "MoE"
                raise layer_pattern_error(self.family, cfg.pattern, f"its {what} layers are not "
                                          f"every {kind}_layer_period layers from an offset")
            out.update(zip(keys, found, strict=True))
        if any(attn):
            self._attention_to_hf(cfg, base, out)
        if not all(attn):
            self._mamba1_to_hf(cfg, out)
        ffn = cfg.moe if any(sparse) else cfg.mlp
        out["intermediate_size"] = ffn.d_ff
        if any(sparse):
            out.update(num_experts=cfg.moe.n_experts, num_experts_per_tok=cfg.moe.top_k,
                       router_aux_loss_coef=cfg.moe.aux_loss_coeff)
        else:
            out["num_experts"] = 1  # every feed-forward part a JambaMLP
        out.pop("num_local_experts", None)
        return out

    def _check_sections(self, cfg: ModelConfig, attn: list[bool], sparse: list[bool]) -> None:
        if any(sparse):
            check_softmax_moe("Jamba", cfg)
            moe = cfg.moe
            if moe.renormalize or moe.n_experts < 2 or moe.activation != "swiglu":
                raise ConfigError("a Jamba MoE layer is a softmax top-k without renormalised "
                                  "weights over 2 or more swiglu experts; set "
                                  "moe.renormalize=false (n_experts >= 2, activation swiglu)")
        if not all(sparse):
            mlp = cfg.mlp
            if mlp.activation != "swiglu" or mlp.bias:
                raise ConfigError("Jamba's MLP is swiglu without bias (hidden_act silu)")
            if any(sparse) and mlp.d_ff != cfg.moe.d_ff:
                raise ConfigError(f"Jamba's MLP and experts share intermediate_size; mlp.d_ff "
                                  f"({mlp.d_ff}) and moe.d_ff ({cfg.moe.d_ff}) differ")

    @staticmethod
    def _attention_to_hf(cfg: ModelConfig, base: dict[str, Any], out: dict[str, Any]) -> None:
        a = cfg.attention
        problems = {"position 'none' (Jamba has no RoPE)": a.position != "none",
                    "no biases": a.qkv_bias or a.out_bias, "no qk-norm": a.qk_norm,
                    "no output gate": a.output_gate,
                    "softmax_scale null": a.softmax_scale is not None}
        wrong = [what for what, bad in problems.items() if bad]
        if wrong:
            raise ConfigError(f"Jamba attention needs {', '.join(wrong)}")
        attention_to_hf(cfg, out)
        for key in ("attention_bias", "rope_parameters", "rope_theta", "rope_scaling"):
            if key not in base:
                out.pop(key, None)  # JambaConfig has none of them
        if "head_dim" not in base and d_head_of(cfg) == cfg.d_model // a.n_heads:
            out.pop("head_dim", None)

    @staticmethod
    def _mamba1_to_hf(cfg: ModelConfig, out: dict[str, Any]) -> None:
        m = cfg.mamba1
        if m.inner_norms != "learned" or m.inner_norm_eps is not None:
            raise ConfigError("Jamba's Mamba layers have learned dt/B/C RMSNorms with "
                              "rms_norm_eps; set mamba1.inner_norms=learned and "
                              "mamba1.inner_norm_eps=null")
        if m.d_inner % cfg.d_model:
            raise ConfigError(f"Jamba sizes its Mamba layers as mamba_expand * hidden_size with "
                              f"an integer mamba_expand; mamba1.d_inner ({m.d_inner}) is not a "
                              f"multiple of d_model ({cfg.d_model})")
        defaults = Mamba1Config()
        init = [f"mamba1.{k}" for k in ("dt_min", "dt_max", "dt_init_floor", "dt_scale")
                if getattr(m, k) != getattr(defaults, k)]
        if init:
            raise ConfigError(f"JambaConfig has no field for {', '.join(init)} (transformers "
                              "initialises dt_proj as a plain Linear)")
        out.update(mamba_d_state=m.d_state, mamba_d_conv=m.d_conv,
                   mamba_expand=m.d_inner // cfg.d_model, mamba_dt_rank=m.dt_rank,
                   mamba_conv_bias=m.conv_bias, mamba_proj_bias=m.proj_bias)

    # ---- tensors
    def links(self, cfg: ModelConfig, fused_experts: bool) -> list[Link]:
        links = [Link("embed.weight", "model.embed_tokens.weight"),
                 Link("final_norm.weight", "model.final_layernorm.weight")]
        if not cfg.tie_embeddings:
            links.append(Link("lm_head.weight", "lm_head.weight"))
        attn, sparse = self.split_pattern(cfg)
        for i, (is_attn, is_sparse) in enumerate(zip(attn, sparse, strict=True)):
            hf, a, f = f"model.layers.{i}", f"layers.{2 * i}", f"layers.{2 * i + 1}"
            links.append(Link(f"{a}.norm.weight", f"{hf}.input_layernorm.weight"))
            links.append(Link(f"{f}.norm.weight", f"{hf}.pre_ff_layernorm.weight"))
            if is_attn:
                links += attention_links(f"{a}.mixer", f"{hf}.self_attn", cfg.attention)
            else:
                links += mamba1_links(f"{a}.mixer", f"{hf}.mamba", cfg.mamba1)
            if is_sparse:
                moe = cfg.moe
                links.append(Link(f"{f}.mixer.router.weight", f"{hf}.feed_forward.router.weight"))
                links += expert_links(f"{f}.mixer", f"{hf}.feed_forward", moe.n_experts, moe.d_ff,
                                      fused_experts, {"gate": "gate_proj", "up": "up_proj",
                                                      "down": "down_proj"})
            else:
                links += gated_mlp_links(f"{f}.mixer", f"{hf}.feed_forward", False)
        return links
