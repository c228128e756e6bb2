"""Dense MLP: gated (SwiGLU/GeGLU, Shazeer 2020) or plain (squared ReLU, GELU, SiLU, ReLU).

Gated: ``down(act(gate(x)) * up(x))``. Plain: ``down(act(up(x)))``. Squared ReLU
(So et al. 2021, "Primer") is ``relu(x)^2``; Nemotron-H uses it without a gate.
Falcon-H1's µP ``mlp_multipliers`` are ``gate_multiplier`` (on ``gate(x)``, before the
activation) and ``down_multiplier`` (on the output), kept as config numbers:
``m_down * down(act(m_gate * gate(x)) * up(x))``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from composer.blocks.kind import LayerKind
from composer.blocks.plan import ZEROS, Divisible, Init, Normal, ParallelPlan, init_module
from composer.config import ConfigError, ModelConfig, positive
from composer.kernels.linear import Linear

# ---------------------------------------------------------------- the kind's config section


Activation = Literal["swiglu", "geglu", "geglu_tanh", "relu2", "gelu", "gelu_tanh", "silu",
                     "relu"]
GATED_ACTIVATIONS = ("swiglu", "geglu", "geglu_tanh")
"""``geglu_tanh``: GeGLU with the tanh approximation of GELU (Gemma's ``gelu_pytorch_tanh``)."""


def is_gated(activation: str) -> bool:
    return activation in GATED_ACTIVATIONS


@dataclass
class MLPConfig:
    d_ff: int = 1024
    activation: Activation = "swiglu"
    bias: bool = False
    gate_multiplier: float = 1.0
    """Scales ``gate_proj``'s output before the activation (Falcon-H1's ``mlp_multipliers[0]``)."""
    down_multiplier: float = 1.0
    """Scales the MLP's output (Falcon-H1's ``mlp_multipliers[1]``)."""


def validate_mlp(mlp: MLPConfig, cfg: ModelConfig) -> None:
    positive(mlp, "mlp.", ("d_ff",))
    if mlp.gate_multiplier != 1.0 and not is_gated(mlp.activation):
        raise ConfigError(f"mlp.gate_multiplier needs a gated activation, not "
                          f"{mlp.activation!r}")


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "swiglu": F.silu,
    "silu": F.silu,
    "geglu": F.gelu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "geglu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu2": relu2,
    "relu": F.relu,
}


def activation_ref(name: str, x: torch.Tensor) -> torch.Tensor:
    """Plain-math twin of :data:`ACTIVATIONS` (written from the formulas)."""
    if name in ("swiglu", "silu"):
        return x / (1 + torch.exp(-x))
    if name in ("geglu", "gelu"):
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    if name in ("gelu_tanh", "geglu_tanh"):
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    if name == "relu2":
        return torch.clamp(x, min=0) ** 2
    if name == "relu":
        return torch.clamp(x, min=0)
    raise ValueError(f"unknown activation {name!r}")


class MLP(nn.Module):
    """``layers.i.mixer.{gate_proj,up_proj,down_proj}``; ``gate_proj`` only when gated."""

    stateless = True
    """Token-wise: nothing to keep between decoding steps (:mod:`composer.blocks.cache`)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0, d_ff: int | None = None,
                 activation: str | None = None, bias: bool | None = None) -> None:
        """Sizes come from ``cfg.mlp`` unless given (the MoE's shared experts give them; their
        MLPs take no multipliers)."""
        super().__init__()
        mlp = cfg.mlp
        assert mlp is not None or (d_ff is not None and activation is not None)
        own = d_ff is None and mlp is not None
        self.gate_multiplier = float(mlp.gate_multiplier) if own else 1.0
        self.down_multiplier = float(mlp.down_multiplier) if own else 1.0
        d_ff = d_ff if d_ff is not None else mlp.d_ff
        self.activation = activation if activation is not None else mlp.activation
        bias = bias if bias is not None else (mlp.bias if mlp is not None else False)
        self.init_std = cfg.init_std
        self.gated = is_gated(self.activation)
        self.act = ACTIVATIONS[self.activation]
        if self.gated:
            self.gate_proj = Linear(cfg.d_model, d_ff, bias=bias)
        self.up_proj = Linear(cfg.d_model, d_ff, bias=bias)
        self.down_proj = Linear(d_ff, cfg.d_model, bias=bias)

    def init_rules(self) -> dict[str, Init]:
        # "*_proj.": a glob that reached below the projections would also name the LoRA
        # adapters attached to them (composer/lora.py), which declare their own init
        return {"*_proj.weight": Normal(self.init_std), "*_proj.bias": ZEROS}

    def lora_targets(self) -> dict[str, str]:
        """The projections LoRA may adapt (:mod:`composer.lora`)."""
        names = ("gate_proj", "up_proj", "down_proj") if self.gated else ("up_proj", "down_proj")
        return {name: name for name in names}

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        init_module(self, generator)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        if self.gated:
            g = self.gate_proj(x_BTD)
            if self.gate_multiplier != 1.0:
                g = g * self.gate_multiplier
            h = self.act(g) * self.up_proj(x_BTD)
        else:
            h = self.act(self.up_proj(x_BTD))
        out = self.down_proj(h)
        return out * self.down_multiplier if self.down_multiplier != 1.0 else out

    def parallel_plan(self) -> ParallelPlan:
        """Hidden units split over ``tp``: gate/up column parallel, down row parallel."""
        return ParallelPlan(colwise=("gate_proj", "up_proj") if self.gated else ("up_proj",),
                            rowwise=("down_proj",))

    @staticmethod
    def layout_rules(cfg: ModelConfig) -> list[Divisible]:
        assert cfg.mlp is not None
        return [Divisible("mlp.d_ff", cfg.mlp.d_ff)]

    @staticmethod
    def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
        """``2 * weights`` of the projections (activations are negligible)."""
        assert cfg.mlp is not None
        n_proj = 3 if is_gated(cfg.mlp.activation) else 2
        return 2 * n_proj * cfg.d_model * cfg.mlp.d_ff

    @staticmethod
    def activation_bytes_per_token(cfg: ModelConfig, seq_len: int, ac: str, size: int,
                                   tp: int = 1, cp: int = 1) -> float:
        """Saved for the backward per token on one of ``tp`` ranks (the same on the CPU and on
        CUDA: matmuls and elementwise ops, no fused kernel). ``none``: the projections' input
        (gathered over the sequence under sequence parallel: whole on every rank) and, with
        the hidden units split over ``tp``, gated the gate and up outputs, the activation and
        the product (``d + 4 d_ff / tp``; ungated ``d + 2 d_ff / tp``). ``selective`` keeps the
        matmul outputs: gate and up (``2 d_ff / tp``; ungated ``d_ff / tp``) and down, a partial
        sum of the whole width (``d``). ``full`` keeps nothing of its own."""
        assert cfg.mlp is not None
        d, f, gated = cfg.d_model, cfg.mlp.d_ff / tp, is_gated(cfg.mlp.activation)
        if ac == "full":
            return 0.0
        if ac == "selective":
            return size * ((2 if gated else 1) * f + d)
        return size * (d + (4 if gated else 2) * f)


def mlp_ref(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, activation: str,
            gate: torch.Tensor | None = None, gate_multiplier: float = 1.0,
            down_multiplier: float = 1.0) -> torch.Tensor:
    """Plain-math twin of :class:`MLP` (weights as ``[out, in]`` matrices, no bias)."""
    if gate is not None:
        h = activation_ref(activation, gate_multiplier * (x @ gate.T)) * (x @ up.T)
    else:
        h = activation_ref(activation, x @ up.T)
    return down_multiplier * (h @ down.T)


KIND = LayerKind("-", "dense MLP", MLP, "mlp", MLPConfig, validate_mlp, always=True)
"""``-``: the dense MLP."""
