"""LFM2 (``Lfm2ForCausalLM``, Liquid AI): gated short convolutions and attention with per-head
qk-norm, every layer followed by a SwiGLU MLP.

Checked against transformers 5.24 ``modeling_lfm2`` / ``configuration_lfm2``. Each HF layer
``L`` is two of ours: ``2L`` is the mixer, ``C`` for ``layer_types[L] == "conv"``
(``conv.{in_proj,conv,out_proj}``) or ``*`` for ``"full_attention"`` (``self_attn.{q,k,v}_proj``,
``out_proj`` -> our ``o_proj``, ``q_layernorm`` / ``k_layernorm`` -> ``q_norm`` / ``k_norm``,
each over one head's channels), with norm ``operator_norm``; ``2L + 1`` is the MLP ``-``
(``feed_forward.w1`` / ``w3`` / ``w2`` -> gate / up / down), norm ``ffn_norm``. The final norm is
``model.embedding_norm``; the embeddings are tied by default. Every norm uses ``norm_eps``.

Config quirks that decide the mapping:
- ``block_ff_dim`` (the Hub's older name) wins over ``intermediate_size``, and ``tie_embedding``
  over ``tie_word_embeddings`` (``Lfm2Config.__post_init__`` pops them).
- The MLP width is not ``intermediate_size`` when ``block_auto_adjust_ff_dim`` (the default):
  transformers takes ``int(2 * I / 3)`` and, when ``block_ffn_dim_multiplier`` is not null,
  scales it and rounds it up to a multiple of ``block_multiple_of`` (:func:`mlp_width`; LFM2-1.2B:
  12288 -> 8192). Export keeps the source's fields when they give our width, else writes the
  width with the adjustment off.
- ``layer_types`` wins; without it ``full_attn_idxs`` names the attention layers, and without
  both every layer is attention. Export writes ``layer_types`` (and ``full_attn_idxs`` when the
  source has them).
- ``conv_bias`` puts a bias on ``in_proj``, the convolution and ``out_proj``; ``conv_L_cache``
  is the convolution's width. Attention has no biases; RoPE theta defaults to 1e6.
"""

from __future__ import annotations

from typing import Any

from composer.config import ConfigError, MLPConfig, ModelConfig, ShortConvConfig, d_head_of
from composer.convert.base import (
    Adapter,
    attention_from_hf,
    attention_to_hf,
    common_to_hf,
    layer_pattern_error,
    require,
)
from composer.convert.mamba_common import check_plain
from composer.convert.plan import Link

CONV, FULL = "conv", "full_attention"
SYMBOL = {CONV: "C", FULL: "*"}

# Lfm2Config (transformers 5.24) defaults: a field missing from config.json means these.
DEFAULTS: dict[str, Any] = dict(
    vocab_size=65536, hidden_size=2560, intermediate_size=12288, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, initializer_range=0.02, norm_eps=1e-5,
    tie_word_embeddings=True, conv_bias=False, conv_L_cache=3, block_multiple_of=256,
    block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True)
ROPE_THETA = 1e6
"""``Lfm2Config.default_theta``."""


def with_defaults(hf: dict[str, Any]) -> dict[str, Any]:
    """``hf`` as transformers reads it: defaults filled, the older aliases winning."""
    h = {**DEFAULTS, **{k: v for k, v in hf.items() if v is not None or k ==
                        "block_ffn_dim_multiplier"}}
    if hf.get("block_ff_dim") is not None:
        h["intermediate_size"] = hf["block_ff_dim"]
    if hf.get("tie_embedding") is not None:
        h["tie_word_embeddings"] = hf["tie_embedding"]
    return h


def mlp_width(h: dict[str, Any]) -> int:
    """The MLP width ``Lfm2MLP`` builds from the (defaulted) config ``h``."""
    width = int(h["intermediate_size"])
    if h["block_auto_adjust_ff_dim"]:
        width = int(2 * width / 3)
        if h["block_ffn_dim_multiplier"] is not None:
            width = int(h["block_ffn_dim_multiplier"] * width)
            multiple = int(h["block_multiple_of"])
            width = multiple * ((width + multiple - 1) // multiple)
    return width


def layer_types_of(h: dict[str, Any]) -> list[str]:
    n = require(h, "num_hidden_layers")
    types = h.get("layer_types")
    if types is None:
        attn = h.get("full_attn_idxs")
        attn = range(n) if attn is None else attn
        types = [FULL if i in attn else CONV for i in range(n)]
    if not isinstance(types, list) or len(types) != n or not set(types) <= set(SYMBOL):
        raise ConfigError(f"config.json: layer_types must list {n} entries of {CONV!r} / "
                          f"{FULL!r}, got {types!r}")
    return types


class Lfm2Adapter(Adapter):
    family = "lfm2"
    symbols = "C*-"
    max_positions = 128000
    architectures = ("Lfm2ForCausalLM",)
    model_type = "lfm2"

    # ---- config
    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        h = with_defaults(hf)
        types = layer_types_of(h)
        if h.get("attention_bias"):
            raise ConfigError("config.json: attention_bias=true, but transformers' "
                              "Lfm2Attention has no biases")
        attention = attention_from_hf({**h, "attention_bias": False}, qk_norm=True,
                                      default_theta=ROPE_THETA)
        if attention.rotary_fraction != 1.0:
            raise ConfigError("config.json: partial_rotary_factor is not supported by LFM2's "
                              "attention (it rotates whole heads)")
        return ModelConfig(
            pattern="".join(SYMBOL[t] + "-" for t in types),
            d_model=require(h, "hidden_size"), vocab_size=require(h, "vocab_size"),
            tie_embeddings=bool(h["tie_word_embeddings"]), norm_eps=float(h["norm_eps"]),
            init_std=float(h["initializer_range"]), attention=attention, mamba=None,
            mlp=MLPConfig(d_ff=mlp_width(h), activation="swiglu"), moe=None,
            shortconv=ShortConvConfig(d_conv=int(h["conv_L_cache"]), bias=bool(h["conv_bias"])))

    def layer_types(self, cfg: ModelConfig) -> list[str]:
        """Per HF layer, its type; raises unless the pattern is ``(C-|*-)*``."""
        layers = cfg.parsed.layers
        pairs = [layers[i:i + 2] for i in range(0, len(layers), 2)]
        if len(layers) % 2 or any(p not in ("C-", "*-") for p in pairs) or cfg.parsed.mtp:
            raise layer_pattern_error(self.family, cfg.pattern,
                                      "every layer must be 'C-' (short convolution) or '*-'")
        return [CONV if p == "C-" else FULL for p in pairs]

    def config_to_hf(self, cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
        types = self.layer_types(cfg)
        check_plain(cfg, self.family)
        self._check(cfg, types)
        out = common_to_hf(cfg, base, self.architectures[0], self.model_type)
        if base.get("tie_embedding") is not None:  # it would win over tie_word_embeddings
            out["tie_embedding"] = cfg.tie_embeddings
        out.update(num_hidden_layers=len(types), layer_types=types, norm_eps=cfg.norm_eps)
        if base.get("full_attn_idxs") is not None:
            out["full_attn_idxs"] = [i for i, t in enumerate(types) if t == FULL]
        self._attention_to_hf(cfg, base, out)
        self._mlp_to_hf(cfg, base, out)
        if cfg.shortconv is not None:
            out.update(conv_L_cache=cfg.shortconv.d_conv, conv_bias=cfg.shortconv.bias)
        for key in ("dtype", "torch_dtype"):
            out.pop(key, None)
        return out

    def _check(self, cfg: ModelConfig, types: list[str]) -> None:
        a, mlp = cfg.attention, cfg.mlp
        problems = [what for what, ok in (
            ("mlp.activation='swiglu'", mlp.activation == "swiglu"), ("mlp.bias=false",
                                                                      not mlp.bias),
            ("norm_zero_centered=false", not cfg.norm_zero_centered),
            ("post_norm_layers=[]", not cfg.post_norm_layers)) if not ok]
        if FULL in types:
            problems += [what for what, ok in (
                ("attention.qk_norm=true", a.qk_norm),
                ("attention.qk_norm_scope='head'", a.qk_norm_scope == "head"),
                ("attention.position='rope'", a.position == "rope"),
                ("attention.rotary_fraction=1.0", a.rotary_fraction == 1.0),
                ("attention.qkv_bias=false", not a.qkv_bias),
                ("attention.out_bias=false", not a.out_bias),
                ("attention.softmax_scale=null", a.softmax_scale is None),
                ("attention.output_gate=false", not a.output_gate),
                ("attention.mrope_section=null", a.mrope_section is None)) if not ok]
        if problems:
            raise ConfigError(f"LFM2 cannot express this model; it needs {', '.join(problems)}")

    def _attention_to_hf(self, cfg: ModelConfig, base: dict[str, Any],
                         out: dict[str, Any]) -> None:
        attention_to_hf(cfg, out)
        if "attention_bias" not in base:  # not an Lfm2Config field (no biases)
            out.pop("attention_bias", None)
        if d_head_of(cfg) == cfg.d_model // cfg.attention.n_heads and not base.get("head_dim"):
            out.pop("head_dim", None)  # transformers derives it; keep the source's form

    def _mlp_to_hf(self, cfg: ModelConfig, base: dict[str, Any], out: dict[str, Any]) -> None:
        """The source's width fields when they give our width (their ``block_ff_dim`` alias
        too), else the width itself with the adjustment off."""
        d_ff = cfg.mlp.d_ff
        if base and mlp_width(with_defaults(base)) == d_ff:
            return
        out.update(intermediate_size=d_ff, block_auto_adjust_ff_dim=False)
        if "block_ff_dim" in base:
            out["block_ff_dim"] = d_ff

    # ---- tensors
    def links(self, cfg: ModelConfig, fused_experts: bool) -> list[Link]:
        links = [Link("embed.weight", "model.embed_tokens.weight"),
                 Link("final_norm.weight", "model.embedding_norm.weight")]
        if not cfg.tie_embeddings:
            links.append(Link("lm_head.weight", "lm_head.weight"))
        for i, kind in enumerate(self.layer_types(cfg)):
            hf, a, m = f"model.layers.{i}", f"layers.{2 * i}", f"layers.{2 * i + 1}"
            links += [Link(f"{a}.norm.weight", f"{hf}.operator_norm.weight"),
                      Link(f"{m}.norm.weight", f"{hf}.ffn_norm.weight")]
            if kind == CONV:
                links += shortconv_links(f"{a}.mixer", f"{hf}.conv", cfg.shortconv)
            else:
                links += attention_links(f"{a}.mixer", f"{hf}.self_attn")
            links += [Link(f"{m}.mixer.{ours}.weight", f"{hf}.feed_forward.{theirs}.weight")
                      for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"),
                                           ("down_proj", "w2"))]
        return links


def shortconv_links(ours: str, hf: str, s: ShortConvConfig) -> list[Link]:
    """``in_proj`` (rows ``[B; C; x]``, ours ``[b; c; u]``), ``conv`` (our ``conv1d``) and
    ``out_proj``, with their biases under ``conv_bias``."""
    names = [("in_proj", "in_proj"), ("conv1d", "conv"), ("out_proj", "out_proj")]
    kinds = ("weight", "bias") if s.bias else ("weight",)
    return [Link(f"{ours}.{a}.{k}", f"{hf}.{b}.{k}") for a, b in names for k in kinds]


def attention_links(ours: str, hf: str) -> list[Link]:
    names = [("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"),
             ("o_proj", "out_proj"), ("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")]
    return [Link(f"{ours}.{a}.weight", f"{hf}.{b}.weight") for a, b in names]
