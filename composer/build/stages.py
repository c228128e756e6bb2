"""The split of a model into pipeline stages: which layers each stage holds, what it costs
(``composer build --pp N``), the checks a pipelined run makes before any work, and this rank's
pruned model. The runtime (stage views, schedules, losses) is :mod:`composer.parallel.pipeline`.

With ``|`` in the pattern the segments are the stages, ``pp x V`` of them (``V`` virtual stages
per rank); without, the layers are cut into ``pp`` contiguous stages minimising the largest
stage's forward FLOPs per token (the LM head counting on the last stage; a linear-partition
dynamic program).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch import nn

from composer.blocks.model import HybridModel
from composer.build.builder import build_model
from composer.build.registry import layer_kind
from composer.config import ModelConfig
from composer.parallel.mesh import LayoutError, ParallelDims
from composer.parallel.pipeline import SCHEDULES, embed_stages, prune, rank_stages


@dataclass(frozen=True)
class StageInfo:
    index: int
    layers: tuple[int, ...]
    """Global layer indices."""
    pattern: str
    n_params: int
    """Parameters the stage holds (a copy of the embedding on the stages of
    :func:`~composer.parallel.pipeline.embed_stages` too)."""
    flops_per_token: int
    """Forward FLOPs per token of its layers (and the head on the last stage)."""


def _layer_flops(cfg: ModelConfig, seq_len: int) -> list[int]:
    return [layer_kind(s).flops_per_token(cfg, seq_len) for s in cfg.parsed.layers]


@functools.lru_cache(maxsize=256)
def _balance(costs: tuple[int, ...], parts: int, tail: int) -> tuple[int, ...]:
    """Cut points of ``costs`` into ``parts`` non-empty contiguous groups minimising the largest
    group's cost (the last group also pays ``tail``): the linear-partition dynamic program
    (cached: ``composer plan``'s search checks many layouts with the same ``pp``)."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest max cost of the first i layers in k groups; cut[k][i] its last cut
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            extra = tail if k == parts else 0
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j] + extra)
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [n], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return tuple(bounds[::-1])


def stage_layers(cfg: ModelConfig, pp: int, seq_len: int = 4096) -> list[tuple[int, ...]]:
    """The layers of every stage (module docstring); a one-line :class:`LayoutError` when the
    pattern's segments are not a multiple of ``pp`` or ``pp`` exceeds the layers."""
    parsed = cfg.parsed
    n = parsed.n_layers
    if pp < 1:
        raise LayoutError(f"--pp must be >= 1, got {pp}")
    segments = parsed.segments
    if len(segments) > 1:
        if len(segments) % pp:
            raise LayoutError(f"the pattern has {len(segments)} pipeline segments ('|'), not a "
                              f"multiple of --pp {pp}")
        out, start = [], 0
        for seg in segments:
            out.append(tuple(range(start, start + len(seg))))
            start += len(seg)
        return out
    if pp > n:
        raise LayoutError(f"--pp {pp} is larger than the model's {n} layers")
    bounds = _balance(tuple(_layer_flops(cfg, seq_len)), pp, 2 * cfg.d_model * cfg.vocab_size)
    return [tuple(range(a, b)) for a, b in zip(bounds, bounds[1:], strict=False)]


def split_stages(cfg: ModelConfig, pp: int, seq_len: int = 4096) -> list[StageInfo]:
    """Every stage's layers, pattern substring, parameters and forward FLOPs per token (what
    ``composer build --pp N`` prints)."""
    groups = stage_layers(cfg, pp, seq_len)
    model = build_model(cfg, device="meta")
    flops = _layer_flops(cfg, seq_len)
    infos = []
    holders = embed_stages(cfg, groups)
    for s, layers in enumerate(groups):
        first, last = s == 0, s == len(groups) - 1
        params = sum(p.numel() for i in layers for p in model.layers[str(i)].parameters())
        labels = {model.layers[str(i)].shared_label for i in layers} - {None}
        params += sum(p.numel() for a in labels for p in model.shared[a].parameters())  # copies
        if s in holders:
            params += model.embed.weight.numel()
        if first and getattr(model, "visual", None) is not None:  # the tower feeds the embedding
            params += sum(p.numel() for p in model.visual.parameters())
        if last:
            params += sum(p.numel() for p in _last_modules(model).parameters())
        fl = sum(flops[i] for i in layers) + (2 * cfg.d_model * cfg.vocab_size if last else 0)
        infos.append(StageInfo(s, layers, "".join(cfg.parsed.layers[i] for i in layers),
                               params, fl))
    return infos


def _last_modules(model: HybridModel) -> nn.ModuleList:
    """The last stage's own modules besides layers: final norm, head, MTP (when built)."""
    mods = [model.final_norm]
    if not model.config.tie_embeddings:
        mods.append(model.lm_head)
    if getattr(model, "mtp", None) is not None:
        mods.append(model.mtp)
    return nn.ModuleList(mods)


def check_pipeline(cfg: ModelConfig, pp: int, schedule: str | None, n_micro: int) -> tuple[
        list[tuple[int, ...]], str]:
    """The stage split and the schedule for ``pp`` ranks and ``n_micro`` micro-batches per
    step, or a one-line :class:`LayoutError` (before any work)."""
    groups = stage_layers(cfg, pp)
    virtual = len(groups) // pp
    name = schedule or ("interleaved-1f1b" if virtual > 1 else "1f1b")
    if name not in SCHEDULES:
        raise LayoutError(f"--pp-schedule must be one of {', '.join(SCHEDULES)}; got {name!r}")
    if virtual > 1 and name != "interleaved-1f1b":
        raise LayoutError(f"{len(groups)} stages on --pp {pp} ranks ({virtual} virtual stages "
                          f"each) need --pp-schedule interleaved-1f1b, not {name}")
    if n_micro < pp:
        raise LayoutError(f"{n_micro} micro-batches per step are fewer than the {pp} pipeline "
                          "ranks; raise --global-batch-size or lower --micro-batch-size")
    if name == "interleaved-1f1b" and n_micro % pp:
        raise LayoutError(f"interleaved-1f1b needs the micro-batches per step ({n_micro}) to be "
                          f"a multiple of --pp {pp}")
    return groups, name


def build_pipeline_model(cfg: ModelConfig, dims: ParallelDims) -> tuple[HybridModel,
                                                                         list[tuple[int, ...]]]:
    """The full model on meta, pruned to this rank's stages."""
    groups = stage_layers(cfg, dims.pp)
    model = build_model(cfg, device="meta")
    prune(model, groups, rank_stages(len(groups), dims.pp, dims.pp_rank()))
    return model, groups
