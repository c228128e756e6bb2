"""Falcon-H1 (``FalconH1ForCausalLM``, TII): every layer runs Mamba-2 and attention side by side
on the same normed input, sums them, then a SwiGLU MLP.

Checked against transformers 5.24 ``modeling_falcon_h1`` / ``configuration_falcon_h1``. Each HF
layer ``L`` is two of ours, ``[M*]-`` (docs/patterns.md "Parallel groups"): ``2L`` is the
parallel group, norm ``input_layernorm``, branch 0 the Mamba-2 mixer (``model.L.mamba.*`` ->
``layers.2L.mixer.0.*``) and branch 1 the attention (``model.L.self_attn.*`` ->
``layers.2L.mixer.1.*``); ``2L + 1`` is the MLP (``model.L.feed_forward.*``), norm
``pre_ff_layernorm``. Embeddings ``model.embed_tokens``, final norm ``model.final_layernorm``,
head ``lm_head`` (absent when tied).

The µP multipliers are carried as config numbers, none folded into a weight:
- ``ssm_in/out_multiplier`` and ``attention_in/out_multiplier`` -> the ``parallel`` section
  (``M`` and ``*``: the branch's input and output scale);
- ``ssm_multipliers`` (z, x, B, C, dt; transformers' non-persistent ``mup_vector``) ->
  ``mamba.multipliers``; ``key_multiplier`` -> ``attention.key_multiplier``;
  ``mlp_multipliers`` (gate, down) -> ``mlp.gate_multiplier`` / ``mlp.down_multiplier``;
- ``embedding_multiplier`` -> ``embedding_multiplier``; ``lm_head_multiplier`` ->
  ``logits_scaling = 1 / lm_head_multiplier`` (our logits are divided by it; the export writes
  the source's number back when it gives the same scaling, since ``1 / (1 / m)`` is not always
  ``m`` in floating point). Dividing instead of multiplying moves a logit by at most one ulp.

Config quirks that decide the mapping:
- The Mamba width is ``mamba_d_ssm`` (when null: ``mamba_expand * hidden_size``), ``mamba_d_head``
  "auto" is that width over ``mamba_n_heads``; the gated norm exists only with ``mamba_rms_norm``
  (else ``y * silu(z)``, no ``norm.weight``), per group of ``d_ssm / mamba_n_groups``, and with
  ``mamba_norm_before_gate`` it normalises before the gate. ``mamba_proj_bias`` is in_proj's bias,
  ``projectors_bias`` out_proj's, ``mamba_conv_bias`` the convolution's.
- ``hidden_act`` is the MLP's and the Mamba convolution's activation (ours: SiLU).
- Attention is Llama's: ``head_dim`` when given, RoPE from ``rope_parameters`` (or a top-level
  ``rope_theta``), ``attention_bias`` on q, k, v and o; ``mlp_bias`` on the MLP.
"""

from __future__ import annotations

from typing import Any

from composer.blocks.mamba2 import out_bias_of
from composer.config import (
    BranchScale,
    ConfigError,
    MambaConfig,
    MLPConfig,
    ModelConfig,
    ParallelConfig,
    d_head_of,
    d_inner_of,
)
from composer.convert.base import (
    Adapter,
    attention_from_hf,
    attention_links,
    attention_to_hf,
    common_to_hf,
    gated_mlp_links,
    layer_pattern_error,
    require,
)
from composer.convert.plan import Link

LAYER = "[M*]-"
# FalconH1Config (transformers 5.24) defaults: a field missing from config.json means these.
DEFAULTS: dict[str, Any] = dict(
    vocab_size=128000, tie_word_embeddings=False, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
    initializer_range=0.02, rms_norm_eps=1e-5, mamba_d_ssm=1024, mamba_n_heads=128,
    mamba_d_head="auto", mamba_n_groups=1, mamba_d_state=256, mamba_d_conv=4, mamba_expand=2,
    mamba_chunk_size=256, mamba_conv_bias=True, mamba_proj_bias=False,
    mamba_norm_before_gate=True, mamba_rms_norm=False, time_step_limit=(0.0, float("inf")),
    projectors_bias=False, lm_head_multiplier=1.0, embedding_multiplier=1.0,
    mlp_multipliers=[1.0, 1.0], key_multiplier=1.0, attention_out_multiplier=1.0,
    attention_in_multiplier=1.0, ssm_multipliers=[1.0] * 5, ssm_in_multiplier=1.0,
    ssm_out_multiplier=1.0, attention_bias=False, mlp_bias=False)
MAMBA_INIT = {"time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 1e-4}
"""Not FalconH1Config fields (transformers initialises dt_bias to 1); carried when present."""


def with_defaults(hf: dict[str, Any]) -> dict[str, Any]:
    """``hf`` as transformers reads it; a null ``mamba_d_ssm`` stays null (expand * width)."""
    return {**DEFAULTS, **{k: v for k, v in hf.items() if v is not None or k == "mamba_d_ssm"}}


def mamba_from_hf(h: dict[str, Any]) -> MambaConfig:
    d_model, n_heads = require(h, "hidden_size"), int(h["mamba_n_heads"])
    d_ssm = h["mamba_d_ssm"] if h["mamba_d_ssm"] is not None \
        else int(h["mamba_expand"] * d_model)
    d_head = d_ssm // n_heads if h["mamba_d_head"] in ("auto", None) else int(h["mamba_d_head"])
    if n_heads * d_head != d_ssm:
        raise ConfigError(f"config.json: mamba_n_heads * mamba_d_head ({n_heads} * {d_head}) "
                          f"must equal the Mamba width mamba_d_ssm ({d_ssm})")
    limit, mults = h["time_step_limit"], _floats(h, "ssm_multipliers", 5)
    return MambaConfig(
        n_heads=n_heads, d_head=d_head, n_groups=int(h["mamba_n_groups"]),
        d_state=int(h["mamba_d_state"]), d_conv=int(h["mamba_d_conv"]),
        chunk_size=int(h["mamba_chunk_size"]), conv_bias=bool(h["mamba_conv_bias"]),
        proj_bias=bool(h["mamba_proj_bias"]),
        out_proj_bias=None if h["projectors_bias"] == h["mamba_proj_bias"]
        else bool(h["projectors_bias"]),
        gated_norm=bool(h["mamba_rms_norm"]), norm_before_gate=bool(h["mamba_norm_before_gate"]),
        multipliers=None if mults == [1.0] * 5 else mults,
        dt_min=float(h.get("time_step_min", MAMBA_INIT["time_step_min"])),
        dt_max=float(h.get("time_step_max", MAMBA_INIT["time_step_max"])),
        dt_init_floor=float(h.get("time_step_floor", MAMBA_INIT["time_step_floor"])),
        dt_limit=(float(limit[0]), float(limit[1])))


def _floats(h: dict[str, Any], key: str, n: int) -> list[float]:
    values = h[key]
    if not isinstance(values, (list, tuple)) or len(values) != n:
        raise ConfigError(f"config.json: {key} must list {n} numbers, got {values!r}")
    return [float(v) for v in values]


class FalconH1Adapter(Adapter):
    family = "falcon-h1"
    symbols = "M*-"
    max_positions = 8192
    architectures = ("FalconH1ForCausalLM",)
    model_type = "falcon_h1"
    hf_keep_fp32 = ()

    # ---- config
    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        h = with_defaults(hf)
        if h["hidden_act"] not in ("silu", "swish"):
            raise ConfigError(f"config.json: hidden_act={h['hidden_act']!r} is not supported (it "
                              "is also the Mamba convolution's activation; ours is silu)")
        attention = attention_from_hf(h)
        attention.key_multiplier = float(h["key_multiplier"])
        gate_mult, down_mult = _floats(h, "mlp_multipliers", 2)
        branches = [BranchScale(s, float(h[f"{name}_in_multiplier"]),
                                float(h[f"{name}_out_multiplier"]))
                    for s, name in (("M", "ssm"), ("*", "attention"))]
        branches = [b for b in branches if (b.in_multiplier, b.out_multiplier) != (1.0, 1.0)]
        lm_head = float(h["lm_head_multiplier"])
        if lm_head <= 0:
            raise ConfigError(f"config.json: lm_head_multiplier must be positive, got {lm_head}")
        return ModelConfig(
            pattern=LAYER * int(require(h, "num_hidden_layers")),
            d_model=require(h, "hidden_size"), vocab_size=require(h, "vocab_size"),
            tie_embeddings=bool(h["tie_word_embeddings"]), norm_eps=float(h["rms_norm_eps"]),
            init_std=float(h["initializer_range"]),
            embedding_multiplier=float(h["embedding_multiplier"]), logits_scaling=1.0 / lm_head,
            attention=attention, mamba=mamba_from_hf(h), moe=None,
            mlp=MLPConfig(d_ff=int(h["intermediate_size"]), activation="swiglu",
                          bias=bool(h["mlp_bias"]), gate_multiplier=gate_mult,
                          down_multiplier=down_mult),
            parallel=ParallelConfig(branches=branches))

    def n_layers(self, cfg: ModelConfig) -> int:
        p = cfg.parsed
        n = len(p.layers) // 2
        shared = any(s is not None for s in p.shared)
        if p.mtp or shared or not n or p.layers != ("[M*]", "-") * n:
            raise layer_pattern_error(self.family, cfg.pattern, "every layer must be '[M*]-' "
                                      "(Mamba-2 and attention side by side, then an MLP)")
        return n

    def config_to_hf(self, cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
        n = self.n_layers(cfg)
        self._check(cfg)
        a, m, mlp = cfg.attention, cfg.mamba, cfg.mlp
        out = common_to_hf(cfg, base, self.architectures[0], self.model_type, mup=True)
        attention_to_hf(cfg, out)
        if a.rope_scaling is None and "rope_theta" in base and "rope_parameters" not in base:
            out.pop("rope_parameters")  # the source's form: a top-level theta
            out["rope_theta"] = a.rope_theta
        sec = cfg.section("parallel")
        (ssm_in, ssm_out), (attn_in, attn_out) = (
            sec.scales(s) if sec is not None else (1.0, 1.0) for s in "M*")
        lm_head = base.get("lm_head_multiplier")
        if lm_head is None or 1.0 / float(lm_head) != cfg.logits_scaling:
            lm_head = 1.0 / cfg.logits_scaling
        out.update(
            num_hidden_layers=n, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
            intermediate_size=mlp.d_ff, mlp_bias=mlp.bias,
            mlp_multipliers=[mlp.gate_multiplier, mlp.down_multiplier],
            key_multiplier=a.key_multiplier, embedding_multiplier=cfg.embedding_multiplier,
            lm_head_multiplier=lm_head, ssm_in_multiplier=ssm_in, ssm_out_multiplier=ssm_out,
            attention_in_multiplier=attn_in, attention_out_multiplier=attn_out,
            mamba_d_ssm=d_inner_of(m), mamba_n_heads=m.n_heads, mamba_d_head=m.d_head,
            mamba_n_groups=m.n_groups, mamba_d_state=m.d_state, mamba_d_conv=m.d_conv,
            mamba_chunk_size=m.chunk_size, mamba_conv_bias=m.conv_bias,
            mamba_proj_bias=m.proj_bias, projectors_bias=out_bias_of(m),
            mamba_rms_norm=m.gated_norm, mamba_norm_before_gate=m.norm_before_gate,
            ssm_multipliers=list(m.multipliers) if m.multipliers is not None else [1.0] * 5,
            time_step_limit=list(m.dt_limit))
        if "mamba_d_ssm" in base and base["mamba_d_ssm"] is None \
                and d_inner_of(m) == int(with_defaults(base)["mamba_expand"] * cfg.d_model):
            out["mamba_d_ssm"] = None  # the source's form: expand * hidden_size
        if d_head_of(cfg) == cfg.d_model // a.n_heads and not base.get("head_dim"):
            out.pop("head_dim", None)  # transformers derives it; keep the source's form
        for key, value in zip(MAMBA_INIT, (m.dt_min, m.dt_max, m.dt_init_floor), strict=True):
            if key in out or value != MAMBA_INIT[key]:
                out[key] = value
        for key in ("dtype", "torch_dtype"):
            out.pop(key, None)
        return out

    def _check(self, cfg: ModelConfig) -> None:
        a, m, mlp = cfg.attention, cfg.mamba, cfg.mlp
        d_inner = d_inner_of(m)
        checks = [
            ("residual_multiplier=1.0", cfg.residual_multiplier == 1.0),
            ("norm_zero_centered=false", not cfg.norm_zero_centered),
            ("post_norm_layers=[]", not cfg.post_norm_layers),
            ("mlp.activation='swiglu'", mlp.activation == "swiglu"),
            ("attention.position='rope'", a.position == "rope"),
            ("attention.rotary_fraction=1.0", a.rotary_fraction == 1.0),
            ("attention.qk_norm=false", not a.qk_norm),
            ("attention.softmax_scale=null", a.softmax_scale is None),
            ("attention.output_gate=false", not a.output_gate),
            ("attention.mrope_section=null", a.mrope_section is None),
            (f"mamba.norm_group_size=null (or {d_inner // m.n_groups})",
             m.norm_group_size in (None, d_inner // m.n_groups)),
            (f"mamba.a_init_range={list(MambaConfig().a_init_range)} (transformers initialises "
             "A_log as log(1..n_heads))", tuple(m.a_init_range) == MambaConfig().a_init_range)]
        problems = [what for what, ok in checks if not ok]
        if problems:
            raise ConfigError(f"Falcon-H1 cannot express this model; it needs "
                              f"{', '.join(problems)}")

    # ---- tensors
    def links(self, cfg: ModelConfig, fused_experts: bool) -> list[Link]:
        links = [Link("embed.weight", "model.embed_tokens.weight"),
                 Link("final_norm.weight", "model.final_layernorm.weight")]
        if not cfg.tie_embeddings:
            links.append(Link("lm_head.weight", "lm_head.weight"))
        for i in range(self.n_layers(cfg)):
            hf, g, f = f"model.layers.{i}", f"layers.{2 * i}", f"layers.{2 * i + 1}"
            links += [Link(f"{g}.norm.weight", f"{hf}.input_layernorm.weight"),
                      Link(f"{f}.norm.weight", f"{hf}.pre_ff_layernorm.weight")]
            links += mamba_links(f"{g}.mixer.0", f"{hf}.mamba", cfg.mamba)
            links += attention_links(f"{g}.mixer.1", f"{hf}.self_attn", cfg.attention)
            links += gated_mlp_links(f"{f}.mixer", f"{hf}.feed_forward", cfg.mlp.bias)
        return links


def mamba_links(ours: str, hf: str, m: MambaConfig) -> list[Link]:
    """The Mamba-2 tensors (same names both sides); ``norm.weight`` only with the gated norm,
    in_proj's and out_proj's biases each under its own flag."""
    names = ["in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "D", "out_proj.weight"]
    names += ["norm.weight"] * m.gated_norm + ["conv1d.bias"] * m.conv_bias
    names += ["in_proj.bias"] * m.proj_bias + ["out_proj.bias"] * out_bias_of(m)
    return [Link(f"{ours}.{n}", f"{hf}.{n}") for n in names]
