"""Tensors computed from others while streaming: what the byte-copy :class:`Link` engine cannot
express (a transpose, an interleave, a dequantisation) becomes a *derived* tensor, computed on
demand from a bounded slice of its inputs (one expert), that the links then copy like any other.

A family opts in with :meth:`~composer.convert.base.Adapter.derive_hf` (import: derived HF
tensors replace the on-disk ones they consume) and :meth:`~composer.convert.base.Adapter.
derive_ours` (export: derived tensors of ours replace our tensors they consume). Strictness is
kept: a consumed tensor leaves the listing, so the coverage checks see the derived names only,
and a derived tensor whose inputs are missing is an error before anything is written.

MXFP4 (OCP Microscaling, as in the published gpt-oss checkpoints and transformers'
``integrations/mxfp4.py``): ``X_blocks [..., G, 16]`` uint8 hold 32 FP4 (e2m1) values per block
of a row, two per byte (low nibble first), and ``X_scales [..., G]`` uint8 the block's e8m0
exponent (``2 ** (s - 127)``); ``X = lut[nibble] * 2 ** (s - 127)`` with the rows
``[..., G * 32]``. Every such value is exact in bf16 and fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from composer.portable import (
    DTYPE_NAMES,
    CheckpointError,
    TensorInfo,
    TensorSource,
    bytes_to_tensor,
    tensor_bytes,
)

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 FP4 e2m1 values by their 4-bit code (sign bit 3)."""


@dataclass(frozen=True)
class Derived:
    """A tensor ``shape`` of ``dtype`` (a safetensors dtype name), computed by ``compute`` from
    the base source; ``near`` names an input (its file appears in error messages)."""

    shape: tuple[int, ...]
    dtype: str
    compute: Callable[[TensorSource], torch.Tensor]
    near: str


class DerivedSource:
    """``base`` without the ``consumed`` tensors, plus the ``derived`` ones. The last derived
    tensor computed is kept while it is read chunk by chunk (bounded memory: one)."""

    def __init__(self, base: TensorSource, derived: dict[str, Derived],
                 consumed: set[str]) -> None:
        self.base, self.derived = base, derived
        self.tensors = {n: i for n, i in base.tensors.items() if n not in consumed}
        for name, d in derived.items():
            numel = 1
            for n in d.shape:
                numel *= n
            itemsize = torch.empty((), dtype=torch_dtype(d.dtype)).element_size()
            self.tensors[name] = TensorInfo(name, base.tensors[d.near].file, d.dtype, d.shape,
                                            0, numel * itemsize)
        self._cached: tuple[str, memoryview] | None = None

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def _bytes(self, name: str) -> memoryview:
        if self._cached is None or self._cached[0] != name:
            d = self.derived[name]
            t = d.compute(self.base).to(torch_dtype(d.dtype)).contiguous()
            if tuple(t.shape) != d.shape:
                raise CheckpointError(f"derived tensor {name!r} is {list(t.shape)}, expected "
                                      f"{list(d.shape)}")
            self._cached = (name, tensor_bytes(t))
        return self._cached[1]

    def locate(self, name: str) -> tuple[Path, int] | None:
        """A base tensor's place in its file (:meth:`TensorSource.locate`); a derived one has
        none."""
        if name in self.derived:
            return None
        return self.base.locate(name)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        if name not in self.derived:
            self.base.read_into(name, offset, out)
            return
        out[:] = self._bytes(name)[offset:offset + out.nbytes]

    def read_bytes(self, name: str, offset: int = 0, nbytes: int | None = None) -> bytearray:
        nbytes = self.tensors[name].nbytes - offset if nbytes is None else nbytes
        buf = bytearray(nbytes)
        self.read_into(name, offset, memoryview(buf))
        return buf

    def read(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        return bytes_to_tensor(self.read_bytes(name), info.torch_dtype, info.shape)

    def close(self) -> None:
        self._cached = None
        self.base.close()


def torch_dtype(name: str) -> torch.dtype:
    return {v: k for k, v in DTYPE_NAMES.items()}[name]


def read_slice(source: TensorSource, name: str, index: int) -> torch.Tensor:
    """``source[name][index]`` (the leading index), reading only its bytes."""
    info = source.tensors[name]
    inner = info.shape[1:]
    n = info.nbytes // info.shape[0]
    return bytes_to_tensor(source.read_bytes(name, index * n, n), info.torch_dtype, inner)


# ---------------------------------------------------------------- MXFP4


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``[..., G, B]`` uint8 blocks and ``[..., G]`` uint8 e8m0 scales -> ``[..., G * 2 * B]``
    (module docstring); exact in bf16 and fp32."""
    if blocks.shape[:-1] != scales.shape:
        raise CheckpointError(f"MXFP4 blocks {list(blocks.shape)} do not match their scales "
                              f"{list(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # low nibble first
    values = lut[codes].flatten(-2)  # [..., G, 2B]
    exponent = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponent[..., None].float()).flatten(-2).to(dtype)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`dequantize_mxfp4` for tensors whose blocks of 32 are FP4 values
    times one power of two (a test helper: exactly representable tensors round-trip exactly;
    others are rounded to the nearest code). Returns ``(blocks, scales)``."""
    *lead, n = x.shape
    x_G = x.float().reshape(*lead, n // 32, 32)
    amax = x_G.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = x_G / torch.exp2(exponent)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)
    pairs = codes.reshape(*lead, n // 32, 16, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks, (exponent[..., 0] + 127).to(torch.uint8)
