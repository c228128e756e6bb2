"""Qwen3.5-VL (``Qwen3_5ForConditionalGeneration``) and Qwen3.5-MoE-VL
(``Qwen3_5MoeForConditionalGeneration``): the Hub's Qwen3.5 checkpoints (transformers 5.24
``modeling_qwen3_5``, ``modeling_qwen3_5_moe``, checked).

``config.json`` nests the language model's fields in ``text_config`` (read and written by the
text adapters of :mod:`composer.convert.qwen3_next`, so the language model converts exactly as a
``Qwen3_5ForCausalLM`` does) and the tower's in ``vision_config`` (:func:`vision_from_hf`); the
top level holds ``image_token_id`` / ``video_token_id`` / ``vision_start_token_id`` /
``vision_end_token_id`` and ``tie_word_embeddings``. The M-RoPE fields of
``text_config.rope_parameters`` (``mrope_section``, ``mrope_interleaved``) are kept on export.

Tensors: ``model.language_model.*`` are the text model's ``model.*`` (the text links renamed),
``lm_head.weight`` stays, and ``model.visual.*`` is the vision tower
(:mod:`composer.vision.tower`), mapped tensor by tensor by :func:`vision_links` from the spelling
table :data:`VISION_SPELLINGS` (one entry per naming in use; Qwen2.5-VL's ``visual.*`` and Gemma
3 / LLaVA's ``vision_tower.vision_model.*`` are further entries, not new code).

The config gets its ``vision:`` section (:class:`~composer.config.VisionConfig`, with the token
ids) and ``attention.mrope_section``; the model holds the tower at ``visual.*``, so its tensors
are linked like every other and checked by the same strict engine: a stray, missing or
mis-shaped ``model.visual.*`` tensor is a one-line error before anything is written.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from composer.config import ConfigError, ModelConfig, VisionConfig, validate_vision
from composer.convert.plan import Link
from composer.convert.qwen3_next import Qwen3_5Adapter, Qwen3_5MoeAdapter

# ---------------------------------------------------------------- the tower's key map


@dataclass(frozen=True)
class VisionSpelling:
    """One family's names for the tower's tensors. ``prefix`` heads every HF name; ``top``
    maps whole-tower tensors (HF suffix -> ours), ``block`` (with ``{i}``, HF block ``i``)
    heads a block's tensors, ``attn`` / ``mlp`` map a block's suffixes to our attention layer
    ``2i`` / MLP layer ``2i + 1``. Every entry is one whole tensor, copied unchanged."""

    prefix: str
    block: str
    top: dict[str, str]
    attn: dict[str, str]
    mlp: dict[str, str]


def _wb(pairs: dict[str, str]) -> dict[str, str]:
    """``{hf: ours}`` for the weight and the bias of each module."""
    return {f"{h}.{s}": f"{o}.{s}" for h, o in pairs.items() for s in ("weight", "bias")}


QWEN3_VL = VisionSpelling(
    prefix="model.visual.", block="blocks.{i}.",
    top={**_wb({"patch_embed.proj": "patch_embed", "merger.norm": "merger.norm",
                "merger.linear_fc1": "merger.mlp.up_proj",
                "merger.linear_fc2": "merger.mlp.down_proj"}),
         "pos_embed.weight": "pos_embed.weight"},
    attn=_wb({"norm1": "norm", "attn.qkv": "mixer.qkv_proj", "attn.proj": "mixer.o_proj"}),
    mlp=_wb({"norm2": "norm", "mlp.linear_fc1": "mixer.up_proj",
             "mlp.linear_fc2": "mixer.down_proj"}))
"""Qwen3-VL and Qwen3.5 (``model.visual.*``; tests/vision/test_tower.py ``HF_NAMES``)."""

VISION_SPELLINGS: dict[str, VisionSpelling] = {"qwen3-vl": QWEN3_VL}
"""The tower spellings, by name; an adapter names the one its checkpoints use."""

TEXT = "model.language_model."
"""Where the text model's ``model.*`` tensors sit in the VL checkpoints."""
OURS = "visual."
"""Where the tower's tensors sit in our model."""


def vision_links(v: VisionConfig, spelling: str = "qwen3-vl", ours: str = OURS) -> list[Link]:
    """The tower's tensors as links: ours (``ours`` + the keys of
    :class:`~composer.vision.tower.VisionTower`) <-> the HF names of ``spelling``."""
    s = VISION_SPELLINGS[spelling]
    links = [Link(ours + o, s.prefix + h) for h, o in s.top.items()]
    for i in range(v.depth):
        block = s.prefix + s.block.format(i=i)
        links += [Link(f"{ours}layers.{2 * i}.{o}", block + h) for h, o in s.attn.items()]
        links += [Link(f"{ours}layers.{2 * i + 1}.{o}", block + h) for h, o in s.mlp.items()]
    return links


# ---------------------------------------------------------------- the tower's config

VISION_DEFAULTS: dict[str, Any] = dict(
    depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304,
    num_heads=16, in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
    out_hidden_size=3584, num_position_embeddings=2304, initializer_range=0.02)
"""transformers 5.24's ``Qwen3_5VisionConfig`` (= ``Qwen3_5MoeVisionConfig``) defaults."""
HF_ACT = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
VISION_EPS = 1e-6
"""transformers' tower builds every LayerNorm with ``eps=1e-6`` (no config field)."""


def _side(value: Any, name: str) -> int:
    """``patch_size`` may be an int or a pair of equal ints."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ConfigError(f"config.json: vision_config.{name} {list(value)} is not square; "
                              "the tower takes square patches")
        value = value[0]
    return int(value)


def vision_from_hf(vc: dict[str, Any] | None, ids: dict[str, int] | None = None
                   ) -> VisionConfig:
    """``vision_config`` (transformers' names, its defaults for missing fields) as our
    :class:`VisionConfig`, with the placeholder token ids ``ids`` (the top level's
    ``image_token_id``, ...); validated on its own (against the text model by the config)."""
    ids = ids or {}
    h = {**VISION_DEFAULTS, **{k: v for k, v in (vc or {}).items() if v is not None}}
    act = h["hidden_act"]
    if act not in HF_ACT:
        raise ConfigError(f"config.json: vision_config.hidden_act {act!r}; the tower takes "
                          f"{', '.join(HF_ACT)}")
    rope = h.get("rope_parameters") or {}
    v = VisionConfig(
        depth=int(h["depth"]), d_model=int(h["hidden_size"]), n_heads=int(h["num_heads"]),
        d_ff=int(h["intermediate_size"]), activation=HF_ACT[act],
        patch_size=_side(h["patch_size"], "patch_size"),
        temporal_patch_size=_side(h["temporal_patch_size"], "temporal_patch_size"),
        in_channels=int(h["in_channels"]), merge_size=int(h["spatial_merge_size"]),
        d_out=int(h["out_hidden_size"]),
        n_position_embeddings=int(h["num_position_embeddings"]),
        rope_theta=float(rope.get("rope_theta", 10000.0)), norm_eps=VISION_EPS,
        init_std=float(h["initializer_range"]),
        **{k: ids[k] for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id")
           if k in ids})
    try:
        validate_vision(v)
    except ConfigError as exc:
        raise ConfigError(f"config.json: vision_config: {exc}") from None
    return v


def vision_to_hf(v: VisionConfig, base: dict[str, Any]) -> dict[str, Any]:
    """``v`` onto ``base`` (the source's ``vision_config``, its other fields kept)."""
    act = {ours: hf for hf, ours in HF_ACT.items()}
    if v.activation not in act:
        raise ConfigError(f"vision.activation {v.activation!r} has no transformers name here")
    out = dict(base)
    out.update(depth=v.depth, hidden_size=v.d_model, num_heads=v.n_heads,
               intermediate_size=v.d_ff, hidden_act=act[v.activation],
               patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
               in_channels=v.in_channels, spatial_merge_size=v.merge_size,
               out_hidden_size=v.d_out, num_position_embeddings=v.n_position_embeddings,
               initializer_range=v.init_std)
    out.setdefault("model_type", "qwen3_5_vision")
    return out


TOKEN_IDS = dict(image_token_id=248056, video_token_id=248057, vision_start_token_id=248053,
                 vision_end_token_id=248054)
"""transformers 5.24's ``Qwen3_5Config`` defaults (the same in ``Qwen3_5MoeConfig``)."""


def vl_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """What the VL config says beyond the text model: the placeholder token ids, M-RoPE's
    sections (``None``: not given) and the tower (a :class:`VisionConfig`)."""
    text = hf.get("text_config") or {}
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    ids = {k: int(hf.get(k, d) if hf.get(k) is not None else d) for k, d in TOKEN_IDS.items()}
    return dict(**ids, mrope_section=rope.get("mrope_section"),
                mrope_interleaved=bool(rope.get("mrope_interleaved", True)),
                vision=vision_from_hf(hf.get("vision_config"), ids))


# ---------------------------------------------------------------- the adapters


class _VLMixin:
    """The ``ForConditionalGeneration`` form of a Qwen3.5 text adapter (placed first in the
    bases, so its methods wrap the text adapter's)."""

    text_model_type = ""
    model_type = ""
    spelling = "qwen3-vl"

    def _text_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        if "text_config" not in hf:
            raise ConfigError("config.json: a vision-language config needs 'text_config'")
        text = dict(hf["text_config"])
        if hf.get("tie_word_embeddings") is not None:  # the top level is what transformers ties by
            text["tie_word_embeddings"] = hf["tie_word_embeddings"]
        return text

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        cfg = super().config_from_hf(self._text_hf(hf))  # type: ignore[misc]
        fields = vl_fields(hf)
        if fields["vision"].d_out != cfg.d_model:
            raise ConfigError(f"config.json: vision_config.out_hidden_size "
                              f"({fields['vision'].d_out}) must be the text hidden_size "
                              f"({cfg.d_model}): the merger's output replaces token embeddings")
        attention = cfg.attention
        if attention is not None and fields["mrope_section"] is not None:
            attention = dataclasses.replace(attention, mrope_section=list(fields["mrope_section"]),
                                            mrope_interleaved=fields["mrope_interleaved"])
        return dataclasses.replace(cfg, vision=fields["vision"], attention=attention)

    def config_to_hf(self, cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
        if cfg.vision is None:
            raise ConfigError("this model has no vision tower (no vision: section): it cannot "
                              f"be written as {self.architectures[0]}")  # type: ignore[attr-defined]
        text_base = dict(base.get("text_config") or {})
        text = super().config_to_hf(cfg, text_base)  # type: ignore[misc]
        text.pop("architectures", None)
        text["model_type"] = self.text_model_type
        a = cfg.attention
        if a is not None and a.mrope_section is not None:
            text["rope_parameters"].update(mrope_section=list(a.mrope_section),
                                           mrope_interleaved=a.mrope_interleaved)
        out = dict(base)
        out.update(architectures=[self.architectures[0]],  # type: ignore[attr-defined]
                   model_type=self.model_type, text_config=text,
                   tie_word_embeddings=text["tie_word_embeddings"])
        if "tie_word_embeddings" not in text_base:
            text.pop("tie_word_embeddings")
        v = cfg.vision
        out["vision_config"] = vision_to_hf(v, base.get("vision_config") or {})
        for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
            if getattr(v, key) is not None:
                out[key] = getattr(v, key)
        out.setdefault("video_token_id", TOKEN_IDS["video_token_id"])
        for key in ("dtype", "torch_dtype"):
            out.pop(key, None)
        return out

    def links(self, cfg: ModelConfig, fused_experts: bool) -> list[Link]:
        links = [dataclasses.replace(link, hf=TEXT + link.hf.removeprefix("model."))
                 if link.hf.startswith("model.") else link
                 for link in super().links(cfg, fused_experts)]  # type: ignore[misc]
        if cfg.vision is not None:
            links += vision_links(cfg.vision, self.spelling)
        return links


class Qwen3_5VLAdapter(_VLMixin, Qwen3_5Adapter):
    family = "qwen3.5-vl"
    architectures = ("Qwen3_5ForConditionalGeneration",)
    model_type = "qwen3_5"
    text_model_type = "qwen3_5_text"


class Qwen3_5MoeVLAdapter(_VLMixin, Qwen3_5MoeAdapter):
    family = "qwen3.5-moe-vl"
    architectures = ("Qwen3_5MoeForConditionalGeneration",)
    model_type = "qwen3_5_moe"
    text_model_type = "qwen3_5_moe_text"
