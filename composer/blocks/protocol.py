"""Everything a mixer (or any module inside one) may declare, in one place (docs/architecture.md).

Code outside the blocks reads a module's optional declarations through the helpers here, never
by probing attributes itself: :class:`Mixer` documents each one, and :func:`declared` is the one
place that looks for them. A block that declares nothing optional is an ``nn.Module`` whose
``forward(x_BTD)`` maps ``(B, T, D)`` to ``(B, T, D)``.

Time-mixing ops (``conv``, ``scan``, ``rule``, ``core``) are parameterless submodules of a
sequence mixer (:class:`TimeMixingOp`): everything around them is token-wise, so context
parallelism swaps only the op for its variant (``composer/parallel/context``), and decoding goes
through the same ``forward`` with a :class:`~composer.blocks.cache.Step`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from composer.blocks.cache import Step
    from composer.blocks.plan import Init, LayoutRule, ParallelPlan


@runtime_checkable
class Mixer(Protocol):
    """A residual block's mixer: built as ``mixer(cfg, layer_idx)``; every attribute but
    ``forward`` is optional (:func:`declared` answers the default)."""

    def forward(self, x_BTD: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """``(B, T, D) -> (B, T, D)``. With ``uses_doc_ids`` it takes ``doc_ids=`` (packed
        documents, ``(B, T)``); with ``uses_positions`` it takes ``positions=`` (the M-RoPE
        position rows ``[3, B, T]`` of a forward with images); with a decoding state
        (``init_cache``) it takes ``step=`` (a :class:`~composer.blocks.cache.Step`) and
        continues from it."""

    # --- declarations read from outside (all optional) ----------------------------------
    uses_doc_ids: bool
    """``forward`` takes ``doc_ids`` (default False: the layer does not pass them)."""
    uses_positions: bool
    """``forward`` takes ``positions`` (M-RoPE rows; default False: the layer does not pass
    them, and the mixer has no position of its own)."""
    uses_embeddings: bool
    """``forward`` takes ``embeddings=`` (default False): the model's input embeddings
    ``(B, T, D)`` (after ``embedding_multiplier``), as every layer of the forward sees them
    (Zamba2's shared blocks read ``[h; embeddings]``)."""
    takes_residual: bool
    """``forward`` takes the layer's *un-normed* input and ``norm=`` (the layer's norm, applied
    where the mixer needs it; default False: the layer hands it ``norm(x)``). Zamba2's hybrid
    layer adds its shared block's output to ``x`` before the norm."""
    stateless: bool
    """Token-wise: no state over time, nothing to cache, nothing for context parallelism to
    split (MLP, MoE)."""
    ops: tuple[str, ...]
    """The names of the mixer's :class:`TimeMixingOp` submodules, in call order; context
    parallelism swaps each for the variant its ``context`` names."""
    keep_fp32: tuple[str, ...]
    """Parameters (relative names) kept in fp32 whatever the model's dtype."""
    step_stats: tuple[str, ...]
    """Attributes holding per-step statistics (restored after a placeholder forward)."""
    aux_loss: torch.Tensor | None
    """The auxiliary loss of the last forward, already weighted (MoE balancing)."""

    def init_rules(self) -> dict[str, Init]:
        """Parameter name (glob) -> its initialisation (``composer/blocks/plan.py``)."""

    def parallel_plan(self) -> ParallelPlan:
        """How the module splits over tensor / expert parallel ranks."""

    @staticmethod
    def layout_rules(cfg: Any) -> list[LayoutRule]:
        """Divisibility of heads, groups and widths by the parallel sizes."""

    @staticmethod
    def flops_per_token(cfg: Any, seq_len: int) -> int:
        """Forward FLOPs per token (a multiply-add is 2)."""

    def init_cache(self, batch: int, max_len: int, device: torch.device,
                   dtype: torch.dtype) -> Any:
        """The decoding state of one batch (its size independent of ``max_len`` for
        recurrent kinds)."""

    def end_step(self) -> None:
        """Called after each optimizer step (MoE bias updates)."""

    def stored_as(self, name: str) -> tuple[str, int]:
        """The checkpoint key and first row of parameter ``name`` (fused projections)."""

    def lora_targets(self) -> dict[str, str]:
        """Target name -> submodule path (relative to the mixer) of each projection LoRA may
        adapt (``composer/lora.py``; ``--lora-targets`` picks names). A path names an
        ``nn.Linear`` or a :class:`~composer.blocks.split.SplitLinear`; the name ``experts``
        names routed experts (3-D weights, adapted in weight space). Default: ``{}`` (the
        mixer has nothing to adapt)."""


class TimeMixingOp(nn.Module):
    """A parameterless submodule that mixes over time; the mixer hands it tensors and its own
    parameters. ``context`` names the context-parallel variant that replaces it
    (``composer.parallel.context.variants``): ``"halo_conv"``, ``"state_passing"``,
    ``"kv_gather"``, ``"latent_gather"``, or a kind's own registered name."""

    context: str | None = None


_DEFAULTS: dict[str, Any] = {"uses_doc_ids": False, "uses_positions": False,
                             "uses_embeddings": False, "takes_residual": False, "stateless": False,
                             "ops": (), "keep_fp32": (), "step_stats": (), "aux_loss": None}


def declared(module: nn.Module, name: str, default: Any = None) -> Any:
    """``module``'s declaration ``name`` (a :class:`Mixer` attribute or method), or
    ``default`` (for the attributes with a natural default, that one) when it declares none."""
    if default is None:
        default = _DEFAULTS.get(name)
    return getattr(module, name, default)


def plan_of(module: nn.Module) -> ParallelPlan | None:
    """The parallel plan ``module`` declares, or None."""
    plan = getattr(module, "parallel_plan", None)
    return plan() if plan is not None else None


def init_rules_of(module: nn.Module) -> dict[str, Init]:
    rules = getattr(module, "init_rules", None)
    return rules() if rules is not None else {}


def lora_targets_of(mixer: nn.Module) -> dict[str, str]:
    """The projections ``mixer`` declares for LoRA (:meth:`Mixer.lora_targets`), or ``{}``."""
    targets = getattr(mixer, "lora_targets", None)
    return dict(targets()) if targets is not None else {}


def has_cache(mixer: nn.Module) -> bool:
    """The mixer keeps a decoding state (``init_cache``)."""
    return getattr(mixer, "init_cache", None) is not None


def time_ops(mixer: nn.Module) -> list[tuple[str, TimeMixingOp]]:
    """``(name, op)`` of the mixer's declared time-mixing ops (:attr:`Mixer.ops`)."""
    out = []
    for name in declared(mixer, "ops"):  # a dotted name is a branch's op (a parallel group)
        op = mixer.get_submodule(name)
        if not isinstance(op, TimeMixingOp):
            raise TypeError(f"{type(mixer).__name__}.{name} is declared in ops but is a "
                            f"{type(op).__name__}, not a TimeMixingOp")
        out.append((name, op))
    return out


def call_mixer(mixer: nn.Module, h_BTD: torch.Tensor, doc_ids: torch.Tensor | None,
               step: Step | None, positions: torch.Tensor | None = None, *,
               embeddings: torch.Tensor | None = None, norm: nn.Module | None = None
               ) -> torch.Tensor:
    """``mixer(h)`` with the keywords it declares it takes: ``doc_ids``, ``positions`` and
    ``embeddings`` when it reads them, ``norm`` when it takes the un-normed input
    (``takes_residual``), ``step`` when it keeps a decoding state."""
    kwargs: dict[str, Any] = {}
    if declared(mixer, "uses_embeddings"):
        if embeddings is None:
            raise ValueError(f"{type(mixer).__name__} reads the model's input embeddings, "
                             "which this call does not carry (an MTP depth does not yet)")
        kwargs["embeddings"] = embeddings
    if norm is not None and declared(mixer, "takes_residual"):
        kwargs["norm"] = norm
    if doc_ids is not None and declared(mixer, "uses_doc_ids"):
        kwargs["doc_ids"] = doc_ids
    if positions is not None and declared(mixer, "uses_positions"):
        kwargs["positions"] = positions
    if step is not None and has_cache(mixer):
        kwargs["step"] = step
    return mixer(h_BTD, **kwargs)
