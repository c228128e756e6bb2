"""Time-mixing ops shared by the recurrent mixers (docs/architecture.md): the causal convolution
and the base of every recurrence linear in its state.

A mixer calls its ops as parameterless submodules (:class:`~composer.blocks.protocol.
TimeMixingOp`) and hands them its tensors and parameters; everything around them is token-wise.
Context parallelism swaps each op for the variant its ``context`` names
(:mod:`composer.parallel.context.recurrent`: ``"halo_conv"``, ``"state_passing"``), written once
for every op of that contract; decoding passes a :class:`~composer.blocks.cache.Step` and the op
continues from its fields of the layer's :class:`~composer.blocks.cache.RecurrentState`.

Shape legend: B batch, T time, X conv channels, K conv taps.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from composer.blocks.cache import Step
from composer.blocks.protocol import TimeMixingOp
from composer.kernels.conv import conv_continue, conv_silu, keep_window


def step_docs(doc_ids: torch.Tensor | None, step: Step | None) -> torch.Tensor | None:
    """The doc ids an op isolates: the caller's, or with ``step`` the first call's padding
    isolation (``step.ctx.doc_ids_BT``; None after the first call)."""
    return doc_ids if step is None else step.ctx.doc_ids_BT


class CausalConv(TimeMixingOp):
    """``silu(conv(x))``: the mixer's depthwise causal convolution ``conv`` (a
    ``SplitCausalConv1d``, ``conv.kernel`` taps) and SiLU, ``[B, T, X] -> [B, T, X]``.

    With ``doc_ids`` no tap reads an earlier document. With ``step`` it continues from the conv
    window ``step.state.conv_BXW`` (the last ``K - 1`` inputs, zeros on the first call) and
    leaves the window after the new tokens there. Under context parallelism each chunk reads
    the ``K - 1`` inputs before it from the rank that holds them (``"halo_conv"``)."""

    context = "halo_conv"

    def forward(self, x_BTX: torch.Tensor, conv: nn.Module, *,
                doc_ids: torch.Tensor | None = None, step: Step | None = None) -> torch.Tensor:
        docs = step_docs(doc_ids, step)
        if step is None or step.fresh:
            y_BTX = conv_silu(x_BTX, conv, docs)
            if step is not None:
                keep_window(step.state.conv_BXW, x_BTX, docs, True)
            return y_BTX
        return conv_continue(x_BTX, conv, step.state.conv_BXW, update=True)


class LinearRecurrence(TimeMixingOp, abc.ABC):
    """A recurrence linear in its state: over any span of tokens the state ``S`` goes

        S_end = carry(M, S_start) + S_local

    with ``S_local`` the span's end state from zero and ``M`` its transition, both functions of
    the span's tokens only (Mamba-2: a decay per head, ``M * S``; the gated delta rule: a
    ``K x K`` matrix per head, ``M @ S``). That is all context parallelism needs
    (``"state_passing"``): each rank computes ``(S_local, M)`` of its spans, they are gathered,
    each rank runs the recurrence over the spans for their true start states and runs its own
    spans again from those. A subclass implements four methods:

    - ``forward(*tokens, doc_ids=None, initial_state=None, step=None, **consts) -> y``: the
      outputs ``[B, T, ...]``; every positional ``tokens[i]`` is ``[B, T, ...]`` (token-major),
      ``consts`` are the non-token arguments (per-head parameters, chunk size). With
      ``initial_state`` ``[B, ...]`` it starts from it (it belongs to each row's first
      document); with ``step`` it continues from ``step.state.state`` and leaves the state
      after the new tokens there. With ``doc_ids`` the state restarts at each document.
    - ``end_state(*tokens, doc_ids=None, **consts) -> (S_local [B, ...], M [B, ...])``: with
      ``doc_ids`` only the last document feeds ``S_local`` and ``M`` is zero across a document
      start.
    - ``carry(M, S) -> S`` (static): what a start state ``S`` becomes at the span's end; any
      leading dims (a batch of spans, or one span's state without one).
    - ``mask_steps(tokens, keep_BT) -> tokens``: the same tokens with every position where
      ``keep`` is False an identity step (no decay, no input), so padding after a span changes
      neither its outputs nor its end state.
    """

    context = "state_passing"

    @abc.abstractmethod
    def forward(self, *tokens: torch.Tensor, doc_ids: torch.Tensor | None = None,
                initial_state: torch.Tensor | None = None, step: Step | None = None,
                **consts: Any) -> torch.Tensor:
        """The outputs ``[B, T, ...]`` (class docstring)."""

    @abc.abstractmethod
    def end_state(self, *tokens: torch.Tensor, doc_ids: torch.Tensor | None = None,
                  **consts: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(S_local, M)`` of the span (class docstring)."""

    @staticmethod
    @abc.abstractmethod
    def carry(M: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
        """What a start state ``S`` becomes at the span's end (class docstring)."""

    @abc.abstractmethod
    def mask_steps(self, tokens: Sequence[torch.Tensor],
                   keep_BT: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The tokens with the positions where ``keep`` is False made identity steps."""


def keep_mask(keep_BT: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``keep`` as ``like``'s dtype, with trailing unit dims to broadcast against it."""
    return keep_BT.view(*keep_BT.shape, *([1] * (like.dim() - 2))).to(like.dtype)
