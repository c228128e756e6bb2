"""Gemma 3 text (``Gemma3ForCausalLM``, ``model_type: gemma3_text``): local sliding-window and
global attention layers, each with a sandwich-normed GeGLU MLP.

Checked against transformers 5.24 ``modeling_gemma3`` / ``configuration_gemma3``. Each HF layer
``L`` is two of ours: ``2L`` is attention, ``W`` for ``layer_types[L] == "sliding_attention"``
and ``*`` for ``"full_attention"`` (``self_attn.{q,k,v,o}_proj``, per-head ``q_norm`` /
``k_norm``), norms ``input_layernorm`` (our ``norm``) and ``post_attention_layernorm`` (our
``out_norm``); ``2L + 1`` is the MLP ``-`` (``mlp.{gate,up,down}_proj``), norms
``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` (``sandwich_norm``). The final norm
is ``model.norm``; the head is tied by default.

What decides the numbers:
- Every RMSNorm scales by ``1 + w`` in fp32 and casts at the end (``norm_zero_centered``); ``w``
  is stored as HF stores it, so conversion copies bytes.
- The embedding is multiplied by ``sqrt(hidden_size)`` rounded to the embedding's dtype
  (``embedding_multiplier_in_dtype``: 55.4256 becomes 55.5 in bf16, as transformers does).
- Scores are scaled by ``query_pre_attn_scalar ** -0.5`` (``attention.softmax_scale``), not by
  the head width; ``head_dim`` is its own field (256 by default, not ``hidden_size / heads``).
- ``layer_types`` wins; without it ``sliding_window_pattern`` (default 6) makes every 6th layer
  global. ``sliding_window`` is ``attention.window`` (a query sees itself and ``window - 1``
  before it, as transformers' mask).
- RoPE: ``rope_parameters`` per layer type (transformers 5) or the Hub's ``rope_theta`` /
  ``rope_scaling`` (global layers, e.g. ``linear`` factor 8 for 4B and up) and
  ``rope_local_base_freq`` (local layers, never scaled: ``attention.window_rope_theta``).
- The MLP's ``hidden_activation`` is ``gelu_pytorch_tanh`` (our gated ``geglu_tanh``).
- Refused: ``final_logit_softcapping`` / ``attn_logit_softcapping`` (Gemma 2's; Gemma 3 sets
  neither), ``use_bidirectional_attention`` (EmbeddingGemma), a scaled local RoPE.

The 4B, 12B and 27B checkpoints are ``Gemma3ForConditionalGeneration`` (a SigLIP tower and this
decoder as ``text_config``, weights under ``model.language_model.``): the presets are their text
decoders; this adapter reads and writes the text-only checkpoints.
"""

from __future__ import annotations

from typing import Any

from composer.config import AttentionConfig, ConfigError, MLPConfig, ModelConfig, d_head_of
from composer.convert.base import (
    GATED_TO_HF_ACT,
    Adapter,
    attention_links,
    common_to_hf,
    gated_activation,
    gated_mlp_links,
    layer_pattern_error,
    require,
    rope_scaling_from_hf,
    rope_scaling_to_hf,
)
from composer.convert.plan import Link

SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}


def layer_types_of(hf: dict[str, Any]) -> list[str]:
    """``layer_types``, or every ``sliding_window_pattern``-th layer global (transformers'
    rule for the Hub's older configs)."""
    n = require(hf, "num_hidden_layers")
    if hf.get("layer_types") is not None:
        types = list(hf["layer_types"])
        if len(types) != n or set(types) - {SLIDING, FULL}:
            raise ConfigError(f"config.json: layer_types must be {n} of {SLIDING!r} / {FULL!r}")
        return types
    every = hf.get("sliding_window_pattern", 6) or 6
    return [SLIDING if (i + 1) % every else FULL for i in range(n)]


def rope_by_type(hf: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The RoPE parameters of each layer type, from either config form."""
    params = hf.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        out = {t: dict(params.get(t) or {"rope_type": "default"}) for t in (FULL, SLIDING)}
    else:
        full = {**(hf.get("rope_scaling") or {}), **params}
        if "type" in full and "rope_type" not in full:
            full["rope_type"] = full.pop("type")
        full.setdefault("rope_type", "default")
        if hf.get("rope_theta") is not None:
            full.setdefault("rope_theta", hf["rope_theta"])
        local = {"rope_type": "default"}
        if hf.get("rope_local_base_freq") is not None:
            local["rope_theta"] = hf["rope_local_base_freq"]
        out = {FULL: full, SLIDING: local}
    for t in (FULL, SLIDING):
        out[t].setdefault("rope_theta", DEFAULT_THETA[t])
    return out


def _scalar(value: float) -> float | int:
    """``query_pre_attn_scalar`` back from its ``** -0.5``: the integer it was, when it was."""
    return round(value) if abs(value - round(value)) < 1e-6 else value


class Gemma3Adapter(Adapter):
    family = "gemma3"
    symbols = "W*-"
    max_positions = 131072
    architectures = ("Gemma3ForCausalLM",)
    model_type = "gemma3_text"

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        if hf.get("text_config") is not None:
            raise ConfigError("config.json: a Gemma3ForConditionalGeneration checkpoint (vision "
                              "tower + text_config); only the text decoder (Gemma3ForCausalLM) "
                              "converts")
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if hf.get(key) is not None:
                raise ConfigError(f"config.json: {key}={hf[key]} (logit soft-capping) is not "
                                  "supported")
        if hf.get("use_bidirectional_attention"):
            raise ConfigError("config.json: use_bidirectional_attention (EmbeddingGemma) is not "
                              "supported")
        types = layer_types_of(hf)
        rope = rope_by_type(hf)
        if rope[SLIDING].get("rope_type", "default") != "default":
            raise ConfigError("config.json: the sliding layers' RoPE must be unscaled (rope_type "
                              f"{rope[SLIDING]['rope_type']!r})")
        d_model, n_heads = require(hf, "hidden_size"), require(hf, "num_attention_heads")
        bias = bool(hf.get("attention_bias", False))
        attention = AttentionConfig(
            n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            d_head=hf.get("head_dim") or 256, rope_theta=float(rope[FULL]["rope_theta"]),
            rope_scaling=rope_scaling_from_hf(rope[FULL]), qk_norm=True, qkv_bias=bias,
            out_bias=bias, softmax_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
            window=int(hf.get("sliding_window") or 4096),
            window_rope_theta=float(rope[SLIDING]["rope_theta"]))
        return ModelConfig(
            pattern="".join("W-" if t == SLIDING else "*-" for t in types),
            d_model=d_model, vocab_size=require(hf, "vocab_size"),
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            init_std=float(hf.get("initializer_range", 0.02)),
            embedding_multiplier=d_model**0.5, embedding_multiplier_in_dtype=True,
            norm_zero_centered=True, sandwich_norm=True, attention=attention,
            mlp=MLPConfig(d_ff=require(hf, "intermediate_size"), activation=gated_activation(
                hf.get("hidden_activation", "gelu_pytorch_tanh"), "hidden_activation")),
            mamba=None, moe=None)

    def layer_types(self, cfg: ModelConfig) -> list[str]:
        layers = cfg.parsed.layers
        pairs = [layers[i:i + 2] for i in range(0, len(layers), 2)]
        if len(layers) % 2 or any(p not in ("W-", "*-") for p in pairs):
            raise layer_pattern_error(self.family, cfg.pattern, "every layer must be 'W-' or '*-'")
        return [SLIDING if p == "W-" else FULL for p in pairs]

    def config_to_hf(self, cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
        types = self.layer_types(cfg)
        self._check(cfg)
        a, mlp = cfg.attention, cfg.mlp
        out = common_to_hf(cfg, base, self.architectures[0], self.model_type)
        scale = a.softmax_scale if a.softmax_scale is not None else d_head_of(cfg) ** -0.5
        local_theta = a.window_rope_theta if a.window_rope_theta is not None else a.rope_theta
        out.update(num_hidden_layers=len(types), layer_types=types, rms_norm_eps=cfg.norm_eps,
                   num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads or a.n_heads,
                   head_dim=d_head_of(cfg), attention_bias=a.qkv_bias,
                   query_pre_attn_scalar=_scalar(scale**-2), sliding_window=a.window,
                   intermediate_size=mlp.d_ff, hidden_activation=GATED_TO_HF_ACT[mlp.activation],
                   rope_parameters={
                       FULL: {"rope_theta": a.rope_theta, **rope_scaling_to_hf(a.rope_scaling)},
                       SLIDING: {"rope_type": "default", "rope_theta": local_theta}})
        for key in ("rope_theta", "rope_scaling", "rope_local_base_freq", "sliding_window_pattern",
                    "dtype", "torch_dtype"):
            out.pop(key, None)
        return out

    def _check(self, cfg: ModelConfig) -> None:
        a, mlp = cfg.attention, cfg.mlp
        checks = [
            ("norm_zero_centered=true", cfg.norm_zero_centered),
            ("sandwich_norm=true", cfg.sandwich_norm),
            (f"embedding_multiplier={cfg.d_model**0.5} (sqrt(d_model))",
             cfg.embedding_multiplier == cfg.d_model**0.5),
            ("embedding_multiplier_in_dtype=true", cfg.embedding_multiplier_in_dtype),
            ("residual_multiplier=1.0", cfg.residual_multiplier == 1.0),
            ("logits_scaling=1.0", cfg.logits_scaling == 1.0),
            ("mlp.activation gated", mlp is not None and mlp.activation in GATED_TO_HF_ACT),
            ("mlp.bias=false", mlp is not None and not mlp.bias),
            ("attention.qk_norm=true", a.qk_norm),
            ("attention.qk_norm_scope='head'", a.qk_norm_scope == "head"),
            ("attention.position='rope'", a.position == "rope"),
            ("attention.rotary_fraction=1.0", a.rotary_fraction == 1.0),
            ("attention.qkv_bias == attention.out_bias", a.qkv_bias == a.out_bias),
            ("attention.output_gate=false", not a.output_gate),
            ("attention.sinks=false", not a.sinks),
            ("attention.mrope_section=null", a.mrope_section is None),
            ("attention.window set", a.window is not None),
            ("attention.window_rope_theta set, or rope_scaling=null",
             a.window_rope_theta is not None or a.rope_scaling is None)]
        problems = [what for what, ok in checks if not ok]
        if problems:
            raise ConfigError(f"Gemma 3 cannot express this model; it needs {', '.join(problems)}")

    # ---- tensors
    def links(self, cfg: ModelConfig, fused_experts: bool) -> list[Link]:
        links = [Link("embed.weight", "model.embed_tokens.weight"),
                 Link("final_norm.weight", "model.norm.weight")]
        if not cfg.tie_embeddings:
            links.append(Link("lm_head.weight", "lm_head.weight"))
        for i in range(len(self.layer_types(cfg))):
            hf, a, m = f"model.layers.{i}", f"layers.{2 * i}", f"layers.{2 * i + 1}"
            links += [Link(f"{a}.norm.weight", f"{hf}.input_layernorm.weight"),
                      Link(f"{a}.out_norm.weight", f"{hf}.post_attention_layernorm.weight"),
                      Link(f"{m}.norm.weight", f"{hf}.pre_feedforward_layernorm.weight"),
                      Link(f"{m}.out_norm.weight", f"{hf}.post_feedforward_layernorm.weight")]
            links += attention_links(f"{a}.mixer", f"{hf}.self_attn", cfg.attention)
            links += gated_mlp_links(f"{m}.mixer", f"{hf}.mlp", False)
        return links
