"""Config -> model: build on the meta device, materialise, seed, count, save and load.

``build_model`` validates the config, builds every layer from its registry record on the meta
device (no memory, any size) and hands the layers to :class:`HybridModel`; unless
``device="meta"``, it then allocates the weights on ``device`` and initialises them from ``seed``
(:func:`composer.build.init.init_weights`: the same values whatever the layout or device).
Parameter and FLOP counts work on the meta model, so a 56B preset is counted in seconds.
Portable checkpoints (``config.yaml`` + ``model.safetensors``) are written and read through
:mod:`composer.portable`, the one owner of the format.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from composer.blocks.model import HybridModel
from composer.blocks.plan import named_state
from composer.blocks.protocol import declared, plan_of
from composer.blocks.shared import distinct, share_layers
from composer.build.init import init_weights, load_weights, stored_dtypes
from composer.build.registry import build_layer, layer_kind, layout_rules
from composer.config import ModelConfig
from composer.portable import (
    CONFIG_FILE,
    DEFAULT_MAX_SHARD,
    DTYPE_NAMES,
    ORIGIN_FILE,
    PlannedTensor,
    ShardedWriter,
    TensorSource,
    atomic_folder,
    tensor_bytes,
)
from composer.vision.tower import VisionTower, tower_flops

if TYPE_CHECKING:
    from composer.parallel.mesh import ParallelDims


def check_buildable(cfg: ModelConfig) -> None:
    """Validate ``cfg`` and check that every symbol of its pattern (MTP parts too) has a block."""
    cfg.validate()
    pattern = cfg.parsed
    for token in pattern.tokens_used():
        layer_kind(token)


def mtp_layer_idx(cfg: ModelConfig, depth: int, j: int) -> int:
    """The ``layer_idx`` of layer ``j`` of MTP depth ``depth`` (0-based): the main numbering
    continued (:mod:`composer.blocks.mtp`)."""
    pattern = cfg.parsed
    return pattern.n_layers + depth * len(pattern.mtp[0]) + j


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int = 0,
                dtype: torch.dtype | None = None) -> HybridModel:
    """Build ``cfg``; on ``device="meta"`` no memory is allocated and nothing is initialised.
    Each ``/`` part of the pattern is one multi-token-prediction depth (``mtp.{d}``)."""
    check_buildable(cfg)
    pattern = cfg.parsed
    with torch.device("meta"):
        layers = {i: build_layer(cfg, i, sym) for i, sym in enumerate(pattern.layers)}
        shared = share_layers(cfg, layers)
        mtp = [{j: build_layer(cfg, mtp_layer_idx(cfg, d, j), sym) for j, sym in enumerate(part)}
               for d, part in enumerate(pattern.mtp)]
        visual = VisionTower(cfg.vision) if cfg.vision is not None else None
        model = HybridModel(cfg, layers, mtp, visual, shared)
    if torch.device(device).type == "meta":
        return model
    model.to_empty(device=device)
    init_weights(model, seed)
    if dtype is not None:
        cast_model(model, dtype)
    return model


def check_model(dims: ParallelDims, cfg: ModelConfig) -> None:
    """Divisibility of the model's heads, groups, widths and experts by the layout (every
    kind's declared rules); a one-line :class:`~composer.parallel.mesh.LayoutError`."""
    from composer.parallel.mesh import check_layout

    check_layout(dims, layout_rules(cfg))


def fp32_names(model: HybridModel) -> set[str]:
    """Names of parameters and buffers that stay fp32 whatever the model dtype (A_log, router)."""
    names = set()
    where = {id(m): n for n, m in model.named_modules()}  # a shared layer's: shared.a.*
    for mixer in distinct([layer.mixer for layer in model.all_layers()]):
        for name in declared(mixer, "keep_fp32"):
            owner, _, leaf = name.rpartition(".")
            module = mixer.get_submodule(owner) if owner else mixer
            names.add(f"{where[id(module)]}.{leaf}")
    return names


def cast_model(model: HybridModel, dtype: torch.dtype) -> HybridModel:
    """Cast floating tensors to ``dtype``, keeping :func:`fp32_names` in at least fp32."""
    keep = fp32_names(model)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.is_floating_point():
                # kept names stay at least fp32 (fp64 stays fp64)
                t.data = t.data.to(torch.promote_types(dtype, torch.float32) if name in keep
                                   else dtype)
    return model


# ---------------------------------------------------------------- counts


@dataclass
class ModelStats:
    n_layers: int
    layer_counts: dict[str, int]
    params_by_kind: dict[str, int]
    n_params: int
    n_active_params: int
    flops_per_token: int
    """Training FLOPs per token (forward + backward = 3x forward) at ``seq_len``, MTP included."""
    forward_flops_per_token: int
    seq_len: int
    mtp_forward_flops_per_token: list[int] = field(default_factory=list)
    """Forward FLOPs per token of each MTP depth (in ``forward_flops_per_token`` too): its
    projection, its layers and its pass through the shared head."""
    vision: dict | None = None
    """A vision-language model's tower (:func:`vision_stats`; in ``n_params`` too, as
    ``params_by_kind["vision tower"]``); None for a text model."""
    layer_forward_flops_per_token: int = 0
    """The part of ``forward_flops_per_token`` inside the layers (the main ones and the MTP
    depths'): what activation checkpointing recomputes. The head, the embedding and the MTP
    projections sit outside the checkpointed layers."""

    @property
    def bf16_bytes(self) -> int:
        return 2 * self.n_params

    def training_flops_per_token(self, ac: str = "none") -> int:
        """FLOPs a training step spends per token under ``--ac ac``: ``full`` runs each layer's
        forward a second time in the backward (:func:`composer.parallel.parallelize.apply_ac`
        checkpoints the layers only, so the head is not recomputed: Megatron's ``96 B s l h^2
        (1 + s/6h + V/16lh)``); ``selective`` recomputes norms and activations only, whose
        FLOPs are not counted (the matmuls' and attention's outputs are kept)."""
        return self.flops_per_token + (self.layer_forward_flops_per_token if ac == "full" else 0)


def _inactive_expert_params(mixer: torch.nn.Module, cfg: ModelConfig) -> int:
    moe = cfg.moe
    plan = plan_of(mixer)
    if moe is None or plan is None or plan.experts is None:
        return 0
    routed = sum(p.numel() for p in mixer.get_submodule(plan.experts).parameters())
    return routed * (moe.n_experts - moe.top_k) // moe.n_experts


def model_stats(model: HybridModel, seq_len: int = 4096) -> ModelStats:
    """Parameter counts (shared tensors once), active parameters and FLOPs per token. Each MTP
    depth is one ``params_by_kind`` entry (``"MTP depth 1 (*E)"``: its projection, norms and
    layers; the head and embedding are the main model's) and adds its FLOPs to the totals."""
    cfg = model.config
    pattern = cfg.parsed
    by_kind: dict[str, int] = {"embedding": model.embed.weight.numel()}
    inactive = sum(_inactive_expert_params(mixer, cfg)
                   for mixer in distinct([layer.mixer for layer in model.all_layers()]))
    for layer in model.layers.values():  # a shared layer's uses hold only their own parts
        name = f"{layer.symbol} {layer_kind(layer.symbol).name}"
        if layer.shared_label is not None and not any(True for _ in layer.parameters()):
            continue
        by_kind[name] = by_kind.get(name, 0) + sum(p.numel() for p in layer.parameters())
    uses = pattern.shared_uses()
    for label, part in (model.shared or {}).items():  # once, whatever the number of uses
        token = pattern.layers[uses[label][0]]
        by_kind[f"shared {label} ({token}, {len(uses[label])} uses)"] = sum(
            p.numel() for p in part.parameters())
    vision = None
    if getattr(model, "visual", None) is not None:
        vision = vision_stats(model.visual)
        by_kind["vision tower"] = vision["n_params"]
    by_kind["final norm"] = model.final_norm.weight.numel()
    if not cfg.tie_embeddings:
        by_kind["lm head"] = model.lm_head.weight.numel()
    for d, depth in enumerate(model.mtp or ()):
        by_kind[f"MTP depth {d + 1} ({''.join(pattern.mtp[d])})"] = sum(p.numel()
                                                               for p in depth.parameters())
    total = sum(p.numel() for p in model.parameters())
    assert total == sum(by_kind.values()), "parameter accounting out of step with the model"
    head = 2 * cfg.d_model * cfg.vocab_size

    def layers_flops(symbols: list[str]) -> int:
        return sum(layer_kind(s).flops_per_token(cfg, seq_len) for s in symbols)

    mtp = [2 * (2 * cfg.d_model) * cfg.d_model + head + layers_flops(part)
           for part in pattern.mtp]
    in_layers = layers_flops(pattern.layers) + sum(layers_flops(part) for part in pattern.mtp)
    forward = head + layers_flops(pattern.layers) + sum(mtp)
    return ModelStats(
        n_layers=pattern.n_layers,
        layer_counts=dict(pattern.counts()),
        params_by_kind=by_kind,
        n_params=total,
        n_active_params=total - inactive,
        flops_per_token=3 * forward,
        forward_flops_per_token=forward,
        seq_len=seq_len,
        mtp_forward_flops_per_token=mtp,
        vision=vision,
        layer_forward_flops_per_token=in_layers,
    )


VISION_STATS_PIXELS = 512
"""The side of the square image ``composer build`` counts the tower's FLOPs on."""


def vision_stats(tower: torch.nn.Module, side: int = VISION_STATS_PIXELS) -> dict:
    """The tower's pattern, layer counts, parameters by part and forward FLOPs on one
    ``side x side`` image (one frame, :func:`composer.vision.tower.tower_flops`)."""
    v = tower.cfg
    unit = v.patch_size * v.merge_size
    grid = (1, max(1, round(side / unit)) * v.merge_size, max(1, round(side / unit)) * v.merge_size)

    def count(mods: list[torch.nn.Module]) -> int:
        return sum(p.numel() for m in mods for p in m.parameters())

    attn = [layer for layer in tower.layers if type(layer.mixer).__name__ == "VisionAttention"]
    mlp = [layer for layer in tower.layers if layer not in attn]
    parts = {"patch embedding": count([tower.patch_embed]),
             "position embedding": count([tower.pos_embed]),
             "B bidirectional attention": count(attn), "- MLP": count(mlp),
             "merger": count([tower.merger])}
    n_params = sum(p.numel() for p in tower.parameters())
    assert n_params == sum(parts.values()), "vision parameter accounting out of step"
    return {"pattern": v.pattern, "layer_counts": {"B bidirectional attention": len(attn),
                                                   "- MLP": len(mlp)},
            "params_by_part": parts, "n_params": n_params, "image_pixels": [side, side],
            "image_grid_thw": list(grid),
            "image_tokens": grid[0] * grid[1] * grid[2] // v.merge_size**2,
            "forward_flops_per_image": tower_flops(v, [grid])}


# ---------------------------------------------------------------- portable checkpoints


def write_portable(folder: str | Path, cfg: ModelConfig,
                   tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
                   read: Iterator[tuple[str, torch.Tensor]], force: bool = False,
                   max_shard_bytes: int = DEFAULT_MAX_SHARD, family: str | None = None,
                   extra_dirs: Mapping[str, Path] | None = None) -> Path:
    """Write a portable checkpoint atomically: ``tensors`` is the plan (name, dtype, shape) and
    ``read`` yields the tensors in that order, one at a time (bounded memory). ``family`` (a
    zoo preset's) is recorded in ``origin.json``, so ``to-hf`` writes that family's class.
    ``extra_dirs`` (name -> folder) are copied in under those names before the checkpoint is
    published (a training run's ``tokenizer/``)."""
    folder = Path(folder)
    plan = [PlannedTensor(name, DTYPE_NAMES[dtype], tuple(shape)) for name, dtype, shape in tensors]
    with atomic_folder(folder, force) as tmp:
        cfg.save(tmp / CONFIG_FILE)
        for name, src in (extra_dirs or {}).items():
            shutil.copytree(src, tmp / name)
        if family:
            (tmp / ORIGIN_FILE).write_text(json.dumps({"family": family}) + "\n")
        writer = ShardedWriter(tmp, plan, max_shard_bytes)  # keeps the plan's order
        for name, t in read:
            writer.write(name, tensor_bytes(t.cpu()))
        writer.close()
    return folder


def save(model: HybridModel, folder: str | Path, force: bool = False,
         max_shard_bytes: int = DEFAULT_MAX_SHARD, family: str | None = None) -> Path:
    """Write ``config.yaml`` and ``model.safetensors`` (sharded with an index past
    ``max_shard_bytes``) atomically; a single-device model."""
    state = model.state_dict()
    plan = [(k, v.dtype, tuple(v.shape)) for k, v in state.items()]
    return write_portable(folder, model.config, plan, iter(state.items()), force,
                          max_shard_bytes, family)


def open_portable(folder: str | Path) -> tuple[ModelConfig, TensorSource]:
    folder = Path(folder)
    if not (folder / CONFIG_FILE).exists():
        raise FileNotFoundError(f"{folder}: no {CONFIG_FILE}; not a composer checkpoint")
    return ModelConfig.load(folder / CONFIG_FILE), TensorSource(folder)


def adopt_dtypes(model: HybridModel, source: TensorSource) -> None:
    """Give the (meta) model's tensors the checkpoint's dtypes, before they are allocated."""
    dtypes = stored_dtypes(model, source)
    for name, t in named_state(model):
        if t.dtype != dtypes[name]:
            t.data = t.data.to(dtypes[name])


def load(folder: str | Path, device: str | torch.device = "cpu") -> HybridModel:
    """Load a portable checkpoint; every key must match the config, with the right shape. The
    tensors keep the checkpoint's dtypes."""
    cfg, source = open_portable(folder)
    try:
        model = build_model(cfg, device="meta")
        adopt_dtypes(model, source)
        model.to_empty(device=device)
        load_weights(model, source)
    finally:
        source.close()
    return model
