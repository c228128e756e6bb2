"""Rotary position embedding (Su et al. 2021) and its frequency scalings.

RoPE in the rotate-half layout that transformers and Megatron use: channel ``i`` pairs with
``i + d_rot/2`` and turns by ``pos * inv_freq[i]``, ``inv_freq[i] = theta^(-2i/d_rot)``; only the
first ``d_rot`` channels of a head rotate. The scalings (:class:`RopeScaling`, transformers'
``rope_parameters`` / ``rope_scaling``) change the inverse frequencies and, for YaRN, the gain of
the cos/sin tables:

- ``linear`` (position interpolation, Chen et al. 2023; Gemma 3's global layers):
  ``inv_freq / factor``.
- ``llama3``: low frequencies (wavelength above ``original_max_position / low_freq_factor``)
  divided by ``factor``, high ones kept, the band between blended.
- ``yarn`` (Peng et al. 2023; gpt-oss): interpolated by ``factor`` below the ``beta_slow``
  correction dimension, extrapolated above ``beta_fast``, a linear ramp between (``truncate``
  rounds the range outwards to whole dimensions); cos and sin are multiplied by
  ``attention_factor`` (default ``0.1 ln(factor) + 1``, or ``g(mscale) / g(mscale_all_dim)``
  when both are set).

:class:`Rotary` holds one mixer's frequencies and gain and makes the tables of a call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from composer.blocks.cache import Step
from composer.blocks.mrope import mrope_cos_sin
from composer.kernels.packing import doc_positions


@dataclass
class RopeScaling:
    """A RoPE frequency scaling (transformers' ``rope_type``; the module docstring gives the
    math). Fields a type does not read are ignored."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    """``llama3``."""
    high_freq_factor: float = 4.0
    """``llama3``."""
    original_max_position: int = 8192
    """``llama3``, ``yarn``: the context length of pretraining."""
    rope_type: Literal["llama3", "linear", "yarn"] = "llama3"
    beta_fast: float = 32.0
    """``yarn``: rotations at which the ramp ends (extrapolated above)."""
    beta_slow: float = 1.0
    """``yarn``: rotations at which the ramp starts (interpolated below)."""
    attention_factor: float | None = None
    """``yarn``: the gain of the cos/sin tables; None: from ``factor`` (and the mscales)."""
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    """``yarn``: round the correction range outwards to whole dimensions (transformers'
    default; gpt-oss sets False)."""


def rope_frequencies(d_rot: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies ``theta^(-2i/d_rot)``, scaled when ``scaling`` is given (fp64)."""
    # an explicit CPU device: the model may be built under a meta-device context
    inv_freq = 1.0 / theta ** (torch.arange(0, d_rot, 2, dtype=torch.float64, device="cpu") / d_rot)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return yarn_frequencies(d_rot, theta, scaling)
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(middle, blended, out)


def rope_gain(scaling: RopeScaling | None) -> float:
    """The gain of the cos/sin tables: YaRN's attention factor, 1 for the other types."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    return yarn_gain(scaling)


def yarn_gain(y: RopeScaling | Any) -> float:
    """YaRN's attention factor for any ``y`` with ``factor``, ``attention_factor``, ``mscale``
    and ``mscale_all_dim`` (:class:`RopeScaling`, MLA's ``YarnScaling``): the given factor, else
    ``g(mscale) / g(mscale_all_dim)`` when both are set, else ``g(1)`` (:func:`yarn_mscale`)."""
    if y.attention_factor is not None:
        return y.attention_factor
    if y.mscale and y.mscale_all_dim:
        return yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim)
    return yarn_mscale(y.factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(d_rot: int, theta: float, y: RopeScaling | Any) -> torch.Tensor:
    """YaRN inverse frequencies (fp64) for any ``y`` with ``factor``, ``original_max_position``,
    ``beta_fast``, ``beta_slow`` and ``truncate`` (:class:`RopeScaling`, MLA's ``YarnScaling``):
    interpolated by ``factor`` below the ``beta_slow`` correction dimension, extrapolated above
    ``beta_fast``, a linear ramp between."""
    dims = torch.arange(0, d_rot, 2, dtype=torch.float64, device="cpu")
    extrapolated = 1.0 / theta ** (dims / d_rot)
    interpolated = extrapolated / y.factor

    def correction_dim(n_rotations: float) -> float:
        ratio = y.original_max_position / (n_rotations * 2 * math.pi)
        return d_rot * math.log(ratio) / (2 * math.log(theta))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d_rot - 1)
    if low == high:
        high += 0.001  # as transformers: avoids a zero-width ramp
    ramp = (torch.arange(d_rot // 2, dtype=torch.float64, device="cpu") - low) / (high - low)
    ramp = ramp.clamp(0, 1)
    return interpolated * ramp + extrapolated * (1 - ramp)


def rope_cos_sin(t: int, inv_freq: torch.Tensor, device: torch.device,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` tables ``[T, d_rot]`` in at least fp32 math, cast to ``dtype``."""
    math_dtype = torch.promote_types(dtype, torch.float32)
    pos = torch.arange(t, device=device, dtype=math_dtype)
    angles = torch.outer(pos, inv_freq.to(device=device, dtype=math_dtype))
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_cos_sin_at(pos_BT: torch.Tensor, inv_freq: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope_cos_sin` at per-row positions: ``[B, 1, T, d_rot]`` tables (one per row,
    shared by the heads) for integer positions ``pos_BT``; the same products as there."""
    math_dtype = torch.promote_types(dtype, torch.float32)
    angles = pos_BT.to(math_dtype)[..., None] * inv_freq.to(pos_BT.device, math_dtype)
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x_BHTE: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d_rot = cos.shape[-1]
    half = d_rot // 2
    if d_rot == x_BHTE.shape[-1]:  # the whole head rotates: no slicing, one concat
        return x_BHTE * cos + torch.cat([-x_BHTE[..., half:], x_BHTE[..., :half]], -1) * sin
    rot, rest = x_BHTE[..., :d_rot], x_BHTE[..., d_rot:]
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


class Rotary:
    """One mixer's RoPE: inverse frequencies ``inv_freq`` (fp64, on the CPU) and the gain of the
    cos/sin tables (YaRN's attention factor for multi-latent attention; 1 otherwise). Holds no
    parameters: the table of the last length is kept while the length, device and dtype
    repeat (a training run asks for one length)."""

    def __init__(self, inv_freq: torch.Tensor, gain: float = 1.0,
                 mrope_section: list[int] | None = None, mrope_interleaved: bool = True) -> None:
        self.inv_freq, self.gain = inv_freq, gain
        self._table: tuple | None = None
        self.mrope_section, self.mrope_interleaved = mrope_section, mrope_interleaved

    def mrope(self, pos_3BT: torch.Tensor, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """M-RoPE tables at the three position rows ``pos_3BT`` (``mrope_section`` set)."""
        assert self.mrope_section is not None
        cos, sin = mrope_cos_sin(pos_3BT, self.inv_freq, self.mrope_section,
                                 interleaved=self.mrope_interleaved, dtype=dtype)
        return self._gain(cos), self._gain(sin)

    def table(self, t: int, device: torch.device,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``/``sin`` ``[T, d_rot]`` at positions ``0 .. t - 1``."""
        key = (t, device, dtype)
        if self._table is None or self._table[0] != key:
            cos, sin = rope_cos_sin(t, self.inv_freq, device, dtype)
            self._table = (key, self._gain(cos), self._gain(sin))
        return self._table[1], self._table[2]

    def at(self, pos_BT: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``/``sin`` ``[B, 1, T, d_rot]`` at per-row integer positions ``pos_BT``."""
        cos, sin = rope_cos_sin_at(pos_BT, self.inv_freq, dtype)
        return self._gain(cos), self._gain(sin)

    def for_call(self, like: torch.Tensor, doc_ids: torch.Tensor | None,
                 step: Step | None, positions: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables of one call on ``like`` ``[B, H, T, E]``: the decoding step's positions,
        or the M-RoPE rows ``positions`` ``[3, B, T]`` of a forward with images, or positions
        restarting at each document, or ``0 .. T - 1``."""
        if step is not None:
            pos_3BT = step.ctx.pos_3BT
            if pos_3BT is not None and self.mrope_section is not None:
                return self.mrope(pos_3BT, like.dtype)
            return self.at(step.ctx.pos_BT, like.dtype)
        if positions is not None and self.mrope_section is not None:
            return self.mrope(positions, like.dtype)
        if doc_ids is not None:
            return self.at(doc_positions(doc_ids), like.dtype)
        return self.table(like.shape[2], like.device, like.dtype)

    def _gain(self, table: torch.Tensor) -> torch.Tensor:
        return table * self.gain if self.gain != 1.0 else table


def rotate_pairs_ref(x: torch.Tensor, inv_freq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs ``(i, i + d_rot/2)`` by angle ``pos * inv_freq[i]``, one at a time
    (``pos`` ``[B, T]``)."""
    out = x.clone()
    half = inv_freq.shape[0]
    pos = pos.to(x.dtype)[..., None]
    for i in range(half):
        ang = pos * inv_freq[i]
        a, b = x[..., i], x[..., i + half]
        out[..., i] = a * torch.cos(ang) - b * torch.sin(ang)
        out[..., i + half] = a * torch.sin(ang) + b * torch.cos(ang)
    return out
