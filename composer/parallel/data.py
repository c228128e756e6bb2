"""Data parallelism with PyTorch's own bucketed, backward-overlapped gradient reduction:
FSDP2 ``fully_shard`` (``--dp-mode shard``) or its replicating twin ``replicate``
(``--dp-mode replicate``: DDP semantics on the same machinery).

Every layer (MTP depths' too) and then the root are wrapped over the ``dp`` mesh dimension
(``dp x cp`` with context parallelism: its ranks hold different tokens of the same rows); the
sharded mode also prefetches the neighbouring layer's parameters (forward and backward) so
gathers overlap compute.
Under expert parallelism the routed experts are left out (already split over ep; their replicas
over ``dp_outer`` are reduced by :func:`finish_grads`, in buckets): an expert on an ep rank
receives tokens from every rank of its ep group, so its gradient sums ep ranks' mean losses and
is divided by the whole ``dp`` after the sum over ``dp_outer``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from composer.blocks.model import named_layers
from composer.parallel.comm import all_reduce_coalesced
from composer.parallel.mesh import ParallelDims
from composer.parallel.tensor import expert_params, local_grad, reduce_tp_grads


def _experts_apart(layer: nn.Module, dims: ParallelDims) -> set[nn.Parameter] | None:
    """The routed experts FSDP leaves alone (already split over ep), or None."""
    if dims.ep == 1:
        return None
    return set(expert_params(layer.mixer)) or None


def mixed_precision(dims: ParallelDims) -> MixedPrecisionPolicy:
    """bf16 compute copies of the fp32 masters, gradients reduced in fp32 (or all fp32)."""
    if dims.precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(model: nn.Module, dims: ParallelDims,
               roots: list[nn.Module] | None = None) -> None:
    """Each layer its own FSDP2 unit, then the root(s) (``model``, or a pipeline rank's stages:
    each stage a root over its layers and its embedding / norm / head)."""
    mp = mixed_precision(dims)
    for root in roots or [model]:
        layers = [layer for _, layer in named_layers(root)]  # MTP depths' last, as they run
        for layer in layers:
            fully_shard(layer, mesh=dims.fsdp_mesh, ignored_params=_experts_apart(layer, dims),
                        mp_policy=mp)
        fully_shard(root, mesh=dims.fsdp_mesh, mp_policy=mp)
        for i, layer in enumerate(layers):
            if i + 1 < len(layers):
                layer.set_modules_to_forward_prefetch([layers[i + 1]])
            if i > 0:
                layer.set_modules_to_backward_prefetch([layers[i - 1]])


def apply_replicate(model: nn.Module, dims: ParallelDims,
                    roots: list[nn.Module] | None = None) -> None:
    mp = mixed_precision(dims)
    for root in roots or [model]:
        for _, layer in named_layers(root):
            replicate(layer, mesh=dims.fsdp_mesh, ignored_params=_experts_apart(layer, dims),
                      mp_policy=mp)
        replicate(root, mesh=dims.fsdp_mesh, mp_policy=mp)


def reshard(model: nn.Module) -> None:
    """Free every FSDP2 unit's gathered weights. A root keeps its own parameters (embedding,
    final norm, head) gathered after a forward without backward (evaluation; a pipeline
    schedule's shape inference), and the model then holds those gathered copies instead of
    the shards the optimizer and the checkpoints know."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def finish_grads(model: nn.Module, dims: ParallelDims) -> None:
    """Complete the gradient reductions that FSDP2 / replicate do not do: partial sums over
    ``tp``, and routed experts over their ``dp_outer`` replicas. Call after backward."""
    reduce_tp_grads(model, dims.tp_context)
    if dims.dp == 1 or dims.ep == 1:
        return
    grads = [local_grad(p) for layer in model.all_layers()
             for p in expert_params(layer.mixer) if p.grad is not None]
    all_reduce_coalesced(grads, dims.mesh["dp_outer"].get_group(), scale=1.0 / dims.dp)
