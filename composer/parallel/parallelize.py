"""Apply the parallel layout to a model, in one documented order (docs/parallelism.md):

1. tensor + sequence parallel (``tensor.py``: the blocks' plans, vocab-parallel embedding/head),
2. expert parallel (``expert.py``: the expert groups the plans name) and global token sums
   (over ``dp x cp``),
2b. LoRA adapters (``lora.py``, with ``lora=``: attached to their bases, sharded like them, the
   base frozen), so that everything after, FSDP included, sees them as parameters,
3. context parallel (``context.py``: the sequence mixers swapped for their cp forms, the model
   cutting its rows),
4. activation checkpointing (``--ac full``: each layer recomputed in the backward; ``--ac
   selective``: each layer's matmul and attention outputs kept, everything else recomputed),
5. compile (``--compile``: each layer, same keys),
6. data parallel (``data.py``, over ``dp x cp``: FSDP2 sharded, or FSDP2-style replicate; with
   ``precision="bf16"`` bf16 compute copies of the fp32 masters and fp32 gradient reduction).

Run it on the meta device (``build_model(cfg, device="meta")``): nothing is allocated, and each
rank then materialises only its own shards (``to_empty`` + ``composer.build.init``). It also works
on a materialised model whose ranks hold the same full weights (each keeps its chunk).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed._composable.checkpoint_activation import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from composer.blocks.protocol import plan_of
from composer.parallel.context import apply_cp
from composer.parallel.data import apply_fsdp, apply_replicate
from composer.parallel.expert import apply_ep, make_global
from composer.parallel.mesh import ParallelDims
from composer.parallel.tensor import TPContext, apply_tp

if TYPE_CHECKING:
    from composer.lora import LoRAConfig


def _moes(model: nn.Module) -> list[nn.Module]:
    out = []
    for layer in model.all_layers():  # the MTP depths' layers too
        plan = plan_of(layer.mixer)
        if plan is not None and plan.experts is not None:
            out.append(layer.mixer)
    return out


SAVED_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
             torch.ops.aten._scaled_dot_product_flash_attention.default,
             torch.ops.aten._scaled_dot_product_efficient_attention.default,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
             torch.ops.aten._scaled_mm.default}
"""What ``--ac selective`` keeps: the outputs of matrix multiplications and attention (the
expensive ops); norms, activations, the scan's elementwise work and casts are recomputed."""


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, mode: str) -> None:
    """Activation checkpointing of every layer (composable: the keys do not change)."""
    if mode == "none":
        return
    kwargs = {}
    if mode == "selective":
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _selective_policy)
    for layer in model.all_layers():  # the MTP depths' layers too
        checkpoint(layer, **kwargs)


def parallelize(model: nn.Module, dims: ParallelDims, roots: list[nn.Module] | None = None,
                lora: LoRAConfig | None = None) -> nn.Module:
    """Apply the layout (module docstring). ``roots``: the modules whose forward runs (a
    pipeline rank's stages, :mod:`composer.parallel.pipeline`); data parallelism wraps each as
    its own root instead of ``model``. ``lora``: adapters to attach (:mod:`composer.lora`)."""
    if dims.mesh is not None and dims.tp > 1:
        tp_mesh = dims.mesh["tp"]
        dims.tp_context = TPContext(mesh=tp_mesh, group=tp_mesh.get_group(), size=dims.tp,
                                    rank=tp_mesh.get_local_rank(),
                                    sequence_parallel=dims.sequence_parallel,
                                    experts_on_ep=dims.ep > 1)
        apply_tp(model, dims.tp_context, roots)
    if dims.mesh is not None:
        for moe in _moes(model):
            if dims.ep > 1:
                apply_ep(moe, dims.mesh["ep"], dims.mesh["ep", "tp"] if dims.tp > 1 else None,
                         chunks=2 if dims.ep_overlap else 1)
            # the load-balancing statistics of the global batch, not of each rank's share; every
            # tp rank computes them whole while the router sums its gradients over tp
            group = dims.fsdp_mesh.get_group() if dims.grad_replicas > 1 else None
            plan = plan_of(moe)
            for name in plan.token_sums:
                make_global(moe, name, group=group, grad_scale=1.0 / dims.tp)
            # per-sequence sums: a sequence is cut over the cp ranks
            seq_group = dims.cp_mesh.get_group() if dims.cp > 1 else None
            for name in plan.local_sums:
                make_global(moe, name, group=seq_group, grad_scale=1.0 / dims.tp)
    if lora is not None:
        from composer.parallel.lora import apply_lora

        apply_lora(model, lora, dims)
    if dims.cp > 1:
        apply_cp(model, dims)
    apply_ac(model, dims.ac)
    if dims.compile:
        from composer.kernels import compile_layers

        compile_layers(model)
    if dims.grad_replicas > 1:
        (apply_fsdp if dims.dp_mode == "shard" else apply_replicate)(model, dims, roots)
    return model
