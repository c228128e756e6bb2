"""Qwen3-Next (``Qwen3NextForCausalLM``), Qwen3.5 (``Qwen3_5ForCausalLM``) and Qwen3.5-MoE
(``Qwen3_5MoeForCausalLM``): gated-delta-net / gated-attention hybrids (transformers 5.24
``modeling_qwen3_next``, ``modeling_qwen3_5``, ``modeling_qwen3_5_moe``, checked).

Each HF layer ``L`` is two of ours: ``2L`` the token mixer, ``G`` for ``linear_attention`` (a
:class:`~composer.blocks.gdn.GatedDeltaNet`, HF ``linear_attn``) or ``*`` for ``full_attention``
(``self_attn``), and ``2L + 1`` the MoE ``E`` (``mlp.gate``, ``mlp.experts``,
``mlp.shared_expert``, ``mlp.shared_expert_gate``) or, for ``mlp_only_layers`` and Qwen3.5, the
dense SwiGLU ``-``. ``layer_types`` lists the mixers; without it ``full_attention_interval``
(default 4) makes every fourth layer attention.

The family's numerics, as config fields: every RMSNorm is zero-centred (``norm_zero_centered``:
``rms(x) * (1 + w)``, ``w`` stored as the checkpoint stores it), except the GDN's gated output
norm (a plain weight); attention has per-head qk-norm, partial RoPE (``partial_rotary_factor``,
default 0.25) and a sigmoid output gate (``attention.output_gate``: ``q_proj`` rows ``[q_h; g_h]``
per head, copied as they are); the shared expert is scaled by ``sigmoid(shared_expert_gate x)``
(``moe.shared_expert_gate``); the router is softmax top-k (renormalised by ``norm_topk_prob`` in
Qwen3-Next, always in Qwen3.5-MoE).

GDN weights (the contract in :mod:`composer.blocks.gdn`): Qwen3-Next fuses ``in_proj_qkvz``
grouped per key head (``[G, 2K + 2RV, D]``) and ``in_proj_ba`` (``[G, 2R, D]``); each group's
rows are a contiguous range, so the split is a list of row-range links, bit-exact both ways.
Qwen3.5 stores ``in_proj_qkv`` (``[q; k; v]`` rows), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``.

Multi-token prediction (:mod:`composer.blocks.mtp`; transformers ignores these tensors, vLLM's
``qwen3_next_mtp`` reads them): ``mtp_num_hidden_layers: 1`` (or ``num_nextn_predict_layers``)
adds one depth ``/*E`` (``/*-`` when HF layer 0's feed-forward is dense: vLLM picks the MTP
layer's kind by index 0), full attention as the main layers have it: ``mtp.fc`` <-> ``mtp.0.proj``
(columns ``[e; h]`` on disk, ``[h; e]`` ours, the halves swapped row by row),
``mtp.pre_fc_norm_embedding`` <-> ``norm_e``, ``mtp.pre_fc_norm_hidden`` <-> ``norm_h``,
``mtp.norm`` <-> ``final_norm``, ``mtp.layers.0.*`` <-> ``mtp.0.layers.{0,1}`` as a main layer;
the norms are zero-centred like the others. Any MTP layer that cannot become our MTP part
exactly (more than one, as vLLM shares one ``fc`` among them; ``mtp_use_dedicated_embeddings``;
a checkpoint without all its tensors, or with a tensor or shape our part does not have): the
``mtp.*`` tensors are kept aside byte for byte (:meth:`Adapter.aside`, a one-line notice) and
written back, never refused.

Qwen3.5's Hub checkpoints are vision-language models (``Qwen3_5ForConditionalGeneration``,
``model.language_model.*``); these adapters read the text-only classes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from composer.config import ConfigError, GDNConfig, MLPConfig, ModelConfig, MoEConfig
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
    rope_parameters,
    rotary_fraction,
    rotary_to_hf,
    swapped_halves_links,
)
from composer.convert.decoder import expert_links
from composer.convert.plan import Link

QWEN3_NEXT_DEFAULTS: dict[str, Any] = dict(
    intermediate_size=5632, num_attention_heads=16, num_key_value_heads=2, hidden_act="silu",
    initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
    head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=16, linear_num_value_heads=32, decoder_sparse_step=1,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts_per_tok=10,
    num_experts=512, norm_topk_prob=True, router_aux_loss_coef=0.001)
"""transformers 5.24's ``Qwen3NextConfig`` defaults (a field missing from config.json)."""
QWEN3_5_DEFAULTS: dict[str, Any] = dict(
    intermediate_size=12288, num_attention_heads=16, num_key_value_heads=4, hidden_act="silu",
    initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
    head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=16, linear_num_value_heads=32)
QWEN3_5_MOE_DEFAULTS: dict[str, Any] = {
    **QWEN3_5_DEFAULTS, "num_key_value_heads": 2, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "num_experts_per_tok": 8, "num_experts": 256,
    "router_aux_loss_coef": 0.001}
ROTARY_DEFAULT = 0.25
"""The configs' ``partial_rotary_factor`` when config.json gives none."""
MIXERS = {"linear_attention": "G", "full_attention": "*"}


class Qwen3NextAdapter(Adapter):
    family = "qwen3-next"
    symbols = "G*E-"
    max_positions = 32768
    architectures = ("Qwen3NextForCausalLM",)
    model_type = "qwen3_next"
    defaults = QWEN3_NEXT_DEFAULTS
    has_dense = True
    """Whether the family has dense layers (``mlp_only_layers``, or all of Qwen3.5)."""
    has_moe = True
    fused_gdn = True
    """``in_proj_qkvz`` / ``in_proj_ba`` (Qwen3-Next) rather than four separate projections."""

    # ---- config
    def _hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        return {**self.defaults, **{k: v for k, v in hf.items() if v is not None}}

    def layer_types(self, h: dict[str, Any]) -> list[str]:
        n = require(h, "num_hidden_layers")
        types = h.get("layer_types")
        if types is None:
            interval = h.get("full_attention_interval", 4)
            types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                     for i in range(n)]
        if len(types) != n or not set(types) <= set(MIXERS):
            raise ConfigError(f"config.json: layer_types must list {n} of "
                              f"{', '.join(MIXERS)}; got {types}")
        return list(types)

    def is_sparse(self, h: dict[str, Any], layer: int) -> bool:
        step = h.get("decoder_sparse_step", 1) or 1
        return (layer not in (h.get("mlp_only_layers") or []) and h["num_experts"] > 0
                and (layer + 1) % step == 0)

    def moe_from_hf(self, h: dict[str, Any]) -> MoEConfig:
        if not h["shared_expert_intermediate_size"]:
            raise ConfigError("config.json: shared_expert_intermediate_size=0; transformers "
                              "always builds the shared expert (of width 0 here), we do not")
        return MoEConfig(
            n_experts=h["num_experts"], top_k=h["num_experts_per_tok"],
            d_ff=h["moe_intermediate_size"], activation=gated_activation(h["hidden_act"]),
            n_shared_experts=1, d_ff_shared=h["shared_expert_intermediate_size"],
            shared_expert_gate=True, score_func="softmax",
            renormalize=bool(h.get("norm_topk_prob", True)),
            aux_loss_coeff=float(h["router_aux_loss_coef"]))

    def mtp_key(self, h: dict[str, Any]) -> str:
        return "num_nextn_predict_layers" if "num_nextn_predict_layers" in h \
            else "mtp_num_hidden_layers"

    def mtp_ffn(self, h: dict[str, Any]) -> str | None:
        """The MTP layer's feed-forward symbol, or None when no depth is built."""
        if int(h.get(self.mtp_key(h)) or 0) != 1 or h.get("mtp_use_dedicated_embeddings"):
            return None
        return "E" if self.has_moe and self.is_sparse(h, 0) else "-"

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        h = self._hf(hf)
        types = self.layer_types(h)
        sparse = [self.has_moe and self.is_sparse(h, i) for i in range(len(types))]
        pattern = "".join(MIXERS[t] + ("E" if s else "-") for t, s in zip(types, sparse,
                                                                         strict=True))
        mtp_ffn = self.mtp_ffn(h)
        if mtp_ffn is not None:
            pattern += "/*" + mtp_ffn
            sparse.append(mtp_ffn == "E")
        attention = dataclasses.replace(
            attention_from_hf(h, qk_norm=True), output_gate=True,
            rotary_fraction=rotary_fraction(h, ROTARY_DEFAULT))
        gdn = GDNConfig(
            n_heads=h["linear_num_value_heads"], n_kv_heads=h["linear_num_key_heads"],
            d_head_k=h["linear_key_head_dim"], d_head_v=h["linear_value_head_dim"],
            d_conv=h["linear_conv_kernel_dim"], norm_eps=float(h["rms_norm_eps"]))
        mlp = None
        if not all(sparse):
            mlp = MLPConfig(d_ff=require(h, "intermediate_size"),
                            activation=gated_activation(h["hidden_act"]))
        return ModelConfig(
            pattern=pattern, d_model=require(h, "hidden_size"),
            vocab_size=require(h, "vocab_size"), tie_embeddings=bool(h["tie_word_embeddings"]),
            norm_eps=float(h["rms_norm_eps"]), init_std=float(h["initializer_range"]),
            norm_zero_centered=True, attention=attention if "*" in pattern else None,
            mamba=None, mlp=mlp, moe=self.moe_from_hf(h) if any(sparse) else None,
            gdn=gdn if "G" in pattern else None)

    def layer_kinds(self, cfg: ModelConfig) -> list[tuple[str, str]]:
        """Per HF layer ``(mixer, ffn)``; raises unless the pattern is ``((G|*)(E|-))*``."""
        layers = cfg.parsed.layers
        pairs = ["".join(layers[i:i + 2]) for i in range(0, len(layers), 2)]
        ffns = "E-" if self.has_moe and self.has_dense else ("E" if self.has_moe else "-")
        if len(layers) % 2 or any(len(p) != 2 or p[0] not in "G*" or p[1] not in ffns
                                  for p in pairs):
            raise layer_pattern_error(self.family, cfg.pattern, "every layer must be a 'G' or "
                                      f"'*' followed by {' or '.join(repr(c) for c in ffns)}")
        return [(p[0], p[1]) for p in pairs]

    def _check(self, cfg: ModelConfig, kinds: list[tuple[str, str]]) -> None:
        mtp = cfg.parsed.mtp
        if mtp and (len(mtp) > 1 or mtp[0] != ("*", kinds[0][1])):
            raise layer_pattern_error(self.family, cfg.pattern, "its one MTP layer is full "
                                      f"attention and layer 0's feed-forward: '/*{kinds[0][1]}'")
        problems = []
        if not cfg.norm_zero_centered:
            problems.append("norm_zero_centered=true")
        a, g = cfg.attention, cfg.gdn
        if any(m == "*" for m, _ in kinds) or mtp:
            if not (a.output_gate and a.qk_norm and a.qk_norm_scope == "head"):
                problems.append("attention.output_gate=true, qk_norm=true, qk_norm_scope='head'")
            if a.position != "rope" or a.rope_scaling is not None or a.softmax_scale is not None:
                problems.append("attention.position='rope' without rope_scaling/softmax_scale")
        if any(m == "G" for m, _ in kinds):
            if g.allow_neg_eigval or g.conv_bias or g.norm_eps != cfg.norm_eps:
                problems.append("gdn.allow_neg_eigval=false, conv_bias=false, gdn.norm_eps = "
                                "norm_eps")
        if any(f == "-" for _, f in kinds) and (cfg.mlp.bias or cfg.mlp.activation != "swiglu"):
            problems.append("mlp.bias=false, mlp.activation='swiglu'")
        if any(f == "E" for _, f in kinds):
            moe = cfg.moe
            if (moe.score_func != "softmax" or moe.score_correction_bias
                    or moe.routed_scaling_factor != 1.0 or moe.n_expert_groups != 1
                    or moe.n_shared_experts != 1 or not moe.shared_expert_gate
                    or moe.activation != "swiglu" or (not moe.renormalize and not self.has_dense)):
                problems.append("moe: softmax top-k (renormalised in Qwen3.5-MoE), no bias, "
                                "scaling or groups, one gated shared expert, swiglu")
        if problems:
            raise ConfigError(f"{self.family} needs {'; '.join(problems)}")

    def config_to_hf(self, cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
        kinds = self.layer_kinds(cfg)
        self._check(cfg, kinds)
        out = common_to_hf(cfg, base, self.architectures[0], self.model_type)
        out.update(num_hidden_layers=len(kinds), rms_norm_eps=cfg.norm_eps, hidden_act="silu")
        types = ["full_attention" if m == "*" else "linear_attention" for m, _ in kinds]
        # The Hub's config.json may say only full_attention_interval: keep that form if it holds.
        interval_form = "layer_types" not in base and "full_attention_interval" in base and \
            self.layer_types({**base, "num_hidden_layers": len(types)}) == types
        if not interval_form:
            out["layer_types"] = types
            out.pop("full_attention_interval", None)
        extra_rope = {k: v for k, v in rope_parameters(base).items()
                      if k not in ("rope_type", "rope_theta", "partial_rotary_factor")}
        if cfg.attention is not None:
            attention_to_hf(cfg, out)
            out["rope_parameters"].update(extra_rope)
            rotary_to_hf(cfg, out)
        if cfg.gdn is not None:
            g = cfg.gdn
            out.update(linear_num_value_heads=g.n_heads,
                       linear_num_key_heads=g.n_kv_heads or g.n_heads,
                       linear_key_head_dim=g.d_head_k, linear_value_head_dim=g.d_head_v,
                       linear_conv_kernel_dim=g.d_conv)
        if cfg.parsed.mtp:  # without, the source's count stays (its tensors kept aside)
            out[self.mtp_key(base)] = 1
        dense = [i for i, (_, f) in enumerate(kinds) if f == "-"]
        if dense:
            out["intermediate_size"] = cfg.mlp.d_ff
        if self.has_moe:
            self.moe_to_hf(cfg, dense, out)
        for key in ("dtype", "torch_dtype"):
            out.pop(key, None)
        return out

    def moe_to_hf(self, cfg: ModelConfig, dense: list[int], out: dict[str, Any]) -> None:
        if cfg.moe is None:  # every layer dense: no experts
            out.update(num_experts=0, mlp_only_layers=dense)
            return
        moe = cfg.moe
        out.update(num_experts=moe.n_experts, num_experts_per_tok=moe.top_k,
                   moe_intermediate_size=moe.d_ff, shared_expert_intermediate_size=moe.d_ff_shared
                   or moe.d_ff, norm_topk_prob=moe.renormalize,
                   router_aux_loss_coef=moe.aux_loss_coeff, mlp_only_layers=dense,
                   decoder_sparse_step=1)
        out.setdefault("intermediate_size", moe.d_ff)

    # ---- tensors
    def aside(self, name: str, hf: dict[str, Any]) -> bool:
        return name.startswith("mtp.")

    def gdn_links(self, ours: str, hf: str, g: GDNConfig) -> list[Link]:
        G, H, K, V = g.n_kv_heads or g.n_heads, g.n_heads, g.d_head_k, g.d_head_v
        links = [Link(f"{ours}.{n}", f"{hf}.{n}") for n in ("conv1d.weight", "A_log", "dt_bias",
                                                           "norm.weight")]
        links.append(Link(f"{ours}.o_proj.weight", f"{hf}.out_proj.weight"))
        if not self.fused_gdn:
            qk = G * K
            return links + [
                Link(f"{ours}.q_proj.weight", f"{hf}.in_proj_qkv.weight", (), ((0, qk),)),
                Link(f"{ours}.k_proj.weight", f"{hf}.in_proj_qkv.weight", (), ((qk, 2 * qk),)),
                Link(f"{ours}.v_proj.weight", f"{hf}.in_proj_qkv.weight", (),
                     ((2 * qk, 2 * qk + H * V),)),
                *(Link(f"{ours}.{n}_proj.weight", f"{hf}.in_proj_{n}.weight") for n in "zba")]
        R = H // G
        width = 2 * K + 2 * R * V  # rows of one key head's group in in_proj_qkvz
        for grp in range(G):
            start = grp * width
            for name, offset, n in (("q", 0, K), ("k", K, K), ("v", 2 * K, R * V),
                                    ("z", 2 * K + R * V, R * V)):
                links.append(Link(f"{ours}.{name}_proj.weight", f"{hf}.in_proj_qkvz.weight",
                                  ((grp * n, (grp + 1) * n),),
                                  ((start + offset, start + offset + n),)))
            for name, offset in (("b", 0), ("a", R)):
                links.append(Link(f"{ours}.{name}_proj.weight", f"{hf}.in_proj_ba.weight",
                                  ((grp * R, (grp + 1) * R),),
                                  ((grp * 2 * R + offset, grp * 2 * R + offset + R),)))
        return links

    def layer_links(self, cfg: ModelConfig, a: str, m: str, hf: str, mixer: str, ffn: str,
                    fused_experts: bool) -> list[Link]:
        """One HF decoder layer ``hf`` as our token mixer ``a`` and feed-forward ``m``."""
        links = [Link(f"{a}.norm.weight", f"{hf}.input_layernorm.weight"),
                 Link(f"{m}.norm.weight", f"{hf}.post_attention_layernorm.weight")]
        if mixer == "G":
            links += self.gdn_links(f"{a}.mixer", f"{hf}.linear_attn", cfg.gdn)
        else:
            links += attention_links(f"{a}.mixer", f"{hf}.self_attn", cfg.attention)
        if ffn != "E":
            return links + gated_mlp_links(f"{m}.mixer", f"{hf}.mlp", False)
        moe = cfg.moe
        links += [Link(f"{m}.mixer.router.weight", f"{hf}.mlp.gate.weight"),
                  Link(f"{m}.mixer.shared_expert_gate.weight",
                       f"{hf}.mlp.shared_expert_gate.weight")]
        links += gated_mlp_links(f"{m}.mixer.shared_experts", f"{hf}.mlp.shared_expert", False)
        return links + expert_links(f"{m}.mixer", f"{hf}.mlp", moe.n_experts, moe.d_ff,
                                    fused_experts, {"gate": "gate_proj", "up": "up_proj",
                                                    "down": "down_proj"})

    def links(self, cfg: ModelConfig, fused_experts: bool) -> list[Link]:
        links = [Link("embed.weight", "model.embed_tokens.weight"),
                 Link("final_norm.weight", "model.norm.weight")]
        if not cfg.tie_embeddings:
            links.append(Link("lm_head.weight", "lm_head.weight"))
        for i, (mixer, ffn) in enumerate(self.layer_kinds(cfg)):
            links += self.layer_links(cfg, f"layers.{2 * i}", f"layers.{2 * i + 1}",
                                      f"model.layers.{i}", mixer, ffn, fused_experts)
        for part in cfg.parsed.mtp:  # one at most (_check)
            links += [Link("mtp.0.norm_e.weight", "mtp.pre_fc_norm_embedding.weight"),
                      Link("mtp.0.norm_h.weight", "mtp.pre_fc_norm_hidden.weight"),
                      Link("mtp.0.final_norm.weight", "mtp.norm.weight")]
            links += swapped_halves_links("mtp.0.proj.weight", "mtp.fc.weight", cfg.d_model,
                                          cfg.d_model)
            links += self.layer_links(cfg, "mtp.0.layers.0", "mtp.0.layers.1", "mtp.layers.0",
                                      part[0], part[1], fused_experts)
        return links


class Qwen3_5Adapter(Qwen3NextAdapter):
    """Qwen3.5 dense: every feed-forward a SwiGLU MLP; separate GDN input projections."""

    family = "qwen3.5"
    symbols = "G*-"
    max_positions = 32768
    architectures = ("Qwen3_5ForCausalLM",)
    model_type = "qwen3_5_text"
    defaults = QWEN3_5_DEFAULTS
    has_moe = False
    fused_gdn = False


class Qwen3_5MoeAdapter(Qwen3NextAdapter):
    """Qwen3.5-MoE: every feed-forward an MoE (always renormalised top-k) with a gated shared
    expert; separate GDN input projections."""

    family = "qwen3.5-moe"
    symbols = "G*E"
    max_positions = 32768
    architectures = ("Qwen3_5MoeForCausalLM",)
    model_type = "qwen3_5_moe_text"
    defaults = QWEN3_5_MOE_DEFAULTS
    has_dense = False
    fused_gdn = False

    def is_sparse(self, h: dict[str, Any], layer: int) -> bool:
        return True

    def moe_from_hf(self, h: dict[str, Any]) -> MoEConfig:
        return dataclasses.replace(super().moe_from_hf(h), renormalize=True)

    def moe_to_hf(self, cfg: ModelConfig, dense: list[int], out: dict[str, Any]) -> None:
        moe = cfg.moe
        out.update(num_experts=moe.n_experts, num_experts_per_tok=moe.top_k,
                   moe_intermediate_size=moe.d_ff,
                   shared_expert_intermediate_size=moe.d_ff_shared or moe.d_ff,
                   router_aux_loss_coef=moe.aux_loss_coeff)
