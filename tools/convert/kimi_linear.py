"""Kimi Linear (``KimiLinearForCausalLM``, Moonshot AI): Kimi delta attention and NoPE MLA,
every layer followed by a dense MLP or a DeepSeek-V3-style MoE.

Checked against transformers 5.24 ``modeling_kimi_linear`` / ``configuration_kimi_linear`` and
``conversion_mapping`` (``kimi_linear``). Each HF layer ``L`` is two of ours: ``2L`` the mixer,
``K`` (Kimi delta attention, :mod:`composer.blocks.kda`) for ``linear_attention`` or ``+`` (MLA
with ``mla.rope`` false) for ``full_attention``, norm ``input_layernorm``; ``2L + 1`` the MLP
``-`` or the MoE ``E``, norm ``post_attention_layernorm``.

Layer kinds, as ``KimiLinearConfig.__post_init__`` decides them: ``layer_types`` wins; else
``linear_attn_config``'s ``kda_layers`` / ``full_attn_layers`` (1-based); else every fourth layer
from index 4 is full attention. MLP kinds: ``mlp_layer_types`` wins, else the first
``first_k_dense_replace`` (default 1) are dense. transformers ignores ``moe_layer_freq``, so a
value other than 1 is refused, as is a tied head (``KimiLinearForCausalLM`` ties nothing,
whatever ``tie_word_embeddings`` says: it is read as untied and written back as it came), a
router other than ``sigmoid`` (``moe_router_activation_func``), and ``mla_use_nope`` false
(transformers' MLA never rotates).
The config's aliases are read both ways (``num_experts`` / ``num_local_experts``,
``num_experts_per_token`` / ``num_experts_per_tok``, ``num_shared_experts`` /
``n_shared_experts``, ``moe_renormalize`` / ``norm_topk_prob``, ``num_expert_group`` /
``n_group``); the export writes the published names.

Tensors (the Hub's layout, which ``save_pretrained`` writes): KDA under ``self_attn``:
``{q,k,v,b,o}_proj``, ``{q,k,v}_conv1d`` (our ``conv1d`` rows ``[q; k; v]``),
``f_a_proj`` / ``f_b_proj`` / ``dt_bias`` / ``A_log`` (``[1, 1, H, 1]``, ours ``[H]``: the same
bytes), ``g_a_proj`` / ``g_b_proj``, ``o_norm`` (our ``norm``). MLA: ``q_proj`` (or
``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``), ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
``kv_b_proj``, ``o_proj``, copied as they are: with no RoPE there is no row order to undo. The
dense MLP is ``mlp.{gate,up,down}_proj`` (``save_pretrained`` writes it under
``block_sparse_moe.``: read, recorded, and written back so); the MoE
``block_sparse_moe.gate.{weight, e_score_correction_bias}`` (our
``router.{weight,score_bias}``), ``shared_experts``, and ``experts.{e}.{w1,w3,w2}`` (gate, up,
down) or fused as transformers holds them
(``mlp.experts.gate_up_proj`` / ``down_proj``, also read).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from composer.config import ConfigError, KDAConfig, MLAConfig, MLPConfig, ModelConfig, MoEConfig
from composer.convert.base import (
    GATED_TO_HF_ACT,
    Adapter,
    common_to_hf,
    gated_activation,
    gated_mlp_links,
    layer_pattern_error,
    require,
)
from composer.convert.decoder import expert_links
from composer.convert.plan import Link

LINEAR, FULL = "linear_attention", "full_attention"
MLA_NORM_EPS = 1e-6  # KimiLinearRMSNorm's default: transformers builds the latent norms with it
ALIASES = {"num_experts": ("num_local_experts", "n_routed_experts"),
           "num_experts_per_token": ("num_experts_per_tok",),
           "num_shared_experts": ("n_shared_experts",), "moe_renormalize": ("norm_topk_prob",),
           "num_expert_group": ("n_group",)}
_MEMORY = re.compile(r"\.mlp\.(gate\.|shared_experts\.|experts\.)")
_DENSE_ON_DISK = re.compile(r"^model\.layers\.\d+\.block_sparse_moe\.(gate|up|down)_proj\.")
PUBLISHED = {"mla_use_nope": True, "moe_layer_freq": 1, "moe_router_activation_func": "sigmoid"}
"""Fields of the published config.json that transformers does not write: a fresh export writes
them, an export onto a source keeps the source's choice of writing them."""


def _get(hf: dict[str, Any], key: str, default: Any = None) -> Any:
    for k in (key, *ALIASES.get(key, ())):
        if hf.get(k) is not None:
            return hf[k]
    return default


def layer_types_of(hf: dict[str, Any], n: int) -> list[str]:
    lin = hf.get("linear_attn_config") or {}
    types = hf.get("layer_types")
    if types is None and "kda_layers" in lin and "full_attn_layers" in lin:
        types = [None] * n
        for i in lin["full_attn_layers"]:
            types[i - 1] = FULL
        for i in lin["kda_layers"]:
            types[i - 1] = LINEAR
    if types is None:
        types = [FULL if i and i % 4 == 0 else LINEAR for i in range(n)]
    if len(types) != n or set(types) - {LINEAR, FULL}:
        raise ConfigError(f"config.json: layer types must be {n} of '{LINEAR}' / '{FULL}', got "
                          f"{types}")
    return list(types)


def mlp_types_of(hf: dict[str, Any], n: int) -> list[str]:
    types = hf.get("mlp_layer_types")
    if types is None:
        k = int(hf.get("first_k_dense_replace", 1) or 0)
        types = ["dense" if i < k else "sparse" for i in range(n)]
    if len(types) != n or set(types) - {"dense", "sparse"}:
        raise ConfigError(f"config.json: mlp_layer_types must be {n} of 'dense' / 'sparse', got "
                          f"{types}")
    return list(types)


class KimiLinearAdapter(Adapter):
    family = "kimi-linear"
    symbols = "K+-E"
    max_positions = 1048576
    architectures = ("KimiLinearForCausalLM",)
    model_type = "kimi_linear"
    hf_keep_fp32 = ("gate.weight", "gate.e_score_correction_bias", "dt_bias")

    # ---- config
    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        n = require(hf, "num_hidden_layers")
        lin = hf.get("linear_attn_config") or {}
        extra = set(lin) - {"head_dim", "num_heads", "short_conv_kernel_size", "kda_layers",
                            "full_attn_layers"}
        refusals = [
            (hf.get("quantization_config"), "quantized checkpoints are not supported; "
                                             "dequantize to bf16 first"),
            (extra, f"linear_attn_config fields {sorted(extra)} are not read by transformers' "
                    "KimiLinear"),
            ((hf.get("moe_layer_freq") or 1) != 1, "moe_layer_freq other than 1 is not "
                                                   "supported (transformers ignores it)"),
            (hf.get("moe_router_activation_func", "sigmoid") != "sigmoid",
             "moe_router_activation_func must be 'sigmoid' (what transformers runs)"),
            (hf.get("mla_use_nope") is False, "mla_use_nope=false: transformers' KimiLinear "
                                              "MLA applies no RoPE"),
            (hf.get("attention_bias"), "attention_bias=true is not supported"),
            (hf.get("hidden_act", "silu") != "silu", "hidden_act must be 'silu' (the KDA "
                                                     "convolution's activation)"),
            (int(hf.get("num_nextn_predict_layers") or 0), "MTP layers are not built by "
                                                          "transformers' KimiLinear")]
        for bad, why in refusals:
            if bad:
                raise ConfigError(f"config.json: {why}")
        types, ffn = layer_types_of(hf, n), mlp_types_of(hf, n)
        eps = float(hf.get("rms_norm_eps", 1e-5))
        kda = KDAConfig(
            n_heads=int(lin.get("num_heads", hf.get("linear_num_heads", 32))),
            d_head=int(lin.get("head_dim", hf.get("linear_head_dim", 128))),
            d_conv=int(lin.get("short_conv_kernel_size", hf.get("linear_conv_kernel_dim", 4))),
            norm_eps=eps) if LINEAR in types else None
        mla = MLAConfig(
            n_heads=require(hf, "num_attention_heads"), q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=require(hf, "kv_lora_rank"), d_head_nope=require(hf, "qk_nope_head_dim"),
            d_head_rope=require(hf, "qk_rope_head_dim"), d_head_v=require(hf, "v_head_dim"),
            rope=False, norm_eps=MLA_NORM_EPS) if FULL in types else None
        mlp = MLPConfig(d_ff=require(hf, "intermediate_size"), activation="swiglu") \
            if "dense" in ffn else None
        return ModelConfig(
            pattern="".join(("K" if t == LINEAR else "+") + ("-" if f == "dense" else "E")
                            for t, f in zip(types, ffn, strict=True)),
            d_model=require(hf, "hidden_size"), vocab_size=require(hf, "vocab_size"),
            tie_embeddings=False, norm_eps=eps,  # transformers never ties (no tied keys)
            init_std=float(hf.get("initializer_range", 0.02)), attention=None, mamba=None,
            mlp=mlp, moe=self._moe_from_hf(hf) if "sparse" in ffn else None, mla=mla, kda=kda)

    def _moe_from_hf(self, hf: dict[str, Any]) -> MoEConfig:
        n_experts = int(_get(hf, "num_experts", 256))
        n_groups = int(_get(hf, "num_expert_group", 1))
        if n_experts // n_groups < 2:
            raise ConfigError(f"transformers' KimiLinear router scores each expert group by its "
                              f"top 2; {n_experts} experts in {n_groups} groups leave fewer")
        n_shared = int(_get(hf, "num_shared_experts", 1))
        if n_shared < 1:
            raise ConfigError("config.json: KimiLinear MoE layers need num_shared_experts >= 1")
        return MoEConfig(
            n_experts=n_experts, top_k=int(_get(hf, "num_experts_per_token", 8)),
            d_ff=require(hf, "moe_intermediate_size"),
            activation=gated_activation(hf.get("hidden_act", "silu")), n_shared_experts=n_shared,
            score_func="sigmoid", renormalize=bool(_get(hf, "moe_renormalize", True)),
            score_correction_bias=True,
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.446)),
            n_expert_groups=n_groups, topk_groups=int(hf.get("topk_group") or 1),
            aux_loss_coeff=float(hf.get("router_aux_loss_coef") or 0.0))

    def layer_kinds(self, cfg: ModelConfig) -> list[tuple[str, str]]:
        """Per HF layer ``(layer type, mlp type)``; the pattern must be pairs of ``K`` or ``+``
        and ``-`` or ``E``."""
        layers = cfg.parsed.layers
        pairs = [layers[i:i + 2] for i in range(0, len(layers), 2)]
        if (len(layers) % 2 or cfg.parsed.mtp
                or any(p[0] not in "K+" or p[1] not in "-E" for p in pairs)):
            raise layer_pattern_error(self.family, cfg.pattern, "every layer must be 'K' (Kimi "
                                      "delta attention) or '+' (MLA), then '-' or 'E'")
        return [(LINEAR if p[0] == "K" else FULL, "dense" if p[1] == "-" else "sparse")
                for p in pairs]

    def config_to_hf(self, cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
        kinds = self.layer_kinds(cfg)
        types, ffn = [t for t, _ in kinds], [f for _, f in kinds]
        self._check(cfg, types, ffn)
        out = common_to_hf(cfg, base, self.architectures[0], self.model_type)
        out["tie_word_embeddings"] = bool(base.get("tie_word_embeddings", False))  # not read
        for key in ("dtype", "torch_dtype", "num_local_experts", "num_experts_per_tok",
                    "n_shared_experts", "norm_topk_prob", "n_group"):
            out.pop(key, None)
        lin = dict(base.get("linear_attn_config") or {})
        lin.update(kda_layers=[i + 1 for i, t in enumerate(types) if t == LINEAR],
                   full_attn_layers=[i + 1 for i, t in enumerate(types) if t == FULL])
        k = ffn.index("sparse") if "sparse" in ffn else len(ffn)
        out.update(num_hidden_layers=len(kinds), rms_norm_eps=cfg.norm_eps, hidden_act="silu",
                   linear_attn_config=lin, first_k_dense_replace=k)
        out.update({key: v for key, v in PUBLISHED.items() if key in base or not base})
        if "pad_token_id" not in base:  # KimiLinearConfig's default 163839 needs its vocabulary
            out["pad_token_id"] = None
        if "layer_types" in base:  # it would win over linear_attn_config
            out["layer_types"] = types
        if "mlp_layer_types" in base or ffn != ["dense"] * k + ["sparse"] * (len(ffn) - k):
            out["mlp_layer_types"] = ffn
        if cfg.kda is not None:
            lin.update(num_heads=cfg.kda.n_heads, head_dim=cfg.kda.d_head,
                       short_conv_kernel_size=cfg.kda.d_conv)
            for key, value in (("linear_num_heads", cfg.kda.n_heads),
                               ("linear_head_dim", cfg.kda.d_head),
                               ("linear_conv_kernel_dim", cfg.kda.d_conv)):
                if key in base:
                    out[key] = value
        if cfg.mla is not None:
            m = cfg.mla
            out.update(num_attention_heads=m.n_heads, q_lora_rank=m.q_lora_rank,
                       kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.d_head_nope,
                       qk_rope_head_dim=m.d_head_rope, v_head_dim=m.d_head_v)
            out.setdefault("num_key_value_heads", m.n_heads)
        if "dense" in ffn:
            out["intermediate_size"] = cfg.mlp.d_ff
        if "sparse" in ffn:
            e = cfg.moe
            out.update(num_experts=e.n_experts, num_experts_per_token=e.top_k,
                       moe_intermediate_size=e.d_ff, num_shared_experts=e.n_shared_experts,
                       moe_renormalize=e.renormalize,
                       routed_scaling_factor=e.routed_scaling_factor,
                       num_expert_group=e.n_expert_groups, topk_group=e.topk_groups)
            if e.aux_loss_coeff or "router_aux_loss_coef" in out:
                out["router_aux_loss_coef"] = e.aux_loss_coeff
        return out

    def _check(self, cfg: ModelConfig, types: list[str], ffn: list[str]) -> None:
        checks = [("tie_embeddings=false (transformers never ties them)",
                   not cfg.tie_embeddings),
                  ("norm_zero_centered=false", not cfg.norm_zero_centered),
                  ("post_norm_layers=[]", not cfg.post_norm_layers)]
        if LINEAR in types:
            d = cfg.kda
            checks += [("kda.d_gate=null (d_head)", d.d_gate in (None, d.d_head)),
                       ("kda.norm_eps equal to norm_eps", d.norm_eps == cfg.norm_eps)]
        if FULL in types:
            m = cfg.mla
            checks += [("mla.rope=false", not m.rope),
                       (f"mla.norm_eps={MLA_NORM_EPS}", m.norm_eps == MLA_NORM_EPS),
                       ("mla.softmax_scale=null", m.softmax_scale is None),
                       ("mla.max_dense_len=null", m.max_dense_len is None)]
        if "dense" in ffn:
            checks += [("mlp.activation='swiglu'", cfg.mlp.activation == "swiglu"),
                       ("mlp.bias=false", not cfg.mlp.bias)]
        if "sparse" in ffn:
            e = cfg.moe
            checks += [("moe.score_func='sigmoid'", e.score_func == "sigmoid"),
                       ("moe.score_correction_bias=true", e.score_correction_bias),
                       ("moe.n_shared_experts >= 1", e.n_shared_experts >= 1),
                       ("moe.d_ff_shared=null", e.d_ff_shared in (
                           None, e.d_ff * e.n_shared_experts)),
                       ("moe.activation='swiglu'", GATED_TO_HF_ACT.get(e.activation) == "silu"),
                       (">= 2 experts per group", e.n_experts // e.n_expert_groups >= 2)]
        problems = [what for what, ok in checks if not ok]
        if problems:
            raise ConfigError(f"Kimi Linear cannot express this model; it needs "
                              f"{', '.join(problems)}")

    # ---- tensors
    def normalize(self, name: str) -> str:
        """transformers' in-memory MoE prefix ``mlp.`` -> the Hub's ``block_sparse_moe.``."""
        return _MEMORY.sub(r".block_sparse_moe.\1", name)

    def source_layout(self, cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]
                      ) -> dict[str, Any]:
        """Where the dense MLP lies: ``mlp.`` (the Hub's), or ``block_sparse_moe.`` (what
        ``save_pretrained`` writes)."""
        return {"dense_prefix": "block_sparse_moe"} if any(
            _DENSE_ON_DISK.match(n) for n in shapes) else {}

    def relink(self, links: list[Link], layout: dict[str, Any]) -> list[Link]:
        prefix = layout.get("dense_prefix")
        if prefix is None:
            return links
        return [dataclasses.replace(link, hf=link.hf.replace(".mlp.", f".{prefix}."))
                for link in links]

    def links(self, cfg: ModelConfig, fused_experts: bool) -> list[Link]:
        links = [Link("embed.weight", "model.embed_tokens.weight"),
                 Link("final_norm.weight", "model.norm.weight")]
        if not cfg.tie_embeddings:
            links.append(Link("lm_head.weight", "lm_head.weight"))
        for i, (kind, ffn) in enumerate(self.layer_kinds(cfg)):
            hf, a, m = f"model.layers.{i}", f"layers.{2 * i}", f"layers.{2 * i + 1}"
            links += [Link(f"{a}.norm.weight", f"{hf}.input_layernorm.weight"),
                      Link(f"{m}.norm.weight", f"{hf}.post_attention_layernorm.weight")]
            if kind == LINEAR:
                links += kda_links(f"{a}.mixer", f"{hf}.self_attn", cfg.kda)
            else:
                links += mla_links(f"{a}.mixer", f"{hf}.self_attn", cfg.mla)
            if ffn == "dense":
                links += gated_mlp_links(f"{m}.mixer", f"{hf}.mlp", False)
            else:
                links += moe_links(f"{m}.mixer", f"{hf}.block_sparse_moe", cfg.moe,
                                   fused_experts)
        return links


def kda_links(ours: str, hf: str, d: KDAConfig) -> list[Link]:
    X = d.n_heads * d.d_head
    names = ["q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "f_b_proj", "g_a_proj",
             "g_b_proj", "o_proj"]
    links = [Link(f"{ours}.{n}.weight", f"{hf}.{n}.weight") for n in names]
    links += [Link(f"{ours}.conv1d.weight", f"{hf}.{p}_conv1d.weight", ((i * X, (i + 1) * X),))
              for i, p in enumerate("qkv")]
    return links + [Link(f"{ours}.A_log", f"{hf}.A_log", hf_shape=(1, 1, d.n_heads, 1)),
                    Link(f"{ours}.dt_bias", f"{hf}.dt_bias"),
                    Link(f"{ours}.norm.weight", f"{hf}.o_norm.weight")]


def mla_links(ours: str, hf: str, m: MLAConfig) -> list[Link]:
    q = ["q_proj"] if m.q_lora_rank is None else ["q_a_proj", "q_b_proj"]
    pairs = [(n, n) for n in q] + [("kv_a_proj", "kv_a_proj_with_mqa"),
                                   ("kv_a_norm", "kv_a_layernorm"), ("kv_b_proj", "kv_b_proj"),
                                   ("o_proj", "o_proj")]
    if m.q_lora_rank is not None:
        pairs.append(("q_a_norm", "q_a_layernorm"))
    return [Link(f"{ours}.{a}.weight", f"{hf}.{b}.weight") for a, b in pairs]


def moe_links(ours: str, hf: str, moe: MoEConfig, fused: bool) -> list[Link]:
    links = [Link(f"{ours}.router.weight", f"{hf}.gate.weight"),
             Link(f"{ours}.router.score_bias", f"{hf}.gate.e_score_correction_bias")]
    links += gated_mlp_links(f"{ours}.shared_experts", f"{hf}.shared_experts", False)
    return links + expert_links(ours, hf, moe.n_experts, moe.d_ff, fused,
                                {"gate": "w1", "up": "w3", "down": "w2"})
