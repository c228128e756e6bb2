"""Zamba2 (``Zamba2ForCausalLM``, Zyphra): a Mamba-2 backbone whose hybrid layers first add the
output of one of ``num_mem_blocks`` shared transformer blocks (:mod:`composer.blocks.zamba`).

Checked against transformers 5.24 ``modeling_zamba2`` / ``configuration_zamba2``. HF layer ``L``
is our layer ``L``: ``M`` for ``layers_block_type[L]`` ``"mamba"`` / ``"linear_attention"``
(``model.L.mamba.*``, norm ``model.L.input_layernorm``), ``Z`` for ``"hybrid"``
(``model.L.mamba_decoder.{mamba.*, input_layernorm}``, ``model.L.linear``). The ``k``-th hybrid
layer uses shared block ``k % num_mem_blocks`` (ABAB...), our shared layer labelled ``a``, ``b``,
...: the pattern is ``M..{a:Z}M..{b:Z}M..{a}M..{b}...``. Embeddings ``model.embed_tokens``
(tied by default), final norm ``model.final_layernorm``.

What decides the mapping (read in transformers' source):
- The block's weights live under the first hybrid layer that uses it
  (``model.F.shared_transformer.*``); later uses are tied to it and absent from the files.
  ``shared.{label}.*`` are those tensors: ``input_layernorm`` -> ``input_norm``,
  ``pre_ff_layernorm`` -> ``ff_norm``, ``self_attn.{q,k,v,o}_proj`` -> ``attn.*``,
  ``feed_forward.gate_up_proj`` (rows ``[gate; up]``) -> ``mlp.gate_proj`` / ``mlp.up_proj``,
  ``feed_forward.down_proj`` -> ``mlp.down_proj``.
- The per-site adapters are lists inside the block, indexed by the hybrid layer's rank ``k``
  among the hybrid layers (entries of the other blocks' sites are ``Identity``):
  ``self_attn.linear_{q,k,v}_adapter_list.{k}.{0,1}`` (with ``use_shared_attention_adapter``)
  and ``feed_forward.gate_up_proj_adapter_list.{k}.{0,1}`` (always) -> our
  ``layers.L.mixer.adapters.{q,k,v,mlp}.{down,up}``.
- Attention: heads ``2 * hidden_size / num_attention_heads`` wide over the ``2 * hidden_size``
  input, scores scaled by ``(d_head / 2) ** -0.5``, RoPE only with ``use_mem_rope``, no biases.
  The MLP is gated with ``hidden_act`` (``gelu``: our ``geglu``); ``add_bias_linear`` biases the
  MLP and the Mamba projections alike.
- transformers ties the blocks' uses (``_tied_weights_keys``) only when
  ``tie_word_embeddings`` is true: with false, every hybrid layer holds a copy of its own (and
  unused adapter slots), which is not Zamba2's model, so that is refused with hybrid layers.
- Mamba-2: ``n_mamba_heads`` heads of ``mamba_expand * hidden_size / n_mamba_heads``,
  ``mamba_ngroups`` groups, the gated norm per group with a fixed eps of 1e-5 (so
  ``rms_norm_eps`` must be 1e-5), ``dt`` clamped below at ``time_step_min`` in the chunked scan
  (our ``mamba.dt_limit``; transformers' one-token decoding step does not clamp).
"""

from __future__ import annotations

import string
from typing import Any

from composer.blocks.zamba import ZambaConfig
from composer.config import AttentionConfig, ConfigError, MambaConfig, MLPConfig, ModelConfig
from composer.convert.base import (
    GATED_TO_HF_ACT,
    Adapter,
    common_to_hf,
    gated_activation,
    layer_pattern_error,
    mamba_links,
    require,
    rope_parameters,
)
from composer.convert.mamba_common import check_plain
from composer.convert.plan import Link

MAMBA, HYBRID = ("mamba", "linear_attention"), "hybrid"
MAMBA_EPS = 1e-5
"""``Zamba2RMSNormGated``'s eps in ``Zamba2MambaMixer`` (not read from the config)."""

# Zamba2Config (transformers 5.24) defaults: a field missing from config.json means these.
DEFAULTS: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=2560, mamba_d_state=64, mamba_d_conv=4, mamba_expand=2,
    mamba_ngroups=1, time_step_min=0.001, time_step_max=0.1, time_step_floor=1e-4,
    n_mamba_heads=8, use_conv_bias=True, chunk_size=256, add_bias_linear=False,
    hidden_act="gelu", num_attention_heads=32, num_key_value_heads=None, num_mem_blocks=1,
    use_shared_attention_adapter=False, adapter_rank=128, use_mem_rope=False,
    initializer_range=0.02, rms_norm_eps=1e-5, tie_word_embeddings=True)


def labels(n: int) -> list[str]:
    """The shared-layer labels of ``n`` blocks: ``a``, ``b``, ... (``m0``, ``m1``, ... past 26)."""
    return list(string.ascii_lowercase[:n]) if n <= 26 else [f"m{i}" for i in range(n)]


def hybrid_pattern(types: list[str], n_blocks: int) -> str:
    """The pattern of ``layers_block_type``: the ``k``-th hybrid layer a use of block
    ``k % n_blocks``."""
    names, seen, out, k = labels(n_blocks), set(), [], 0
    for t in types:
        if t != HYBRID:
            out.append("M")
            continue
        label = names[k % n_blocks]
        out.append(f"{{{label}}}" if label in seen else f"{{{label}:Z}}")
        seen.add(label)
        k += 1
    return "".join(out)


class Zamba2Adapter(Adapter):
    family = "zamba2"
    symbols = "MZ"
    max_positions = 4096
    architectures = ("Zamba2ForCausalLM",)
    model_type = "zamba2"

    # ---- config
    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        h = {**DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
        d, n_layers = require(hf, "hidden_size"), require(hf, "num_hidden_layers")
        types = hf.get("layers_block_type") or hf.get("layer_types")
        if (not isinstance(types, list) or len(types) != n_layers
                or any(t not in (*MAMBA, HYBRID) for t in types)):
            raise ConfigError(f"config.json: layers_block_type must list {n_layers} entries of "
                              f"'mamba' / 'hybrid', got {types!r}")
        if not h["tie_word_embeddings"] and HYBRID in types:
            raise ConfigError("config.json: tie_word_embeddings=false with hybrid layers: "
                              "transformers then ties nothing, not even the shared blocks (each "
                              "hybrid layer holds its own copy), which is not Zamba2's model")
        if float(h["rms_norm_eps"]) != MAMBA_EPS:
            raise ConfigError(f"config.json: rms_norm_eps={h['rms_norm_eps']}, but Zamba2's "
                              f"Mamba gated norm always uses {MAMBA_EPS} and ours uses norm_eps")
        n_heads = h["num_attention_heads"]
        d_head = 2 * d // n_heads
        params = rope_parameters(h)
        if h["use_mem_rope"] and params.get("rope_type", "default") != "default":
            raise ConfigError(f"config.json: rope type {params['rope_type']!r} is not supported "
                              "for Zamba2 (supported: default)")
        attention = AttentionConfig(
            n_heads=n_heads, n_kv_heads=h["num_key_value_heads"] or n_heads, d_head=d_head,
            position="rope" if h["use_mem_rope"] else "none",
            rope_theta=float(params.get("rope_theta", 10000.0)),
            softmax_scale=(d_head / 2) ** -0.5)
        d_inner = int(h["mamba_expand"] * d)
        mamba = MambaConfig(
            n_heads=h["n_mamba_heads"], d_head=d_inner // h["n_mamba_heads"],
            n_groups=h["mamba_ngroups"], d_state=h["mamba_d_state"], d_conv=h["mamba_d_conv"],
            chunk_size=h["chunk_size"], conv_bias=bool(h["use_conv_bias"]),
            proj_bias=bool(h["add_bias_linear"]), dt_min=float(h["time_step_min"]),
            dt_max=float(h["time_step_max"]), dt_init_floor=float(h["time_step_floor"]),
            dt_limit=(float(h["time_step_min"]), float("inf")))
        mlp = MLPConfig(d_ff=h.get("intermediate_size") or 4 * d,
                        activation=gated_activation(h["hidden_act"]),
                        bias=bool(h["add_bias_linear"]))
        return ModelConfig(
            pattern=hybrid_pattern(types, h["num_mem_blocks"]), d_model=d,
            vocab_size=require(hf, "vocab_size"), tie_embeddings=bool(h["tie_word_embeddings"]),
            norm_eps=float(h["rms_norm_eps"]), init_std=float(h["initializer_range"]),
            attention=attention, mamba=mamba, mlp=mlp,
            zamba=ZambaConfig(adapter_rank=h["adapter_rank"],
                              attention_adapters=bool(h["use_shared_attention_adapter"])))

    def sites(self, cfg: ModelConfig) -> tuple[list[int], list[str]]:
        """The hybrid layers in order, and the labels of the blocks in the order Zamba2 cycles
        them; raises unless the pattern is ``M`` / ``Z`` layers whose ``Z`` are shared layers
        used in turn."""
        p = cfg.parsed
        layers = p.layers
        why = None
        if p.mtp or any(t not in "MZ" for t in layers):
            why = "every layer must be 'M' or a shared 'Z' ({a:Z} ... {a})"
        hybrid = [i for i, t in enumerate(layers) if t == "Z"]
        order: list[str] = []
        for i in hybrid:
            if p.shared[i] is None:
                why = why or f"layer {i} ('Z') is not a shared layer; write it {{a:Z}}"
            elif p.shared[i] not in order:
                order.append(p.shared[i])
        if why is None and any(p.shared[i] != order[k % len(order)]
                               for k, i in enumerate(hybrid)):
            why = "its shared blocks are not used in turn (Zamba2 cycles num_mem_blocks blocks)"
        if why is not None:
            raise layer_pattern_error(self.family, cfg.pattern, why)
        return hybrid, order

    def config_to_hf(self, cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
        hybrid, order = self.sites(cfg)
        check_plain(cfg, self.family)
        self._check(cfg, hybrid)
        out = common_to_hf(cfg, base, self.architectures[0], self.model_type)
        legacy = "mamba" in (base.get("layers_block_type") or ())
        mamba_name = "mamba" if legacy else "linear_attention"
        types = [HYBRID if i in hybrid else mamba_name for i in range(len(cfg.parsed.layers))]
        out.update(num_hidden_layers=len(types), layers_block_type=types,
                   hybrid_layer_ids=hybrid, num_mem_blocks=max(len(order), 1),
                   rms_norm_eps=cfg.norm_eps)
        out.pop("layer_types", None)
        if hybrid:
            self._block_to_hf(cfg, out)
        m = cfg.mamba
        out.update(n_mamba_heads=m.n_heads, mamba_headdim=m.d_head, mamba_ngroups=m.n_groups,
                   mamba_d_state=m.d_state, mamba_d_conv=m.d_conv,
                   mamba_expand=m.n_heads * m.d_head // cfg.d_model, chunk_size=m.chunk_size,
                   use_conv_bias=m.conv_bias, add_bias_linear=m.proj_bias,
                   time_step_min=m.dt_min, time_step_max=m.dt_max,
                   time_step_floor=m.dt_init_floor)
        for key in ("dtype", "torch_dtype"):
            out.pop(key, None)
        return out

    def _check(self, cfg: ModelConfig, hybrid: list[int]) -> None:
        m, d = cfg.mamba, cfg.d_model
        checks = [("norm_eps=1e-5 (the Mamba gated norm's)", cfg.norm_eps == MAMBA_EPS),
                  ("norm_zero_centered=false", not cfg.norm_zero_centered),
                  ("post_norm_layers=[]", not cfg.post_norm_layers),
                  ("mamba.norm_group_size=null", m.norm_group_size is None),
                  ("mamba.dt_limit=[dt_min, inf]", tuple(m.dt_limit) == (m.dt_min, float("inf"))),
                  ("mamba.a_init_range=[1, 16]", tuple(m.a_init_range) == (1.0, 16.0)),
                  ("n_heads*d_head a multiple of d_model", (m.n_heads * m.d_head) % d == 0)]
        if hybrid:
            a, mlp = cfg.attention, cfg.mlp
            d_head = 2 * d // a.n_heads
            checks += [
                (f"attention.d_head={d_head} (2 * d_model / n_heads)", a.d_head == d_head),
                (f"attention.softmax_scale={(d_head / 2) ** -0.5!r}",
                 a.softmax_scale == (d_head / 2) ** -0.5),
                ("no attention biases", not (a.qkv_bias or a.out_bias)),
                ("attention.rotary_fraction=1.0", a.rotary_fraction == 1.0),
                ("attention.rope_scaling=null", a.rope_scaling is None),
                ("mlp.bias equal to mamba.proj_bias (add_bias_linear)", mlp.bias == m.proj_bias),
                ("tie_embeddings=true (transformers ties the shared blocks only then)",
                 cfg.tie_embeddings),
                ("mlp.activation swiglu or geglu", mlp.activation in GATED_TO_HF_ACT)]
        problems = [what for what, ok in checks if not ok]
        if problems:
            raise ConfigError(f"Zamba2 cannot express this model; it needs {', '.join(problems)}")

    @staticmethod
    def _block_to_hf(cfg: ModelConfig, out: dict[str, Any]) -> None:
        a, z, d = cfg.attention, cfg.zamba, cfg.d_model
        out.update(num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads or a.n_heads,
                   attention_head_dim=a.d_head, attention_hidden_size=2 * d,
                   kv_channels=d // a.n_heads, num_query_groups=a.n_heads,
                   use_mem_rope=a.position == "rope", intermediate_size=cfg.mlp.d_ff,
                   hidden_act=GATED_TO_HF_ACT[cfg.mlp.activation],
                   adapter_rank=z.adapter_rank,
                   use_shared_attention_adapter=z.attention_adapters)
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": a.rope_theta}
        out.pop("rope_theta", None)

    # ---- tensors
    def links(self, cfg: ModelConfig, fused_experts: bool) -> list[Link]:
        links = [Link("embed.weight", "model.embed_tokens.weight"),
                 Link("final_norm.weight", "model.final_layernorm.weight")]
        if not cfg.tie_embeddings:
            links.append(Link("lm_head.weight", "lm_head.weight"))
        hybrid, order = self.sites(cfg)
        first = {label: hybrid[b] for b, label in enumerate(order)}
        for label, i in first.items():
            links += block_links(f"shared.{label}", f"model.layers.{i}.shared_transformer",
                                 cfg)
        for i in range(len(cfg.parsed.layers)):
            ours, hf = f"layers.{i}", f"model.layers.{i}"
            if i not in hybrid:
                links.append(Link(f"{ours}.norm.weight", f"{hf}.input_layernorm.weight"))
                links += mamba_links(f"{ours}.mixer", f"{hf}.mamba", cfg.mamba)
                continue
            k = hybrid.index(i)
            block = f"model.layers.{first[cfg.parsed.shared[i]]}.shared_transformer"
            links += [Link(f"{ours}.norm.weight", f"{hf}.mamba_decoder.input_layernorm.weight"),
                      Link(f"{ours}.mixer.linear.weight", f"{hf}.linear.weight")]
            links += mamba_links(f"{ours}.mixer.mamba", f"{hf}.mamba_decoder.mamba", cfg.mamba)
            lists = {"mlp": "feed_forward.gate_up_proj_adapter_list"}
            if cfg.zamba.attention_adapters:
                lists |= {p: f"self_attn.linear_{p}_adapter_list" for p in "qkv"}
            for name, hf_list in lists.items():
                links += [Link(f"{ours}.mixer.adapters.{name}.{part}.weight",
                               f"{block}.{hf_list}.{k}.{j}.weight")
                          for j, part in enumerate(("down", "up"))]
        return links


def block_links(ours: str, hf: str, cfg: ModelConfig) -> list[Link]:
    """One shared transformer block: norms, attention, the MLP (``gate_up_proj`` split)."""
    f = cfg.mlp.d_ff
    links = [Link(f"{ours}.input_norm.weight", f"{hf}.input_layernorm.weight"),
             Link(f"{ours}.ff_norm.weight", f"{hf}.pre_ff_layernorm.weight")]
    links += [Link(f"{ours}.attn.{p}_proj.weight", f"{hf}.self_attn.{p}_proj.weight")
              for p in "qkvo"]
    suffixes = ("weight", "bias") if cfg.mlp.bias else ("weight",)
    for s in suffixes:
        links += [Link(f"{ours}.mlp.gate_proj.{s}", f"{hf}.feed_forward.gate_up_proj.{s}", (),
                       ((0, f),)),
                  Link(f"{ours}.mlp.up_proj.{s}", f"{hf}.feed_forward.gate_up_proj.{s}", (),
                       ((f, 2 * f),)),
                  Link(f"{ours}.mlp.down_proj.{s}", f"{hf}.feed_forward.down_proj.{s}")]
    return links
