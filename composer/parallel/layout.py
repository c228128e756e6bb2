"""The parallel layout's settings, declared once: the recipe nests them (``parallel:`` in a
recipe YAML), ``composer train`` and ``eval`` make their flags from them
(:func:`composer.settings.add_flags`), :func:`composer.parallel.mesh.build_parallel_dims` turns
them into meshes.

No torch here: the CLI builds its parser from these fields before anything heavy loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from composer.settings import setting


@dataclass
class ParallelConfig:
    tp: int = setting(1, "tensor-parallel size")
    ep: int = setting(1, "expert-parallel size (divides dp)")
    dp: int | None = setting(None, "data-parallel size (default: the rest of the world)")
    """``None`` fills the world: ``world // (pp * cp * tp)``."""
    dp_mode: Literal["shard", "replicate"] = setting(
        "shard", "FSDP2 sharding (default) or replication")
    dp_replicate: int = setting(
        1, "HSDP: dp as R replica groups x dp/R shards (weights sharded within a group, "
           "replicated across groups; needs --dp-mode shard)")
    """``R > 1``: FSDP2 over a 2-D ``(dp_replicate, dp_shard)`` mesh (``composer.parallel.mesh``):
    each rank holds ``1 / (dp * cp / R)`` of the weights; gathers and reduce-scatters stay within
    a replica group, one all-reduce of the shards crosses the groups."""
    grad_sync: Literal["every", "last"] | None = setting(
        None, "reduce gradients after every micro-batch, or once per step after the last "
              "(default: last where the unsharded gradients fit, docs/parallelism.md)")
    """``last`` keeps each rank's gradients unreduced (and, sharded, whole) across the
    micro-batches of a step and reduces once (FSDP2 ``set_requires_gradient_sync``); the default
    is resolved by :func:`composer.parallel.data.default_grad_sync`."""
    sequence_parallel: bool = setting(True, "keep activations replicated across tp ranks")
    """The flag is ``--no-sequence-parallel`` (it defaults to on), hence its help."""
    ep_overlap: bool = setting(
        False, "expert parallel: dispatch half the tokens while the experts compute the rest")
    """Dispatch one half of a forward's rows while the experts compute the other
    (``composer.parallel.expert``; the same results)."""
    pp: int = setting(1, "pipeline-parallel size: the pattern's '|' segments, or balanced stages")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] | None = setting(
        None, "gpipe, 1f1b (default) or interleaved-1f1b (default with virtual stages)")
    cp: int = setting(1, "context-parallel size: each sequence split into 2 x cp chunks over cp "
                         "ranks")
    cp_adaptive: bool = setting(
        False, "context parallel for packed documents: shorter ones whole on one rank")
    """Short documents whole on one rank (:mod:`composer.parallel.context`)."""
    cp_min_tokens: int | None = setting(
        None, "with --cp-adaptive: documents this long or longer are split over the cp ranks "
              "(default: sequence length / cp)")
    ac: Literal["none", "full", "selective"] = setting(
        "none", "activation checkpointing per layer: none (default), full or selective")
    """``full`` recomputes each layer in the backward, ``selective`` keeps the outputs of its
    matmuls and recomputes the rest (``--activation-checkpointing`` is ``--ac full``)."""
    compile: bool = setting(False, "torch.compile every layer")
    """After the plans, before data parallel."""


LAYOUT_KEYS = tuple(ParallelConfig.__dataclass_fields__)
"""The layout's setting names (a recipe also reads them at its top level: flags, old recipes)."""
