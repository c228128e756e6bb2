"""The gated short convolution of LFM2 (Liquid AI, 2025; transformers' ``Lfm2ShortConv``).

One input projection gives, per token, three ``d_model``-wide vectors ``[b, c, u]`` (transformers
calls them ``B``, ``C`` and ``x``): an input gate, an output gate and a value. The value, gated,
is mixed over the last ``d_conv`` tokens by a depthwise causal convolution with no activation,
gated again and projected back:

    [b, c, u] = in_proj(x),    y = out_proj(c * conv(b * u))

with ``conv(v)[t] = bias + sum_k w[k] * v[t - (K - 1) + k]`` per channel (``v = 0`` before the
sequence). ``bias`` (LFM2's ``conv_bias``) puts a bias on in_proj, the convolution and
out_proj alike. Nothing else mixes over time, so the layer's whole decoding state is the last
``d_conv - 1`` gated values: constant-size, whatever the length.

Time mixing is one parameterless op, ``conv`` (:class:`GatedConv`: the built-in
:class:`~composer.blocks.ops.CausalConv` without its SiLU), so context parallelism swaps it for
the ``halo_conv`` variant that every convolution shares, and decoding passes ``step`` through it.

Packed documents (``doc_ids``): no tap reads a gated value of an earlier document (the products
``b * u`` are per token, so that isolates the documents exactly).

Shape legend: B batch, T time, D d_model (the conv's channels), K conv taps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from composer.blocks.cache import Step
from composer.blocks.kind import LayerKind, cp_rows
from composer.blocks.ops import CausalConv, step_docs
from composer.blocks.plan import ZEROS, Divisible, Init, Normal, ParallelPlan, init_module
from composer.blocks.split import SplitCausalConv1d, SplitLinear
from composer.config import ModelConfig, positive
from composer.kernels.conv import keep_window
from composer.kernels.linear import Linear

# ---------------------------------------------------------------- the kind's config section


@dataclass
class ShortConvConfig:
    d_conv: int = 3
    """Convolution taps (LFM2's ``conv_L_cache``)."""
    bias: bool = False
    """Biases on in_proj, the convolution and out_proj (LFM2's ``conv_bias`` sets all three)."""


def validate_shortconv(section: ShortConvConfig, cfg: ModelConfig) -> None:
    positive(section, "shortconv.", ("d_conv",))


@dataclass
class ConvWindow:
    """The decoding state: the last ``d_conv - 1`` gated values ``b * u`` (zeros before the
    prompt), channels before time as causal_conv1d's ``conv_state``."""

    conv_BXW: torch.Tensor


class GatedConv(CausalConv):
    """``conv(v)``, ``[B, T, D] -> [B, T, D]``: :class:`~composer.blocks.ops.CausalConv`'s
    contract (``doc_ids``, ``step``, the ``halo_conv`` variant) without the SiLU, as LFM2
    applies none. Every path calls the conv module itself, so a tensor-parallel rank convolves
    its own channels."""

    def forward(self, v_BTD: torch.Tensor, conv: nn.Module, *,
                doc_ids: torch.Tensor | None = None, step: Step | None = None) -> torch.Tensor:
        docs = step_docs(doc_ids, step)
        if step is not None and not step.fresh:
            return _continue(v_BTD, conv, step.state.conv_BXW)
        y_BTD = conv(v_BTD) if docs is None else conv(v_BTD, doc_ids=docs)
        if step is not None:
            keep_window(step.state.conv_BXW, v_BTD, docs, True)
        return y_BTD


def _continue(v_BTD: torch.Tensor, conv: nn.Module, window_BDW: torch.Tensor) -> torch.Tensor:
    """The convolution of tokens that continue a sequence whose last ``K - 1`` values are
    ``window`` (moved on, in place, by the new values): the zero-padded causal convolution of
    ``[window, v]`` gives, at the new positions, exactly the taps over the true history."""
    w = window_BDW.shape[-1]
    full_BLD = torch.cat([window_BDW.transpose(1, 2).to(v_BTD.dtype), v_BTD], dim=1)
    if w:
        window_BDW.copy_(full_BLD[:, full_BLD.shape[1] - w:].transpose(1, 2))
    return conv(full_BLD)[:, w:]


class ShortConvMixer(nn.Module):
    """``layers.i.mixer.{in_proj,conv1d,out_proj}``: in_proj's rows are ``[b; c; u]`` (each
    ``d_model``, transformers' order), conv1d's weight ``[D, 1, K]``."""

    uses_doc_ids = True
    ops = ("conv",)

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        s = cfg.shortconv
        assert s is not None
        d = cfg.d_model
        self.init_std, self.d_conv = cfg.init_std, s.d_conv
        # b, c and u are their own parameters so that tensor parallelism splits each by
        # channels (split.py): a rank then holds the b, c and u of the same channels.
        self.in_proj = SplitLinear(d, {"b": d, "c": d, "u": d}, bias=s.bias)
        self.conv1d = SplitCausalConv1d({"u": d}, s.d_conv, bias=s.bias)
        self.out_proj = Linear(d, d, bias=s.bias)
        self.conv = GatedConv()  # the time-mixing op (parameterless; cp swaps it)

    def init_rules(self) -> dict[str, Init]:
        return {"in_proj.weight_*": Normal(self.init_std), "in_proj.bias_*": ZEROS,
                "out_proj.weight": Normal(self.init_std), "out_proj.bias": ZEROS}

    def lora_targets(self) -> dict[str, str]:
        """The projections LoRA may adapt; in_proj's adapter B splits into its parts."""
        return {"in_proj": "in_proj", "out_proj": "out_proj"}

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        init_module(self, generator)

    def forward(self, x_BTD: torch.Tensor, *, doc_ids: torch.Tensor | None = None,
                step: Step | None = None) -> torch.Tensor:
        """With ``step`` it continues from the window in ``step.state`` (and leaves its own)."""
        b_BTD, c_BTD, u_BTD = self.in_proj(x_BTD).chunk(3, dim=-1)
        y_BTD = self.conv(b_BTD * u_BTD, self.conv1d, doc_ids=doc_ids, step=step)
        return self.out_proj(c_BTD * y_BTD)

    def init_cache(self, batch: int, max_len: int, device: torch.device,
                   dtype: torch.dtype) -> ConvWindow:
        """The window ``[B, D, d_conv - 1]`` of this rank's channels, whatever ``max_len``."""
        d = self.conv1d.weight_u.shape[0]
        return ConvWindow(torch.zeros(batch, d, self.d_conv - 1, device=device, dtype=dtype))

    def parallel_plan(self) -> ParallelPlan:
        """Channels split over ``tp``: each part of in_proj row-split on its own (so a rank's
        b, c and u are the same channels, and a tp=2 checkpoint equals a tp=1 one), the conv
        split with them, out_proj row parallel."""
        return ParallelPlan(shard={"in_proj.*": 0, "conv1d.*": 0}, rowwise=("out_proj",))

    @staticmethod
    def layout_rules(cfg: ModelConfig) -> list[Divisible]:
        return [Divisible("d_model (the short convolution's channels)", cfg.d_model)]

    @staticmethod
    def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
        """``2 * (params(in_proj) + params(out_proj))``, the convolution ``2 * D * K`` and the
        two gates ``2 * D`` (a multiply each)."""
        s = cfg.shortconv
        assert s is not None
        d, bias = cfg.d_model, 1 if s.bias else 0
        return 2 * (d + bias) * 4 * d + 2 * d * s.d_conv + 2 * d


    @staticmethod
    def activation_bytes_per_token(cfg: ModelConfig, seq_len: int, ac: str, size: int,
                                   tp: int = 1, cp: int = 1) -> float:
        """Saved for the backward per token of a ``seq_len``-token sequence on one of ``tp``
        ranks (channels split over ``tp``). ``none``: in_proj's input ``d`` (gathered over the
        sequence under sequence parallel) and output ``[b; c; u]`` (``3 D``), the gated input
        ``b u`` (the conv's input), the conv's output with its ``K - 1`` steps of padding
        (``D (T + K - 1) / T``) and out_proj's input ``c y`` (``D``); per call (per sequence,
        exact at micro-batch 1) in_proj's and the conv's weights concatenated from their parts
        (``3 D d + D K``). Under context parallelism (``seq_len`` a rank's share: two rows of
        ``T / 2``) the conv's input is copied with its halo and its output padded per row.
        ``selective`` keeps in_proj's output and out_proj's partial sum ``d``; ``full`` keeps
        nothing of its own. causal-conv1d on CUDA keeps its input instead of a padded
        output."""
        c = cfg.shortconv
        assert c is not None
        if ac == "full":
            return 0.0
        d, T, K = cfg.d_model, max(seq_len, 1), c.d_conv
        D = d / tp
        if ac == "selective":
            return size * (3 * D + d)
        rows, Tr = cp_rows(T, cp)  # the rank's two chunks under cp, each a row
        conv = D * (Tr + K - 1) / Tr
        if cp > 1:
            conv += D * (Tr + 2 * (K - 1)) / Tr - D  # the halo'd copy replaces the input
        return size * (d + 3 * D + D + conv + D + (3 * D * d + D * K) / T)

def shortconv_ref(x: torch.Tensor, weights: dict[str, torch.Tensor], cfg: ModelConfig,
                  doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-math twin of :class:`ShortConvMixer`; ``weights`` uses its state-dict names. The
    convolution is a sum over taps, each tap reading 0 before the sequence and, with
    ``doc_ids``, before the token's document. Meant for fp64."""
    d, T = cfg.d_model, x.shape[1]
    bcu = x @ weights["in_proj.weight"].T
    if "in_proj.bias" in weights:
        bcu = bcu + weights["in_proj.bias"]
    b, c, u = bcu[..., :d], bcu[..., d:2 * d], bcu[..., 2 * d:]
    v = b * u
    w = weights["conv1d.weight"][:, 0, :]
    K = w.shape[-1]
    y = torch.zeros_like(v)
    for k in range(K):
        lag = K - 1 - k  # tap k multiplies the value lag steps back
        for t in range(lag, T):
            src = v[:, t - lag]
            if doc_ids is not None:
                src = src * (doc_ids[:, t - lag] == doc_ids[:, t])[:, None]
            y[:, t] = y[:, t] + w[:, k] * src
    if "conv1d.bias" in weights:
        y = y + weights["conv1d.bias"]
    out = (c * y) @ weights["out_proj.weight"].T
    if "out_proj.bias" in weights:
        out = out + weights["out_proj.bias"]
    return out


KIND = LayerKind("C", "short convolution", ShortConvMixer, "shortconv", ShortConvConfig,
                 validate_shortconv, halo=lambda cfg: cfg.shortconv.d_conv - 1)
"""``C``: LFM2's gated short convolution; a context-parallel chunk needs the ``d_conv - 1``
values before it."""
