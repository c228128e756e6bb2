"""Data parallelism: FSDP2 (``fully_shard``, sharded) or plain replication.

Sharded: every layer and then the root are ``fully_shard``-ed over the ``dp`` mesh dimension, with
explicit forward/backward prefetch of the neighbouring layer so parameter gathers overlap compute.
Under expert parallelism the routed experts are left out of FSDP (already split over ep; their
replicas over ``dp_outer`` are reduced by :func:`finish_grads`): an expert on an ep rank receives
tokens from every rank of its ep group, so its gradient sums ep ranks' mean losses and is
divided by the whole ``dp`` after the sum over ``dp_outer``.

Replicated: parameters stay whole; :func:`finish_grads` averages gradients over ``dp``.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from composer.blocks.split import local
from composer.parallel.mesh import ParallelDims
from composer.parallel.tensor import reduce_tp_grads


def is_expert_param(name: str) -> bool:
    return ".mixer.experts." in name


def apply_fsdp(model: nn.Module, dims: ParallelDims) -> None:
    dp_mesh = dims.dp_mesh
    layers = list(model.layers.values())
    for layer in layers:
        experts = getattr(layer.mixer, "experts", None)
        ignored = set(experts.parameters()) if experts is not None and dims.ep > 1 else None
        fully_shard(layer, mesh=dp_mesh, ignored_params=ignored)
    fully_shard(model, mesh=dp_mesh)
    for i, layer in enumerate(layers):
        if i + 1 < len(layers):
            layer.set_modules_to_forward_prefetch([layers[i + 1]])
        if i > 0:
            layer.set_modules_to_backward_prefetch([layers[i - 1]])
    model.fsdp = True


def finish_grads(model: nn.Module, dims: ParallelDims) -> None:
    """Complete the gradient reductions FSDP does not do: partial sums over ``tp``, and the
    data-parallel average when parameters are replicated. Call after backward."""
    reduce_tp_grads(model)
    if dims.dp == 1:
        return
    fsdp = getattr(model, "fsdp", False)
    dp_group, outer_group = dims.dp_mesh.get_group(), dims.mesh["dp_outer"].get_group()
    for name, p in model.named_parameters():
        expert = is_expert_param(name) and dims.ep > 1
        if p.grad is None or (fsdp and not expert):
            continue
        g = local(p.grad)
        if expert:
            if dims.dp_outer > 1:
                dist.all_reduce(g, group=outer_group)
        else:
            dist.all_reduce(g, group=dp_group)
        g.div_(dims.dp)
