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

LFM2-MoE (``Lfm2MoeForCausalLM``, :class:`Lfm2MoeAdapter`): the same mixers; the first
``num_dense_layers`` MLPs are dense (``intermediate_size`` as it is: no width rule), the others
MoE (``E``): a sigmoid router ``feed_forward.gate`` choosing the top ``num_experts_per_tok`` with
the fp32 ``feed_forward.expert_bias`` (``use_expert_bias``; our ``router.score_bias``, for
choosing only), weights renormalised (``norm_topk_prob``) and scaled
(``routed_scaling_factor``); experts per expert on disk (``feed_forward.experts.{e}.w1/w3/w2``)
or fused as transformers holds them (``experts.gate_up_proj``, gate first, ``down_proj``). It
needs ``layer_types`` (its config builds none) and has no load-balancing loss. transformers
renormalises with ``sum + 1e-6``, ours with ``sum + 1e-20``: the weights differ by about
``1e-6 / sum`` relative (5e-7 for top-4 sigmoid scores), inside the parity bound.
"""

from __future__ import annotations

from typing import Any

from composer.config import (
    ConfigError,
    MLPConfig,
    ModelConfig,
    MoEConfig,
    ShortConvConfig,
    d_head_of,
)
from composer.convert.base import (
    Adapter,
    attention_from_hf,
    attention_to_hf,
    common_to_hf,
    layer_pattern_error,
    require,
)
from composer.convert.decoder import expert_links
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
    """``hf`` as transformers reads it: defaults filled, the older aliases winning. A null
    ``block_ffn_dim_multiplier`` stays null: ``Lfm2MLP`` then skips the scaling and rounding."""
    h = {**DEFAULTS, **{k: v for k, v in hf.items()
                        if v is not None or k == "block_ffn_dim_multiplier"}}
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
    ffn_symbols = "-"
    """What may follow a mixer in a layer (the MLP, or with LFM2-MoE the MoE too)."""

    # ---- config
    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        h = self.with_defaults(hf)
        types = self.hf_layer_types(h)
        if h.get("attention_bias"):
            raise ConfigError("config.json: attention_bias=true, but transformers' "
                              "Lfm2Attention has no biases")
        attention = attention_from_hf({**h, "attention_bias": False}, qk_norm=True,
                                      default_theta=ROPE_THETA)
        if attention.rotary_fraction != 1.0:
            raise ConfigError("config.json: partial_rotary_factor is not supported by LFM2's "
                              "attention (it rotates whole heads)")
        ffn, mlp, moe = self.ffn_from_hf(h, len(types))
        return ModelConfig(
            pattern="".join(SYMBOL[t] + f for t, f in zip(types, ffn, strict=True)),
            d_model=require(h, "hidden_size"), vocab_size=require(h, "vocab_size"),
            tie_embeddings=bool(h["tie_word_embeddings"]), norm_eps=float(h["norm_eps"]),
            init_std=float(h["initializer_range"]), attention=attention, mamba=None,
            mlp=mlp, moe=moe,
            shortconv=ShortConvConfig(d_conv=int(h["conv_L_cache"]), bias=bool(h["conv_bias"])))

    def with_defaults(self, hf: dict[str, Any]) -> dict[str, Any]:
        return with_defaults(hf)

    def hf_layer_types(self, h: dict[str, Any]) -> list[str]:
        return layer_types_of(h)

    def ffn_from_hf(self, h: dict[str, Any], n_layers: int
                    ) -> tuple[list[str], MLPConfig | None, MoEConfig | None]:
        """The symbol after each mixer, and the MLP / MoE sections."""
        return ["-"] * n_layers, MLPConfig(d_ff=mlp_width(h), activation="swiglu"), None

    def layer_kinds(self, cfg: ModelConfig) -> list[tuple[str, str]]:
        """Per HF layer, its type and its feed-forward symbol; raises unless each layer is a
        ``C`` or ``*`` followed by one of :attr:`ffn_symbols`."""
        layers = cfg.parsed.layers
        pairs = ["".join(layers[i:i + 2]) for i in range(0, len(layers), 2)]
        if (len(layers) % 2 or cfg.parsed.mtp
                or any(p[0] not in "C*" or p[1] not in self.ffn_symbols for p in pairs)):
            shapes = " or ".join(f"'{m}{f}'" for f in self.ffn_symbols for m in "C*")
            raise layer_pattern_error(self.family, cfg.pattern, f"every layer must be {shapes} "
                                      "(C: short convolution)")
        return [(CONV if p[0] == "C" else FULL, p[1]) for p in pairs]

    def config_to_hf(self, cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
        kinds = self.layer_kinds(cfg)
        types = [t for t, _ in kinds]
        check_plain(cfg, self.family)
        self._check(cfg, kinds)
        out = common_to_hf(cfg, base, self.architectures[0], self.model_type)
        if base.get("tie_embedding") is not None:  # it would win over tie_word_embeddings
            out["tie_embedding"] = cfg.tie_embeddings
        out.update(num_hidden_layers=len(types), layer_types=types, norm_eps=cfg.norm_eps)
        if base.get("full_attn_idxs") is not None:
            out["full_attn_idxs"] = [i for i, t in enumerate(types) if t == FULL]
        self._attention_to_hf(cfg, base, out)
        self.ffn_to_hf(cfg, [f for _, f in kinds], base, out)
        if cfg.shortconv is not None:
            out.update(conv_L_cache=cfg.shortconv.d_conv, conv_bias=cfg.shortconv.bias)
        for key in ("dtype", "torch_dtype"):
            out.pop(key, None)
        return out

    def _check(self, cfg: ModelConfig, kinds: list[tuple[str, str]]) -> None:
        a, mlp = cfg.attention, cfg.mlp
        checks = [("norm_zero_centered=false", not cfg.norm_zero_centered),
                  ("post_norm_layers=[]", not cfg.post_norm_layers)]
        if any(f == "-" for _, f in kinds):
            checks += [("mlp.activation='swiglu'", mlp.activation == "swiglu"),
                       ("mlp.bias=false", not mlp.bias)]
        if any(t == FULL for t, _ in kinds):
            checks += [
                ("attention.qk_norm=true", a.qk_norm),
                ("attention.qk_norm_scope='head'", a.qk_norm_scope == "head"),
                ("attention.position='rope'", a.position == "rope"),
                ("attention.rotary_fraction=1.0", a.rotary_fraction == 1.0),
                ("attention.qkv_bias=false", not a.qkv_bias),
                ("attention.out_bias=false", not a.out_bias),
                ("attention.softmax_scale=null", a.softmax_scale is None),
                ("attention.output_gate=false", not a.output_gate),
                ("attention.mrope_section=null", a.mrope_section is None)]
        problems = [what for what, ok in checks if not ok]
        if problems:
            name = "LFM2-MoE" if "E" in self.ffn_symbols else "LFM2"
            raise ConfigError(f"{name} cannot express this model; it needs {', '.join(problems)}")

    def _attention_to_hf(self, cfg: ModelConfig, base: dict[str, Any],
                         out: dict[str, Any]) -> None:
        attention_to_hf(cfg, out)
        if "attention_bias" not in base:  # not an Lfm2Config field (no biases)
            out.pop("attention_bias", None)
        if d_head_of(cfg) == cfg.d_model // cfg.attention.n_heads and not base.get("head_dim"):
            out.pop("head_dim", None)  # transformers derives it; keep the source's form

    def ffn_to_hf(self, cfg: ModelConfig, ffn: list[str], base: dict[str, Any],
                  out: dict[str, Any]) -> None:
        """The MLP width: the source's fields when they give ours (their ``block_ff_dim``
        alias too), else the width itself with the adjustment off."""
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
        for i, (kind, ffn) in enumerate(self.layer_kinds(cfg)):
            hf, a, m = f"model.layers.{i}", f"layers.{2 * i}", f"layers.{2 * i + 1}"
            links += [Link(f"{a}.norm.weight", f"{hf}.operator_norm.weight"),
                      Link(f"{m}.norm.weight", f"{hf}.ffn_norm.weight")]
            if kind == CONV:
                links += shortconv_links(f"{a}.mixer", f"{hf}.conv", cfg.shortconv)
            else:
                links += attention_links(f"{a}.mixer", f"{hf}.self_attn")
            if ffn == "-":
                links += [Link(f"{m}.mixer.{ours}.weight", f"{hf}.feed_forward.{theirs}.weight")
                          for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"),
                                               ("down_proj", "w2"))]
            else:
                links += moe_links(f"{m}.mixer", f"{hf}.feed_forward", cfg.moe, fused_experts)
        return links


# Lfm2MoeConfig (transformers 5.24) defaults.
MOE_DEFAULTS: dict[str, Any] = dict(
    vocab_size=65536, hidden_size=2048, intermediate_size=7168, moe_intermediate_size=1792,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, initializer_range=0.02,
    norm_eps=1e-5, tie_word_embeddings=True, conv_bias=False, conv_L_cache=3, num_dense_layers=2,
    num_experts_per_tok=4, num_experts=32, use_expert_bias=True, routed_scaling_factor=1.0,
    norm_topk_prob=True)


class Lfm2MoeAdapter(Lfm2Adapter):
    family = "lfm2-moe"
    symbols = "C*-E"
    architectures = ("Lfm2MoeForCausalLM",)
    model_type = "lfm2_moe"
    ffn_symbols = "-E"

    def with_defaults(self, hf: dict[str, Any]) -> dict[str, Any]:
        h = {**MOE_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
        if hf.get("tie_embedding") is not None:
            h["tie_word_embeddings"] = hf["tie_embedding"]
        return h

    def hf_layer_types(self, h: dict[str, Any]) -> list[str]:
        if h.get("layer_types") is None:
            raise ConfigError("config.json: missing field 'layer_types' (Lfm2MoeConfig builds "
                              "none from full_attn_idxs)")
        return layer_types_of(h)

    def ffn_from_hf(self, h: dict[str, Any], n_layers: int
                    ) -> tuple[list[str], MLPConfig | None, MoEConfig | None]:
        ffn = ["-" if i < int(h["num_dense_layers"]) else "E" for i in range(n_layers)]
        mlp = MLPConfig(d_ff=int(h["intermediate_size"]), activation="swiglu") \
            if "-" in ffn else None
        moe = MoEConfig(
            n_experts=int(h["num_experts"]), top_k=int(h["num_experts_per_tok"]),
            d_ff=int(h["moe_intermediate_size"]), activation="swiglu", score_func="sigmoid",
            renormalize=bool(h["norm_topk_prob"]),
            score_correction_bias=bool(h["use_expert_bias"]),
            routed_scaling_factor=float(h["routed_scaling_factor"]),
            # Not a transformers field (it computes no such loss); kept so that ours round-trips.
            aux_loss_coeff=float(h.get("router_aux_loss_coef") or 0.0)) if "E" in ffn else None
        return ffn, mlp, moe

    def ffn_to_hf(self, cfg: ModelConfig, ffn: list[str], base: dict[str, Any],
                  out: dict[str, Any]) -> None:
        dense = ffn.count("-")
        if ffn != ["-"] * dense + ["E"] * (len(ffn) - dense):
            raise layer_pattern_error(self.family, cfg.pattern, "its dense MLP layers come "
                                      "first (num_dense_layers), then the MoE ones")
        out["num_dense_layers"] = dense
        if dense:
            out["intermediate_size"] = cfg.mlp.d_ff
        if dense < len(ffn):
            self._moe_to_hf(cfg, out)

    def _moe_to_hf(self, cfg: ModelConfig, out: dict[str, Any]) -> None:
        e = cfg.moe
        problems = [what for what, ok in (
            ("moe.score_func='sigmoid'", e.score_func == "sigmoid"),
            ("moe.activation='swiglu'", e.activation == "swiglu"),
            ("moe.n_shared_experts=0", not e.n_shared_experts),
            ("moe.n_expert_groups=1", e.n_expert_groups == 1),
            ("moe.capacity_factor=null", e.capacity_factor is None)) if not ok]
        if problems:
            raise ConfigError(f"LFM2-MoE cannot express this model; it needs "
                              f"{', '.join(problems)}")
        out.update(num_experts=e.n_experts, num_experts_per_tok=e.top_k,
                   moe_intermediate_size=e.d_ff, norm_topk_prob=e.renormalize,
                   use_expert_bias=e.score_correction_bias,
                   routed_scaling_factor=e.routed_scaling_factor)
        if e.aux_loss_coeff or "router_aux_loss_coef" in out:
            out["router_aux_loss_coef"] = e.aux_loss_coeff


def moe_links(ours: str, hf: str, moe: MoEConfig, fused: bool) -> list[Link]:
    """Router ``gate`` (and ``expert_bias`` -> our ``router.score_bias``), experts ``w1`` /
    ``w3`` / ``w2`` per expert or fused."""
    links = [Link(f"{ours}.router.weight", f"{hf}.gate.weight")]
    if moe.score_correction_bias:
        links.append(Link(f"{ours}.router.score_bias", f"{hf}.expert_bias"))
    return links + expert_links(ours, hf, moe.n_experts, moe.d_ff, fused,
                                {"gate": "w1", "up": "w3", "down": "w2"})


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
