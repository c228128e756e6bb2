"""Shard-local materialisation: initialise or load only this rank's part of every tensor.

A model is built on the meta device and parallelised there (``composer/parallel/``); then each
rank allocates its own shards (``to_empty``) and fills them here, so no rank ever holds the
whole model.

**Initialisation does not depend on the layout.** Every parameter and persistent buffer takes
its values from the :class:`~composer.blocks.plan.Init` its blocks declare (``init_rules``),
filled in *row blocks*: dim 0 is cut into blocks of ``max(1, BLOCK_ELEMENTS // row_size)`` rows
(a function of the full shape only), and block ``b`` of tensor ``name`` is filled in fp32 on the
CPU from a generator seeded by ``sha256(seed, name, b)``. A rank fills just the blocks its shard
touches and copies its slice of them. So for a given seed the weights are bit-identical under any
tensor, expert or data-parallel layout, on any device, and equal to ``composer build --seed S``.

**Loading reads only this rank's slices** of a portable checkpoint: each tensor's region (its
DTensor shard, or the whole tensor) is read from the safetensors files as byte ranges, never the
whole file. Mamba's fused projections are stored fused and held per part
(:meth:`~composer.blocks.split.SplitParams.stored_as` gives the part's rows).
"""

from __future__ import annotations

import hashlib
import inspect
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn

from composer.blocks.plan import Init, named_state, rule_for
from composer.blocks.protocol import declared
from composer.portable import CheckpointError, TensorSource, bytes_to_tensor

BLOCK_ELEMENTS = 1 << 22
"""Elements per initialisation block (16 MiB in fp32); part of the definition of the init."""

Region = tuple[tuple[int, ...], tuple[int, ...]]
"""``(offsets, sizes)`` of a shard inside the full tensor."""


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard, or ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def local_region(t: torch.Tensor) -> Region:
    """Where this rank's part of ``t`` sits in the full tensor."""
    if not hasattr(t, "device_mesh"):
        return (0,) * t.ndim, tuple(t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(offsets), tuple(sizes)


def _block_rows(shape: tuple[int, ...]) -> int:
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, BLOCK_ELEMENTS // max(row, 1))


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}\0{name}\0{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _fill_block(rule: Init, seed: int, name: str, full: tuple[int, ...], b: int,
                scratch: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """Rows ``lo:hi`` of tensor ``name`` (full shape ``full``): its block ``b``, filled in fp32
    in ``scratch`` when it fits (so the result is valid until the next call), else fresh."""
    rows = _block_rows(full)
    lo, hi = b * rows, min((b + 1) * rows, full[0])
    shape = (hi - lo, *full[1:])
    n = math.prod(shape)
    block = scratch[:n].view(shape) if n <= scratch.numel() else \
        torch.empty(shape, dtype=torch.float32)
    rule.fill(block, torch.Generator().manual_seed(_block_seed(seed, name, b)))
    return lo, hi, block


def owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module that holds tensor ``name`` and the tensor's name there."""
    prefix, _, leaf = name.rpartition(".")
    return (model.get_submodule(prefix) if prefix else model), leaf


@torch.no_grad()
def init_weights(model: nn.Module, seed: int,
                 only: Callable[[str], bool] | None = None) -> None:
    """Fill every parameter and persistent buffer (its local shard) from its declared rule
    (with ``only``, just the tensors it accepts by name: LoRA adapters on a loaded base).

    A tensor no rule names falls back to the ``reset_parameters`` of the outermost module
    around it that has one (a user's block that declares no rules): that module is filled whole
    on the CPU from a generator seeded by ``(seed, module name)`` and each rank copies its part;
    layout-independent too, at the cost of holding that one module whole for a moment."""
    scratch = torch.empty(BLOCK_ELEMENTS, dtype=torch.float32)  # one buffer for every block
    fallback: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named_state(model):
        if only is not None and not only(name):
            continue
        rule = rule_for(model, name)
        if rule is None:
            holder = _reset_holder(model, name)
            if holder is None:
                raise ValueError(f"no initialisation declared for {name!r}: add it to the "
                                 "init_rules() of the block that holds it")
            fallback.setdefault(holder, []).append((name, t))
            continue
        offsets, sizes = local_region(t)
        out = local_tensor(t)
        if out.numel() == 0:
            continue
        full = tuple(t.shape)
        if not full:
            value = torch.empty((), dtype=torch.float32)
            rule.fill(value, torch.Generator().manual_seed(_block_seed(seed, name, 0)))
            out.copy_(value)
            continue
        start, stop = offsets[0], offsets[0] + sizes[0]
        inner = tuple(slice(o, o + s) for o, s in zip(offsets[1:], sizes[1:], strict=True))
        rows = _block_rows(full)
        for b in range(start // rows, (stop - 1) // rows + 1):
            lo, hi, block = _fill_block(rule, seed, name, full, b, scratch)
            a, z = max(lo, start), min(hi, stop)
            out[a - start:z - start].copy_(block[(slice(a - lo, z - lo), *inner)])

    for holder, tensors in fallback.items():
        _init_by_reset(model, holder, tensors, seed)


def _reset_holder(model: nn.Module, name: str) -> str | None:
    """The outermost module on ``name``'s path (below the root) with ``reset_parameters``."""
    module, path = model, []
    for part in name.split(".")[:-1]:
        module = getattr(module, part)
        path.append(part)
        if declared(module, "reset_parameters") is not None:
            return ".".join(path)
    return None


def _reset_values(model: nn.Module, holder: str, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of module ``holder`` as its ``reset_parameters`` fills it, whole, in fp32 on
    the CPU, from generators seeded by ``(seed, holder)``; the model itself (meta or not) is
    left as it was."""
    module = model.get_submodule(holder)
    originals: list[tuple[nn.Module, str, bool, torch.Tensor]] = []
    full: dict[str, torch.Tensor] = {}
    for sub_name, sub in module.named_modules():
        for kind in ("_parameters", "_buffers"):
            for leaf, t in getattr(sub, kind).items():
                if t is None:
                    continue
                temp = torch.empty(t.shape, dtype=torch.float32)
                originals.append((sub, leaf, kind == "_parameters", t))
                getattr(sub, kind)[leaf] = nn.Parameter(temp, requires_grad=False) \
                    if kind == "_parameters" else temp
                full[f"{holder}.{sub_name}.{leaf}" if sub_name else f"{holder}.{leaf}"] = temp
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_block_seed(seed, holder, 0))
            generator = torch.Generator().manual_seed(_block_seed(seed, holder, 1))
            takes = "generator" in inspect.signature(module.reset_parameters).parameters
            module.reset_parameters(generator) if takes else module.reset_parameters()
    finally:
        for sub, leaf, is_param, t in originals:
            (sub._parameters if is_param else sub._buffers)[leaf] = t
    return full


def _init_by_reset(model: nn.Module, holder: str, tensors: list[tuple[str, torch.Tensor]],
                   seed: int) -> None:
    full = _reset_values(model, holder, seed)
    for name, t in tensors:
        offsets, sizes = local_region(t)
        region = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
        local_tensor(t).copy_(full[name][region])


# ---------------------------------------------------------------- streaming


@torch.no_grad()
def initial_pieces(model: nn.Module, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The values :func:`init_weights` gives ``model`` (a meta model will do), without holding
    the model: ``(state-dict key, piece)`` in ``model.state_dict()`` order, each key's pieces
    (row blocks, a fused key's parts in row order) concatenating to its tensor in row-major
    order, in the tensor's dtype. Memory is one row block (a module, for a tensor initialised
    by ``reset_parameters``); a piece is valid only until the next one is drawn, so write it
    out (``composer build --out`` streams a model of any size to disk this way)."""
    parts: dict[str, list[tuple[int, str, torch.Tensor]]] = {}
    resets: dict[str, set[str]] = {}  # holder -> its rule-less tensors still to yield
    for name, t in named_state(model):
        key, row = stored_as(model, name)
        parts.setdefault(key, []).append((row, name, t))
        if rule_for(model, name) is None:
            holder = _reset_holder(model, name)
            if holder is None:
                raise ValueError(f"no initialisation declared for {name!r}: add it to the "
                                 "init_rules() of the block that holds it")
            resets.setdefault(holder, set()).add(name)
    scratch = torch.empty(BLOCK_ELEMENTS, dtype=torch.float32)
    done: dict[str, dict[str, torch.Tensor]] = {}  # holder -> its reset values, while needed
    for key, planned in model.state_dict().items():
        if key not in parts:
            raise ValueError(f"state-dict key {key!r} is no parameter or buffer of its own")
        if planned.numel() == 0:  # the writer still wants to hear of it, in its place
            parts.pop(key)
            yield key, torch.empty(0, dtype=planned.dtype)
            continue
        for _, name, t in sorted(parts.pop(key), key=lambda p: p[0]):
            rule = rule_for(model, name)
            holder = _reset_holder(model, name) if rule is None else None
            if holder is not None:
                if holder not in done:
                    done[holder] = _reset_values(model, holder, seed)
                resets[holder].discard(name)
                yield key, done[holder][name].to(t.dtype)
                if not resets[holder]:
                    del done[holder]
            elif rule is not None and t.numel():
                for piece in _rule_pieces(rule, name, tuple(t.shape), seed, scratch):
                    yield key, piece.to(t.dtype)


def _rule_pieces(rule: Init, name: str, full: tuple[int, ...], seed: int,
                 scratch: torch.Tensor) -> Iterator[torch.Tensor]:
    """Tensor ``name``'s row blocks in order, filled from ``rule`` exactly as
    :func:`init_weights` fills them."""
    if not full:
        value = torch.empty((), dtype=torch.float32)
        rule.fill(value, torch.Generator().manual_seed(_block_seed(seed, name, 0)))
        yield value
        return
    for b in range(-(-full[0] // _block_rows(full))):
        yield _fill_block(rule, seed, name, full, b, scratch)[2]


def stored_as(model: nn.Module, name: str) -> tuple[str, int]:
    """The state-dict key that holds tensor ``name`` and the row where it starts there."""
    module, leaf = owner(model, name)
    prefix = name[: len(name) - len(leaf)]
    if declared(module, "stored_as") is not None:
        key, row = module.stored_as(leaf)
        return prefix + key, row
    return name, 0


def _runs(offsets: tuple[int, ...], sizes: tuple[int, ...],
          shape: tuple[int, ...]) -> Iterator[tuple[int, int]]:
    """Contiguous ``(element offset, length)`` runs of a region of a row-major tensor."""
    ndim = len(shape)
    k = ndim  # dims k.. are covered whole
    while k > 0 and offsets[k - 1] == 0 and sizes[k - 1] == shape[k - 1]:
        k -= 1
    if k == 0:
        yield 0, math.prod(shape)
        return
    inner = math.prod(shape[k:])
    run = sizes[k - 1] * inner
    strides = [math.prod(shape[i + 1:]) for i in range(ndim)]
    ranges = [range(offsets[i], offsets[i] + sizes[i]) for i in range(k - 1)]

    def walk(dim: int, base: int) -> Iterator[tuple[int, int]]:
        if dim == k - 1:
            yield base + offsets[k - 1] * strides[k - 1], run
            return
        for i in ranges[dim]:
            yield from walk(dim + 1, base + i * strides[dim])

    yield from walk(0, 0)


def read_region(source: TensorSource, key: str, offsets: tuple[int, ...],
                sizes: tuple[int, ...], out: torch.Tensor | None = None) -> torch.Tensor:
    """The ``sizes`` block at ``offsets`` of tensor ``key``, read as byte ranges: straight into
    ``out`` when it is a contiguous CPU tensor of the stored dtype (no temporary), else into a
    new tensor."""
    info = source.tensors[key]
    dtype = info.torch_dtype
    direct = out is not None and out.device.type == "cpu" and out.dtype == dtype \
        and out.is_contiguous() and tuple(out.shape) == tuple(sizes) and out.numel() > 0
    if direct:
        view = memoryview(out.detach().view(-1).view(torch.uint8).numpy()).cast("B")
    else:
        buf = bytearray(math.prod(sizes) * dtype.itemsize)
        view = memoryview(buf)
    pos = 0
    for start, length in _runs(offsets, sizes, info.shape):
        n = length * dtype.itemsize
        source.read_into(key, start * dtype.itemsize, view[pos:pos + n])
        pos += n
    return out if direct else bytes_to_tensor(buf, dtype, sizes)


def checkpoint_shapes(model: nn.Module,
                      skip: Callable[[str], bool] | None = None) -> dict[str, tuple[int, ...]]:
    """The state-dict keys a portable checkpoint of ``model`` holds, with their full shapes
    (but the tensors ``skip`` names)."""
    shapes: dict[str, list[int]] = {}
    for name, t in named_state(model):
        if skip is not None and skip(name):
            continue
        key, row = stored_as(model, name)
        shape = list(t.shape)
        if key in shapes:  # another part of a fused tensor
            shapes[key][0] = max(shapes[key][0], row + shape[0])
        else:
            if shape:
                shape[0] += row
            shapes[key] = shape
    return {k: tuple(v) for k, v in shapes.items()}


@torch.no_grad()
def load_weights(model: nn.Module, source: TensorSource, strict: bool = True,
                 skip: Callable[[str], bool] | None = None) -> None:
    """Fill every tensor of ``model`` (its local shard) from a portable checkpoint: strict (every
    key of the checkpoint used, every tensor found, shapes equal to the config's). A pipeline
    stage's pruned model reads its own tensors only (``strict=False``; the whole model is
    checked with :func:`check_source` first)."""
    check_source(model, source, strict, skip)
    for name, t in named_state(model):
        if skip is not None and skip(name):  # not in the checkpoint (LoRA adapters)
            continue
        key, row = stored_as(model, name)
        offsets, sizes = local_region(t)
        out = local_tensor(t)
        if t.ndim:
            offsets = (offsets[0] + row, *offsets[1:])
        got = read_region(source, key, offsets, sizes, out)
        if got is not out:
            out.copy_(got)


def check_source(model: nn.Module, source: TensorSource, strict: bool = True,
                 skip: Callable[[str], bool] | None = None) -> None:
    """Every tensor of ``model`` (but those ``skip`` names) is in ``source`` with its shape;
    with ``strict`` every tensor of ``source`` is one of ``model``'s."""
    expected = checkpoint_shapes(model, skip)
    where = source.folder
    unexpected = sorted(set(source.tensors) - set(expected))
    if unexpected and strict:
        raise CheckpointError(f"{where}: unexpected tensor {unexpected[0]!r} for this config")
    missing = sorted(set(expected) - set(source.tensors))
    if missing:
        more = " ..." if len(missing) > 5 else ""
        raise CheckpointError(f"{where}: missing tensors {missing[:5]}{more}")
    for key, shape in expected.items():
        if tuple(source.tensors[key].shape) != shape:
            raise CheckpointError(f"{where}: tensor {key!r} has shape "
                                  f"{list(source.tensors[key].shape)}, the config needs "
                                  f"{list(shape)}")


def stored_dtypes(model: nn.Module, source: TensorSource) -> dict[str, torch.dtype]:
    """Each tensor's dtype in the checkpoint, by the model's tensor names."""
    return {name: source.tensors[stored_as(model, name)[0]].torch_dtype
            for name, _ in named_state(model)}
