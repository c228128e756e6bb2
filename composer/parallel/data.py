"""Data parallelism with PyTorch's own bucketed, backward-overlapped gradient reduction:
FSDP2 ``fully_shard`` (``--dp-mode shard``) or its replicating twin ``replicate``
(``--dp-mode replicate``: DDP semantics on the same machinery).

Every layer (MTP depths' too) and then the root are wrapped over the ``dp`` mesh dimension
(``dp x cp`` with context parallelism: its ranks hold different tokens of the same rows); the
sharded mode also prefetches the neighbouring layer's parameters (forward and backward) so
gathers overlap compute.

Under expert parallelism the routed experts are already split over ep and replicated over
``dp_outer``. The sharded mode makes them FSDP units of their own over ``dp_outer`` (torchtitan's
expert-FSDP mesh: weights, gradients and optimizer state ``1 / (ep * dp_outer)`` per rank; the
tensors are DTensors on ``(dp_outer, ep[, tp])``, so checkpoints reshard across ep and dp);
with ``dp_outer = 1`` or ``--dp-mode replicate`` they are left out and their replicas are
reduced by :func:`finish_grads`, in buckets. Either way an expert on an ep rank receives tokens
from every rank of its ep group, so its gradient sums ep ranks' mean losses and is divided by
the whole ``dp`` (:func:`composer.parallel.expert.expert_grad_scale`).
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import Shard

from composer.blocks.model import named_layers
from composer.blocks.protocol import plan_of
from composer.parallel.comm import all_reduce_coalesced
from composer.parallel.mesh import ParallelDims
from composer.parallel.tensor import expert_params, local_grad, reduce_tp_grads


def experts_sharded(dims: ParallelDims) -> bool:
    """Whether the routed experts are FSDP units over ``dp_outer`` (module docstring; under
    HSDP over its ``dp_outer / dp_replicate`` ranks of a replica group)."""
    return dims.ep > 1 and dims.dp_outer // dims.dp_replicate > 1 and dims.dp_mode == "shard"


def _experts_apart(layer: nn.Module, dims: ParallelDims) -> set[nn.Parameter] | None:
    """The routed experts data parallel leaves alone (already split over ep and, when
    :func:`experts_sharded`, FSDP units of their own), or None."""
    if dims.ep == 1 or experts_sharded(dims):
        return None
    return set(expert_params(layer.mixer)) or None


def _expert_modules(mixer: nn.Module) -> list[nn.Module]:
    out = []
    for module in mixer.modules():
        plan = plan_of(module)
        if plan is not None and plan.experts is not None:
            out.append(module.get_submodule(plan.experts))
    return out


def shard_experts(layer: nn.Module, dims: ParallelDims,
                  mp: MixedPrecisionPolicy) -> list[nn.Module]:
    """Expert FSDP: each expert group of ``layer`` its own unit over ``dp_outer`` (HSDP: sharded
    over a replica group's share of it, replicated across the groups), on dim 0 (the local
    experts) when they divide evenly, else on dim 1; gradients divided by ``dp``. Returns the
    units."""
    shards = dims.dp_outer // dims.dp_replicate
    units = _expert_modules(layer.mixer)
    for experts in units:
        n_local = next(iter(experts.parameters())).shape[0] // dims.ep
        dim = 0 if n_local % shards == 0 else 1
        fully_shard(experts, mesh=dims.expert_mesh, mp_policy=mp,
                    shard_placement_fn=lambda p, d=dim: Shard(d))
        experts.set_gradient_divide_factor(float(dims.dp))
        if dims.device.type != "cuda":  # gloo has no pre-multiplied sum: SUM, then divide
            experts.set_force_sum_reduction_for_comms(True)
    return units


def mixed_precision(dims: ParallelDims) -> MixedPrecisionPolicy:
    """bf16 compute copies of the fp32 masters, gradients reduced in fp32 (or all fp32).

    Forward inputs are not cast: they already arrive in the compute dtype (token ids, the
    bf16 embedding's output, each layer's), and the cast would copy every floating tensor of
    the arguments, dataclasses included: a decoding step's cache states, which the layers
    update in place (``forward_cached``), would be updated in the copies."""
    if dims.precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                    cast_forward_inputs=False)
    return MixedPrecisionPolicy()


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
GATHER_MMAP_BYTES = 1 << 18


def map_gathered_buffers() -> bool:
    """Make the C allocator map every block of ``GATHER_MMAP_BYTES`` or more on its own, so that
    freeing it returns it to the system; False where there is no glibc ``mallopt``.

    On the CPU FSDP2 gathers each unit's weights into fresh buffers before its forward (and
    backward) and frees them after. glibc serves them from its heap once its dynamic mmap
    threshold has grown past their size, and the small allocations made in between split the
    freed blocks, so the next unit's buffers no longer fit: the heap grew by about a unit per
    layer, and a forward left every layer's gathered weights in the process (freed, never
    returned: ``--dp-mode shard`` held as much as the whole model). A fixed threshold also
    turns off the dynamic one. CUDA memory has its own caching allocator."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, GATHER_MMAP_BYTES))


FORWARD_METHODS = ("token_logprobs", "forward_cached")
"""Methods of the root that run the model like ``forward`` (scoring, cached decoding): FSDP2
gathers the root's weights around them too (``register_fsdp_forward_method``)."""


def _register_forward_methods(root: nn.Module) -> None:
    for name in FORWARD_METHODS:
        if hasattr(root, name):  # a pipeline stage has neither
            register_fsdp_forward_method(root, name)


def apply_fsdp(model: nn.Module, dims: ParallelDims,
               roots: list[nn.Module] | None = None) -> None:
    """Each layer its own FSDP2 unit, then the root(s) (``model``, or a pipeline rank's stages:
    each stage a root over its layers and its embedding / norm / head). Each unit but a root
    reshards after its forward (FSDP2's default), also in forward-only passes; a root keeps
    its own weights gathered until :func:`reshard`."""
    if dims.device.type == "cpu":
        map_gathered_buffers()
    mp = mixed_precision(dims)
    for root in roots or [model]:
        layers = [layer for _, layer in named_layers(root)]  # MTP depths' last, as they run
        experts = [shard_experts(layer, dims, mp) if experts_sharded(dims) else []
                   for layer in layers]
        for layer in layers:
            fully_shard(layer, mesh=dims.shard_mesh, ignored_params=_experts_apart(layer, dims),
                        mp_policy=mp)
        fully_shard(root, mesh=dims.shard_mesh, mp_policy=mp)
        _register_forward_methods(root)
        for i, layer in enumerate(layers):
            # a layer gathers its own experts (their units sit inside it) and the next layer
            ahead = experts[i] + ([layers[i + 1]] if i + 1 < len(layers) else [])
            if ahead:
                layer.set_modules_to_forward_prefetch(ahead)
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
        _register_forward_methods(root)


def reshard(model: nn.Module) -> None:
    """Free every FSDP2 unit's gathered weights. A root keeps its own parameters (embedding,
    final norm, head) gathered after a forward without backward (evaluation; a pipeline
    schedule's shape inference), and the model then holds those gathered copies instead of
    the shards the optimizer and the checkpoints know. A pipeline rank's roots are its stages
    (``model.pipeline.views``), which are not submodules of the model."""
    roots = [model, *getattr(getattr(model, "pipeline", None), "views", ())]
    for root in roots:
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def finish_grads(model: nn.Module, dims: ParallelDims) -> None:
    """Complete the gradient reductions that FSDP2 / replicate do not do: partial sums over
    ``tp``, and routed experts that are no FSDP units over their ``dp_outer`` replicas (scaled
    by ``1 / dp``). Call after backward."""
    reduce_tp_grads(model, dims.tp_context)
    if dims.dp == 1 or dims.ep == 1 or experts_sharded(dims):
        return
    grads = [local_grad(p) for layer in model.all_layers()
             for p in expert_params(layer.mixer) if p.grad is not None]
    all_reduce_coalesced(grads, dims.mesh["dp_outer"].get_group(), scale=1.0 / dims.dp)


GRAD_SYNC_MEMORY_SHARE = 0.25
"""``--grad-sync`` default on CUDA: ``last`` when the unsharded fp32 gradients fit in this share
of the device's memory (:func:`default_grad_sync`)."""


def default_grad_sync(model: nn.Module, dims: ParallelDims, n_micro: int) -> tuple[str, str]:
    """``--grad-sync``'s default and why: ``every`` with one micro-batch per step (the same
    thing) or where no data parallelism reduces, else ``last`` on the CPU (its memory holds the
    model already) and on CUDA when this rank's unsharded fp32 gradients (an upper bound: every
    parameter's, divided by tp) fit in ``GRAD_SYNC_MEMORY_SHARE`` of the device's memory.
    A pipeline's schedule reduces once per step by itself (its last backward)."""
    if dims.pp > 1:
        return "last", "the pipeline schedule reduces after its last backward"
    if dims.grad_replicas == 1 or n_micro == 1:
        return "every", ("one micro-batch per step" if n_micro == 1 else "no data parallelism")
    if dims.device.type != "cuda":
        return "last", f"{n_micro} micro-batches, on the CPU"
    grad_bytes = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad) / dims.tp
    total = torch.cuda.get_device_properties(dims.device).total_memory
    fits = grad_bytes <= GRAD_SYNC_MEMORY_SHARE * total
    return ("last" if fits else "every",
            f"unsharded fp32 gradients {grad_bytes / 2**30:.1f} GiB "
            f"{'<=' if fits else '>'} {GRAD_SYNC_MEMORY_SHARE:.0%} of {total / 2**30:.0f} GiB")


def set_grad_sync(model: nn.Module, sync: bool) -> None:
    """Whether the next backward reduces the gradients over data parallel (every FSDP2 and
    replicate unit's ``set_requires_gradient_sync``). Off, each unit adds this rank's
    unreduced gradients (whole, also in the sharded mode) to what it holds; the next backward
    with it on reduces their sum, once (HSDP: the reduce-scatter and the all-reduce)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(sync, recurse=False)
