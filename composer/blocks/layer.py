"""The residual block that every pattern symbol builds: ``x + m * mixer(norm(x))``.

One symbol is one such block (Megatron-Core's hybrid models): the mixer is a Mamba-2 mixer,
attention, a dense MLP or an MoE. ``m`` is the residual multiplier (1 except for Granite).
"""

from __future__ import annotations

import torch
from torch import nn

from composer.blocks.norm import RMSNorm
from composer.config import ModelConfig


class Layer(nn.Module):
    """``layers.i.norm.weight`` and ``layers.i.mixer.*``."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, *, mixer: nn.Module, symbol: str) -> None:
        super().__init__()
        self.symbol = symbol
        self.layer_idx = layer_idx
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = mixer
        self.residual_multiplier = cfg.residual_multiplier
        self.tp = None  # a TPContext once tensor parallel (composer.parallel.tensor)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        h = self.norm(x_BTD)
        if self.tp is not None:  # gather the sequence (SP) for the mixer, reduce its output
            out = self.tp.leave(self.mixer(self.tp.enter(h)))
        else:
            out = self.mixer(h)
        if self.residual_multiplier != 1.0:
            out = out * self.residual_multiplier
        return x_BTD + out
