"""LoRA: low-rank adapters on the projections the blocks declare (Hu et al. 2021).

``y = W x + (alpha / r) B A x`` with ``A [r, in]`` Kaiming-uniform (``a = sqrt(5)``, i.e.
``U(-1/sqrt(in), 1/sqrt(in))``, PEFT's default) and ``B [out, r]`` zero, so that at init the
adapted model computes exactly what the base does. The base is frozen: only adapters require
grad, so the optimizer holds only them.

Each mixer declares its projections (``lora_targets()``, :class:`composer.blocks.protocol.Mixer`):
target name -> submodule path. ``--lora-targets all`` takes every declared name but
``experts``; ``experts`` takes the routed experts. An adapter is the child ``lora`` of its base
projection and acts from outside, through a forward hook on the base (no block forward changes):

    <base>.lora.A.weight  [r, in]     <base>.lora.B.weight  [out, r]
    (Mamba-2's fused in_proj: B is a SplitLinear, ``<base>.lora.B.weight`` fused in the state
    dict, held per part so that tensor parallelism splits it like its base)

Routed experts (``experts``) hold 3-D weights ``[E, out, in]``; they are adapted in weight
space: per weight, ``<experts>.lora.<weight>.A [E, r, in]`` and ``.B [E, out, r]``, and a
forward pre-hook on the experts module shadows the weight with ``W + (alpha/r) B @ A`` for the
forward. Dropout does not apply there (there is no input to drop).

:func:`disabled` turns every adapter off for a while (the hooks add nothing, the experts read their
base weights): the base model without a copy, e.g. DPO's and GRPO's reference under LoRA.

Blocks never import this; the parallel layer applies it (``composer/parallel/lora.py``), after
tensor / expert parallelism and before FSDP, so that adapters are sharded like their bases.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from composer.blocks.model import named_layers
from composer.blocks.plan import ZEROS, Init, Uniform, init_module, rule_for
from composer.blocks.protocol import lora_targets_of
from composer.blocks.split import SplitLinear
from composer.config import ConfigError

ALL, EXPERTS = "all", "experts"


@dataclass(frozen=True)
class LoRAConfig:
    """``--lora-rank``, ``--lora-alpha`` (default: the rank), ``--lora-dropout``,
    ``--lora-targets``."""

    rank: int
    alpha: float | None = None
    dropout: float = 0.0
    targets: tuple[str, ...] = (ALL,)
    ranks: Mapping[str, int] | None = None
    """Per-projection ranks (module path or target name -> rank): an imported PEFT adapter's
    ``rank_pattern``, or a rank widened by fusing; default ``rank``."""
    scalings: Mapping[str, float] | None = None
    """Per-projection scalings, likewise (``alpha_pattern``); default :attr:`scaling`."""
    paths: tuple[str, ...] | None = None
    """Adapt only these module paths among the targets (an imported adapter's modules)."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ConfigError(f"--lora-rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"--lora-dropout must be in [0, 1), got {self.dropout}")
        if not self.targets:
            raise ConfigError("--lora-targets names no projection")

    @property
    def scaling(self) -> float:
        return (self.rank if self.alpha is None else self.alpha) / self.rank


def lora_config(recipe: Any) -> LoRAConfig | None:
    """The recipe's LoRA (``lora_rank``, ``lora_alpha``, ``lora_dropout``, ``lora_targets``),
    or None when ``lora_rank`` is 0."""
    if not recipe.lora_rank:
        return None
    return LoRAConfig(rank=recipe.lora_rank, alpha=recipe.lora_alpha,
                      dropout=recipe.lora_dropout, targets=tuple(recipe.lora_targets))


def _kaiming(d_in: int) -> Init:
    bound = 1.0 / math.sqrt(d_in)  # kaiming_uniform_(a=sqrt(5)): gain sqrt(1/3) * sqrt(3/in)
    return Uniform(-bound, bound)


class LoRA(nn.Module):
    """The adapter of one projection: ``scaling * B(A(dropout(x)))``."""

    def __init__(self, d_in: int, d_out: int | Mapping[str, int], rank: int, scaling: float,
                 dropout: float = 0.0, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.d_in, self.rank, self.scaling, self.dropout = d_in, rank, float(scaling), dropout
        self.off = False
        """Set by :func:`disabled`: the adapter adds nothing."""
        self.A = nn.Linear(d_in, rank, bias=False, device=device, dtype=dtype)
        if isinstance(d_out, Mapping):  # the parts of a fused base (SplitLinear)
            with torch.device(device or "cpu"):
                self.B: nn.Module = SplitLinear(rank, dict(d_out), bias=False)
            if dtype is not None:
                self.B.to(dtype)
        else:
            self.B = nn.Linear(rank, d_out, bias=False, device=device, dtype=dtype)

    def init_rules(self) -> dict[str, Init]:
        return {"A.weight": _kaiming(self.d_in), "B.weight*": ZEROS}

    def b_weight(self) -> torch.Tensor:
        b = self.B
        return b.fused_weight() if isinstance(b, SplitLinear) else b.weight

    def delta(self) -> torch.Tensor:
        """``scaling * B @ A``, the base weight's change (``[out, in]``)."""
        return self.scaling * (self.b_weight() @ self.A.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout and self.training:
            x = F.dropout(x, self.dropout, training=True)
        return self.scaling * self.B(self.A(x))


class ExpertLoRA(nn.Module):
    """The adapter of one routed-expert weight ``[E, out, in]``: ``A [E, r, in]``,
    ``B [E, out, r]``; the weight reads ``W + scaling * B @ A`` during the forward."""

    def __init__(self, shape: tuple[int, int, int], rank: int, scaling: float,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        n, d_out, d_in = shape
        self.d_in, self.rank, self.scaling = d_in, rank, float(scaling)
        self.off = False
        """Set by :func:`disabled`: the weight reads as its base."""
        self.A = nn.Parameter(torch.empty(n, rank, d_in, device=device, dtype=dtype))
        self.B = nn.Parameter(torch.empty(n, d_out, rank, device=device, dtype=dtype))

    def init_rules(self) -> dict[str, Init]:
        return {"A": _kaiming(self.d_in), "B": ZEROS}

    def delta(self, a: torch.Tensor | None = None, b: torch.Tensor | None = None) -> torch.Tensor:
        a = self.A if a is None else a
        b = self.B if b is None else b
        return self.scaling * torch.bmm(b, a)


def _add_lora(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return out if module.lora.off else out + module.lora(args[0])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _shadow_experts(module: nn.Module, args: tuple) -> None:
    # after any local-view hook (registered earlier): the weight this forward reads, plus delta
    for name, adapter in module.lora.named_children():
        if adapter.off:  # the base weight as it is (a local view, if any, stays in place)
            continue
        w = module.__dict__.get(name, module._parameters[name])
        module.__dict__[name] = _local(w) + adapter.delta(_local(adapter.A), _local(adapter.B))


def _unshadow_experts(module: nn.Module, args: tuple, out: object) -> None:
    for name, adapter in module.lora.named_children():
        if not adapter.off:
            module.__dict__.pop(name, None)


# ---------------------------------------------------------------- attaching


@dataclass(frozen=True)
class Target:
    """One projection to adapt: its module path in the model, the target name it matched."""

    path: str
    name: str


def available_targets(model: nn.Module) -> dict[str, list[str]]:
    """Target name -> the module paths (in the model) it names, over every layer."""
    out: dict[str, list[str]] = {}
    for prefix, layer in named_layers(model):
        for name, path in lora_targets_of(layer.mixer).items():
            out.setdefault(name, []).append(f"{prefix}.mixer.{path}")
    return out


def select_targets(model: nn.Module, names: tuple[str, ...]) -> list[Target]:
    """The projections ``names`` pick (``all``: every declared one but ``experts``); names that
    match nothing are a one-line :class:`ConfigError` listing the available ones."""
    avail = available_targets(model)
    unknown = [n for n in names if n != ALL and n not in avail]
    if unknown:
        listed = ", ".join(sorted(avail)) or "none"
        raise ConfigError(f"--lora-targets {' '.join(unknown)}: no such projection in this "
                          f"model (available: all, {listed})")
    wanted = {n for n in avail if n != EXPERTS} if ALL in names else set()
    wanted |= {n for n in names if n != ALL}
    out = [Target(p, n) for n, paths in avail.items() if n in wanted for p in paths]
    if not out:
        raise ConfigError(f"--lora-targets {' '.join(names)}: no projection of this model "
                          "to adapt")
    return out


def _lookup(table: Mapping[str, Any] | None, target: Target, default: Any) -> Any:
    if not table:
        return default
    return table.get(target.path, table.get(target.name, default))


def _attach_linear(base: nn.Module, rank: int, scaling: float, dropout: float) -> None:
    if isinstance(base, SplitLinear):
        weights = base.weights()
        d_out: int | dict[str, int] = {p: w.shape[0] for p, w in zip(base.parts, weights,
                                                                     strict=True)}
        w = weights[0]
    elif isinstance(base, nn.Linear):
        d_out, w = base.weight.shape[0], base.weight
    else:
        raise TypeError(f"LoRA adapts nn.Linear or SplitLinear, not {type(base).__name__}")
    # where and as its base is (on meta before materialisation; fp32 masters for training)
    base.lora = LoRA(w.shape[1], d_out, rank, scaling, dropout, device=w.device, dtype=w.dtype)
    base.register_forward_hook(_add_lora)


def _attach_experts(experts: nn.Module, rank: int, scaling: float) -> None:
    holder = nn.Module()
    for name, p in experts.named_parameters(recurse=False):
        if p.ndim == 3:
            holder.add_module(name, ExpertLoRA(tuple(p.shape), rank, scaling, device=p.device,
                                                 dtype=p.dtype))
    experts.lora = holder
    experts.register_forward_pre_hook(_shadow_experts)
    experts.register_forward_hook(_unshadow_experts, always_call=True)


def add_lora(model: nn.Module, cfg: LoRAConfig, ranks: Mapping[str, int] | None = None,
             scalings: Mapping[str, float] | None = None, seed: int = 0) -> list[Target]:
    """Attach adapters to the projections ``cfg.targets`` pick and freeze everything else.

    ``ranks`` / ``scalings`` override ``cfg.rank`` / ``cfg.scaling`` per projection, keyed by
    its module path in the model (``layers.0.mixer.q_proj``) or by target name (``q_proj``):
    an imported PEFT adapter's ``rank_pattern`` / ``alpha_pattern``, or a rank widened by fusing
    several HF modules' adapters into one of ours. Works on the meta device (the adapters are
    made where their base's weight is, and there initialised from ``seed`` by their init rules,
    as the builder initialises every tensor: ``composer.build.init``). Returns the adapted
    targets."""
    targets = select_targets(model, cfg.targets)
    if cfg.paths is not None:
        keep = set(cfg.paths)
        missing = sorted(keep - {t.path for t in targets})
        if missing:
            raise ConfigError(f"LoRA: {missing[0]!r} is not a projection of this model that "
                              f"{' '.join(cfg.targets)} names")
        targets = [t for t in targets if t.path in keep]
    before = adapter_names(model)
    ranks = cfg.ranks if ranks is None else ranks
    scalings = cfg.scalings if scalings is None else scalings
    for t in targets:
        rank = _lookup(ranks, t, cfg.rank)
        scaling = _lookup(scalings, t, cfg.scaling)
        module = model.get_submodule(t.path)
        if t.name == EXPERTS:
            _attach_experts(module, rank, scaling)
        else:
            _attach_linear(module, rank, scaling, cfg.dropout)
    freeze_base(model)
    _check_init(model)
    fresh = [m for name, m in adapter_modules(model) if not any(
        f"{name}.{n}" in before for n, _ in m.named_parameters())]
    if any(p.device.type != "meta" for m in fresh for p in m.parameters()):
        # a model in memory: B = 0 now (a meta model is initialised by the builder, by name and
        # layout-independently; composer.build sits above this module)
        generator = torch.Generator().manual_seed(seed)
        for m in fresh:
            init_module(m, generator)
    return targets


def adapter_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, adapter)`` of every :class:`LoRA` and :class:`ExpertLoRA` in ``model``."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRA | ExpertLoRA)]


@contextlib.contextmanager
def disabled(model: nn.Module) -> Iterator[None]:
    """Within the block, every adapter of ``model`` (projections' and routed experts') adds
    nothing: the model computes what its base does, with no copy of the weights. Each adapter's
    earlier state is restored on exit (nesting is fine). Applies to every layout: the flag is on
    the adapter modules, which sharding keeps."""
    adapters = [m for _, m in adapter_modules(model)]
    before = [m.off for m in adapters]
    for m in adapters:
        m.off = True
    try:
        yield
    finally:
        for m, off in zip(adapters, before, strict=True):
            m.off = off


def adapter_names(model: nn.Module) -> set[str]:
    """The parameter names of every adapter (``...q_proj.lora.A.weight``)."""
    out = set()
    for prefix, module in adapter_modules(model):
        out |= {f"{prefix}.{n}" for n, _ in module.named_parameters()}
    return out


def is_adapter(name: str) -> bool:
    """Whether a parameter or state-dict key belongs to an adapter (by its name)."""
    return name.startswith("lora.") or ".lora." in name


def freeze_base(model: nn.Module) -> None:
    """Only adapters require grad (no gradient, no optimizer state for the base)."""
    mine = adapter_names(model)
    for name, p in model.named_parameters():
        p.requires_grad_(name in mine)


def _check_init(model: nn.Module) -> None:
    """Each adapter's tensors take its own init: a block glob that reached into them (``*``)
    would initialise B randomly, and the adapted model would not start as the base."""
    for prefix, module in adapter_modules(model):
        for name, _ in module.named_parameters():
            mine = rule_for(module, name)
            if rule_for(model, f"{prefix}.{name}") != mine:
                raise ValueError(f"{prefix}.{name}: an init rule of an outer module names this "
                                 "adapter tensor; narrow the block's init_rules glob")


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors by state-dict key (a fused B whole), detached."""
    return {k: v for k, v in model.state_dict().items() if is_adapter(k)}


@torch.no_grad()
def load_lora_state_dict(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy adapter tensors (keys as :func:`lora_state_dict` gives them; a fused B whole) into
    ``model``'s adapters (a single-process model, after :func:`add_lora` with the adapter's
    ranks). Every adapter must be given, and nothing else; shapes must match."""
    want = lora_state_dict(model)
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or extra:
        what = f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}"
        raise ValueError(f"LoRA adapter tensors do not match the model's adapters: {what}")
    for key, value in tensors.items():
        if tuple(value.shape) != tuple(want[key].shape):
            raise ValueError(f"LoRA adapter {key}: shape {list(value.shape)}, the model's "
                             f"adapter is {list(want[key].shape)}")
    model.load_state_dict(dict(tensors), strict=False)


@torch.no_grad()
def merge_lora(model: nn.Module) -> None:
    """``W += scaling * B @ A`` for every adapter, in place (a whole single-process model), then
    remove the adapters and their hooks; the base's parameters require grad again."""
    for module in list(model.modules()):
        lora = getattr(module, "lora", None) if "lora" in module._modules else None
        if isinstance(lora, LoRA):
            delta = lora.delta()
            if isinstance(module, SplitLinear):
                rows = 0
                for w in module.weights():
                    w.add_(delta[rows:rows + w.shape[0]].to(w.dtype))
                    rows += w.shape[0]
            else:
                module.weight.add_(delta.to(module.weight.dtype))
            _remove_hooks(module._forward_hooks, _add_lora)
        elif lora is not None and any(isinstance(c, ExpertLoRA) for c in lora.children()):
            for name, adapter in lora.named_children():
                w = module._parameters[name]
                w.add_(adapter.delta().to(w.dtype))
            _remove_hooks(module._forward_pre_hooks, _shadow_experts)
            _remove_hooks(module._forward_hooks, _unshadow_experts,
                          module._forward_hooks_always_called)
        else:
            continue
        del module.lora
    for p in model.parameters():
        p.requires_grad_(True)


def _remove_hooks(hooks: dict, fn: object, always: dict | None = None) -> None:
    for key in [k for k, h in hooks.items() if h is fn]:
        del hooks[key]
        if always is not None:
            always.pop(key, None)
