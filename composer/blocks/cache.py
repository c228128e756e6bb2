"""Inference caches: what each mixer keeps between decoding steps, and the per-call context.

One :class:`InferenceCache` per model and batch (``HybridModel.new_cache``), holding one state
per stateful layer, keyed by the layer's global index; MLP and MoE layers keep nothing. The
layouts are those of the GPU decoding kernels, so a later kernel reads them in place (channels
before time in the conv windows: causal_conv1d's ``causal_conv1d_update(x, conv_state, ...)``;
``[B, H, P, N]`` for the SSM state: mamba_ssm's ``selective_state_update``), and every tensor is
allocated once, at its final size (a CUDA graph can capture the decoding step).

- ``*`` attention, :class:`KVState`: keys (after RoPE) and values ``[B, K, S, E]``; grows
  with ``S``. ``W`` (sliding window): the same, ``min(window, S)`` slots used as a ring
  (:mod:`composer.blocks.attn_core`); constant.
- ``+`` multi-latent attention, :class:`LatentState`: the normalised kv latent ``[B, S, C]``
  and the shared RoPE key ``[B, S, R]``; grows with ``S``, ``C + R`` numbers per token.
- ``M`` Mamba-2, :class:`RecurrentState`: conv window ``[B, X, d_conv - 1]``, SSM state
  ``[B, H, P, N]``; constant.
- ``G`` gated delta net, :class:`RecurrentState`: conv window ``[B, X, d_conv - 1]``, state
  ``[B, H, K, V]``; constant.

``S`` is ``max_len`` (prompt + new tokens), preallocated. Recurrent states are kept in fp32 (at
least): a decoding step adds to them thousands of times.

Padding. Prompts of different lengths are left-padded; ``real_BS`` marks the slots that hold a
real token. The prefill treats the padding as a separate, earlier document of each row
(``doc_ids`` = 0 for padding, 1 for the prompt; :mod:`composer.kernels.packing`): attention and
RoPE positions, the convolutions and the scans of the prompt are exactly those of the prompt
alone. Later steps attend only to real slots; the conv windows hold zeros, never padding.

Shape legend: B batch, S cache slots (``max_len``), T new tokens this call, K kv heads, E head
width, C latent rank, R RoPE width, X conv channels, H heads, P/N (Mamba) or K/V (GDN) state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from composer.kernels.flex import Visible


@dataclass
class KVState:
    """Attention: keys after RoPE and values of every slot written so far."""

    k_BKSE: torch.Tensor
    v_BKSE: torch.Tensor


@dataclass
class LatentState:
    """Multi-latent attention: the normalised latent (``kv_a_norm(c)``) and the shared RoPE key
    (after RoPE); decoding attends against them in the absorbed form."""

    c_BSC: torch.Tensor
    kr_BSR: torch.Tensor


@dataclass
class RecurrentState:
    """Mamba-2 / gated delta net: the last ``d_conv - 1`` conv inputs (zeros before the prompt)
    and the scan state after the last token."""

    conv_BXW: torch.Tensor
    state: torch.Tensor


def recurrent_state(batch: int, channels: int, d_conv: int, state_shape: tuple[int, ...],
                    device: torch.device, dtype: torch.dtype) -> RecurrentState:
    """Zeros: a conv window of ``channels x (d_conv - 1)`` in ``dtype`` and a state of
    ``state_shape`` in at least fp32, per sequence."""
    return RecurrentState(
        torch.zeros(batch, channels, d_conv - 1, device=device, dtype=dtype),
        torch.zeros(batch, *state_shape, device=device,
                    dtype=torch.promote_types(dtype, torch.float32)))


@dataclass
class StepContext:
    """What every layer of one cached forward shares: where the new tokens go and where they
    are."""

    start: int
    """Slots filled before this call; the ``T`` new tokens fill ``start : start + T``."""
    pos_BT: torch.Tensor
    """RoPE position of each new token: its index among its row's real tokens."""
    real_BS: torch.Tensor
    """``[B, start + T]``: the slot holds a real token (not padding)."""
    doc_ids_BT: torch.Tensor | None = None
    """A first call with padding: 0 for padding, 1 for the prompt (isolation); else None."""
    padded: bool = False
    """Some slot of the cache holds padding (set by the first call)."""
    pos_3BT: torch.Tensor | None = None
    """M-RoPE's three position rows ``[3, B, T]`` (a prompt with images, and every later
    call: ``pos_BT + delta`` on each row); None: 1-D positions ``pos_BT``."""

    @property
    def end(self) -> int:
        return self.start + self.pos_BT.shape[1]


@dataclass
class Step:
    """One layer's part of a cached forward: its decoding ``state`` (what its kind's
    ``init_cache`` made) and the call's shared :class:`StepContext`. A stateful mixer's
    ``forward(x, step=...)`` continues from ``state`` and leaves it after the new tokens; its
    time-mixing ops read their own fields of the state."""

    state: Any
    ctx: StepContext

    @property
    def fresh(self) -> bool:
        """The first call (the prompt): states start from zero."""
        return self.ctx.start == 0


@dataclass
class InferenceCache:
    """The states of one model for one batch, and the slots used so far."""

    batch: int
    max_len: int
    layers: dict[int, KVState | LatentState | RecurrentState]
    real_BS: torch.Tensor
    """``[B, max_len]`` bool: slot holds a real token (filled as tokens are written)."""
    length: int = 0
    """Slots filled (the same for every row: rows are left-padded)."""
    padded: bool = False
    """The prompt had padding (some slots are not real tokens)."""
    next_pos_B: torch.Tensor = field(default=None)  # type: ignore[assignment]
    """Position of each row's next token (its real tokens so far)."""
    rope_deltas_B1: torch.Tensor | None = None
    """M-RoPE's offset of each row after a prompt with images (``max position + 1 - real
    tokens``, :func:`composer.blocks.mrope.mrope_positions`): the later tokens sit at
    ``pos_BT + delta`` on all three rows. None for a text-only prompt (1-D positions)."""

    def __post_init__(self) -> None:
        if self.next_pos_B is None:
            self.next_pos_B = torch.zeros(self.batch, dtype=torch.long,
                                          device=self.real_BS.device)

    def advance(self, n_new: int, real_BT: torch.Tensor | None = None) -> StepContext:
        """Reserve the next ``n_new`` slots (``real_BT``: which hold real tokens; all by
        default) and return the context for the forward that fills them."""
        start, end = self.length, self.length + n_new
        if end > self.max_len:
            raise ValueError(f"inference cache full: {end} tokens do not fit in max_len="
                             f"{self.max_len}")
        device = self.real_BS.device
        doc_ids = None
        if real_BT is None:  # every new token is real: positions count on (no host sync)
            pos_BT = self.next_pos_B[:, None] + torch.arange(n_new, device=device)
            self.real_BS[:, start:end] = True
            self.next_pos_B = self.next_pos_B + n_new
            self.length = end
            return StepContext(start, pos_BT, self.real_BS[:, :end], None, self.padded,
                               self._pos_3BT(pos_BT))
        else:
            real_BT = real_BT.to(device=device, dtype=torch.bool)
            if not bool(real_BT.all()):
                if start != 0:
                    raise ValueError("padding is only allowed in the first call (the prompt)")
                if bool((real_BT[:, :-1] & ~real_BT[:, 1:]).any()):
                    raise ValueError("attention_mask must be left padding: 0s, then 1s, in "
                                     "each row")
                doc_ids = real_BT.long()
                self.padded = True
        pos_BT = self.next_pos_B[:, None] + real_BT.long().cumsum(1) - 1
        pos_BT = pos_BT.clamp(min=0)  # padding slots: position 0 (never attended to)
        self.real_BS[:, start:end] = real_BT
        self.next_pos_B = self.next_pos_B + real_BT.long().sum(1)
        self.length = end
        return StepContext(start, pos_BT, self.real_BS[:, :end], doc_ids, self.padded,
                           self._pos_3BT(pos_BT))

    def _pos_3BT(self, pos_BT: torch.Tensor) -> torch.Tensor | None:
        if self.rope_deltas_B1 is None:
            return None
        return (pos_BT + self.rope_deltas_B1.to(pos_BT.device)).expand(3, -1, -1)


def needs_mask(ctx: StepContext) -> bool:
    """Whether the new queries need a mask over the slots (:func:`attention_mask`)."""
    return ctx.padded or (ctx.start > 0 and ctx.pos_BT.shape[1] > 1)


def attention_mask(ctx: StepContext) -> torch.Tensor | None:
    """``[B, 1, T, start + T]`` bool mask for the new queries over all slots so far, or None
    when no mask is needed: a first call without padding (plain causal attention: the caller
    passes ``is_causal`` when ``start == 0``), or one new token with no padding anywhere (it
    sees every slot). A query sees earlier or same slots of its own kind (real or padding):
    padding queries see padding (never NaN), real ones see real tokens only."""
    if not needs_mask(ctx):
        return None
    s = ctx.end
    device = ctx.real_BS.device
    causal_TS = (torch.arange(s, device=device)[None, :]
                 <= torch.arange(ctx.start, s, device=device)[:, None])
    real_q_BT = ctx.real_BS[:, ctx.start:]
    same_BTS = real_q_BT[:, :, None] == ctx.real_BS[:, None, :]
    return (causal_TS[None] & same_BTS)[:, None]


def attention_visible(ctx: StepContext) -> Visible:
    """:func:`attention_mask`'s rule as slot positions and slot kinds, for FlexAttention's
    block mask on CUDA (:mod:`composer.kernels.flex`): no ``[T, start + T]`` tensor."""
    device = ctx.real_BS.device
    return Visible(torch.arange(ctx.start, ctx.end, device=device),
                   torch.arange(ctx.end, device=device), ctx.real_BS[:, ctx.start:], ctx.real_BS)
