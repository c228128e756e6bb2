"""The Mamba-1 mixer (Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State
Spaces", §3.2-3.4, Fig. 3): the layer of Jamba (with learned RMSNorms on dt, B and C,
Lieber et al. 2024) and Falcon-Mamba (with the same norms, weightless)::

    x, z  = in_proj(h)                                 ([x; z] rows, x first)
    x     = silu(causal depthwise conv(x))             (width d_conv)
    dt, B, C = x_proj(x)                               (dt_rank, d_state, d_state)
    dt, B, C = norm(dt), norm(B), norm(C)              (inner_norms: none / learned / weightless)
    dt    = softplus(dt_proj.weight dt + dt_proj.bias)
    y     = selective_scan(x, dt, A = -exp(A_log), B, C) + D x       (composer.kernels)
    out   = out_proj(y * silu(z))

This is the math of transformers' ``JambaMambaMixer`` and ``FalconMambaMixer`` torch paths
(``MambaMixer`` with ``inner_norms: none``). The bias of ``dt_proj`` is added inside the scan in
fp32, as mamba_ssm's kernel takes it (``delta_bias``).

Time mixing is two parameterless ops (:mod:`composer.blocks.ops`): ``conv``
(:class:`~composer.blocks.ops.CausalConv`) and ``scan`` (:class:`SelectiveScan`, a
:class:`~composer.blocks.ops.LinearRecurrence`: over a span the state goes ``decay * S + S_local``
with a decay per channel and state index, so context parallelism passes states exactly).

Packed documents (``doc_ids``): the convolution reads no earlier document and the scan restarts
at each document's first token.

Tensor parallelism is refused (:class:`NoTensorParallel`): ``x_proj`` reads every inner channel
to make dt, B and C, so channels split over ranks would need an all-reduce inside the mixer,
which the block plans cannot declare (the parallel layer reduces only at the mixer's exit).

Parameters (canonical names, transformers' too; ``E`` d_inner, ``R`` dt_rank, ``N`` d_state)::

    in_proj.weight [2E, D] ([x; z])    conv1d.weight [E, 1, d_conv]  (conv1d.bias [E])
    x_proj.weight [R + 2N, E]          dt_proj.weight [E, R], dt_proj.bias [E]
    A_log [E, N] (fp32), D [E]         out_proj.weight [D, E]
    dt_layernorm.weight [R], b_layernorm.weight [N], c_layernorm.weight [N]   (learned norms)

Shape legend: B batch, T time, D d_model, E d_inner, R dt_rank, N d_state, F = R + 2N.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from composer.blocks.cache import RecurrentState, Step, recurrent_state
from composer.blocks.kind import LayerKind, cp_rows
from composer.blocks.mamba2 import DtBiasInit
from composer.blocks.norm import RMSNorm
from composer.blocks.ops import CausalConv, LinearRecurrence, keep_mask, step_docs
from composer.blocks.plan import ONES, ZEROS, Init, Normal, Uniform, init_module
from composer.blocks.split import SplitCausalConv1d, SplitLinear
from composer.config import ConfigError, ModelConfig, positive
from composer.kernels.linear import Linear
from composer.kernels.selective_scan import (
    selective_end_state,
    selective_scan,
    selective_scan_ref,
    selective_step,
)

InnerNorms = Literal["none", "learned", "weightless"]

# ---------------------------------------------------------------- the kind's config section


@dataclass
class Mamba1Config:
    """Mamba-1 (the selective scan). The defaults are a ``d_model`` 256 model's (expand 2,
    ``dt_rank = ceil(d_model / 16)``); a new section follows ``d_model``."""

    d_inner: int = 512
    d_state: int = 16
    d_conv: int = 4
    dt_rank: int = 16
    conv_bias: bool = True
    proj_bias: bool = False
    """Biases of in_proj and out_proj (transformers' ``mamba_proj_bias`` / ``use_bias``)."""
    inner_norms: InnerNorms = "none"
    """RMSNorms on dt, B and C after x_proj: none (Mamba), learned (Jamba's ``dt_layernorm``,
    ``b_layernorm``, ``c_layernorm``) or weightless (Falcon-Mamba)."""
    inner_norm_eps: float | None = None
    """Their epsilon; None means the model's ``norm_eps`` (Jamba's ``rms_norm_eps``;
    Falcon-Mamba's ``mixer_rms_eps`` is its own)."""
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    dt_scale: float = 1.0
    """``dt_proj.weight`` starts uniform in ``+-dt_scale / sqrt(dt_rank)`` (mamba_ssm's init)."""


def validate_mamba1(m: Mamba1Config, cfg: ModelConfig) -> None:
    positive(m, "mamba1.", ("d_inner", "d_state", "d_conv", "dt_rank", "inner_norm_eps",
                             "dt_scale"))
    if m.inner_norms not in ("none", "learned", "weightless"):
        raise ConfigError(f"mamba1.inner_norms must be none, learned or weightless, not "
                          f"{m.inner_norms!r}")
    if not 0 < m.dt_min <= m.dt_max:
        raise ConfigError(f"mamba1.dt_min ({m.dt_min}) must be positive and <= dt_max "
                          f"({m.dt_max})")


def default_mamba1(d_model: int) -> Mamba1Config:
    """Expand 2 and ``dt_rank = ceil(d_model / 16)`` (Mamba's and Jamba's ``auto``)."""
    width = d_model if isinstance(d_model, int) and d_model > 0 else 256
    return Mamba1Config(d_inner=2 * width, dt_rank=math.ceil(width / 16))


@dataclass(frozen=True)
class S4DRealInit(Init):
    """``A_log[e, n] = log(n + 1)``: S4D-real (Gu et al. 2022), every channel alike, so any
    block of rows fills on its own."""

    def fill(self, t: torch.Tensor, generator: torch.Generator | None) -> None:
        n = torch.arange(1, t.shape[-1] + 1, dtype=torch.float32, device=t.device)
        t.copy_(torch.log(n).expand_as(t))


@dataclass(frozen=True)
class NoTensorParallel:
    """The layout rule that refuses ``tp > 1`` for this kind (module docstring)."""

    def problem(self, sizes: dict[str, int]) -> str | None:
        if sizes["tp"] > 1:
            return (f"Mamba-1 (symbol 'S') has no tensor-parallel form: x_proj reads every "
                    f"inner channel, so channels split over tp ({sizes['tp']}) would need an "
                    "all-reduce inside the mixer; use --tp 1")
        return None


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def weightless_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Falcon-Mamba's norm: ``x / rms(x)`` in >= fp32, cast back."""
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class SelectiveScan(LinearRecurrence):
    """The selective scan (:func:`composer.kernels.selective_scan.selective_scan`) as a linear
    recurrence over the tokens ``x, dt [B, T, E]`` (raw ``dt``) and ``B, C [B, T, N]``; the state
    ``[B, E, N]`` ends a span as ``decay * S_start + S_local``
    (:func:`~composer.kernels.selective_scan.selective_end_state`). With ``step``: one step per
    decoded token, the chunked scan from the cached state for a prompt."""

    def forward(self, x_BTE: torch.Tensor, dt_BTE: torch.Tensor, B_BTN: torch.Tensor,
                C_BTN: torch.Tensor, *, doc_ids: torch.Tensor | None = None,
                initial_state: torch.Tensor | None = None, step: Step | None = None,
                A_EN: torch.Tensor, **kw: Any) -> torch.Tensor:
        if step is None:
            return selective_scan(x_BTE, dt_BTE, A_EN, B_BTN, C_BTN, **kw, doc_ids=doc_ids,
                                  initial_state_BEN=initial_state)
        state = step.state.state
        if x_BTE.shape[1] == 1 and not step.fresh:  # one decoding step: the recurrence
            return selective_step(x_BTE, dt_BTE, A_EN, B_BTN, C_BTN, state, **kw)
        y_BTE, final = selective_scan(
            x_BTE, dt_BTE, A_EN, B_BTN, C_BTN, **kw,
            doc_ids=step_docs(doc_ids, step), initial_state_BEN=None if step.fresh else state,
            return_final_state=True)
        state.copy_(final)
        return y_BTE

    def end_state(self, x_BTE: torch.Tensor, dt_BTE: torch.Tensor, B_BTN: torch.Tensor,
                  C_BTN: torch.Tensor, *, doc_ids: torch.Tensor | None = None,
                  A_EN: torch.Tensor, dt_bias_E: torch.Tensor | None = None,
                  dt_softplus: bool = False, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(S_local [B, E, N], decay [B, E, N])``."""
        return selective_end_state(x_BTE, dt_BTE, A_EN, B_BTN, doc_ids=doc_ids,
                                   dt_bias_E=dt_bias_E, dt_softplus=dt_softplus)

    @staticmethod
    def carry(M: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
        return M * S

    def mask_steps(self, tokens: Sequence[torch.Tensor],
                   keep_BT: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``dt -> -1e4`` (its softplus is 0: no decay, no input) and ``x -> 0``."""
        x_BTE, dt_BTE, B_BTN, C_BTN = tokens
        dt_BTE = torch.where(keep_BT[..., None], dt_BTE, torch.full_like(dt_BTE, -1e4))
        return x_BTE * keep_mask(keep_BT, x_BTE), dt_BTE, B_BTN, C_BTN


class Mamba1Mixer(nn.Module):
    """``layers.i.mixer.{in_proj, conv1d, x_proj, dt_proj, A_log, D, out_proj}`` and, with
    learned inner norms, ``{dt,b,c}_layernorm`` (module docstring)."""

    keep_fp32 = ("A_log",)
    uses_doc_ids = True
    ops = ("conv", "scan")

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        m = cfg.mamba1
        assert m is not None
        self.mamba1_cfg = m
        self.layer_idx = layer_idx
        self.init_std = cfg.init_std
        self.norm_eps = m.inner_norm_eps if m.inner_norm_eps is not None else cfg.norm_eps
        E, R, N = m.d_inner, m.dt_rank, m.d_state
        # x and z as parts of one fused in_proj.weight (transformers' [x; z] rows)
        self.in_proj = SplitLinear(cfg.d_model, {"x": E, "z": E}, bias=m.proj_bias)
        self.conv1d = SplitCausalConv1d({"x": E}, m.d_conv, bias=m.conv_bias)
        self.x_proj = Linear(E, R + 2 * N, bias=False)
        self.dt_proj = Linear(R, E, bias=True)
        self.A_log = nn.Parameter(torch.empty(E, N))
        self.D = nn.Parameter(torch.empty(E))
        self.out_proj = Linear(E, cfg.d_model, bias=m.proj_bias)
        if m.inner_norms == "learned":
            self.dt_layernorm = RMSNorm(R, self.norm_eps)
            self.b_layernorm = RMSNorm(N, self.norm_eps)
            self.c_layernorm = RMSNorm(N, self.norm_eps)
        self.conv = CausalConv()  # the time-mixing ops (parameterless; cp swaps them)
        self.scan = SelectiveScan()

    def init_rules(self) -> dict[str, Init]:
        m = self.mamba1_cfg  # conv1d and the norms declare their own
        bound = m.dt_scale * m.dt_rank ** -0.5
        return {"in_proj.weight_*": Normal(self.init_std), "in_proj.bias_*": ZEROS,
                "x_proj.weight": Normal(self.init_std), "dt_proj.weight": Uniform(-bound, bound),
                "dt_proj.bias": DtBiasInit(m.dt_min, m.dt_max, m.dt_init_floor),
                "out_proj.weight": Normal(self.init_std), "out_proj.bias": ZEROS,
                "A_log": S4DRealInit(), "D": ONES}

    def lora_targets(self) -> dict[str, str]:
        """The projections LoRA may adapt (peft's Mamba defaults); not dt_proj, whose weight
        the mixer reads without its module (its bias goes into the scan)."""
        return {"in_proj": "in_proj", "x_proj": "x_proj", "out_proj": "out_proj"}

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        init_module(self, generator)

    def forward(self, x_BTD: torch.Tensor, *, doc_ids: torch.Tensor | None = None,
                step: Step | None = None) -> torch.Tensor:
        """The mixer; with ``step`` it continues from ``step.state`` (the ops read and leave
        their fields of it: the conv window, the SSM state)."""
        x_BTE, z_BTE = self.in_proj(x_BTD).chunk(2, dim=-1)
        x_BTE = self.conv(x_BTE, self.conv1d, doc_ids=doc_ids, step=step).contiguous()
        dt_BTE, B_BTN, C_BTN = self.selection(x_BTE)
        y_BTE = self.scan(x_BTE, dt_BTE, B_BTN, C_BTN, doc_ids=doc_ids, step=step,
                          A_EN=-torch.exp(_at_least_fp32(self.A_log)), D_E=self.D,
                          dt_bias_E=self.dt_proj.bias, dt_softplus=True)
        return self.out_proj((y_BTE * F.silu(z_BTE.to(y_BTE.dtype))).to(x_BTD.dtype))

    def selection(self, x_BTE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The input-dependent ``dt`` (raw: before its bias and softplus), ``B`` and ``C``."""
        m = self.mamba1_cfg
        dt_BTR, B_BTN, C_BTN = self.x_proj(x_BTE).split([m.dt_rank, m.d_state, m.d_state], -1)
        if m.inner_norms == "learned":
            dt_BTR, B_BTN = self.dt_layernorm(dt_BTR), self.b_layernorm(B_BTN)
            C_BTN = self.c_layernorm(C_BTN)
        elif m.inner_norms == "weightless":
            dt_BTR, B_BTN = weightless_rms(dt_BTR, self.norm_eps), weightless_rms(B_BTN,
                                                                                self.norm_eps)
            C_BTN = weightless_rms(C_BTN, self.norm_eps)
        return F.linear(dt_BTR, self.dt_proj.weight), B_BTN, C_BTN

    def init_cache(self, batch: int, max_len: int, device: torch.device,
                   dtype: torch.dtype) -> RecurrentState:
        """Conv window ``[B, E, d_conv - 1]`` and SSM state ``[B, E, N]`` (>= fp32): the same
        size whatever ``max_len`` (:mod:`composer.blocks.cache`)."""
        m = self.mamba1_cfg
        return recurrent_state(batch, m.d_inner, m.d_conv, (m.d_inner, m.d_state), device,
                               dtype)

    @staticmethod
    def layout_rules(cfg: ModelConfig) -> list[NoTensorParallel]:
        return [NoTensorParallel()]

    @staticmethod
    def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
        """Forward FLOPs per token (a multiply-add is 2), the same at every ``seq_len``::

            projections  2 * (params of in_proj, x_proj, dt_proj's weight, out_proj)
            conv         2 * E * d_conv
            scan         5 * E * N + 2 * E

        The scan counts the recurrence as the kernel runs it: the state update ``a h + u`` (a
        multiply-add per state element), ``u = (dt x) B`` (a multiply), the read-out ``h . C``
        (a multiply-add) and the D skip. The torch path's log-depth chunk scan does about
        ``log2(TORCH_CHUNK)`` times the update's elementwise work; elementwise work (exp,
        softplus, SiLU, the norms, the gate) is not counted.
        """
        m = cfg.mamba1
        assert m is not None
        E, R, N = m.d_inner, m.dt_rank, m.d_state
        bias = 1 if m.proj_bias else 0
        proj = ((cfg.d_model + bias) * 2 * E + E * (R + 2 * N) + R * E
                + (E + bias) * cfg.d_model)
        return 2 * proj + 2 * E * m.d_conv + 5 * E * N + 2 * E


    @staticmethod
    def activation_bytes_per_token(cfg: ModelConfig, seq_len: int, ac: str, size: int,
                                   tp: int = 1, cp: int = 1) -> float:
        """Saved for the backward per token of a ``seq_len``-token sequence (never split over
        ``tp``: :class:`NoTensorParallel`), on the torch path (CPU: the scan in chunks of
        :data:`composer.kernels.selective_scan.TORCH_CHUNK` steps, ``n`` of them, keeping only
        each chunk's start state and recomputing the chunk in the backward). With ``E``
        channels, ``N`` states and ``R = dt_rank``, ``none`` keeps: in_proj's input ``d`` and
        output ``[x; z]`` (``2 E``); the conv's padded output (``E (T + K - 1) / T``) and its
        contiguous SiLU (``E``: x_proj's input); x_proj's output (``R + 2 N``) and, with inner
        norms, each norm's ``1/rms``, scaled input and output (learned: ``3 + 2 R + 4 N``;
        weightless: no scaled input, ``3 + R + 2 N``); ``dt + bias`` and its softplus (``2
        E``); the chunks' start states (``n E N`` per sequence); ``silu(z)``, the scan's output
        and out_proj's input (``3 E``); per call (per sequence, exact at micro-batch 1)
        in_proj's and the conv's concatenated weights and ``A = -exp(A_log)`` (``2 E d + E K +
        2 E N``). ``selective`` keeps the matmul outputs: in_proj (``2 E``), x_proj (``R + 2
        N``), dt_proj (``E``), out_proj (``d``) and each chunk's read-out (``E`` per
        padded step); ``full`` keeps nothing of its own. Under
        context parallelism the scan runs on two rows of ``T / 2`` (their chunk states) from
        passed states; the end-state pass is not counted. The CUDA kernel (mamba_ssm's
        selective scan) keeps its inputs and recomputes the states."""
        from composer.kernels.selective_scan import TORCH_CHUNK

        m = cfg.mamba1
        assert m is not None
        if ac == "full":
            return 0.0
        d, T, E, N, R, K = cfg.d_model, max(seq_len, 1), m.d_inner, m.d_state, m.dt_rank, m.d_conv
        rows, Tr = cp_rows(T, cp)  # the rank's two chunks under cp, each a row
        n = -(-Tr // TORCH_CHUNK)
        if ac == "selective":  # and each chunk's read-out product (``E`` per padded step)
            return size * (2 * E + R + 2 * N + E + d + E * n * min(TORCH_CHUNK, Tr) / Tr)
        norms = {"learned": 3 + 2 * R + 4 * N, "weightless": 3 + R + 2 * N}.get(m.inner_norms, 0)
        states = rows * n * E * N / T
        per_call = (2 * E * d + E * K + 2 * E * N) / T
        return size * (d + 2 * E + E * (Tr + K - 1) / Tr + E + R + 2 * N + norms + 2 * E
                       + states + 3 * E + per_call)

def mamba1_ref(x: torch.Tensor, weights: dict[str, torch.Tensor], cfg: ModelConfig,
               doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-math twin of :class:`Mamba1Mixer`; ``weights`` uses its state-dict names.

    The causal convolution as a sum over taps, softplus as ``log1p(exp(.))``, the norms written
    out, the sequential :func:`~composer.kernels.selective_scan.selective_scan_ref`. Meant for
    fp64 inputs and weights. With ``doc_ids`` a tap reading an earlier document reads 0 and the
    scan restarts at each document.
    """
    m = cfg.mamba1
    assert m is not None
    E, R, N, K = m.d_inner, m.dt_rank, m.d_state, m.d_conv
    eps = m.inner_norm_eps if m.inner_norm_eps is not None else cfg.norm_eps
    T = x.shape[1]
    xz = x @ weights["in_proj.weight"].T
    if "in_proj.bias" in weights:
        xz = xz + weights["in_proj.bias"]
    xs, z = xz[..., :E], xz[..., E:]
    w = weights["conv1d.weight"][:, 0, :]
    conv = torch.zeros_like(xs)
    for k in range(K):  # tap k multiplies the input K - 1 - k steps back
        lag = K - 1 - k
        if lag >= T:
            continue
        src = xs[:, : T - lag]
        if doc_ids is not None:
            src = src * (doc_ids[:, : T - lag] == doc_ids[:, lag:])[..., None]
        conv[:, lag:] = conv[:, lag:] + w[:, k] * src
    if "conv1d.bias" in weights:
        conv = conv + weights["conv1d.bias"]
    xs = conv / (1 + torch.exp(-conv))
    sel = xs @ weights["x_proj.weight"].T
    parts = {"dt": sel[..., :R], "b": sel[..., R : R + N], "c": sel[..., R + N :]}
    if m.inner_norms != "none":
        for name, v in parts.items():
            scale = weights[f"{name}_layernorm.weight"] if m.inner_norms == "learned" else 1.0
            parts[name] = scale * v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps)
    dt = parts["dt"] @ weights["dt_proj.weight"].T + weights["dt_proj.bias"]
    dt = torch.log1p(torch.exp(dt))
    A = -torch.exp(weights["A_log"])
    y = selective_scan_ref(xs, dt, A, parts["b"], parts["c"], D_E=weights["D"], doc_ids=doc_ids)
    out = (y * z / (1 + torch.exp(-z))) @ weights["out_proj.weight"].T
    if "out_proj.bias" in weights:
        out = out + weights["out_proj.bias"]
    return out


KIND = LayerKind("S", "Mamba-1", Mamba1Mixer, "mamba1", Mamba1Config, validate_mamba1,
                 default=default_mamba1, halo=lambda cfg: cfg.mamba1.d_conv - 1)
"""``S``: the Mamba-1 (S6) mixer; a context-parallel chunk needs the ``d_conv - 1`` inputs
before it."""
