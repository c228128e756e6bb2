"""What every family adapter provides, and the HF-config helpers they share.

An adapter maps one Hugging Face architecture both ways: its ``config.json`` to our
:class:`ModelConfig` (and back onto a base ``config.json``, keeping the fields we do not model),
and its tensor names to ours as :class:`~composer.convert.plan.Link` lists. Adapters never touch
tensors: the engine in :mod:`composer.convert.plan` does the streaming.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer import config
from composer.config import ConfigError, ModelConfig
from composer.convert.plan import Link

if TYPE_CHECKING:  # the sections live in their block files, which import torch: read on use
    from composer.config import AttentionConfig, MambaConfig, RopeScaling

HF_ACT_TO_GATED = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu",
                   "gelu_pytorch_tanh": "geglu_tanh"}
GATED_TO_HF_ACT = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_pytorch_tanh"}


class Adapter(abc.ABC):
    """One HF architecture. Subclasses set the class attributes and implement the methods."""

    family: str = ""
    architectures: tuple[str, ...] = ()
    model_type: str = ""
    save_fused_experts: bool = False
    """The expert layout ``transformers``' ``save_pretrained`` writes for this family."""
    hf_keep_fp32: tuple[str, ...] = ()
    """HF name suffixes that transformers keeps in fp32 even in a bf16 checkpoint."""
    symbols: str = ""
    """The layer kinds (pattern symbols) this family's models are made of: how close a model
    that no family writes is to this one (:func:`composer.convert.infer.closeness`)."""
    max_positions: int | None = None
    """The HF config class's ``max_position_embeddings`` default (None: it has no such field),
    written on a fresh export when no scaled RoPE says more (:func:`max_positions`)."""

    @abc.abstractmethod
    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        """See the class docstring."""

    @abc.abstractmethod
    def config_to_hf(self, cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
        """See the class docstring."""

    @abc.abstractmethod
    def links(self, cfg: ModelConfig, fused_experts: bool) -> list[Link]:
        """See the class docstring."""

    def normalize(self, name: str) -> str:
        """Map an on-disk HF name to the canonical name the links use (prefix variants)."""
        return name

    def ignored(self, name: str, hf: dict[str, Any]) -> bool:
        """Source tensors that are deliberately not converted (e.g. rotary caches)."""
        return name.endswith("rotary_emb.inv_freq")

    def aside(self, name: str, hf: dict[str, Any]) -> bool:
        """Source tensors kept aside as they are (e.g. multi-token-prediction layers the config
        does not build): stored byte for byte in the checkpoint's ``hf/aside/`` and written
        back on export, never dropped. A tensor some link reads is never kept aside."""
        return False

    def source_layout(self, cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]
                      ) -> dict[str, Any]:
        """What a checkpoint's on-disk split holds that the config does not fix (OLMo-Hybrid's
        conv rows per input), from its tensors' ``shapes``: recorded in ``conversion.json`` and
        given to :meth:`relink` on import and export, so that the export splits the same way."""
        return {}

    def relink(self, links: list[Link], layout: dict[str, Any]) -> list[Link]:
        """``links`` for the on-disk split ``layout`` (:meth:`source_layout`; ``{}``: the
        Hub's)."""
        return links

    def export_links(self, cfg: ModelConfig, fused_experts: bool) -> list[Link]:
        """The links of an export: :meth:`links`, unless :meth:`derive_ours` derives tensors
        that the export reads instead of ours."""
        return self.links(cfg, fused_experts)

    def derive_hf(self, source: Any, hf: dict[str, Any], notify: Callable[[str], None]) -> Any:
        """The import's source with derived tensors (:mod:`composer.convert.derived`: what
        byte copies cannot express, e.g. a transpose or a dequantisation) in place of the ones
        they consume; ``notify`` takes a one-line notice. Default: ``source`` as it is."""
        return source

    def derive_ours(self, source: Any, cfg: ModelConfig) -> Any:
        """The export's source (our tensors) with derived tensors in place of ours they
        consume, for :meth:`export_links`. Default: ``source`` as it is."""
        return source

    def copy_links(self, cfg: ModelConfig) -> list[Link]:
        """HF tensors that are stored copies of one of our tensors (DeepSeek's MTP layer holds
        the embedding and the head again): on import each must equal, byte for byte, the HF
        tensor our tensor comes from, and is consumed; on export it is written again."""
        return []


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def without_mtp(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with the multi-token-prediction parts of its pattern removed."""
    return dataclasses.replace(cfg, pattern=dataclasses.replace(cfg.parsed, mtp=()).format())


def max_positions(cfg: ModelConfig, default: int) -> int:
    """``max_position_embeddings`` for a fresh export: the length a scaled RoPE (Llama-3's or
    YaRN's, attention or MLA; linear scaling has no original length) is scaled to,
    ``original_max_position * factor`` (DeepSeek-V3's
    163840; transformers warns when it is not above the original length), else the HF config
    class's ``default`` (what transformers assumes without the field). Our config has no
    sequence limit of its own."""
    scaling = [s for s in (cfg.attention and cfg.attention.rope_scaling,
                           cfg.mla and cfg.mla.rope_scaling)
               if s is not None and getattr(s, "rope_type", "yarn") != "linear"]
    if not scaling:
        return default
    return max(int(s.original_max_position * s.factor) for s in scaling)


def swapped_halves_links(ours: str, hf: str, rows: int, half: int) -> list[Link]:
    """Our ``[rows, 2 * half]`` tensor whose column halves HF stores the other way round (MTP's
    projection: ours ``[h; e]``, the checkpoints' ``[e; h]``): row by row, each half from the
    other; a byte permutation, exact both ways."""
    links = []
    for r in range(rows):
        links += [Link(ours, hf, (r, (0, half)), (r, (half, 2 * half))),
                  Link(ours, hf, (r, (half, 2 * half)), (r, (0, half)))]
    return links


def is_mtp_tensor(name: str, n_layers: int) -> bool:
    """A multi-token-prediction tensor: a decoder layer at or beyond ``num_hidden_layers``
    (DeepSeek-V3, GLM-4.5) or under ``mtp.`` (Qwen3-Next); what :meth:`Adapter.aside` keeps."""
    m = _LAYER.match(name)
    return bool(m and int(m.group(1)) >= n_layers) or name.startswith(("mtp.", "model.mtp."))


# ---------------------------------------------------------------- HF config helpers


def decode_floats(obj: Any) -> Any:
    """transformers writes inf as ``{"__float__": "Infinity"}``; decode such values."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"}:
            return float(obj["__float__"])
        return {k: decode_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_floats(v) for v in obj]
    return obj


def encode_floats(obj: Any) -> Any:
    if isinstance(obj, float) and (math.isinf(obj) or math.isnan(obj)):
        text = "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
        return {"__float__": text}
    if isinstance(obj, dict):
        return {k: encode_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode_floats(v) for v in obj]
    return obj


def load_hf_config(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"{path.parent}: no config.json; not a Hugging Face model folder")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return decode_floats(data)


def require(hf: dict[str, Any], key: str, *alternatives: str) -> Any:
    for k in (key, *alternatives):
        if hf.get(k) is not None:
            return hf[k]
    raise ConfigError(f"config.json: missing field {key!r}")


def rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling``.
    """
    params = dict(hf.get("rope_parameters") or {})
    if hf.get("rope_scaling"):
        params = {**hf["rope_scaling"], **params}
    if "rope_theta" not in params and hf.get("rope_theta") is not None:
        params["rope_theta"] = hf["rope_theta"]
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    return params


def rope_scaling_from_hf(params: dict[str, Any]) -> RopeScaling | None:
    """The scaling of one ``rope_parameters`` dict (:func:`rope_parameters`): None for
    ``default``; ``linear``, ``llama3`` and ``yarn`` carried field by field."""
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return config.RopeScaling(rope_type="linear", factor=float(params["factor"]))
    if rope_type == "llama3":
        return config.RopeScaling(factor=float(params["factor"]),
                           low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                           high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                           original_max_position=int(params["original_max_position_embeddings"]))
    if rope_type == "yarn":
        def opt(key: str) -> float | None:
            return None if params.get(key) is None else float(params[key])

        return config.RopeScaling(rope_type="yarn", factor=float(params["factor"]),
                           original_max_position=int(params["original_max_position_embeddings"]),
                           beta_fast=float(params.get("beta_fast") or 32.0),
                           beta_slow=float(params.get("beta_slow") or 1.0),
                           attention_factor=opt("attention_factor"), mscale=opt("mscale"),
                           mscale_all_dim=opt("mscale_all_dim"),
                           truncate=bool(params.get("truncate", True)))
    raise ConfigError(f"config.json: rope type {rope_type!r} is not supported yet "
                      "(supported: default, linear, llama3, yarn)")


def rope_scaling_to_hf(s: RopeScaling | None) -> dict[str, Any]:
    """The ``rope_parameters`` entries of ``s`` (besides ``rope_theta``); the inverse of
    :func:`rope_scaling_from_hf`."""
    if s is None:
        return {"rope_type": "default"}
    if s.rope_type == "linear":
        return {"rope_type": "linear", "factor": s.factor}
    if s.rope_type == "llama3":
        return {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position}
    out: dict[str, Any] = {"rope_type": "yarn", "factor": s.factor,
                           "original_max_position_embeddings": s.original_max_position,
                           "beta_fast": s.beta_fast, "beta_slow": s.beta_slow,
                           "truncate": s.truncate}
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        if getattr(s, key) is not None:
            out[key] = getattr(s, key)
    return out


def attention_from_hf(hf: dict[str, Any], *, qk_norm: bool = False, position: str = "rope",
                      default_theta: float = 10000.0) -> AttentionConfig:
    n_heads = require(hf, "num_attention_heads")
    d_model = require(hf, "hidden_size")
    params = rope_parameters(hf)
    scaling = rope_scaling_from_hf(params) if position == "rope" else None
    bias = bool(hf.get("attention_bias", False))
    return config.AttentionConfig(
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        d_head=hf.get("head_dim") or d_model // n_heads,
        position=position,  # type: ignore[arg-type]
        rope_theta=float(params.get("rope_theta", default_theta)),
        rope_scaling=scaling,
        rotary_fraction=float(params.get("partial_rotary_factor", 1.0)),
        qk_norm=qk_norm,
        qkv_bias=bias,
        out_bias=bias,
    )


def attention_to_hf(cfg: ModelConfig, out: dict[str, Any]) -> None:
    a = cfg.attention
    assert a is not None
    if a.qkv_bias != a.out_bias:
        raise ConfigError("HF attention has one attention_bias; qkv_bias and out_bias differ")
    out.update(num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads or a.n_heads,
               head_dim=a.d_head or cfg.d_model // a.n_heads, attention_bias=a.qkv_bias)
    if a.position == "rope":
        params: dict[str, Any] = {"rope_type": "default", "rope_theta": a.rope_theta}
        params.update(rope_scaling_to_hf(a.rope_scaling))
        if a.rotary_fraction != 1.0:
            params["partial_rotary_factor"] = a.rotary_fraction
        out["rope_parameters"] = params
        out.pop("rope_theta", None)
        out.pop("rope_scaling", None)


def rotary_fraction(h: dict[str, Any], default: float) -> float:
    """transformers' precedence: ``rope_parameters``, then the top-level field, then the
    default (MiniMax-M2's ``rotary_dim`` becomes the top-level ``partial_rotary_factor``)."""
    params = rope_parameters(h)
    if "partial_rotary_factor" in params:
        return float(params["partial_rotary_factor"])
    if h.get("partial_rotary_factor") is not None:
        return float(h["partial_rotary_factor"])
    if h.get("rotary_dim") is not None:
        d_head = h.get("head_dim") or require(h, "hidden_size") // require(h, "num_attention_heads")
        return h["rotary_dim"] / d_head
    return default


def rotary_to_hf(cfg: ModelConfig, out: dict[str, Any]) -> None:
    """Write the rotary fraction into ``rope_parameters`` always, and keep the legacy top-level
    fields (GLM's ``partial_rotary_factor``, MiniMax's ``rotary_dim``) consistent with it."""
    a = cfg.attention
    assert a is not None
    out["rope_parameters"]["partial_rotary_factor"] = a.rotary_fraction
    if "partial_rotary_factor" in out:
        out["partial_rotary_factor"] = a.rotary_fraction
    if "rotary_dim" in out:
        out["rotary_dim"] = int(config.d_head_of(cfg) * a.rotary_fraction)


def gated_activation(hf_act: str, field: str = "hidden_act") -> str:
    if hf_act not in HF_ACT_TO_GATED:
        raise ConfigError(f"config.json: {field}={hf_act!r} is not supported for a gated MLP "
                          f"(supported: {', '.join(HF_ACT_TO_GATED)})")
    return HF_ACT_TO_GATED[hf_act]


def common_to_hf(cfg: ModelConfig, base: dict[str, Any], architecture: str,
                 model_type: str, mup: bool = False) -> dict[str, Any]:
    """The fields every family writes; unless the family writes them (``mup``: Falcon-H1),
    refuses the options of its kinds that no other HF class has."""
    if not mup:
        check_no_mup(cfg, architecture)
    out = dict(base)
    out.update(architectures=[architecture], model_type=model_type, hidden_size=cfg.d_model,
               vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_embeddings,
               initializer_range=cfg.init_std)
    return out


def check_no_mup(cfg: ModelConfig, architecture: str) -> None:
    """Falcon-H1's options (µP multipliers, its Mamba norm variants) are not fields of the other
    HF classes: refuse them rather than drop them (P8, docs/conversion.md)."""
    a, m, mlp = (cfg.section(n) for n in ("attention", "mamba", "mlp"))
    found = []
    if a is not None and a.key_multiplier != 1.0:
        found.append(f"attention.key_multiplier={a.key_multiplier}")
    if mlp is not None:
        found += [f"mlp.{n}={getattr(mlp, n)}" for n in ("gate_multiplier", "down_multiplier")
                  if getattr(mlp, n) != 1.0]
    if m is not None:
        found += [f"mamba.{n}={getattr(m, n)}" for n, ok in (
            ("multipliers", m.multipliers is None), ("gated_norm", m.gated_norm),
            ("norm_before_gate", not m.norm_before_gate),
            ("out_proj_bias", m.out_proj_bias in (None, m.proj_bias))) if not ok]
    if found:
        raise ConfigError(f"{architecture} has no field for {', '.join(found)} (Falcon-H1's "
                          "options)")


def attention_links(ours: str, hf: str, a: AttentionConfig) -> list[Link]:
    """q/k/v/o projections (and biases, qk-norms); HF and we use the same names per prefix."""
    links = []
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        links.append(Link(f"{ours}.{proj}.weight", f"{hf}.{proj}.weight"))
        if a.qkv_bias:
            links.append(Link(f"{ours}.{proj}.bias", f"{hf}.{proj}.bias"))
    if a.qk_norm:
        links += [Link(f"{ours}.{n}.weight", f"{hf}.{n}.weight") for n in ("q_norm", "k_norm")]
    return links


def gated_mlp_links(ours: str, hf: str, bias: bool) -> list[Link]:
    """gate/up/down projections (and biases); HF and we use the same names under each prefix."""
    suffixes = ("weight", "bias") if bias else ("weight",)
    return [Link(f"{ours}.{p}.{s}", f"{hf}.{p}.{s}")
            for p in ("gate_proj", "up_proj", "down_proj") for s in suffixes]


def mamba_links(ours: str, hf: str, m: MambaConfig) -> list[Link]:
    """The Mamba-2 mixer's tensors; HF and we use the same names under each prefix."""
    names = ["in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "D", "norm.weight",
             "out_proj.weight"]
    if m.conv_bias:
        names.append("conv1d.bias")
    if m.proj_bias:
        names += ["in_proj.bias", "out_proj.bias"]
    return [Link(f"{ours}.{n}", f"{hf}.{n}") for n in names]


def layer_pattern_error(family: str, pattern: str, why: str) -> ConfigError:
    return ConfigError(f"pattern {pattern!r} cannot be written as {family}: {why}")
