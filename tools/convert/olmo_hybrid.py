"""OLMo-Hybrid (``OlmoHybridForCausalLM``, Ai2): gated delta net layers interleaved with post-norm
attention layers, every layer followed by a SwiGLU MLP.

Checked against transformers 5.24 ``modeling_olmo_hybrid``. Each HF layer ``L`` is two of ours:

- ``linear_attention``: pre-norm, as Llama. ``2L`` is ``G`` (norm ``input_layernorm``, mixer
  ``linear_attn``), ``2L + 1`` is ``-`` (norm ``post_attention_layernorm``); names in memory.
- ``full_attention``: post-norm, as OLMo 2 / OLMo 3: ``h = x + post_attention_layernorm(attn(x))``,
  ``h + post_feedforward_layernorm(mlp(h))``. ``2L`` is ``*``, ``2L + 1`` is ``-``, and both
  indices are in ``post_norm_layers``.

Attention: q/k/v/o with one ``attention_bias``; qk-norm over the whole q / k projection before
RoPE (``attention.qk_norm_scope: all``, weights ``n_heads * d_head`` and ``n_kv_heads * d_head``
wide, eps ``rms_norm_eps``); full rotate-half RoPE, or none (``attention.position: none``) when
``rope_parameters`` says ``"rope_theta": null`` (see :func:`is_nope`).

Tensor names are the Hub's (the OLMo-core names that transformers renames on load and back on
save): the GDN layers' norms are ``attention_layer_norm`` / ``feedforward_layer_norm``, and so is
the attention layers' ``post_attention_layernorm`` (``feedforward_layer_norm`` on disk, beside
``post_feedforward_layernorm``); the convolution is stored per input, ``q_conv1d`` / ``k_conv1d``
/ ``v_conv1d`` of ``QK``, ``QK`` and ``VV`` rows. transformers 5.24's ``save_pretrained`` splits
the fused conv back into ``torch.chunk(conv, 3)`` parts (``Chunk``, the reverse of its
``Concatenate``), which differs from the Hub whenever ``QK != VV``; only the concatenation
matters to transformers, so any three parts that tile the ``2 QK + VV`` rows in order are read
(:meth:`OlmoHybridAdapter.source_layout`), and the export splits as the source did (the Hub's
way for a model built here). Every width is transformers': ``QK = linear_num_key_heads *
linear_key_head_dim``, ``VV = linear_num_value_heads * linear_value_head_dim``.

Gated delta net (:mod:`composer.blocks.gdn` has the math): separate ``q/k/v/a/b_proj``,
``g_proj`` (our ``z_proj``), ``o_norm`` (our ``norm``, eps fixed at 1e-5 in transformers),
``o_proj``; conv without bias, activated by ``hidden_act`` (so silu only); beta doubled when
``linear_allow_neg_eigval`` (default true). Missing head sizes follow ``OlmoHybridConfig``:
``linear_num_*_heads = num_attention_heads``, ``linear_key_head_dim = int(0.75 * hidden_size /
linear_num_key_heads)``, ``linear_value_head_dim = 2 * linear_key_head_dim``.
"""

from __future__ import annotations

from typing import Any

from composer.config import ConfigError, GDNConfig, MLPConfig, ModelConfig, d_head_of
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
from composer.convert.plan import Link

LINEAR, FULL = "linear_attention", "full_attention"
GDN_NORM_EPS = 1e-5
"""transformers' ``OlmoHybridGatedDeltaNet.o_norm`` epsilon (fla's FusedRMSNormGated default)."""

# OlmoHybridConfig (transformers 5.24) defaults for the fields that change the math or the init.
DEFAULTS: dict[str, Any] = dict(
    hidden_act="silu", rms_norm_eps=1e-6, attention_bias=False, tie_word_embeddings=False,
    initializer_range=0.02, linear_conv_kernel_dim=4, linear_allow_neg_eigval=True,
    linear_a_log_min=0.0, linear_a_log_max=16.0, linear_dt_min=0.001, linear_dt_max=0.1,
    linear_dt_init_floor=1e-4)


def default_layer_types(n_layers: int) -> list[str]:
    """``OlmoHybridConfig``'s default: every fourth layer attention, at least the last one."""
    types = [FULL if i % 4 == 3 else LINEAR for i in range(n_layers)]
    if FULL not in types:
        types[-1] = FULL
    return types


def _with_defaults(hf: dict[str, Any]) -> dict[str, Any]:
    h = {**DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    n_heads = require(h, "num_attention_heads")
    h.setdefault("linear_num_key_heads", n_heads)
    h.setdefault("linear_num_value_heads", n_heads)
    h.setdefault("linear_key_head_dim",
                 int(0.75 * require(h, "hidden_size") / h["linear_num_key_heads"]))
    h.setdefault("linear_value_head_dim", 2 * h["linear_key_head_dim"])
    h.setdefault("layer_types", default_layer_types(require(h, "num_hidden_layers")))
    return h


def is_nope(hf: dict[str, Any]) -> bool:
    """No positional encoding: ``rope_parameters`` holds ``"rope_theta": null`` (the DPO
    release; transformers then builds no rotary embedding). A null ``rope_parameters`` is not
    NoPE: transformers re-creates the default RoPE (theta 1e4) on load."""
    params = hf.get("rope_parameters")
    return isinstance(params, dict) and "rope_theta" in params and params["rope_theta"] is None


def _a_init_range(h: dict[str, Any]) -> tuple[float, float] | None:
    """A is drawn uniform in ``[linear_a_log_min, linear_a_log_max]`` (then logged); ours must
    start above 0, so a 0 minimum (the default) keeps our default range."""
    lo, hi = float(h["linear_a_log_min"]), float(h["linear_a_log_max"])
    return (lo, hi) if 0 < lo <= hi else None


class OlmoHybridAdapter(Adapter):
    family = "olmo-hybrid"
    symbols = "G*-"
    max_positions = 65536
    architectures = ("OlmoHybridForCausalLM",)
    model_type = "olmo_hybrid"

    # ---- config
    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        h = _with_defaults(hf)
        types = list(h["layer_types"])
        if len(types) != h["num_hidden_layers"] or not set(types) <= {LINEAR, FULL}:
            raise ConfigError(f"config.json: layer_types must list {h['num_hidden_layers']} "
                              f"entries of {LINEAR!r} / {FULL!r}, got {types}")
        if h["hidden_act"] != "silu":
            raise ConfigError(f"config.json: hidden_act={h['hidden_act']!r} is not supported "
                              "(the OLMo-Hybrid conv and MLP use silu)")
        if is_nope(h):
            attention = attention_from_hf({**h, "rope_parameters": None}, qk_norm=True,
                                          position="none")
        else:
            attention = attention_from_hf(h, qk_norm=True)
        attention.qk_norm_scope = "all"
        if attention.rotary_fraction != 1.0:
            raise ConfigError("config.json: partial_rotary_factor is not supported by "
                              "OLMo-Hybrid's attention (it rotates whole heads)")
        gdn = GDNConfig(
            n_heads=h["linear_num_value_heads"], n_kv_heads=h["linear_num_key_heads"],
            d_head_k=h["linear_key_head_dim"], d_head_v=h["linear_value_head_dim"],
            d_conv=h["linear_conv_kernel_dim"], conv_bias=False, norm_eps=GDN_NORM_EPS,
            allow_neg_eigval=bool(h["linear_allow_neg_eigval"]),
            dt_min=float(h["linear_dt_min"]), dt_max=float(h["linear_dt_max"]),
            dt_init_floor=float(h["linear_dt_init_floor"]))
        if _a_init_range(h) is not None:
            gdn.a_init_range = _a_init_range(h)
        return ModelConfig(
            pattern="".join("G-" if t == LINEAR else "*-" for t in types),
            d_model=require(h, "hidden_size"),
            vocab_size=require(h, "vocab_size"),
            tie_embeddings=bool(h["tie_word_embeddings"]),
            norm_eps=float(h["rms_norm_eps"]),
            init_std=float(h["initializer_range"]),
            post_norm_layers=tuple(j for i, t in enumerate(types) if t == FULL
                                   for j in (2 * i, 2 * i + 1)),
            attention=attention, mamba=None,
            mlp=MLPConfig(d_ff=require(h, "intermediate_size"),
                          activation=gated_activation(h["hidden_act"])),
            moe=None, gdn=gdn)

    def layer_types(self, cfg: ModelConfig) -> list[str]:
        """Per HF layer, its type; raises unless the pattern is ``(G-|*-)*`` with exactly the
        attention layers post-norm."""
        layers = cfg.parsed.layers
        pairs = ["".join(layers[i:i + 2]) for i in range(0, len(layers), 2)]
        if len(layers) % 2 or any(p not in ("G-", "*-") for p in pairs) or cfg.parsed.mtp:
            raise layer_pattern_error(self.family, cfg.pattern,
                                      "every layer must be 'G-' (gated delta net) or '*-'")
        types = [LINEAR if p == "G-" else FULL for p in pairs]
        post = tuple(j for i, t in enumerate(types) if t == FULL for j in (2 * i, 2 * i + 1))
        if tuple(cfg.post_norm_layers) != post:
            raise ConfigError(f"OLMo-Hybrid's attention layers (and their MLPs) are post-norm and "
                              f"its gated delta net layers pre-norm: post_norm_layers must be "
                              f"{list(post)}, got {list(cfg.post_norm_layers)}")
        if FULL not in types or LINEAR not in types:
            raise layer_pattern_error(self.family, cfg.pattern, "transformers' OlmoHybridConfig "
                                      "needs at least one 'G-' and one '*-' layer")
        return types

    def config_to_hf(self, cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
        types = self.layer_types(cfg)
        a, d, mlp = cfg.attention, cfg.gdn, cfg.mlp
        problems = [what for what, ok in (
            ("attention.qk_norm=true", a.qk_norm), ("attention.qk_norm_scope='all'",
                                                    a.qk_norm_scope == "all"),
            ("attention.rotary_fraction=1.0", a.rotary_fraction == 1.0),
            ("attention.softmax_scale=null", a.softmax_scale is None),
            ("mlp.activation='swiglu'", mlp.activation == "swiglu"), ("mlp.bias=false",
                                                                      not mlp.bias),
            ("gdn.conv_bias=false", not d.conv_bias),
            (f"gdn.norm_eps={GDN_NORM_EPS}", d.norm_eps == GDN_NORM_EPS)) if not ok]
        if problems:
            raise ConfigError(f"OLMo-Hybrid cannot express this model; it needs "
                              f"{', '.join(problems)}")
        out = common_to_hf(cfg, base, self.architectures[0], self.model_type)
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # OlmoHybridConfig's
            out.setdefault(key, None)  # defaults are the 100k-vocab ids: none on a fresh export
        out.update(num_hidden_layers=len(types), layer_types=types, rms_norm_eps=cfg.norm_eps,
                   intermediate_size=mlp.d_ff, hidden_act="silu")
        attention_to_hf(cfg, out)
        if a.position == "none":  # the one form transformers keeps as NoPE (see is_nope)
            out["rope_parameters"] = base["rope_parameters"] if is_nope(base) else \
                {"rope_theta": None, "rope_type": "default"}
            out.pop("rope_theta", None)
        if d_head_of(cfg) == cfg.d_model // a.n_heads and not base.get("head_dim"):
            out.pop("head_dim", None)  # OlmoHybridConfig derives it; keep the source's form
        out.update(linear_num_key_heads=d.n_kv_heads or d.n_heads,
                   linear_num_value_heads=d.n_heads, linear_key_head_dim=d.d_head_k,
                   linear_value_head_dim=d.d_head_v, linear_conv_kernel_dim=d.d_conv,
                   linear_allow_neg_eigval=d.allow_neg_eigval, linear_dt_min=d.dt_min,
                   linear_dt_max=d.dt_max, linear_dt_init_floor=d.dt_init_floor)
        h_base = {**DEFAULTS, **{k: v for k, v in base.items() if v is not None}}
        if (_a_init_range(h_base) or GDNConfig().a_init_range) != d.a_init_range:
            out.update(linear_a_log_min=d.a_init_range[0], linear_a_log_max=d.a_init_range[1])
        for key in ("dtype", "torch_dtype", "mlp_bias"):
            out.pop(key, None)
        return out

    # ---- tensors
    def source_layout(self, cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]
                      ) -> dict[str, Any]:
        """The rows of ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` on disk when they are not the
        Hub's ``QK, QK, VV`` but still tile the ``2 QK + VV`` conv rows in order:
        transformers' ``save_pretrained`` writes ``torch.chunk(conv, 3)`` (equal thirds, the
        last one shorter), which its loader concatenates back."""
        types = self.layer_types(cfg)
        if LINEAR not in types:
            return {}
        stem = f"model.layers.{types.index(LINEAR)}.linear_attn"
        rows = [shapes.get(f"{stem}.{x}_conv1d.weight", (0,))[0] for x in "qkv"]
        qk, vv = _conv_widths(cfg.gdn)
        if rows == [qk, qk, vv] or min(rows) <= 0 or sum(rows) != 2 * qk + vv:
            return {}  # the Hub's split (or a file whose shape error names the tensor)
        return {"conv_rows": rows}

    def relink(self, links: list[Link], layout: dict[str, Any]) -> list[Link]:
        if "conv_rows" not in layout:
            return links
        a, b, c = layout["conv_rows"]
        rows = {"q": (0, a), "k": (a, a + b), "v": (a + b, a + b + c)}
        return [Link(link.ours, link.hf, (rows[link.hf.split(".")[-2][0]],), ())
                if link.hf.endswith(CONV_SUFFIXES) else link for link in links]

    def links(self, cfg: ModelConfig, fused_experts: bool) -> list[Link]:
        links = [Link("embed.weight", "model.embed_tokens.weight"),
                 Link("final_norm.weight", "model.norm.weight")]
        if not cfg.tie_embeddings:
            links.append(Link("lm_head.weight", "lm_head.weight"))
        for i, kind in enumerate(self.layer_types(cfg)):
            hf, a, m = f"model.layers.{i}", f"layers.{2 * i}", f"layers.{2 * i + 1}"
            if kind == LINEAR:
                links.append(Link(f"{a}.norm.weight", f"{hf}.attention_layer_norm.weight"))
                links.append(Link(f"{m}.norm.weight", f"{hf}.feedforward_layer_norm.weight"))
                links += gdn_links(f"{a}.mixer", f"{hf}.linear_attn", cfg.gdn)
            else:
                links.append(Link(f"{a}.norm.weight", f"{hf}.feedforward_layer_norm.weight"))
                links.append(Link(f"{m}.norm.weight", f"{hf}.post_feedforward_layernorm.weight"))
                links += attention_links(f"{a}.mixer", f"{hf}.self_attn", cfg.attention)
            links += gated_mlp_links(f"{m}.mixer", f"{hf}.mlp", False)
        return links


def gdn_links(ours: str, hf: str, d: GDNConfig) -> list[Link]:
    """OLMo-Hybrid's ``linear_attn`` tensors as the Hub stores them: our names, except
    ``g_proj`` -> ``z_proj``, ``o_norm`` -> ``norm``, and the convolution split per input
    (``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``, transformers concatenates them on load) where
    ours is one ``conv1d.weight`` with rows ``[q; k; v]``."""
    same = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "a_proj.weight", "b_proj.weight",
            "o_proj.weight", "A_log", "dt_bias"]
    qk, vv = _conv_widths(d)
    rows = {"q": (0, qk), "k": (qk, 2 * qk), "v": (2 * qk, 2 * qk + vv)}
    return [Link(f"{ours}.{n}", f"{hf}.{n}") for n in same] + [
        Link(f"{ours}.z_proj.weight", f"{hf}.g_proj.weight"),
        Link(f"{ours}.norm.weight", f"{hf}.o_norm.weight")] + [
        Link(f"{ours}.conv1d.weight", f"{hf}.{x}_conv1d.weight", (r,), ()) for x, r in rows.items()]


CONV_SUFFIXES = tuple(f"linear_attn.{x}_conv1d.weight" for x in "qkv")


def _conv_widths(d: GDNConfig) -> tuple[int, int]:
    """``(QK, VV)``: transformers' ``key_dim = linear_key_head_dim * linear_num_key_heads`` and
    ``value_dim = linear_value_head_dim * linear_num_value_heads``."""
    return (d.n_kv_heads or d.n_heads) * d.d_head_k, d.n_heads * d.d_head_v
