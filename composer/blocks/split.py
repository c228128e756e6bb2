"""Fused projections stored as named parts, so that tensor parallelism can shard each part.

Mamba-2's input projection packs ``[z, x, B, C, dt]`` and its depthwise convolution
``[x, B, C]``; Megatron-Core shards each component separately over the tensor-parallel ranks
(docs/parallelism.md). Keeping every component its own parameter makes that a plain row split
of each part (``Shard(0)``) whose global shape is independent of the layout, so sharded checkpoints
reshard on load. The state dict still shows one fused ``weight`` (and ``bias``): the canonical
keys of docs/architecture.md and Hugging Face's layout.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from composer.blocks.plan import Init, Uniform, init_module
from composer.kernels.conv import causal_conv1d, causal_conv1d_docs
from composer.kernels.linear import linear


class SplitParams(nn.Module):
    """Parameters ``weight_<part>`` (and ``bias_<part>``) fused along dim 0 in the state dict."""

    def __init__(self, sizes: dict[str, int], trailing: tuple[int, ...], bias: bool) -> None:
        super().__init__()
        self.parts = tuple(sizes)
        self.has_bias = bias
        for name, n in sizes.items():
            self.register_parameter(f"weight_{name}", nn.Parameter(torch.empty(n, *trailing)))
            if bias:
                self.register_parameter(f"bias_{name}", nn.Parameter(torch.empty(n)))

    def weights(self) -> list[nn.Parameter]:
        return [getattr(self, f"weight_{p}") for p in self.parts]

    def biases(self) -> list[nn.Parameter]:
        return [getattr(self, f"bias_{p}") for p in self.parts] if self.has_bias else []

    def fused_weight(self) -> torch.Tensor:
        """The fused weight: the parts' rows, in part order."""
        return _fused(self.weights())

    def fused_bias(self) -> torch.Tensor | None:
        return _fused(self.biases()) if self.has_bias else None

    def stored_as(self, name: str) -> tuple[str, int]:
        """Where parameter ``name`` (``weight_<part>``) lives in the state dict: the fused key
        and the row at which the part starts."""
        kind, _, part = name.partition("_")
        tensors = self.weights() if kind == "weight" else self.biases()
        row = 0
        for p, t in zip(self.parts, tensors, strict=True):
            if p == part:
                return kind, row
            row += t.shape[0]
        raise KeyError(name)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        for kind, tensors in (("weight", self.weights()), ("bias", self.biases())):
            if tensors:
                fused = torch.cat(tensors, dim=0)
                destination[prefix + kind] = fused if keep_vars else fused.detach()

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: Any,
                              strict: bool, missing_keys: list, unexpected_keys: list,
                              error_msgs: list) -> None:
        assign = local_metadata.get("assign_to_params_buffers", False)
        for kind, tensors in (("weight", self.weights()), ("bias", self.biases())):
            if not tensors:
                continue
            key = prefix + kind
            if key not in state_dict:
                missing_keys.append(key)
                continue
            value = state_dict[key]
            rows = sum(t.shape[0] for t in tensors)
            want = (rows, *tensors[0].shape[1:])
            if tuple(value.shape) != want:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                                  f"{tuple(value.shape)}, the model needs {want}")
                continue
            names = [f"{kind}_{p}" for p in self.parts]
            for name, piece in zip(names, value.split([t.shape[0] for t in tensors]), strict=True):
                if assign:
                    setattr(self, name, nn.Parameter(piece.clone()))
                else:
                    with torch.no_grad():
                        getattr(self, name).copy_(piece)
        if strict:
            expected = {prefix + "weight"} | ({prefix + "bias"} if self.has_bias else set())
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix)
                                   and k not in expected and "." not in k[len(prefix):])


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _adjacent(parts: list[torch.Tensor]) -> bool:
    """The parts are consecutive contiguous blocks of one storage (fused already)."""
    first = parts[0]
    base = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for t in parts:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.device != first.device
                or t.untyped_storage().data_ptr() != base or t.storage_offset() != offset):
            return False
        offset += t.numel()
    return True


def _fused(parts: list[torch.Tensor]) -> torch.Tensor:
    """``cat(parts)``; without autograd, a view instead of a copy.

    Inference (decoding: one token per call) would otherwise copy every fused weight at every
    step. Without grad, in a single process, plain parameters on a real device are moved once
    into one buffer, each part a block of it (the same Parameter objects, so optimizers and
    state dicts are unaffected), and the fused tensor is a view of that buffer. Anything that
    needs gradients, and any process of a parallel run, takes the copy.
    """
    if torch.is_grad_enabled() or len(parts) == 1 or dist.is_initialized():
        # under any parallel layout the parameters' storage belongs to the wrappers (FSDP's
        # unsharded buffers, tensor-parallel shadows): never re-pointed
        return torch.cat(parts, dim=0)
    if not _adjacent(parts):
        if not all(type(t) is nn.Parameter and t.device.type != "meta" for t in parts):
            return torch.cat(parts, dim=0)
        with torch.inference_mode(False):  # a normal buffer, usable for training later
            buffer = torch.cat([t.detach() for t in parts], dim=0)
        for t, piece in zip(parts, buffer.split([t.shape[0] for t in parts]), strict=True):
            t.data = piece
    first = parts[0]
    shape = (sum(t.shape[0] for t in parts), *first.shape[1:])
    return first.detach().as_strided(shape, _contiguous_strides(shape), first.storage_offset())


class SplitLinear(SplitParams):
    """``y = x W^T + b`` with ``W`` the row-concatenation of the parts."""

    def __init__(self, d_in: int, sizes: dict[str, int], bias: bool) -> None:
        super().__init__(sizes, (d_in,), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.fused_weight(), self.fused_bias())


class SplitCausalConv1d(SplitParams):
    """Depthwise causal convolution over channels ``[B, T, C]``, weight ``[C, 1, K]``."""

    def __init__(self, sizes: dict[str, int], kernel: int, bias: bool) -> None:
        super().__init__(sizes, (1, kernel), bias)
        self.kernel = kernel

    def init_rules(self) -> dict[str, Init]:
        # PyTorch's Conv1d default for a depthwise conv: U(+-1/sqrt(fan_in)), fan_in = K.
        bound = 1.0 / math.sqrt(self.kernel)
        return {"*": Uniform(-bound, bound)}

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        init_module(self, generator)

    def forward(self, x_BTC: torch.Tensor, *, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """With ``doc_ids`` (``(B, T)``) no tap reaches into an earlier document."""
        w = self.fused_weight()
        if doc_ids is not None:
            return causal_conv1d_docs(x_BTC, w, self.fused_bias(), doc_ids)
        return causal_conv1d(x_BTC, w, self.fused_bias())
