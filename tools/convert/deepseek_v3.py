"""DeepSeek-V3 (``DeepseekV3ForCausalLM``; Kimi-K2 ships the same class): MLA + dense MLP / MoE.

Each HF layer ``L`` is two of ours: ``2L`` multi-latent attention (``+``, norm
``input_layernorm``) and ``2L + 1`` the MLP (``-``, the first ``first_k_dense_replace`` layers) or
the MoE (``E``, norm ``post_attention_layernorm``). Names: ``q_a_layernorm`` <-> ``q_a_norm``,
``kv_a_proj_with_mqa`` <-> ``kv_a_proj``, ``kv_a_layernorm`` <-> ``kv_a_norm``; the MoE router is
``mlp.gate.{weight,e_score_correction_bias}`` <-> ``router.{weight,score_bias}``.

RoPE rows: DeepSeek stores the RoPE rows of ``q_b_proj`` (``q_proj``) in every head and the last
``qk_rope_head_dim`` rows of ``kv_a_proj_with_mqa`` pair-interleaved (``rope_interleave``, which
transformers de-interleaves at run time). Ours are rotate-half, so the links gather those rows
one by one (``x0 y0 x1 y1 ...`` -> ``x0 x1 ... y0 y1 ...``) on import and scatter them back on
export: a byte permutation, exact both ways.

Multi-token prediction (:mod:`composer.blocks.mtp`): ``num_nextn_predict_layers = D`` adds
``D`` parts ``/+E`` to the pattern (an MTP layer is always MLA + MoE, as transformers builds
it). Depth ``d`` is the HF layer ``L = num_hidden_layers + d``: ``enorm`` <-> ``mtp.{d}.norm_e``,
``hnorm`` <-> ``norm_h``, ``eh_proj`` <-> ``proj`` (columns ``[e; h]`` on disk, ``[h; e]`` ours:
the halves are swapped row by row, a byte permutation), ``shared_head.norm`` <-> ``final_norm``,
the decoder layer <-> ``mtp.{d}.layers.{0,1}`` as a main layer. The layer's ``embed_tokens`` and
``shared_head.head`` are copies of the model's embedding and head: on import each is checked
equal to them byte for byte and consumed, on export it is written again (:meth:`copy_links`).
MTP layers that cannot become our MTP part exactly (a copy that differs: our part shares the
model's embedding and head; a missing tensor, an extra one, another shape) do not stop the
conversion: the model converts without them, they are kept aside byte for byte
(``hf/aside/``, a one-line notice) and written back on export. FP8 checkpoints
(``weight_scale_inv``) are refused: dequantize to bf16 first.

DeepSeek-V3.2 (``DeepseekV32ForCausalLM``, :class:`DeepseekV32Adapter`) is the same model plus a
DSA indexer per attention layer (``self_attn.indexer.{wq_b,wk,k_norm,weights_proj}``) that keeps
the top ``index_topk`` keys per query. Up to ``index_topk`` tokens that is every causal key
(transformers takes ``topk(min(index_topk, T))`` over all ``T`` keys and masks none of the causal
ones), so the layer is dense MLA: the indexer tensors are kept aside byte for byte and
``mla.max_dense_len = index_topk`` makes our block refuse longer sequences. Its MLA RoPE is always
interleaved (no ``rope_interleave`` field; the indexer's own RoPE is rotate-half but its tensors
are not touched), so the same row permutation applies.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from composer.config import (
    ConfigError,
    MLAConfig,
    MLPConfig,
    ModelConfig,
    MoEConfig,
    YarnScaling,
)
from composer.convert.base import (
    GATED_TO_HF_ACT,
    Adapter,
    common_to_hf,
    gated_activation,
    gated_mlp_links,
    is_mtp_tensor,
    layer_pattern_error,
    require,
    rope_parameters,
    swapped_halves_links,
)
from composer.convert.decoder import expert_links
from composer.convert.plan import Link

MLA_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with its default eps


def rope_row_links(ours: str, hf: str, start: int, d_rope: int) -> list[Link]:
    """Our rotate-half RoPE rows ``[start, start + d_rope)`` from DeepSeek's interleaved ones."""
    half = d_rope // 2
    links = []
    for j in range(d_rope):
        src = start + (2 * j if j < half else 2 * (j - half) + 1)
        links.append(Link(ours, hf, ((start + j, start + j + 1),), ((src, src + 1),)))
    return links


def rows(ours: str, hf: str, a: int, b: int) -> Link:
    return Link(ours, hf, ((a, b),), ((a, b),))


def mla_links(ours: str, hf: str, m: MLAConfig) -> list[Link]:
    d_qk = m.d_head_nope + m.d_head_rope
    links = []
    if m.q_lora_rank is None:
        q_ours, q_hf = f"{ours}.q_proj.weight", f"{hf}.q_proj.weight"
    else:
        q_ours, q_hf = f"{ours}.q_b_proj.weight", f"{hf}.q_b_proj.weight"
        links += [Link(f"{ours}.q_a_proj.weight", f"{hf}.q_a_proj.weight"),
                  Link(f"{ours}.q_a_norm.weight", f"{hf}.q_a_layernorm.weight")]
    for h in range(m.n_heads):
        links.append(rows(q_ours, q_hf, h * d_qk, h * d_qk + m.d_head_nope))
        links += rope_row_links(q_ours, q_hf, h * d_qk + m.d_head_nope, m.d_head_rope)
    kv_ours, kv_hf = f"{ours}.kv_a_proj.weight", f"{hf}.kv_a_proj_with_mqa.weight"
    links.append(rows(kv_ours, kv_hf, 0, m.kv_lora_rank))
    links += rope_row_links(kv_ours, kv_hf, m.kv_lora_rank, m.d_head_rope)
    links += [Link(f"{ours}.kv_a_norm.weight", f"{hf}.kv_a_layernorm.weight"),
              Link(f"{ours}.kv_b_proj.weight", f"{hf}.kv_b_proj.weight"),
              Link(f"{ours}.o_proj.weight", f"{hf}.o_proj.weight")]
    return links


def mla_from_hf(hf: dict[str, Any]) -> MLAConfig:
    if hf.get("attention_bias"):
        raise ConfigError("config.json: attention_bias=true is not supported for MLA yet")
    if hf.get("rope_interleave", True) is False:
        raise ConfigError("config.json: rope_interleave=false is not supported yet (DeepSeek "
                          "checkpoints store interleaved RoPE rows)")
    params = rope_parameters(hf)
    rope_type = params.get("rope_type", "default")
    scaling = None
    if rope_type == "yarn":
        factor = params.get("factor")
        orig = int(params["original_max_position_embeddings"])
        if factor is None:
            factor = require(hf, "max_position_embeddings") / orig
        scaling = YarnScaling(
            factor=float(factor), original_max_position=orig,
            beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(
                params.get("beta_slow") or 1),
            mscale=_float_or_none(params.get("mscale")),
            mscale_all_dim=_float_or_none(params.get("mscale_all_dim")),
            attention_factor=_float_or_none(params.get("attention_factor")),
            truncate=bool(params.get("truncate", True)))
    elif rope_type != "default":
        raise ConfigError(f"config.json: rope type {rope_type!r} is not supported for MLA "
                          "(supported: default, yarn)")
    return MLAConfig(
        n_heads=require(hf, "num_attention_heads"), q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=require(hf, "kv_lora_rank"), d_head_nope=require(hf, "qk_nope_head_dim"),
        d_head_rope=require(hf, "qk_rope_head_dim"), d_head_v=require(hf, "v_head_dim"),
        rope_theta=float(params.get("rope_theta", 10000.0)), rope_scaling=scaling,
        norm_eps=MLA_NORM_EPS)


def mla_to_hf(m: MLAConfig, out: dict[str, Any]) -> None:
    if m.norm_eps != MLA_NORM_EPS or m.softmax_scale is not None:
        raise ConfigError(f"transformers' MLA has latent-norm eps {MLA_NORM_EPS} and the default "
                          "softmax scale; set mla.norm_eps=1e-6 and mla.softmax_scale=null")
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
    y = m.rope_scaling
    if y is not None:
        params.update(rope_type="yarn", factor=y.factor, beta_fast=y.beta_fast,
                      beta_slow=y.beta_slow,
                      original_max_position_embeddings=y.original_max_position)
        for key in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(y, key) is not None:
                params[key] = getattr(y, key)
        if not y.truncate:
            params["truncate"] = False
    out.update(num_attention_heads=m.n_heads, num_key_value_heads=m.n_heads,
               q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
               qk_nope_head_dim=m.d_head_nope, qk_rope_head_dim=m.d_head_rope,
               v_head_dim=m.d_head_v, head_dim=m.d_head_rope,
               qk_head_dim=m.d_head_nope + m.d_head_rope, rope_interleave=True,
               attention_bias=False, rope_parameters=params)
    out.pop("rope_theta", None)
    out.pop("rope_scaling", None)


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


class DeepseekV3Adapter(Adapter):
    family = "deepseek-v3"
    symbols = "+-E"
    max_positions = 4096
    architectures = ("DeepseekV3ForCausalLM",)
    model_type = "deepseek_v3"
    hf_keep_fp32 = ("gate.weight", "gate.e_score_correction_bias")

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        if hf.get("quantization_config"):
            raise ConfigError("config.json: quantized checkpoints (quantization_config, e.g. FP8 "
                              "weight_scale_inv) are not supported; dequantize to bf16 first")
        if (hf.get("moe_layer_freq") or 1) != 1:
            raise ConfigError(f"config.json: moe_layer_freq={hf['moe_layer_freq']} is not "
                              "supported (transformers' DeepseekV3 ignores it)")
        if hf.get("scoring_func", "sigmoid") != "sigmoid" or \
                hf.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ConfigError("config.json: DeepseekV3 routing is sigmoid scoring with noaux_tc "
                              "top-k (what transformers runs)")
        n_layers = require(hf, "num_hidden_layers")
        k = min(int(hf.get("first_k_dense_replace") or 0), n_layers)
        n_mtp = int(hf.get("num_nextn_predict_layers") or 0)
        moe = None
        if k < n_layers or n_mtp:
            n_experts, n_groups = require(hf, "n_routed_experts"), int(hf.get("n_group") or 1)
            if n_experts // n_groups < 2:
                raise ConfigError(f"transformers' DeepseekV3 router scores each expert group by "
                                  f"its top 2; {n_experts} experts in {n_groups} groups leave "
                                  "fewer than 2 per group")
            if not hf.get("n_shared_experts"):
                raise ConfigError("config.json: DeepseekV3 MoE layers need n_shared_experts >= 1")
            moe = MoEConfig(
                n_experts=n_experts, top_k=require(hf, "num_experts_per_tok"),
                d_ff=require(hf, "moe_intermediate_size"),
                activation=gated_activation(hf.get("hidden_act", "silu")),
                n_shared_experts=int(hf["n_shared_experts"]), score_func="sigmoid",
                renormalize=bool(hf.get("norm_topk_prob", True)), score_correction_bias=True,
                routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                n_expert_groups=n_groups, topk_groups=int(hf.get("topk_group") or 1),
                aux_loss_coeff=float(hf.get("router_aux_loss_coef") or 0.0))
        mlp = None
        if k > 0:
            mlp = MLPConfig(d_ff=require(hf, "intermediate_size"),
                            activation=gated_activation(hf.get("hidden_act", "silu")))
        return ModelConfig(
            pattern="+-" * k + "+E" * (n_layers - k) + "/+E" * n_mtp,
            d_model=require(hf, "hidden_size"),
            vocab_size=require(hf, "vocab_size"),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            init_std=float(hf.get("initializer_range", 0.02)),
            attention=None, mamba=None, mlp=mlp, moe=moe, mla=mla_from_hf(hf))

    def layer_kinds(self, cfg: ModelConfig) -> list[bool]:
        """Per HF layer, whether it is MoE: the pattern must be ``(+-)*(+E)*``."""
        layers = cfg.parsed.layers
        pairs = ["".join(layers[i:i + 2]) for i in range(0, len(layers), 2)]
        sparse = [p == "+E" for p in pairs]
        if len(layers) % 2 or any(p not in ("+-", "+E") for p in pairs) or \
                sparse != sorted(sparse):
            raise layer_pattern_error(self.family, cfg.pattern, "it must be '+-' layers (the "
                                      "first_k_dense_replace dense ones) followed by '+E' layers")
        return sparse

    def mtp_depths(self, cfg: ModelConfig) -> int:
        """The number of MTP layers; raises unless every MTP part is ``+E``."""
        parts = cfg.parsed.mtp
        if parts and parts[0] != ("+", "E"):
            raise layer_pattern_error(self.family, cfg.pattern, "its MTP layers are '+E' "
                                      "(MLA + MoE), one part per layer")
        return len(parts)

    def config_to_hf(self, cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
        sparse = self.layer_kinds(cfg)
        n_mtp = self.mtp_depths(cfg)
        out = common_to_hf(cfg, base, self.architectures[0], self.model_type)
        k = sparse.count(False)
        # without MTP parts keep the source's count (its MTP tensors come back from hf/aside/)
        out.update(num_hidden_layers=len(sparse), first_k_dense_replace=k,
                   rms_norm_eps=cfg.norm_eps, num_nextn_predict_layers=n_mtp or
                   base.get("num_nextn_predict_layers", 0))
        mla_to_hf(cfg.mla, out)
        act = None
        if k:
            if cfg.mlp.activation not in GATED_TO_HF_ACT or cfg.mlp.bias:
                raise ConfigError("DeepseekV3's dense MLP is gated and has no bias")
            act = GATED_TO_HF_ACT[cfg.mlp.activation]
            out.update(intermediate_size=cfg.mlp.d_ff, hidden_act=act)
        if k < len(sparse) or n_mtp:
            self._moe_to_hf(cfg.moe, act, out)
        for key in ("dtype", "torch_dtype"):
            out.pop(key, None)
        return out

    def _moe_to_hf(self, moe: MoEConfig, act: str | None, out: dict[str, Any]) -> None:
        problems = [what for what, ok in (
            ("score_func=sigmoid", moe.score_func == "sigmoid"),
            ("score_correction_bias=true", moe.score_correction_bias),
            ("n_shared_experts >= 1", moe.n_shared_experts >= 1),
            ("d_ff_shared=null (d_ff * n_shared_experts)", moe.d_ff_shared in (
                None, moe.d_ff * moe.n_shared_experts)),
            ("a gated activation", moe.activation in GATED_TO_HF_ACT)) if not ok]
        if problems:
            raise ConfigError(f"a DeepseekV3 MoE layer needs moe.{', moe.'.join(problems)}")
        moe_act = GATED_TO_HF_ACT[moe.activation]
        if act is not None and act != moe_act:
            raise ConfigError("DeepseekV3 has one hidden_act; mlp.activation and moe.activation "
                              "differ")
        if moe.n_experts // moe.n_expert_groups < 2:
            raise ConfigError("transformers' DeepseekV3 router needs >= 2 experts per group")
        out.update(n_routed_experts=moe.n_experts, num_experts_per_tok=moe.top_k,
                   moe_intermediate_size=moe.d_ff, n_shared_experts=moe.n_shared_experts,
                   norm_topk_prob=moe.renormalize,
                   routed_scaling_factor=moe.routed_scaling_factor, n_group=moe.n_expert_groups,
                   topk_group=moe.topk_groups, hidden_act=moe_act)
        if moe.aux_loss_coeff or "router_aux_loss_coef" in out:
            out["router_aux_loss_coef"] = moe.aux_loss_coeff

    def aside(self, name: str, hf: dict[str, Any]) -> bool:
        return is_mtp_tensor(name, require(hf, "num_hidden_layers"))

    def layer_links(self, cfg: ModelConfig, a: str, m: str, hf: str, is_sparse: bool,
                    fused_experts: bool) -> list[Link]:
        """One HF decoder layer ``hf`` as our attention layer ``a`` and feed-forward ``m``."""
        links = [Link(f"{a}.norm.weight", f"{hf}.input_layernorm.weight"),
                 Link(f"{m}.norm.weight", f"{hf}.post_attention_layernorm.weight")]
        links += mla_links(f"{a}.mixer", f"{hf}.self_attn", cfg.mla)
        if not is_sparse:
            return links + gated_mlp_links(f"{m}.mixer", f"{hf}.mlp", False)
        moe, ours = cfg.moe, f"{m}.mixer"
        links += [Link(f"{ours}.router.weight", f"{hf}.mlp.gate.weight"),
                  Link(f"{ours}.router.score_bias", f"{hf}.mlp.gate.e_score_correction_bias")]
        links += gated_mlp_links(f"{ours}.shared_experts", f"{hf}.mlp.shared_experts", False)
        return links + expert_links(ours, f"{hf}.mlp", moe.n_experts, moe.d_ff, fused_experts,
                                    {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})

    def links(self, cfg: ModelConfig, fused_experts: bool) -> list[Link]:
        links = [Link("embed.weight", "model.embed_tokens.weight"),
                 Link("final_norm.weight", "model.norm.weight")]
        if not cfg.tie_embeddings:
            links.append(Link("lm_head.weight", "lm_head.weight"))
        kinds = self.layer_kinds(cfg)
        for i, is_sparse in enumerate(kinds):
            links += self.layer_links(cfg, f"layers.{2 * i}", f"layers.{2 * i + 1}",
                                      f"model.layers.{i}", is_sparse, fused_experts)
        d_model = cfg.d_model
        for d in range(self.mtp_depths(cfg)):
            ours, hf = f"mtp.{d}", f"model.layers.{len(kinds) + d}"
            links += [Link(f"{ours}.norm_e.weight", f"{hf}.enorm.weight"),
                      Link(f"{ours}.norm_h.weight", f"{hf}.hnorm.weight"),
                      Link(f"{ours}.final_norm.weight", f"{hf}.shared_head.norm.weight")]
            links += swapped_halves_links(f"{ours}.proj.weight", f"{hf}.eh_proj.weight",
                                          d_model, d_model)
            links += self.layer_links(cfg, f"{ours}.layers.0", f"{ours}.layers.1", hf, True,
                                      fused_experts)
        return links

    def copy_links(self, cfg: ModelConfig) -> list[Link]:
        """Each MTP layer's ``embed_tokens`` / ``shared_head.head``: our embedding / head."""
        head = "embed.weight" if cfg.tie_embeddings else "lm_head.weight"
        n = cfg.parsed.n_layers // 2
        return [link for d in range(self.mtp_depths(cfg)) for link in (
            Link("embed.weight", f"model.layers.{n + d}.embed_tokens.weight"),
            Link(head, f"model.layers.{n + d}.shared_head.head.weight"))]


class DeepseekV32Adapter(DeepseekV3Adapter):
    """DeepSeek-V3.2: V3's MLA + MoE with a DSA indexer (kept aside; see the module docstring).
    Per-layer ``mlp_layer_types`` (``dense`` / ``sparse``) in any order; ``layer_types`` must be
    all ``indexed_attention``; ``index_n_heads`` / ``index_head_dim`` come back from the source
    config on export. Its MTP layers are not built: kept aside byte for byte."""

    family = "deepseek-v3.2"
    symbols = "+-E"
    max_positions = 163840
    architectures = ("DeepseekV32ForCausalLM",)
    model_type = "deepseek_v32"

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        n_layers = require(hf, "num_hidden_layers")
        if hf.get("q_lora_rank") is None:
            raise ConfigError("config.json: DeepseekV32 needs q_lora_rank (its indexer reads the "
                              "query latent; transformers builds no full q_proj)")
        topk = require(hf, "index_topk")
        types = hf.get("layer_types") or ["indexed_attention"] * n_layers
        if list(types) != ["indexed_attention"] * n_layers:
            raise ConfigError(f"config.json: layer_types must be {n_layers} x "
                              f"'indexed_attention', got {types}")
        mlp_types = hf.get("mlp_layer_types")
        if mlp_types is None:
            k = min(int(hf.get("first_k_dense_replace") or 0), n_layers)
            mlp_types = ["dense"] * k + ["sparse"] * (n_layers - k)
        if len(mlp_types) != n_layers or set(mlp_types) - {"dense", "sparse"}:
            raise ConfigError(f"config.json: mlp_layer_types must be {n_layers} of 'dense' / "
                              f"'sparse', got {mlp_types}")
        n_dense = mlp_types.count("dense")
        # V3's reader builds the MLP section when k > 0 and the MoE one when k < n_layers.
        k = n_layers if n_dense == n_layers else 0 if n_dense == 0 else 1
        v3 = {key: v for key, v in hf.items() if key != "rope_interleave"}  # always interleaved
        v3["first_k_dense_replace"] = k
        v3["num_nextn_predict_layers"] = 0  # its MTP layers (with their indexer) are kept aside
        cfg = super().config_from_hf(v3)
        pattern = "".join("+-" if t == "dense" else "+E" for t in mlp_types)
        return dataclasses.replace(cfg, pattern=pattern,
                                   mla=dataclasses.replace(cfg.mla, max_dense_len=int(topk)))

    def layer_kinds(self, cfg: ModelConfig) -> list[bool]:
        """Per HF layer, whether it is MoE: the pattern must be ``(+-|+E)*``."""
        layers = cfg.parsed.layers
        pairs = ["".join(layers[i:i + 2]) for i in range(0, len(layers), 2)]
        if len(layers) % 2 or any(p not in ("+-", "+E") for p in pairs):
            raise layer_pattern_error(self.family, cfg.pattern, "it must be '+-' (dense MLP) "
                                      "and '+E' (MoE) layers")
        return [p == "+E" for p in pairs]

    def config_to_hf(self, cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
        if cfg.mla is None or cfg.mla.max_dense_len is None:
            raise ConfigError("DeepseekV32 needs mla.max_dense_len (its index_topk)")
        if "index_n_heads" not in base or "index_head_dim" not in base:
            raise ConfigError("DeepseekV32 export needs a DeepSeek-V3.2 source checkpoint "
                              "(index_n_heads / index_head_dim in hf/config.json, the indexer "
                              "tensors in hf/aside/): no block of ours builds the indexer")
        out = super().config_to_hf(cfg, base)
        sparse = self.layer_kinds(cfg)
        lead = next((i for i, s in enumerate(sparse) if s), len(sparse))
        out.pop("rope_interleave", None)
        out.update(first_k_dense_replace=lead,
                   mlp_layer_types=["sparse" if s else "dense" for s in sparse],
                   layer_types=["indexed_attention"] * len(sparse),
                   index_topk=cfg.mla.max_dense_len)
        return out

    def aside(self, name: str, hf: dict[str, Any]) -> bool:
        return ".self_attn.indexer." in name or super().aside(name, hf)
