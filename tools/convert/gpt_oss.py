"""gpt-oss (``GptOssForCausalLM``, OpenAI): attention with learned sinks, every other layer
sliding-window, each followed by a top-k MoE with biases and a clamped SwiGLU.

Checked against transformers 5.24 ``modeling_gpt_oss`` / ``configuration_gpt_oss``. Each HF layer
``L`` is two of ours: ``2L`` is attention, ``W`` for ``layer_types[L] == "sliding_attention"``
(window ``sliding_window``) or ``*`` for ``"full_attention"``, norm ``input_layernorm``:
``self_attn.{q,k,v,o}_proj`` with biases (``attention_bias``, true), the per-head ``sinks``, a
head width ``head_dim`` decoupled from ``hidden_size``, RoPE (rotate-half) with YaRN scaling
(``rope_parameters``; without it ``GptOssConfig`` builds yarn, factor 32, beta 32 / 1, not
truncated, from 4096 positions; theta 150000). ``2L + 1`` is the MoE ``E``, norm
``post_attention_layernorm``: ``mlp.router`` (a linear with bias; top-k on the logits, softmax
over the chosen: our ``moe.score_func = topk_softmax``, ``router_bias``) and ``mlp.experts``:

    gate_up_proj [E, D, 2F]  (x @ W: columns 2j the gate, 2j + 1 the up of hidden unit j)
    gate_up_proj_bias [E, 2F] (interleaved alike), down_proj [E, F, D], down_proj_bias [E, D]

ours ``experts.{gate,up}_proj [E, F, D]``, ``down_proj [E, D, F]`` and their ``*_bias``: a
transpose and a de-interleave, which are not byte ranges, so they are derived tensors
(:mod:`composer.convert.derived`), one expert at a time. The clamped SwiGLU's ``swiglu_limit`` /
``swiglu_alpha`` are ours by the same names. The head is untied; every norm uses
``rms_norm_eps``. transformers adds the load-balancing loss (``router_aux_loss_coef``, Switch
style like ours) only with ``output_router_logits`` (false in the published configs), so our
``moe.aux_loss_coeff`` is ``router_aux_loss_coef`` when that is true, else 0; an export with a
nonzero coefficient writes both, one with 0 turns ``output_router_logits`` off and keeps the
source's coefficient.

The published checkpoints hold the experts in MXFP4 (``gate_up_proj_blocks [E, 2F, D/32, 16]``
with ``gate_up_proj_scales [E, 2F, D/32]``, rows = output features, gate / up rows interleaved;
``down_proj_blocks [E, D, F/32, 16]``, ``down_proj_scales``; blocks flattened to
``[E, rows, D/2]`` are read too) and ``quantization_config``
(``quant_method: mxfp4``): dequantised on import (exactly) to the checkpoint's dtype (the
config's ``dtype`` / ``torch_dtype``, else bf16) or ``--dtype``, with a one-line notice; blocks
without their scales are refused. An export always writes plain tensors and no
``quantization_config``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from composer.config import ConfigError, ModelConfig, MoEConfig
from composer.convert.base import (
    Adapter,
    attention_from_hf,
    attention_links,
    attention_to_hf,
    common_to_hf,
    layer_pattern_error,
    require,
)
from composer.convert.derived import Derived, DerivedSource, dequantize_mxfp4, read_slice
from composer.convert.mamba_common import check_plain
from composer.convert.plan import Link
from composer.portable import DTYPE_NAMES, CheckpointError, TensorSource

SLIDING, FULL = "sliding_attention", "full_attention"
SYMBOL = {SLIDING: "W", FULL: "*"}

# GptOssConfig (transformers 5.24) defaults: a field missing from config.json means these.
DEFAULTS: dict[str, Any] = dict(
    num_hidden_layers=36, num_local_experts=128, vocab_size=201088, hidden_size=2880,
    intermediate_size=2880, head_dim=64, num_attention_heads=64, num_key_value_heads=8,
    sliding_window=128, tie_word_embeddings=False, initializer_range=0.02, rms_norm_eps=1e-5,
    num_experts_per_tok=4, swiglu_alpha=1.702, swiglu_limit=7.0, router_aux_loss_coef=0.001,
    attention_bias=True, hidden_act="silu")
ROPE_THETA = 150000.0
"""``GptOssConfig.default_theta``."""
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}
"""The ``rope_parameters`` ``GptOssConfig.__post_init__`` builds when there are none."""


def with_defaults(hf: dict[str, Any]) -> dict[str, Any]:
    h = {**DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
    if not hf.get("rope_parameters") and not hf.get("rope_scaling"):
        h["rope_parameters"] = {**DEFAULT_ROPE, "rope_theta": hf.get("rope_theta", ROPE_THETA)}
    return h


def layer_types_of(h: dict[str, Any]) -> list[str]:
    n = int(h["num_hidden_layers"])
    types = h.get("layer_types")
    if types is None:  # GptOssConfig: sliding first, then alternating
        types = [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    if not isinstance(types, list) or len(types) != n or not set(types) <= set(SYMBOL):
        raise ConfigError(f"config.json: layer_types must list {n} entries of {SLIDING!r} / "
                          f"{FULL!r}, got {types!r}")
    return types


class GptOssAdapter(Adapter):
    family = "gpt-oss"
    symbols = "W*E"
    max_positions = 131072
    architectures = ("GptOssForCausalLM",)
    model_type = "gpt_oss"
    save_fused_experts = True

    # ---- config
    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        h = with_defaults(hf)
        types = layer_types_of(h)
        if h.get("hidden_act") != "silu":
            raise ConfigError(f"config.json: hidden_act={h['hidden_act']!r}; gpt-oss's experts "
                              "apply their clamped SwiGLU whatever it says, and we read only "
                              "'silu'")
        attention = attention_from_hf(h, default_theta=ROPE_THETA)
        attention.sinks = True
        attention.window = int(h["sliding_window"]) if SLIDING in types else None
        moe = MoEConfig(
            n_experts=int(h["num_local_experts"]), top_k=int(h["num_experts_per_tok"]),
            d_ff=int(h["intermediate_size"]), activation="swiglu", score_func="topk_softmax",
            router_bias=True, expert_bias=True, swiglu_limit=float(h["swiglu_limit"]),
            swiglu_alpha=float(h["swiglu_alpha"]),
            aux_loss_coeff=float(h["router_aux_loss_coef"]) if h.get("output_router_logits")
            else 0.0)
        return ModelConfig(
            pattern="".join(SYMBOL[t] + "E" for t in types),
            d_model=require(h, "hidden_size"), vocab_size=require(h, "vocab_size"),
            tie_embeddings=bool(h["tie_word_embeddings"]), norm_eps=float(h["rms_norm_eps"]),
            init_std=float(h["initializer_range"]), attention=attention, mamba=None, mlp=None,
            moe=moe)

    def layer_types(self, cfg: ModelConfig) -> list[str]:
        layers = cfg.parsed.layers
        pairs = ["".join(layers[i:i + 2]) for i in range(0, len(layers), 2)]
        if len(layers) % 2 or cfg.parsed.mtp or any(p not in ("WE", "*E") for p in pairs):
            raise layer_pattern_error(self.family, cfg.pattern, "every layer must be 'WE' or "
                                      "'*E' (W: sliding-window attention)")
        return [SLIDING if p[0] == "W" else FULL for p in pairs]

    def config_to_hf(self, cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
        types = self.layer_types(cfg)
        self._check(cfg)
        a, e = cfg.attention, cfg.moe
        out = common_to_hf(cfg, base, self.architectures[0], self.model_type)
        out.pop("quantization_config", None)  # the export is never quantised
        attention_to_hf(cfg, out)
        out.update(num_hidden_layers=len(types), layer_types=types, rms_norm_eps=cfg.norm_eps,
                   num_local_experts=e.n_experts, num_experts_per_tok=e.top_k,
                   intermediate_size=e.d_ff, swiglu_limit=e.swiglu_limit,
                   swiglu_alpha=e.swiglu_alpha)
        if e.aux_loss_coeff > 0:
            out.update(router_aux_loss_coef=e.aux_loss_coeff, output_router_logits=True)
        elif out.get("output_router_logits"):  # absent means false
            out["output_router_logits"] = False
        if a.window is not None:
            out["sliding_window"] = a.window
        elif SLIDING not in types and "sliding_window" not in base:
            out["sliding_window"] = None
        for key in ("dtype", "torch_dtype"):
            out.pop(key, None)
        return out

    def _check(self, cfg: ModelConfig) -> None:
        a, e = cfg.attention, cfg.moe
        check_plain(cfg, self.family)
        checks = [
            ("norm_zero_centered=false", not cfg.norm_zero_centered),
            ("sandwich_norm=false", not cfg.sandwich_norm),
            ("post_norm_layers=[]", not cfg.post_norm_layers),
            ("attention.sinks=true", a.sinks),
            ("attention.qkv_bias=true", a.qkv_bias), ("attention.out_bias=true", a.out_bias),
            ("attention.position='rope'", a.position == "rope"),
            ("attention.rotary_fraction=1.0", a.rotary_fraction == 1.0),
            ("attention.qk_norm=false", not a.qk_norm),
            ("attention.softmax_scale=null", a.softmax_scale is None),
            ("attention.output_gate=false", not a.output_gate),
            ("attention.window_rope_theta=null", a.window_rope_theta is None),
            ("attention.mrope_section=null", a.mrope_section is None),
            ("moe.score_func='topk_softmax'", e.score_func == "topk_softmax"),
            ("moe.router_bias=true", e.router_bias), ("moe.expert_bias=true", e.expert_bias),
            ("moe.activation='swiglu'", e.activation == "swiglu"),
            ("moe.swiglu_limit set", e.swiglu_limit is not None),
            ("moe.routed_scaling_factor=1.0", e.routed_scaling_factor == 1.0),
            ("moe.n_shared_experts=0", not e.n_shared_experts),
            ("moe.capacity_factor=null", e.capacity_factor is None)]
        problems = [what for what, ok in checks if not ok]
        if problems:
            raise ConfigError(f"gpt-oss cannot express this model; it needs "
                              f"{', '.join(problems)}")

    # ---- tensors
    def links(self, cfg: ModelConfig, fused_experts: bool) -> list[Link]:
        """Import links: the experts from the derived per-expert tensors (:meth:`derive_hf`)."""
        links = self._common_links(cfg)
        for i in range(len(self.layer_types(cfg))):
            ours, hf = f"layers.{2 * i + 1}.mixer.experts", f"model.layers.{i}.mlp.experts"
            for e in range(cfg.moe.n_experts):
                links += [Link(f"{ours}.{p}", f"{hf}.{e}.{p}.weight", (e,), ())
                          for p in ("gate_proj", "up_proj", "down_proj")]
            links += [Link(f"{ours}.{p}_bias", f"{hf}.{p}_bias")
                      for p in ("gate_proj", "up_proj", "down_proj")]
        return links

    def export_links(self, cfg: ModelConfig, fused_experts: bool) -> list[Link]:
        """Export links: the experts from our derived HF-shaped tensors (:meth:`derive_ours`)."""
        links = self._common_links(cfg)
        for i in range(len(self.layer_types(cfg))):
            ours, hf = f"layers.{2 * i + 1}.mixer.experts", f"model.layers.{i}.mlp.experts"
            for e in range(cfg.moe.n_experts):
                links += [Link(f"{ours}.{p}.{e}", f"{hf}.{p}", (), (e,))
                          for p in ("gate_up_proj", "down_proj")]
            links += [Link(f"{ours}.gate_up_proj_bias", f"{hf}.gate_up_proj_bias"),
                      Link(f"{ours}.down_proj_bias", f"{hf}.down_proj_bias")]
        return links

    def _common_links(self, cfg: ModelConfig) -> list[Link]:
        links = [Link("embed.weight", "model.embed_tokens.weight"),
                 Link("final_norm.weight", "model.norm.weight")]
        if not cfg.tie_embeddings:
            links.append(Link("lm_head.weight", "lm_head.weight"))
        for i in range(len(self.layer_types(cfg))):
            hf, a, m = f"model.layers.{i}", f"layers.{2 * i}", f"layers.{2 * i + 1}"
            links += [Link(f"{a}.norm.weight", f"{hf}.input_layernorm.weight"),
                      Link(f"{m}.norm.weight", f"{hf}.post_attention_layernorm.weight"),
                      Link(f"{a}.mixer.sinks", f"{hf}.self_attn.sinks"),
                      Link(f"{m}.mixer.router.weight", f"{hf}.mlp.router.weight"),
                      Link(f"{m}.mixer.router.bias", f"{hf}.mlp.router.bias")]
            links += attention_links(f"{a}.mixer", f"{hf}.self_attn", cfg.attention)
        return links

    def derive_hf(self, source: TensorSource, hf: dict[str, Any],
                  notify: Callable[[str], None]) -> TensorSource:
        """Per expert ``mlp.experts.{e}.{gate,up,down}_proj.weight`` in our orientation and the
        de-interleaved ``gate_proj_bias`` / ``up_proj_bias``, from the plain or the MXFP4
        tensors (module docstring)."""
        derived: dict[str, Derived] = {}
        consumed: set[str] = set()
        names = set(source.names())
        n_mxfp4 = 0
        dtype = _checkpoint_dtype(source, hf)
        for name in sorted(names):
            prefix, _, leaf = name.rpartition(".")
            if not prefix.endswith(".mlp.experts"):
                continue
            if leaf in ("gate_up_proj", "down_proj"):
                consumed.add(name)
                derived |= _plain_experts(source, prefix, leaf)
            elif leaf in ("gate_up_proj_blocks", "down_proj_blocks"):
                scales = name.removesuffix("_blocks") + "_scales"
                if scales not in names:
                    raise CheckpointError(f"MXFP4 tensor {name!r} comes without its scales "
                                          f"{scales!r}")
                consumed |= {name, scales}
                derived |= _mxfp4_experts(source, prefix, leaf.removesuffix("_blocks"), dtype)
                n_mxfp4 += 1
            elif leaf.endswith("_scales") and name.removesuffix("_scales") + "_blocks" \
                    not in names:
                raise CheckpointError(f"MXFP4 scales {name!r} come without their blocks")
            elif leaf == "gate_up_proj_bias":
                consumed.add(name)
                for half, p in enumerate(("gate_proj", "up_proj")):
                    info = source.tensors[name]
                    derived[f"{prefix}.{p}_bias"] = Derived(
                        (info.shape[0], info.shape[1] // 2), info.dtype,
                        lambda s, name=name, half=half: s.read(name)[:, half::2], name)
        if n_mxfp4:
            notify(f"{n_mxfp4} MXFP4 expert tensors dequantised to "
                   f"{str(dtype).removeprefix('torch.')} on import (exact); the export "
                   "writes them unquantised")
        return DerivedSource(source, derived, consumed)

    def derive_ours(self, source: TensorSource, cfg: ModelConfig) -> TensorSource:
        """Per expert HF-shaped ``experts.gate_up_proj.{e} [D, 2F]`` (gate / up interleaved)
        and ``experts.down_proj.{e} [F, D]``, and the interleaved ``gate_up_proj_bias``."""
        derived: dict[str, Derived] = {}
        consumed: set[str] = set()
        for i in range(len(self.layer_types(cfg))):
            q = f"layers.{2 * i + 1}.mixer.experts"
            gate, up, down = (f"{q}.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
            consumed |= {gate, up, down, f"{q}.gate_proj_bias", f"{q}.up_proj_bias"}
            E, F, D = source.tensors[gate].shape
            for e in range(E):
                derived[f"{q}.gate_up_proj.{e}"] = Derived(
                    (D, 2 * F), source.tensors[gate].dtype,
                    lambda s, g=gate, u=up, e=e: _interleave(read_slice(s, g, e),
                                                             read_slice(s, u, e)).T, gate)
                derived[f"{q}.down_proj.{e}"] = Derived(
                    (F, D), source.tensors[down].dtype,
                    lambda s, d=down, e=e: read_slice(s, d, e).T, down)
            derived[f"{q}.gate_up_proj_bias"] = Derived(
                (E, 2 * F), source.tensors[f"{q}.gate_proj_bias"].dtype,
                lambda s, q=q: _interleave(s.read(f"{q}.gate_proj_bias").T,
                                           s.read(f"{q}.up_proj_bias").T).T, f"{q}.gate_proj_bias")
        return DerivedSource(source, derived, consumed)


def _interleave(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rows ``a[0], b[0], a[1], b[1], ...`` of two ``[F, ...]`` tensors."""
    return torch.stack([a, b], dim=1).reshape(2 * a.shape[0], *a.shape[1:])


def _plain_experts(source: TensorSource, prefix: str, leaf: str) -> dict[str, Derived]:
    name = f"{prefix}.{leaf}"
    info = source.tensors[name]
    E, rows, cols = info.shape  # gate_up [E, D, 2F], down [E, F, D]: x @ W
    if leaf == "down_proj":
        return {f"{prefix}.{e}.down_proj.weight": Derived(
            (cols, rows), info.dtype, lambda s, e=e: read_slice(s, name, e).T, name)
            for e in range(E)}
    return {f"{prefix}.{e}.{p}.weight": Derived(
        (cols // 2, rows), info.dtype,
        lambda s, e=e, half=half: read_slice(s, name, e)[:, half::2].T, name)
        for e in range(E) for half, p in enumerate(("gate_proj", "up_proj"))}


def _mxfp4_experts(source: TensorSource, prefix: str, proj: str,
                   dtype: torch.dtype) -> dict[str, Derived]:
    blocks, scales = f"{prefix}.{proj}_blocks", f"{prefix}.{proj}_scales"
    shape, s_shape = tuple(source.tensors[blocks].shape), tuple(source.tensors[scales].shape)
    # [E, rows, G, B] as published, or [E, rows, G * B] as transformers holds them
    if len(s_shape) != 3 or len(shape) not in (3, 4) or shape[:2] != s_shape[:2] \
            or (len(shape) == 4 and shape[2] != s_shape[2]) or shape[2] % s_shape[2]:
        raise CheckpointError(f"MXFP4 tensor {blocks!r} is {list(shape)} with scales "
                              f"{list(s_shape)}; expected [E, rows, G, B] and [E, rows, G]")
    E, rows, G = s_shape
    B = shape[3] if len(shape) == 4 else shape[2] // G
    dname = DTYPE_NAMES[dtype]

    def expert(s: TensorSource, e: int) -> torch.Tensor:  # [rows, G * 2B]
        packed = read_slice(s, blocks, e).reshape(rows, G, B)
        return dequantize_mxfp4(packed, read_slice(s, scales, e), dtype)

    if proj == "down_proj":  # rows = D: already ours, [D, F]
        return {f"{prefix}.{e}.down_proj.weight": Derived(
            (rows, G * 2 * B), dname, lambda s, e=e: expert(s, e), blocks) for e in range(E)}
    return {f"{prefix}.{e}.{p}.weight": Derived(
        (rows // 2, G * 2 * B), dname, lambda s, e=e, half=half: expert(s, e)[half::2], blocks)
        for e in range(E) for half, p in enumerate(("gate_proj", "up_proj"))}


def _checkpoint_dtype(source: TensorSource, hf: dict[str, Any]) -> torch.dtype:
    """The dtype MXFP4 tensors dequantise to: the config's ``dtype`` / ``torch_dtype``, else
    bf16."""
    name = hf.get("dtype") or hf.get("torch_dtype") or "bfloat16"
    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point \
        else torch.bfloat16

