"""The gated delta net mixer (Yang, Kautz & Hatamizadeh, ICLR 2025, "Gated Delta Networks",
§3.4 "Gated DeltaNet"): the linear-attention layer of Qwen3-Next, Qwen3.5 and OLMo-Hybrid.

Per token, with ``G`` query/key heads of width ``K`` and ``H = G * R`` value heads of width
``V`` (each q/k head serves ``R`` consecutive value heads)::

    q, k, v = silu(causal depthwise conv([q_proj x, k_proj x, v_proj x]))   (width d_conv)
    q, k    = l2norm(q), l2norm(k) per head  (x * rsqrt(sum x^2 + 1e-6), in >= fp32)
    g       = -exp(A_log) * softplus(a_proj x + dt_bias)                    per value head
    beta    = sigmoid(b_proj x)              (times 2 with allow_neg_eigval, OLMo-Hybrid)
    o       = gated delta rule(q / sqrt(K), k, v, g, beta)    (composer.kernels.gdn)
    y       = o_proj(norm.weight * rms(o) * silu(z_proj x))   per value head (norm, then gate)

This is the math of transformers' ``Qwen3NextGatedDeltaNet`` / ``OlmoHybridGatedDeltaNet``.

Parameters (canonical names and shapes; the contract for converters). ``D`` d_model,
``QK = G * K``, ``VV = H * V``; heads are contiguous blocks of rows, value head ``h`` at rows
``h * V : (h + 1) * V``, q/k head ``h // R``:

    q_proj.weight   [QK, D]              k_proj.weight   [QK, D]
    v_proj.weight   [VV, D]              z_proj.weight   [VV, D]   (output gate)
    b_proj.weight   [H, D]  (beta)       a_proj.weight   [H, D]    (decay input)
    conv1d.weight   [2 QK + VV, 1, d_conv]   rows [q; k; v] (conv1d.bias [2 QK + VV] if conv_bias)
    A_log [H] fp32,  dt_bias [H] fp32,  norm.weight [V] (shared by the heads)
    o_proj.weight   [D, VV]

Qwen3-Next fuses ``in_proj_qkvz`` ``[2 QK + 2 VV, D]`` grouped per key head: view it as
``[G, 2K + 2RV, D]`` and split the middle dim into ``(K, K, R V, R V)`` for q, k, v, z (then
flatten the first two dims); ``in_proj_ba`` ``[2H, D]`` as ``[G, 2R, D]`` split ``(R, R)`` for
b, a. Its ``conv1d.weight`` is already ``[q; k; v]``, ``out_proj`` is ``o_proj``. Qwen3.5 stores
``in_proj_qkv`` (``[q; k; v]`` rows), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``; OLMo-Hybrid
stores ``q/k/v/a/b_proj``, ``g_proj`` (our ``z_proj``) and ``o_norm`` (our ``norm``).

Time mixing is two parameterless ops (:mod:`composer.blocks.ops`), ``conv``
(:class:`~composer.blocks.ops.CausalConv`, Mamba-2's) and ``rule`` (:class:`DeltaRule`);
everything around them is token-wise.

Packed documents (``doc_ids``): the convolution reads no earlier document and the state restarts
at each document's first token (:mod:`composer.kernels.gdn`).

Shape legend: B batch, T time, D d_model, G q/k heads, H value heads, K / V their widths,
X conv channels (2 G K + H V).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from composer.blocks.cache import RecurrentState, Step, recurrent_state
from composer.blocks.kind import LayerKind, cp_rows
from composer.blocks.mamba2 import ALogInit, DtBiasInit
from composer.blocks.ops import CausalConv, LinearRecurrence, keep_mask, step_docs
from composer.blocks.plan import ONES, Divisible, Init, Normal, ParallelPlan, init_module
from composer.blocks.split import SplitCausalConv1d
from composer.config import ConfigError, ModelConfig, positive
from composer.kernels.gdn import gated_delta_rule, gdn_end_state, gdn_recurrent_ref, gdn_step
from composer.kernels.linear import Linear

L2_EPS = 1e-6
"""transformers' and fla's ``l2norm`` epsilon (inside the square root, added to the sum)."""

# ---------------------------------------------------------------- the kind's config section


@dataclass
class GDNConfig:
    """Gated delta net (Yang et al. 2025; Qwen3-Next, Qwen3.5, OLMo-Hybrid linear attention)."""

    n_heads: int = 8
    """Value heads (each with its own decay ``A_log`` / ``dt_bias``, beta and state)."""
    n_kv_heads: int | None = None
    """Query/key heads, shared by ``n_heads / n_kv_heads`` value heads; ``None`` means
    ``n_heads``."""
    d_head_k: int = 64
    d_head_v: int = 64
    d_conv: int = 4
    chunk_size: int = 64
    conv_bias: bool = False
    norm_eps: float = 1e-6
    """Epsilon of the gated per-head output RMSNorm (Qwen3-Next: rms_norm_eps; OLMo-Hybrid 1e-5)."""
    allow_neg_eigval: bool = False
    """beta = 2 * sigmoid(b), in (0, 2) (OLMo-Hybrid's ``linear_allow_neg_eigval``)."""
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    a_init_range: tuple[float, float] = (1.0, 16.0)


def validate_gdn(d: GDNConfig, cfg: ModelConfig) -> None:
    positive(d, "gdn.", ("n_heads", "n_kv_heads", "d_head_k", "d_head_v", "d_conv", "chunk_size",
                          "norm_eps"))
    kv = d.n_kv_heads or d.n_heads
    if d.n_heads % kv:
        raise ConfigError(f"gdn.n_heads ({d.n_heads}) must be divisible by gdn.n_kv_heads ({kv})")
    if not 0 < d.dt_min <= d.dt_max:
        raise ConfigError(f"gdn.dt_min ({d.dt_min}) must be positive and <= dt_max ({d.dt_max})")
    if not 0 < d.a_init_range[0] <= d.a_init_range[1]:
        raise ConfigError(f"gdn.a_init_range {list(d.a_init_range)} must be positive, increasing")


def default_gdn(d_model: int) -> GDNConfig:
    """The per-head widths of the defaults and a value width of ``2 * d_model`` (Mamba-2's
    ``expand`` 2; at ``d_model`` 256, the dataclass's defaults)."""
    width = d_model if isinstance(d_model, int) and d_model > 0 else 256
    return GDNConfig(n_heads=max(1, 2 * width // GDNConfig.d_head_v))


def _n_kv_heads(d: GDNConfig) -> int:
    return d.n_kv_heads or d.n_heads


def _sizes(d: GDNConfig) -> tuple[int, int]:
    """``(QK, VV)``: the widths of q (and k) and of v (and z)."""
    return _n_kv_heads(d) * d.d_head_k, d.n_heads * d.d_head_v


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2_EPS)


class HeadGatedRMSNorm(nn.Module):
    """``w * rms(x) * silu(z)`` over the last dim (one head), weight shared by the heads; the norm
    in >= fp32 and cast back before the weight, as transformers' ``Qwen3NextRMSNormGated``.
    ``gate="sigmoid"`` gates with ``sigmoid(z)`` instead (Kimi delta attention's ``o_norm``)."""

    def __init__(self, d: int, eps: float, gate: str = "silu") -> None:
        super().__init__()
        self.eps = eps
        self.act = F.silu if gate == "silu" else torch.sigmoid
        self.weight = nn.Parameter(torch.ones(d))

    def init_rules(self) -> dict[str, Init]:
        return {"weight": ONES}

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return h * self.act(gate.to(h.dtype))


class DeltaRule(LinearRecurrence):
    """The gated delta rule (:func:`composer.kernels.gated_delta_rule`) as a linear recurrence
    over the tokens ``q, k [B, T, G, K]``, ``v [B, T, H, V]``, ``g, beta [B, T, H]``; the state
    ``[B, H, K, V]`` ends a span as ``M @ S_start + S_local`` (``M [B, H, K, K]``,
    :func:`composer.kernels.gdn.gdn_end_state`). With ``step``: one step of the recurrence per
    decoded token (:func:`composer.kernels.gdn.gdn_step`), the chunked form from the cached
    state for a prompt."""

    def forward(self, q_BTGK: torch.Tensor, k_BTGK: torch.Tensor, v_BTHV: torch.Tensor,
                g_BTH: torch.Tensor, beta_BTH: torch.Tensor, *,
                doc_ids: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                step: Step | None = None, chunk_size: int) -> torch.Tensor:
        if step is None:
            return gated_delta_rule(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, chunk_size,
                                    initial_state_BHKV=initial_state, doc_ids=doc_ids)
        state = step.state.state
        if q_BTGK.shape[1] == 1 and not step.fresh:  # one decoding step: the recurrence
            return gdn_step(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, state)
        o_BTHV, final = gated_delta_rule(
            q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, chunk_size,
            initial_state_BHKV=None if step.fresh else state, return_final_state=True,
            doc_ids=step_docs(doc_ids, step))
        state.copy_(final)
        return o_BTHV

    def end_state(self, q_BTGK: torch.Tensor, k_BTGK: torch.Tensor, v_BTHV: torch.Tensor,
                  g_BTH: torch.Tensor, beta_BTH: torch.Tensor, *,
                  doc_ids: torch.Tensor | None = None, chunk_size: int,
                  **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(S_local [B, H, K, V], M [B, H, K, K])``."""
        return gdn_end_state(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, chunk_size,
                             doc_ids=doc_ids)

    @staticmethod
    def carry(M: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
        return M @ S

    def mask_steps(self, tokens: Sequence[torch.Tensor],
                   keep_BT: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """No decay (``g = 0``) and no update (``beta = 0``, ``q = k = 0``)."""
        q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH = tokens
        return (q_BTGK * keep_mask(keep_BT, q_BTGK), k_BTGK * keep_mask(keep_BT, k_BTGK),
                v_BTHV, g_BTH * keep_mask(keep_BT, g_BTH), beta_BTH * keep_mask(keep_BT, beta_BTH))


class GatedDeltaNet(nn.Module):
    """``layers.i.mixer.{q,k,v,z,b,a}_proj, conv1d, A_log, dt_bias, norm, o_proj`` (docstring)."""

    keep_fp32 = ("A_log", "dt_bias")
    uses_doc_ids = True
    ops = ("conv", "rule")

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        d = cfg.gdn
        assert d is not None
        self.gdn_cfg = d
        self.layer_idx = layer_idx
        self.init_std = cfg.init_std
        qk, vv = _sizes(d)
        D = cfg.d_model
        self.q_proj = Linear(D, qk, bias=False)
        self.k_proj = Linear(D, qk, bias=False)
        self.v_proj = Linear(D, vv, bias=False)
        self.z_proj = Linear(D, vv, bias=False)
        self.b_proj = Linear(D, d.n_heads, bias=False)
        self.a_proj = Linear(D, d.n_heads, bias=False)
        self.conv1d = SplitCausalConv1d({"q": qk, "k": qk, "v": vv}, d.d_conv, bias=d.conv_bias)
        self.A_log = nn.Parameter(torch.empty(d.n_heads))
        self.dt_bias = nn.Parameter(torch.empty(d.n_heads))
        self.norm = HeadGatedRMSNorm(d.d_head_v, d.norm_eps)
        self.o_proj = Linear(vv, D, bias=False)
        self.conv = CausalConv()  # the time-mixing ops (parameterless; cp swaps them)
        self.rule = DeltaRule()

    def init_rules(self) -> dict[str, Init]:
        d = self.gdn_cfg  # conv1d and norm declare their own
        return {"*_proj.weight": Normal(self.init_std),
                "dt_bias": DtBiasInit(d.dt_min, d.dt_max, d.dt_init_floor),
                "A_log": ALogInit(*d.a_init_range)}

    def lora_targets(self) -> dict[str, str]:
        """The projections LoRA may adapt (:mod:`composer.lora`)."""
        return {f"{n}_proj": f"{n}_proj" for n in "qkvzbao"}

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        init_module(self, generator)

    def _heads(self) -> tuple[int, int]:
        """``(G, H)`` of this rank (a tensor-parallel rank holds a slice of the heads)."""
        H = self.A_log.shape[0]
        return H * _n_kv_heads(self.gdn_cfg) // self.gdn_cfg.n_heads, H

    def forward(self, x_BTD: torch.Tensor, *, doc_ids: torch.Tensor | None = None,
                step: Step | None = None) -> torch.Tensor:
        """The mixer; with ``step`` it continues from ``step.state`` (the ops read and leave
        their fields of it: the conv window, the delta-rule state)."""
        conv_BTX = self.conv(self.project(x_BTD), self.conv1d, doc_ids=doc_ids, step=step)
        q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH = self.rule_inputs(conv_BTX, x_BTD)
        o_BTHV = self.rule(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, doc_ids=doc_ids, step=step,
                           chunk_size=self.gdn_cfg.chunk_size)
        return self.finish(o_BTHV, x_BTD)

    # The token-wise stages around the ops.

    def project(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """The convolution's input ``[q, k, v]`` (``[B, T, X]``)."""
        return torch.cat([self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)], -1)

    def rule_inputs(self, conv_BTX: torch.Tensor, x_BTD: torch.Tensor
                    ) -> tuple[torch.Tensor, ...]:
        """``q, k [B, T, G, K]`` (L2-normalised), ``v [B, T, H, V]``, the log decay ``g`` and
        ``beta [B, T, H]`` of :func:`composer.kernels.gated_delta_rule`, in >= fp32."""
        d = self.gdn_cfg
        b, T, _ = x_BTD.shape
        G, H = self._heads()
        K, V = d.d_head_k, d.d_head_v
        q_BTX, k_BTX, v_BTX = conv_BTX.split([G * K, G * K, H * V], dim=-1)
        dtype = torch.promote_types(x_BTD.dtype, torch.float32)
        q_BTGK = _l2norm(q_BTX.reshape(b, T, G, K).to(dtype))
        k_BTGK = _l2norm(k_BTX.reshape(b, T, G, K).to(dtype))
        beta_BTH = torch.sigmoid(self.b_proj(x_BTD).to(dtype))
        if d.allow_neg_eigval:
            beta_BTH = beta_BTH * 2.0
        a_BTH = self.a_proj(x_BTD).to(dtype)
        g_BTH = -torch.exp(self.A_log.to(dtype)) * F.softplus(a_BTH + self.dt_bias.to(dtype))
        return q_BTGK, k_BTGK, v_BTX.reshape(b, T, H, V), g_BTH, beta_BTH

    def finish(self, o_BTHV: torch.Tensor, x_BTD: torch.Tensor) -> torch.Tensor:
        """The gated norm (``o`` stays in >= fp32 through it, as in transformers) and o_proj."""
        b, T, H, V = o_BTHV.shape
        z_BTHV = self.z_proj(x_BTD).reshape(b, T, H, V)
        y_BTHV = self.norm(o_BTHV, z_BTHV)
        return self.o_proj(y_BTHV.reshape(b, T, H * V).to(x_BTD.dtype))

    def init_cache(self, batch: int, max_len: int, device: torch.device,
                   dtype: torch.dtype) -> RecurrentState:
        """Conv window ``[B, X, d_conv - 1]`` and state ``[B, H, K, V]`` (>= fp32): the same
        size whatever ``max_len`` (:mod:`composer.blocks.cache`)."""
        d = self.gdn_cfg
        G, H = self._heads()
        return recurrent_state(batch, 2 * G * d.d_head_k + H * d.d_head_v, d.d_conv,
                               (H, d.d_head_k, d.d_head_v), device, dtype)

    def parallel_plan(self) -> ParallelPlan:
        """Heads split over ``tp`` (Megatron's GDN): the six input projections column parallel by
        heads, each part of the conv and the per-head ``A_log`` / ``dt_bias`` split alike, o_proj
        row parallel; the norm weight (one head wide, shared) replicated with partial grads."""
        return ParallelPlan(colwise=("q_proj", "k_proj", "v_proj", "z_proj", "b_proj", "a_proj"),
                            rowwise=("o_proj",), shard={"conv1d.*": 0, "A_log": 0, "dt_bias": 0},
                            partial=("norm.weight",))

    @staticmethod
    def layout_rules(cfg: ModelConfig) -> list[Divisible]:
        d = cfg.gdn
        assert d is not None
        return [Divisible("gdn.n_heads", d.n_heads), Divisible("gdn.n_kv_heads", _n_kv_heads(d))]

    @staticmethod
    def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
        """Forward FLOPs per token (a multiply-add is 2), averaged over a ``seq_len`` sequence.

        With ``L = min(chunk_size, seq_len)``, ``n_chunks = ceil(seq_len / L)``, the sequence
        padded to ``T' = n_chunks * L`` and per value head::

            projections  2 * (params of the seven projections)
            conv         2 * X * d_conv
            chunked      T' * H * (4 L K + 2 L V + L (K + V) + 6 K V) / seq_len

        The chunked terms per step: the ``L x L`` products ``k_beta k^T`` and ``q k^T`` (dense, as
        computed), the triangular solves for ``U0`` and ``W`` (``L`` multiply-adds per column,
        halved by the triangle), ``attn @ u``, and the state's three ``K x V`` products
        (``W S``, ``q S``, ``k^T u``). Elementwise work is not counted.
        """
        d = cfg.gdn
        assert d is not None
        qk, vv = _sizes(d)
        H, K, V = d.n_heads, d.d_head_k, d.d_head_v
        proj = cfg.d_model * (2 * qk + 2 * vv + 2 * H) + vv * cfg.d_model
        L = max(1, min(d.chunk_size, seq_len))
        padded = -(-max(seq_len, 1) // L) * L
        chunked = padded * H * (4 * L * K + 2 * L * V + L * (K + V) + 6 * K * V)
        return 2 * proj + 2 * (2 * qk + vv) * d.d_conv + chunked // max(seq_len, 1)


    @staticmethod
    def activation_bytes_per_token(cfg: ModelConfig, seq_len: int, ac: str, size: int,
                                   tp: int = 1, cp: int = 1) -> float:
        """Saved for the backward per token of a ``seq_len``-token sequence on one of ``tp``
        ranks (heads split over ``tp``), on the torch path (CPU: :func:`composer.kernels.gdn.
        gdn_chunked`, plain autograd over chunks of ``L = min(chunk_size, T)`` steps, ``n`` of
        them, padded by ``p = n L / T``). With ``G`` q/k heads, ``H`` v heads and ``X = 2 G K
        + H V`` (conv channels), ``ac`` none keeps:

        - the projections' input ``d`` (gathered over the sequence under sequence parallel),
          the conv's input ``X``, its padded output ``X (T + K_conv - 1) / T`` and its SiLU
          ``X``; the L2 norms' ``1/|q|``, ``1/|k|`` (``2 G``);
        - ``beta = sigmoid(b)``, ``a + dt_bias``, its softplus and two broadcasts of ``beta``
          (``5 H``), and the decays from and to the chunk ends in fp64 (``2 H`` of 8 bytes
          per padded step);
        - per padded step, five ``H x L`` matrices (the decay ``Γ``, ``I + A``, ``A``'s
          product, ``q k^T`` and one chunk's slice of it) and the rule's key-sized operands
          (k, ``k beta``, W, q, ``q e^c``, ``k e^{c_L - c}``: ``6 H K``) and ``U0`` (``H V``);
          with more than one chunk the batched products copy four more key-sized operands and
          keep each chunk's deltas (``4 H K + H V``);
        - the state entering each chunk (``n H K V`` per sequence);
        - the gated norm and o_proj: the rule's output, ``1/rms``, the scaled output, its
          view, ``silu(z)``, the product and o_proj's input (``6 H V + H``);
        - per call (per sequence, exact at micro-batch 1): the conv weight concatenated from
          its parts (``X K_conv``) and the causal mask (``L^2`` booleans).

        ``selective`` keeps the matmul outputs: the q, k, v, b, a and z projections (``2 G K
        + 2 H V + 2 H``), ``k beta k^T`` and ``q k^T`` (``2 H L`` per padded step), the three
        per-chunk ``H V`` products and the state update (``n H K V`` per sequence), and
        o_proj's partial sum ``d``. ``full`` keeps nothing of its own.

        On CUDA flash-linear-attention's chunked kernel keeps its inputs and recomputes the
        chunk states and ``L x L`` matrices in the backward (not measured here). Everything
        from the rule's inputs to the gated norm computes in at least fp32 (4 bytes under bf16);
        the projections, the conv and o_proj's input are at ``size``.

        Under context parallelism (``cp > 1``: ``seq_len`` is a rank's share, run as its two
        chunks side by side, rows of ``T / 2``; :mod:`composer.parallel.context.recurrent`) the
        conv and the rule count per row (chunks, padding, states), the conv's input is copied
        with its halo and its output padded once more, every row starts from a passed state
        (the batched products copy their operands as with several chunks), and the end-state
        pass (:func:`composer.kernels.gdn.gdn_end_state`, plain autograd over the same chunks)
        keeps eight ``H x L`` matrices and ten key-sized operands per padded step, two
        broadcasts of ``beta`` and a decay in fp64, and the passed states (``2 cp - 1`` of ``H
        K V`` per sequence, plus each row's start); ``selective`` keeps the
        end-state pass's products besides (five ``H x L``, one key-sized per padded step, each
        row's ``K x K`` transition and end state)."""
        c = cfg.gdn
        assert c is not None
        if ac == "full":
            return 0.0
        d, T = cfg.d_model, max(seq_len, 1)
        H, K, V = c.n_heads / tp, c.d_head_k, c.d_head_v
        G = _n_kv_heads(c) / tp
        X = 2 * G * K + H * V
        rows, Tr = cp_rows(T, cp)  # the rank's two chunks under cp, each a row
        L = max(1, min(c.chunk_size, Tr))
        n = -(-Tr // L)
        p = n * L / Tr
        states = rows * n * H * K * V / T
        passed = (2 * cp - 1 + rows) * H * K * V / T if cp > 1 else 0.0
        wide = max(size, 4)  # the rule and the gated norm compute in >= fp32
        if ac == "selective":
            ends = ((5 * H * L + H * K) * p + rows * H * K * (K + V) / T) if cp > 1 else 0.0
            products = 2 * H * L * p + 3 * H * V * p + states + ends
            return size * (2 * G * K + 2 * H * V + 2 * H + d) + wide * products
        copies = n > 1 or cp > 1  # several chunks or a passed start: operands copied
        operands = 6 * H * K + H * V + (4 * H * K + H * V if copies else 0)
        rule = 5 * H * L * p + operands * p + states
        # the norm's input, 1/rms, scaled output, z's >= fp32 copy, silu(z), the product; and
        # o_proj's input in the activation dtype
        finish = wide * (5 * H * V + H) + size * H * V
        per_call = X * c.d_conv / T
        conv = X * (Tr + c.d_conv - 1) / Tr
        fp64 = 2 * H * p  # the decays from and to the chunk ends, 8 bytes each
        if cp > 1:
            conv += X * (Tr + 2 * (c.d_conv - 1)) / Tr
            rule += (8 * H * L + 10 * H * K) * p + 2 * H + passed
            fp64 += H * p
        # the rule's q, k, v (the activated conv output) in >= fp32, their norms, the gates
        return (size * (d + X + conv + per_call) + wide * (X + 2 * G + 5 * H + rule) + finish
                + 8 * fp64 + rows * L * L / T)

def conv_silu_ref(x_BTX: torch.Tensor, weights: dict[str, torch.Tensor],
                  doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(causal depthwise conv(x))`` as a sum over taps (``conv1d.weight``, optional
    ``conv1d.bias`` in ``weights``); no tap reads an earlier document."""
    T = x_BTX.shape[1]
    cw = weights["conv1d.weight"][:, 0, :]
    taps = cw.shape[-1]
    conv = torch.zeros_like(x_BTX)
    for tap in range(taps):  # tap k multiplies the input K - 1 - k steps back
        lag = taps - 1 - tap
        if lag >= T:
            continue
        src = x_BTX[:, : T - lag]
        if doc_ids is not None:
            src = src * (doc_ids[:, : T - lag] == doc_ids[:, lag:])[..., None]
        conv[:, lag:] = conv[:, lag:] + cw[:, tap] * src
    if "conv1d.bias" in weights:
        conv = conv + weights["conv1d.bias"]
    return conv / (1 + torch.exp(-conv))


def l2norm_ref(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def gdn_ref(x: torch.Tensor, weights: dict[str, torch.Tensor], cfg: ModelConfig,
            doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-math twin of :class:`GatedDeltaNet`; ``weights`` uses its state-dict names.

    The causal convolution as a sum over taps, softplus as ``log1p(exp(.))``, the sequential
    :func:`gdn_recurrent_ref`. Meant for fp64 inputs and weights.
    """
    d = cfg.gdn
    assert d is not None
    b, T, _ = x.shape
    G, H, K, V = _n_kv_heads(d), d.n_heads, d.d_head_k, d.d_head_v
    qk, vv = _sizes(d)
    w = {name: weights[f"{name}_proj.weight"] for name in "qkvzba"}
    qkv = torch.cat([x @ w["q"].T, x @ w["k"].T, x @ w["v"].T], -1)
    qkv = conv_silu_ref(qkv, weights, doc_ids)
    q, k, v = qkv[..., :qk], qkv[..., qk : 2 * qk], qkv[..., 2 * qk :]
    q = l2norm_ref(q.reshape(b, T, G, K))
    k = l2norm_ref(k.reshape(b, T, G, K))
    beta = 1 / (1 + torch.exp(-(x @ w["b"].T)))
    if d.allow_neg_eigval:
        beta = 2 * beta
    g = -torch.exp(weights["A_log"]) * torch.log1p(torch.exp(x @ w["a"].T + weights["dt_bias"]))
    o = gdn_recurrent_ref(q, k, v.reshape(b, T, H, V), g, beta, doc_ids=doc_ids)
    z = (x @ w["z"].T).reshape(b, T, H, V)
    o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + d.norm_eps)
    y = weights["norm.weight"] * o * z / (1 + torch.exp(-z))
    return y.reshape(b, T, vv) @ weights["o_proj.weight"].T


KIND = LayerKind("G", "gated delta net", GatedDeltaNet, "gdn", GDNConfig, validate_gdn,
                 default=default_gdn, halo=lambda cfg: cfg.gdn.d_conv - 1)
"""``G``: the gated delta net (its section exists when the pattern uses it, sized by
``d_model``)."""
