"""The residual block that every pattern symbol builds: ``x + m * mixer(norm(x))`` (pre-norm),
or ``x + m * norm(mixer(x))`` for the layers listed in ``ModelConfig.post_norm_layers``, or
``x + m * out_norm(mixer(norm(x)))`` with ``ModelConfig.sandwich_norm`` (Gemma 2/3).

One symbol is one such block (Megatron-Core's hybrid models): the mixer is a Mamba-2 mixer,
attention, a dense MLP, an MoE or a user-registered kind. ``m`` is the residual multiplier (1
except for Granite). Post-norm (OLMo 2 / OLMo 3 and OLMo-Hybrid's attention layers, transformers'
``post_attention_layernorm`` / ``post_feedforward_layernorm``) normalises the mixer's output
before the residual add, with the same ``layers.i.norm.weight``; the residual stream itself is
never normalised there. Under tensor parallelism the parallel layer wraps the *mixer* call (gather
the sequence on the way in, reduce the partial sums on the way out); this code does not change.

Packed documents: ``doc_ids`` (``(B, T)``, :mod:`composer.kernels.packing`) go, as a keyword, only
to mixers whose class sets ``uses_doc_ids = True`` (attention, Mamba-2): token-wise mixers (MLP,
MoE) need nothing, and a user-registered mixer without the keyword keeps working. The M-RoPE
position rows of a forward with images (``positions``, ``[3, B, T]``) go the same way to mixers
that set ``uses_positions = True`` (attention), and the model's input embeddings
(``embeddings``) to mixers that set ``uses_embeddings = True`` (Zamba2's hybrid layer). A mixer
that sets ``takes_residual = True`` gets ``x`` itself and this layer's norm (``norm=``), and
normalises where its math puts the norm (Zamba2: ``x + mamba(norm(x + linear(T(x, e))))``). A
keyword passes untouched through the
tensor-parallel pre-hooks (they rewrite ``args[0]``, and ``embeddings``, which enter the mixer
like its input) and activation checkpointing.

Decoding (:mod:`composer.blocks.cache`): the same ``forward`` with ``step=`` (a
:class:`~composer.blocks.cache.Step`: the layer's state and the call's context); a stateful
mixer (one with ``init_cache``) continues from its state, a stateless one (MLP, MoE) is called
as in training. What a mixer takes is read through :func:`composer.blocks.protocol.call_mixer`.
"""

from __future__ import annotations

import torch
from torch import nn

from composer.blocks.cache import Step
from composer.blocks.norm import RMSNorm
from composer.blocks.protocol import call_mixer, declared
from composer.config import ModelConfig


class Layer(nn.Module):
    """``layers.i.norm.weight`` and ``layers.i.mixer.*`` (and ``layers.i.out_norm.weight``:
    sandwich norm)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, *, mixer: nn.Module, symbol: str) -> None:
        super().__init__()
        self.symbol = symbol
        self.layer_idx = layer_idx
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = mixer
        self.residual_multiplier = cfg.residual_multiplier
        self.post_norm = layer_idx in cfg.post_norm_layers
        self.out_norm = RMSNorm(cfg.d_model, cfg.norm_eps) if cfg.sandwich_norm else None
        self.shared_label: str | None = None
        """The label of the shared layer this is a use of (:mod:`composer.blocks.shared`)."""

    def forward(self, x_BTD: torch.Tensor, *, doc_ids: torch.Tensor | None = None,
                step: Step | None = None, positions: torch.Tensor | None = None,
                embeddings: torch.Tensor | None = None) -> torch.Tensor:
        raw = self.post_norm or declared(self.mixer, "takes_residual")
        h_BTD = x_BTD if raw else self.norm(x_BTD)
        return self._residual(x_BTD, call_mixer(self.mixer, h_BTD, doc_ids, step, positions,
                                                embeddings=embeddings, norm=self.norm))

    def _residual(self, x_BTD: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.post_norm:
            out = self.norm(out)
        elif self.out_norm is not None:
            out = self.out_norm(out)
        if self.residual_multiplier != 1.0:
            out = out * self.residual_multiplier
        return x_BTD + out
