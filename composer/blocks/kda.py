"""Kimi delta attention (KDA; Kimi Team 2025, "Kimi Linear: An Expressive, Efficient Attention
Architecture", §3 "Kimi Delta Attention"): the linear-attention layer of Kimi Linear.

The gated delta net (:mod:`composer.blocks.gdn`) with a forget gate per key channel instead of
per head. Per token, with ``H`` heads of width ``K`` (q, k and v alike) and a gate rank ``R``
(Kimi: ``R = K``)::

    q, k, v = silu(causal depthwise conv([q_proj x, k_proj x, v_proj x]))   (width d_conv)
    q, k    = l2norm(q), l2norm(k) per head  (x / sqrt(sum x^2 + 1e-6), in >= fp32)
    g       = -exp(A_log[h]) * softplus(f_b_proj(f_a_proj x) + dt_bias)  [H, K] per channel
    beta    = sigmoid(b_proj x)                                          [H]
    o       = delta rule(q / sqrt(K), k, v, g, beta)  with  S_t = diag(exp(g_t)) S_{t-1} ...
    y       = o_proj(norm.weight * rms(o) * sigmoid(g_b_proj(g_a_proj x)))  per head

This is the math of transformers' ``KimiLinearDeltaAttention`` (``chunk_kimi_delta_attention``,
``recurrent_kimi_delta_attention``) and fla's ``chunk_kda``.

Parameters (canonical names and shapes; the contract for converters). ``D`` d_model,
``X = H * K``; heads are contiguous blocks of ``K`` rows:

    q_proj.weight, k_proj.weight, v_proj.weight   [X, D]
    conv1d.weight   [3 X, 1, d_conv]   rows [q; k; v], no bias
    f_a_proj.weight [R, D]    f_b_proj.weight [X, R]    dt_bias [X] fp32    A_log [H] fp32
    b_proj.weight   [H, D]
    g_a_proj.weight [R, D]    g_b_proj.weight [X, R]    norm.weight [K] (shared by the heads)
    o_proj.weight   [D, X]

transformers stores the gate under ``forget_gate.{f_a_proj, f_b_proj, dt_bias, A_log}`` (its
``A_log`` ``[1, 1, H, 1]``) and the norm as ``o_norm``.

Everything but the gate and the output gate is the gated delta net's: the block subclasses
:class:`~composer.blocks.gdn.GatedDeltaNet` and keeps its two time-mixing ops, ``conv``
(:class:`~composer.blocks.ops.CausalConv`) and ``rule`` (:class:`~composer.blocks.gdn.DeltaRule`,
whose kernels in :mod:`composer.kernels.gdn` take a per-channel ``g [B, T, H, K]``). So packed
documents, decoding (constant-size conv window and ``[H, K, K]`` state), context parallelism
(halo conv and chunk state passing: the rule stays linear in its state) and tensor parallelism
(by heads) are the gated delta net's.

Shape legend: B batch, T time, D d_model, H heads, K their width, R gate rank, X = H K.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from composer.blocks.cache import RecurrentState, recurrent_state
from composer.blocks.gdn import (
    DeltaRule,
    GatedDeltaNet,
    HeadGatedRMSNorm,
    _l2norm,
    conv_silu_ref,
    l2norm_ref,
)
from composer.blocks.kind import LayerKind, cp_rows
from composer.blocks.mamba2 import ALogInit, DtBiasInit
from composer.blocks.ops import CausalConv
from composer.blocks.plan import Divisible, Init, Normal, ParallelPlan
from composer.blocks.split import SplitCausalConv1d
from composer.config import ConfigError, ModelConfig, positive
from composer.kernels.gdn import gdn_recurrent_ref
from composer.kernels.linear import Linear

# ---------------------------------------------------------------- the kind's config section


@dataclass
class KDAConfig:
    """Kimi delta attention (Kimi Linear's linear-attention layer)."""

    n_heads: int = 4
    d_head: int = 64
    """Width of every head's q, k and v (Kimi Linear's ``linear_attn_config.head_dim``)."""
    d_gate: int | None = None
    """Rank of the low-rank forget and output gates (``f_a_proj`` / ``g_a_proj`` rows); ``None``
    means ``d_head`` (what Kimi Linear builds)."""
    d_conv: int = 4
    chunk_size: int = 32
    """Chunk length of the torch path (its per-channel decay costs ``L^2 K`` per chunk)."""
    norm_eps: float = 1e-5
    """Epsilon of the gated per-head output RMSNorm (Kimi Linear: rms_norm_eps)."""
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    a_init_range: tuple[float, float] = (1.0, 16.0)


def validate_kda(d: KDAConfig, cfg: ModelConfig) -> None:
    positive(d, "kda.", ("n_heads", "d_head", "d_gate", "d_conv", "chunk_size", "norm_eps"))
    if not 0 < d.dt_min <= d.dt_max:
        raise ConfigError(f"kda.dt_min ({d.dt_min}) must be positive and <= dt_max ({d.dt_max})")
    if not 0 < d.a_init_range[0] <= d.a_init_range[1]:
        raise ConfigError(f"kda.a_init_range {list(d.a_init_range)} must be positive, increasing")


def default_kda(d_model: int) -> KDAConfig:
    """Heads of the default width covering ``d_model`` (at ``d_model`` 256, the defaults)."""
    width = d_model if isinstance(d_model, int) and d_model > 0 else 256
    return KDAConfig(n_heads=max(1, width // KDAConfig.d_head))


def _rank(d: KDAConfig) -> int:
    return d.d_gate or d.d_head


class KimiDeltaAttention(GatedDeltaNet):
    """``layers.i.mixer.{q,k,v,b,o}_proj, conv1d, f_a_proj, f_b_proj, A_log, dt_bias,
    g_a_proj, g_b_proj, norm`` (module docstring); forward, ops, decoding state and cp are the
    gated delta net's."""

    keep_fp32 = ("A_log", "dt_bias")

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        nn.Module.__init__(self)
        d = cfg.kda
        assert d is not None
        self.kda_cfg = d
        self.layer_idx = layer_idx
        self.init_std = cfg.init_std
        D, H, K, R = cfg.d_model, d.n_heads, d.d_head, _rank(d)
        X = H * K
        self.q_proj = Linear(D, X, bias=False)
        self.k_proj = Linear(D, X, bias=False)
        self.v_proj = Linear(D, X, bias=False)
        self.conv1d = SplitCausalConv1d({"q": X, "k": X, "v": X}, d.d_conv, bias=False)
        self.f_a_proj = Linear(D, R, bias=False)
        self.f_b_proj = Linear(R, X, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(X))
        self.b_proj = Linear(D, H, bias=False)
        self.g_a_proj = Linear(D, R, bias=False)
        self.g_b_proj = Linear(R, X, bias=False)
        self.norm = HeadGatedRMSNorm(K, d.norm_eps, gate="sigmoid")
        self.o_proj = Linear(X, D, bias=False)
        self.conv = CausalConv()  # the time-mixing ops (parameterless; cp swaps them)
        self.rule = DeltaRule()

    @property
    def gdn_cfg(self) -> KDAConfig:
        """What :meth:`GatedDeltaNet.forward` reads (``chunk_size``)."""
        return self.kda_cfg

    def init_rules(self) -> dict[str, Init]:
        d = self.kda_cfg  # conv1d and norm declare their own
        return {"*_proj.weight": Normal(self.init_std),
                "dt_bias": DtBiasInit(d.dt_min, d.dt_max, d.dt_init_floor),
                "A_log": ALogInit(*d.a_init_range)}

    def lora_targets(self) -> dict[str, str]:
        """The projections LoRA may adapt (:mod:`composer.lora`)."""
        names = ("q", "k", "v", "b", "o", "f_a", "f_b", "g_a", "g_b")
        return {f"{n}_proj": f"{n}_proj" for n in names}

    def _heads(self) -> tuple[int, int]:
        """``(H, H)`` of this rank (a tensor-parallel rank holds a slice of the heads)."""
        H = self.A_log.shape[0]
        return H, H

    def rule_inputs(self, conv_BTX: torch.Tensor, x_BTD: torch.Tensor
                    ) -> tuple[torch.Tensor, ...]:
        """``q, k, v [B, T, H, K]`` (q, k L2-normalised), the per-channel log decay
        ``g [B, T, H, K]`` and ``beta [B, T, H]``, in >= fp32."""
        b, T, _ = x_BTD.shape
        H, K = self.A_log.shape[0], self.kda_cfg.d_head
        q_BTX, k_BTX, v_BTX = conv_BTX.split([H * K] * 3, dim=-1)
        dtype = torch.promote_types(x_BTD.dtype, torch.float32)
        q_BTHK = _l2norm(q_BTX.reshape(b, T, H, K).to(dtype))
        k_BTHK = _l2norm(k_BTX.reshape(b, T, H, K).to(dtype))
        beta_BTH = torch.sigmoid(self.b_proj(x_BTD).to(dtype))
        f_BTX = self.f_b_proj(self.f_a_proj(x_BTD)).to(dtype) + self.dt_bias.to(dtype)
        g_BTHK = -torch.exp(self.A_log.to(dtype))[:, None] * F.softplus(f_BTX.view(b, T, H, K))
        return q_BTHK, k_BTHK, v_BTX.reshape(b, T, H, K), g_BTHK, beta_BTH

    def finish(self, o_BTHV: torch.Tensor, x_BTD: torch.Tensor) -> torch.Tensor:
        """The sigmoid-gated norm (``o`` in >= fp32 through it) and o_proj."""
        b, T, H, V = o_BTHV.shape
        gate_BTHV = self.g_b_proj(self.g_a_proj(x_BTD)).reshape(b, T, H, V)
        y_BTHV = self.norm(o_BTHV, gate_BTHV)
        return self.o_proj(y_BTHV.reshape(b, T, H * V).to(x_BTD.dtype))

    def init_cache(self, batch: int, max_len: int, device: torch.device,
                   dtype: torch.dtype) -> RecurrentState:
        """Conv window ``[B, 3 X, d_conv - 1]`` and state ``[B, H, K, K]`` (>= fp32): the same
        size whatever ``max_len``."""
        d = self.kda_cfg
        H, K = self.A_log.shape[0], d.d_head
        return recurrent_state(batch, 3 * H * K, d.d_conv, (H, K, K), device, dtype)

    def parallel_plan(self) -> ParallelPlan:
        """Heads split over ``tp``: q/k/v/b and the gates' up-projections column parallel by
        heads, each part of the conv and the per-head ``A_log`` / per-channel ``dt_bias`` split
        alike, o_proj row parallel; the gates' down-projections and the norm weight (one head
        wide, shared) replicated with partial grads."""
        return ParallelPlan(colwise=("q_proj", "k_proj", "v_proj", "b_proj", "f_b_proj",
                                     "g_b_proj"),
                            rowwise=("o_proj",), shard={"conv1d.*": 0, "A_log": 0, "dt_bias": 0},
                            partial=("f_a_proj.weight", "g_a_proj.weight", "norm.weight"))

    @staticmethod
    def layout_rules(cfg: ModelConfig) -> list[Divisible]:
        assert cfg.kda is not None
        return [Divisible("kda.n_heads", cfg.kda.n_heads)]

    @staticmethod
    def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
        """Forward FLOPs per token (a multiply-add is 2), averaged over a ``seq_len`` sequence:
        the projections ``2 * params``, the conv ``2 * 3X * d_conv``, and the chunked rule as
        the gated delta net counts it (``L = min(chunk_size, seq_len)``, ``T'`` padded), its two
        ``L x L`` key products taken per channel (``2 L K`` each, the decay inside the sum)::

            T' * H * (4 L K + 2 L K + L (K + K) + 6 K K) / seq_len
        """
        d = cfg.kda
        assert d is not None
        H, K, R, D = d.n_heads, d.d_head, _rank(d), cfg.d_model
        X = H * K
        proj = D * (3 * X + H + 2 * R) + 2 * R * X + X * D
        L = max(1, min(d.chunk_size, seq_len))
        padded = -(-max(seq_len, 1) // L) * L
        chunked = padded * H * (4 * L * K + 2 * L * K + L * 2 * K + 6 * K * K)
        return 2 * proj + 2 * 3 * X * d.d_conv + chunked // max(seq_len, 1)


    @staticmethod
    def activation_bytes_per_token(cfg: ModelConfig, seq_len: int, ac: str, size: int,
                                   tp: int = 1, cp: int = 1) -> float:
        """Saved for the backward per token of a ``seq_len``-token sequence on one of ``tp``
        ranks (heads split over ``tp``; the gates' low-rank down-projections replicated), on
        the torch path (the gated delta net's chunked rule with a decay per key channel,
        chunks of ``L = min(chunk_size, T)``, ``n`` of them, padded by ``p``). With ``H`` heads
        of width ``K`` (q, k and v alike), ``X = 3 H K`` and the gate rank ``R``, ``none``
        keeps: the projections' input ``d``; the conv's input, padded output and SiLU (``3 X``
        with padding); ``1/|q|``, ``1/|k|`` and ``beta`` (``3 H``); the forget gate's
        down-projection ``R``, its up-projection plus bias and softplus (``2 H K``); the decays
        to and from the chunk ends per channel in fp64 (``2 H K`` of 8 bytes per padded
        step); per padded step the per-channel decay ``Γ`` and its two weighted products
        (``3 H L K``: the dominant term), the summed key products ``H L``, seven key-sized
        operands and solves, and the batched products' copies (``2 H K + H K + H L``); the
        chunk states (``n H K K`` per sequence); the output gate's ``R`` and the gated norm
        and o_proj (``5 H K + H``); per call the conv's concatenated weight and the causal
        mask. ``selective`` keeps the matmul outputs: the projections (``X + H + 2 R + 2 H K``),
        three key-sized products per padded step and the state updates of each chunk (the
        per-channel key products are elementwise, recomputed), o_proj's partial sum ``d``;
        ``full`` keeps nothing of its own. Context parallelism's end-state pass is not
        counted (the rule counts per row of ``T / 2``)."""
        k = cfg.kda
        assert k is not None
        if ac == "full":
            return 0.0
        d, T = cfg.d_model, max(seq_len, 1)
        H, K, R = k.n_heads / tp, k.d_head, _rank(k)
        X = 3 * H * K
        rows, Tr = cp_rows(T, cp)  # the rank's two chunks under cp, each a row
        L = max(1, min(k.chunk_size, Tr))
        n = -(-Tr // L)
        p = n * L / Tr
        states = rows * n * H * K * K / T
        if ac == "selective":
            return size * (X + H + 2 * R + 2 * H * K + 3 * H * K * p + states + d)
        rule = (3 * H * L * K + H * L + 7 * H * K + 3 * H * K + H * L) * p + states
        tok = d + X + X * (Tr + k.d_conv - 1) / Tr + X + 3 * H + R + 2 * H * K
        finish = R + 5 * H * K + H
        return (size * (tok + rule + finish + X * k.d_conv / T) + 8 * 2 * H * K * p
                + rows * L * L / T)

def kda_ref(x: torch.Tensor, weights: dict[str, torch.Tensor], cfg: ModelConfig,
            doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-math twin of :class:`KimiDeltaAttention`; ``weights`` uses its state-dict names.

    The conv as a sum over taps, softplus as ``log1p(exp(.))``, sigmoid as ``1 / (1 + e^-x)``,
    the sequential :func:`~composer.kernels.gdn.gdn_recurrent_ref`. Meant for fp64.
    """
    d = cfg.kda
    assert d is not None
    b, T, _ = x.shape
    H, K = d.n_heads, d.d_head
    X = H * K
    w = {n: weights[f"{n}_proj.weight"] for n in ("q", "k", "v", "b", "f_a", "f_b", "g_a", "g_b")}
    qkv = conv_silu_ref(torch.cat([x @ w["q"].T, x @ w["k"].T, x @ w["v"].T], -1), weights,
                        doc_ids)
    q, k, v = (qkv[..., i * X:(i + 1) * X].reshape(b, T, H, K) for i in range(3))
    q, k = l2norm_ref(q), l2norm_ref(k)
    beta = 1 / (1 + torch.exp(-(x @ w["b"].T)))
    f = (x @ w["f_a"].T) @ w["f_b"].T + weights["dt_bias"]
    g = -torch.exp(weights["A_log"])[:, None] * torch.log1p(torch.exp(f.reshape(b, T, H, K)))
    o = gdn_recurrent_ref(q, k, v, g, beta, doc_ids=doc_ids)
    gate = ((x @ w["g_a"].T) @ w["g_b"].T).reshape(b, T, H, K)
    o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + d.norm_eps)
    y = weights["norm.weight"] * o / (1 + torch.exp(-gate))
    return y.reshape(b, T, X) @ weights["o_proj.weight"].T


KIND = LayerKind("K", "Kimi delta attention", KimiDeltaAttention, "kda", KDAConfig,
                 validate_kda, default=default_kda, halo=lambda cfg: cfg.kda.d_conv - 1)
"""``K``: Kimi delta attention (its section exists when the pattern uses it, sized by
``d_model``)."""
