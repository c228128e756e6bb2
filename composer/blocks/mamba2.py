"""The Mamba-2 mixer (Dao & Gu 2024, "Transformers are SSMs", §7 "The Mamba-2 architecture").

One fused input projection gives, per token, ``[z, x, B, C, dt]`` (§7.1 "parallel parameter
projections"); a short causal depthwise convolution plus SiLU mixes ``xBC`` over time; the SSD scan
(§6, :mod:`composer.kernels.ssd`) runs with

    dt = clamp(softplus(dt + dt_bias), dt_limit),   A = -exp(A_log),
    y  = SSD(x, dt, A, B, C) + D * x,

then the gated grouped RMSNorm (§7.2) ``norm(y * silu(z))`` and the output projection. This is
the math of transformers' ``Mamba2Mixer`` / ``NemotronHMamba2Mixer`` torch path.

Falcon-H1's options (transformers' ``FalconH1Mixer``), each off by default: ``multipliers``
scales the five parts of the input projection's output ``[z, x, B, C, dt]`` by five numbers
(its µP ``ssm_multipliers``, kept as config, never folded into ``in_proj``); ``gated_norm: false``
drops the norm (``y * silu(z)``, no ``norm.weight``); ``norm_before_gate`` normalises first,
``norm(y) * silu(z)``; ``out_proj_bias`` gives ``out_proj`` its own bias flag.

Time mixing is two parameterless ops (:mod:`composer.blocks.ops`), ``conv``
(:class:`~composer.blocks.ops.CausalConv`) and ``scan`` (:class:`SSDScan`); everything around
them is token-wise. Context parallelism swaps them for their variants; decoding passes ``step``
through them.

Packed documents (``doc_ids``, :mod:`composer.kernels.packing`): the convolution reads no input of
an earlier document and the scan's state restarts from zero at each document, so every document
gives what it gives alone.

Shape legend:
    B batch, T time, D d_model, E d_inner (= H * P), H heads, P head dim, G groups of B/C,
    N state size, X conv channels (E + 2 * G * N), K conv taps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from composer.blocks.cache import RecurrentState, Step, recurrent_state
from composer.blocks.kind import LayerKind, cp_rows
from composer.blocks.norm import GatedRMSNorm, gated_rms_norm_ref
from composer.blocks.ops import CausalConv, LinearRecurrence, keep_mask, step_docs
from composer.blocks.plan import (
    ONES,
    ZEROS,
    DividesShard,
    Divisible,
    Init,
    Normal,
    ParallelPlan,
    init_module,
)
from composer.blocks.split import SplitCausalConv1d, SplitLinear
from composer.config import ConfigError, ModelConfig, positive
from composer.kernels import mamba_scan
from composer.kernels.linear import Linear
from composer.kernels.packing import doc_segments
from composer.kernels.scan import NO_LIMIT, ssd_end_state, ssd_step
from composer.kernels.ssd import ssd_scan_ref

# ---------------------------------------------------------------- the kind's config section


@dataclass
class MambaConfig:
    n_heads: int = 8
    d_head: int = 64
    n_groups: int = 1
    d_state: int = 64
    d_conv: int = 4
    chunk_size: int = 64
    norm_group_size: int | None = None
    """Channels per gated-RMSNorm group; ``None`` means ``d_inner // n_groups`` (transformers 5.x,
    Megatron). Set it to ``d_inner`` for the older whole-width normalisation."""
    conv_bias: bool = True
    proj_bias: bool = False
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    a_init_range: tuple[float, float] = (1.0, 16.0)
    gated_norm: bool = True
    """The gated RMSNorm after the scan; False: ``y * silu(z)`` only, no ``norm.weight``
    (Falcon-H1's ``mamba_rms_norm: false``)."""
    norm_before_gate: bool = False
    """``norm(y) * silu(z)`` instead of ``norm(y * silu(z))`` (Falcon-H1's
    ``mamba_norm_before_gate``); read only with ``gated_norm``."""
    out_proj_bias: bool | None = None
    """A bias on ``out_proj``; None: ``proj_bias`` (Falcon-H1's ``projectors_bias``)."""
    multipliers: list[float] | None = None
    """Five numbers scaling the input projection's ``[z, x, B, C, dt]`` outputs (Falcon-H1's µP
    ``ssm_multipliers``); None: all 1."""


def validate_mamba(m: MambaConfig, cfg: ModelConfig) -> None:
    positive(m, "mamba.", ("n_heads", "d_head", "n_groups", "d_state", "d_conv", "chunk_size",
                            "norm_group_size"))
    if m.n_heads % m.n_groups:
        raise ConfigError(f"mamba.n_heads ({m.n_heads}) must be divisible by mamba.n_groups "
                          f"({m.n_groups})")
    d_inner = m.n_heads * m.d_head
    if m.norm_group_size is not None and d_inner % m.norm_group_size:
        raise ConfigError(f"mamba.norm_group_size ({m.norm_group_size}) must divide the inner "
                          f"width n_heads*d_head ({d_inner})")
    if not 0 < m.dt_min <= m.dt_max:
        raise ConfigError(f"mamba.dt_min ({m.dt_min}) must be positive and <= dt_max ({m.dt_max})")
    if m.dt_limit[0] > m.dt_limit[1]:
        raise ConfigError(f"mamba.dt_limit {list(m.dt_limit)} must be increasing")
    if not 0 < m.a_init_range[0] <= m.a_init_range[1]:
        raise ConfigError(f"mamba.a_init_range {list(m.a_init_range)} must be positive, increasing")
    if m.multipliers is not None and (
            len(m.multipliers) != 5 or not all(isinstance(v, (int, float))
                                               and not isinstance(v, bool) for v in m.multipliers)):
        raise ConfigError(f"mamba.multipliers must be five numbers (z, x, B, C, dt), got "
                          f"{m.multipliers!r}")


def d_inner_of(m: MambaConfig) -> int:
    return m.n_heads * m.d_head


def out_bias_of(m: MambaConfig) -> bool:
    return m.proj_bias if m.out_proj_bias is None else m.out_proj_bias


def _norm_group_size(m: MambaConfig) -> int:
    return m.norm_group_size or d_inner_of(m) // m.n_groups


def _sizes(m: MambaConfig) -> tuple[int, int, int]:
    """``(d_inner, d_bc, conv_dim)`` with ``d_bc = G * N`` the width of B (and of C)."""
    d_inner = d_inner_of(m)
    d_bc = m.n_groups * m.d_state
    return d_inner, d_bc, d_inner + 2 * d_bc


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


@dataclass(frozen=True)
class DtBiasInit(Init):
    """``dt`` log-uniform in ``[dt_min, dt_max]`` (floored); ``dt_bias`` is its inverse softplus,
    so that at init ``softplus(0 + dt_bias) = dt`` (mamba_ssm's init)."""

    dt_min: float
    dt_max: float
    floor: float

    def fill(self, t: torch.Tensor, generator: torch.Generator | None) -> None:
        u = torch.rand(t.shape, generator=generator, device=t.device, dtype=torch.float32)
        log_lo, log_hi = math.log(self.dt_min), math.log(self.dt_max)
        dt = torch.exp(u * (log_hi - log_lo) + log_lo).clamp(min=self.floor)
        t.copy_(dt + torch.log(-torch.expm1(-dt)))


@dataclass(frozen=True)
class ALogInit(Init):
    """``A_log = log(a)`` with ``a`` uniform in ``[low, high]``."""

    low: float
    high: float

    def fill(self, t: torch.Tensor, generator: torch.Generator | None) -> None:
        a = torch.empty(t.shape, device=t.device, dtype=torch.float32)
        t.copy_(torch.log(a.uniform_(self.low, self.high, generator=generator)))


class SSDScan(LinearRecurrence):
    """The SSD scan (:func:`composer.kernels.mamba_scan`) as a linear recurrence over the
    tokens ``x [B, T, H, P]``, raw ``dt [B, T, H]``, ``B``, ``C [B, T, G, N]``; the state
    ``[B, H, P, N]`` ends a span as ``decay * S_start + S_local``
    (:func:`composer.kernels.scan.ssd_end_state`, closed form). With ``step``: one step of the
    recurrence per decoded token (:func:`composer.kernels.scan.ssd_step`), the chunked scan from
    the cached state for a prompt."""

    def forward(self, x_BTHP: torch.Tensor, dt_BTH: torch.Tensor, B_BTGN: torch.Tensor,
                C_BTGN: torch.Tensor, *, doc_ids: torch.Tensor | None = None,
                initial_state: torch.Tensor | None = None, step: Step | None = None,
                A_H: torch.Tensor, chunk_size: int, **dt_kw: Any) -> torch.Tensor:
        if step is None:
            return mamba_scan(x_BTHP, dt_BTH, A_H, B_BTGN, C_BTGN, chunk_size, **dt_kw,
                              doc_ids=doc_ids, initial_state_BHPN=initial_state)
        state = step.state.state
        if x_BTHP.shape[1] == 1 and not step.fresh:  # one decoding step: the recurrence
            return ssd_step(x_BTHP, dt_BTH, A_H, B_BTGN, C_BTGN, state, **dt_kw)
        y_BTHP, final = mamba_scan(
            x_BTHP, dt_BTH, A_H, B_BTGN, C_BTGN, chunk_size, **dt_kw,
            doc_ids=step_docs(doc_ids, step), initial_state_BHPN=None if step.fresh else state,
            return_final_state=True)
        state.copy_(final)
        return y_BTHP

    def end_state(self, x_BTHP: torch.Tensor, dt_BTH: torch.Tensor, B_BTGN: torch.Tensor,
                  C_BTGN: torch.Tensor, *, doc_ids: torch.Tensor | None = None,
                  A_H: torch.Tensor, dt_bias_H: torch.Tensor | None = None,
                  dt_softplus: bool = False, dt_limit: tuple[float, float] = NO_LIMIT,
                  **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(S_local [B, H, P, N], decay [B, H])``."""
        seg_BT = None if doc_ids is None else doc_segments(doc_ids)
        return ssd_end_state(x_BTHP, dt_BTH, A_H, B_BTGN, seg_BT, dt_bias_H=dt_bias_H,
                             dt_softplus=dt_softplus, dt_limit=dt_limit)

    @staticmethod
    def carry(M: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
        return M[..., None, None] * S

    def mask_steps(self, tokens: Sequence[torch.Tensor],
                   keep_BT: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``dt -> -1e4`` (``softplus`` of it is 0: no decay, no input) and ``x -> 0``."""
        x_BTHP, dt_BTH, B_BTGN, C_BTGN = tokens
        dt_BTH = torch.where(keep_BT[..., None], dt_BTH, torch.full_like(dt_BTH, -1e4))
        return x_BTHP * keep_mask(keep_BT, x_BTHP), dt_BTH, B_BTGN, C_BTGN


class Mamba2Mixer(nn.Module):
    """``layers.i.mixer.{in_proj,conv1d,dt_bias,A_log,D,norm,out_proj}`` (transformers' names)."""

    keep_fp32 = ("A_log",)
    uses_doc_ids = True
    """``forward`` takes ``doc_ids`` (the residual layer passes them only to mixers that do)."""
    ops = ("conv", "scan")

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        assert cfg.mamba is not None
        m = cfg.mamba
        self.mamba_cfg = m
        self.layer_idx = layer_idx
        self.init_std = cfg.init_std
        d_inner, d_bc, conv_dim = _sizes(m)
        self.d_inner, self.d_bc, self.conv_dim = d_inner, d_bc, conv_dim
        # Each component is its own parameter so tensor parallelism can shard it (split.py);
        # the state dict shows the fused in_proj.weight / conv1d.weight of transformers.
        self.in_proj = SplitLinear(cfg.d_model, {"z": d_inner, "x": d_inner, "B": d_bc,
                                                 "C": d_bc, "dt": m.n_heads}, bias=m.proj_bias)
        self.conv1d = SplitCausalConv1d({"x": d_inner, "B": d_bc, "C": d_bc}, m.d_conv,
                                        bias=m.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(m.n_heads))
        self.A_log = nn.Parameter(torch.empty(m.n_heads))
        self.D = nn.Parameter(torch.empty(m.n_heads))
        if m.gated_norm:
            self.norm = GatedRMSNorm(d_inner, _norm_group_size(m), eps=cfg.norm_eps,
                                     norm_before_gate=m.norm_before_gate)
        self.out_proj = Linear(d_inner, cfg.d_model, bias=out_bias_of(m))
        self.conv = CausalConv()  # the time-mixing ops (parameterless; cp swaps them)
        self.scan = SSDScan()

    def init_rules(self) -> dict[str, Init]:
        m = self.mamba_cfg  # conv1d and norm declare their own
        return {"in_proj.weight_*": Normal(self.init_std), "in_proj.bias_*": ZEROS,
                "out_proj.weight": Normal(self.init_std), "out_proj.bias": ZEROS,
                "dt_bias": DtBiasInit(m.dt_min, m.dt_max, m.dt_init_floor),
                "A_log": ALogInit(*m.a_init_range), "D": ONES}

    def lora_targets(self) -> dict[str, str]:
        """The projections LoRA may adapt (:mod:`composer.lora`); ``in_proj`` is fused, its
        adapter's B split into the same parts (tensor parallelism shards each)."""
        return {"in_proj": "in_proj", "out_proj": "out_proj"}

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        init_module(self, generator)

    def _sizes(self) -> tuple[int, int, int, int]:
        """``(H, G, E, F)`` of this rank (a tensor-parallel rank holds a slice of heads and
        groups): the sizes follow the weights."""
        m = self.mamba_cfg
        H = self.dt_bias.shape[0]
        G = H * m.n_groups // m.n_heads
        return H, G, H * m.d_head, G * m.d_state

    def forward(self, x_BTD: torch.Tensor, *, doc_ids: torch.Tensor | None = None,
                step: Step | None = None) -> torch.Tensor:
        """The mixer; with ``step`` it continues from ``step.state`` (the ops read and leave
        their fields of it: the conv window, the SSM state)."""
        z_BTE, xBC_BTX, dt_BTH = self.project(x_BTD)
        # The CUDA conv kernel (and a decoding step's conv) returns the transposed [B, X, T]
        # layout; one copy back to [B, T, X] is cheaper than the scan reading x, B and C with a
        # stride-T inner dimension. The CPU conv returns [B, T, X] itself: no copy.
        conv_BTX = self.conv(xBC_BTX, self.conv1d, doc_ids=doc_ids, step=step).contiguous()
        x_BTHP, B_BTGN, C_BTGN, A_H, extra = self.scan_inputs(conv_BTX)
        y_BTHP = self.scan(x_BTHP, dt_BTH, B_BTGN, C_BTGN, doc_ids=doc_ids, step=step, A_H=A_H,
                           chunk_size=self.mamba_cfg.chunk_size, **extra)
        return self.finish(y_BTHP, z_BTE, x_BTD.dtype)

    # The token-wise stages around the ops.

    def project(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(z [B, T, E], xBC [B, T, X], dt [B, T, H])`` from the fused input projection."""
        H, _, E, F_ = self._sizes()
        zxbcdt = self.in_proj(x_BTD)
        mults = self.mamba_cfg.multipliers
        if mults is not None:  # one number per part, on this rank's widths of the parts
            widths = torch.tensor([E, E, F_, F_, H], device=zxbcdt.device)
            vec = torch.tensor([float(v) for v in mults], dtype=zxbcdt.dtype,
                               device=zxbcdt.device)
            zxbcdt = zxbcdt * torch.repeat_interleave(vec, widths)
        return zxbcdt.split([E, E + 2 * F_, H], dim=-1)

    def scan_inputs(self, conv_BTX: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                           torch.Tensor, torch.Tensor, dict]:
        """The convolution's output as the scan's ``x [B, T, H, P]``, ``B``, ``C [B, T, G, N]``,
        plus ``A [H]`` and the keyword arguments of :func:`composer.kernels.mamba_scan`."""
        m = self.mamba_cfg
        b, T, _ = conv_BTX.shape
        H, G, E, F_ = self._sizes()
        x_BTE, B_BTF, C_BTF = conv_BTX.split([E, F_, F_], dim=-1)
        # dt = clamp(softplus(dt + dt_bias), dt_limit), then the scan, all in >= fp32 as the
        # mamba_ssm kernel does (it fuses them on CUDA; transformers' torch path does the
        # softplus in the input dtype, identical in fp32).
        A_H = -torch.exp(_at_least_fp32(self.A_log))
        extra = dict(D_H=self.D, dt_bias_H=self.dt_bias, dt_softplus=True, dt_limit=m.dt_limit)
        return (x_BTE.view(b, T, H, m.d_head), B_BTF.view(b, T, G, m.d_state),
                C_BTF.view(b, T, G, m.d_state), A_H, extra)

    def finish(self, y_BTHP: torch.Tensor, z_BTE: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
        """The gated norm and the output projection. The D skip is inside the scan, so it is
        gated and normalised too (as in transformers); the scan output stays fp32 through the
        norm and is cast only for out_proj."""
        b, T = y_BTHP.shape[:2]
        y_BTE = y_BTHP.reshape(b, T, -1)
        if self.mamba_cfg.gated_norm:
            y_BTE = self.norm(y_BTE, gate=z_BTE)
        else:  # Falcon-H1 without its norm: the gate alone, in the scan's >= fp32
            y_BTE = y_BTE * F.silu(z_BTE.to(y_BTE.dtype))
        return self.out_proj(y_BTE.to(dtype))

    def init_cache(self, batch: int, max_len: int, device: torch.device,
                   dtype: torch.dtype) -> RecurrentState:
        """Conv window ``[B, X, d_conv - 1]`` and SSM state ``[B, H, P, N]`` (>= fp32): the
        same size whatever ``max_len`` (:mod:`composer.blocks.cache`)."""
        m = self.mamba_cfg
        H, _, E, F_ = self._sizes()
        return recurrent_state(batch, E + 2 * F_, m.d_conv, (H, m.d_head, m.d_state), device,
                               dtype)

    def parallel_plan(self) -> ParallelPlan:
        """Heads and groups split over ``tp``: every component of in_proj and conv1d row-split on
        its own (Megatron's per-component sharding), the per-head vectors and the norm split;
        out_proj row parallel."""
        shard = {"in_proj.*": 0, "conv1d.*": 0, "dt_bias": 0, "A_log": 0, "D": 0}
        if self.mamba_cfg.gated_norm:
            shard["norm.weight"] = 0
        return ParallelPlan(shard=shard, rowwise=("out_proj",))

    @staticmethod
    def layout_rules(cfg: ModelConfig) -> list[Divisible | DividesShard]:
        m = cfg.mamba
        assert m is not None
        rules: list[Divisible | DividesShard] = [Divisible("mamba.n_heads", m.n_heads),
                                                 Divisible("mamba.n_groups", m.n_groups)]
        if m.norm_group_size is not None:
            rules.append(DividesShard("mamba.norm_group_size", m.norm_group_size, d_inner_of(m)))
        return rules

    @staticmethod
    def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
        """Forward FLOPs per token (a multiply-add is 2), averaged over a ``seq_len`` sequence.

        With ``L = min(chunk_size, seq_len)``, ``n_chunks = ceil(seq_len / L)`` and the sequence
        padded to ``T' = n_chunks * L``::

            projections  2 * (params(in_proj) + params(out_proj))
            conv         2 * X * K
            SSD          [T' * (2 * L * (G*N + H*P) + 4 * H*P*N) + n_chunks * 2 * H*P*N] / seq_len

        The SSD terms: per chunk the ``L x L`` scores ``C·B`` (per group) and their product with
        ``x`` (per head), both computed densely as the chunked algorithm does; each chunk's end
        state (``B ⊗ x``) and the read-out of its starting state (``C · state``); and the
        recurrence over chunk boundaries as a sequential pass. Elementwise work (softplus, exp,
        SiLU, the norm, the gate, the D skip) is not counted.
        """
        m = cfg.mamba
        assert m is not None
        d_inner, d_bc, conv_dim = _sizes(m)
        in_params = (cfg.d_model + int(m.proj_bias)) * (d_inner + conv_dim + m.n_heads)
        out_params = (d_inner + int(out_bias_of(m))) * cfg.d_model
        H, P, N, G = m.n_heads, m.d_head, m.d_state, m.n_groups
        L = max(1, min(m.chunk_size, seq_len))
        n_chunks = -(-max(seq_len, 1) // L)
        padded = n_chunks * L
        ssd = padded * (2 * L * (G * N + H * P) + 4 * H * P * N) + n_chunks * 2 * H * P * N
        return 2 * (in_params + out_params) + 2 * conv_dim * m.d_conv + ssd // max(seq_len, 1)


    @staticmethod
    def activation_bytes_per_token(cfg: ModelConfig, seq_len: int, ac: str, size: int,
                                   tp: int = 1, cp: int = 1) -> float:
        """Saved for the backward per token of a ``seq_len``-token sequence on one of ``tp``
        ranks (heads and groups split over ``tp``), on the torch path (CPU; the scan in chunks
        of ``L = min(chunk_size, 64, seq_len)`` steps, ``n`` of them, padded to ``n L``). With
        ``E = H P``, ``X = E + 2 G N`` (conv channels) and ``J = E + X + H`` (the fused
        projection's output), ``ac`` none keeps:

        - the projection's input ``d`` (gathered over the sequence under sequence parallel)
          and output ``J`` (the conv reads a slice of it);
        - the conv's output with its ``K - 1`` steps of padding (``X (T + K - 1) / T``) and
          its activated, contiguous copy (``X``: the scan's x, B and C are views of it);
        - ``dt + dt_bias``, its softplus and its clamp (``3 H``);
        - the scan's own (:class:`composer.kernels.ssd._SSDScan`): the state entering each
          chunk (``n H P N`` per sequence) and, with more than one chunk, the starting states'
          read-out (``E`` per padded step);
        - the gated norm: ``silu(z)``, the scan output, its grouped view, ``1/rms`` per group,
          the normalised output, ``out_proj``'s input (``5 E + E / group``; without the norm
          the product and its factors, ``3 E``);
        - per call, not per token (counted per sequence: exact at micro-batch 1): the fused
          projection and conv weights concatenated from their per-component parameters
          (``d J + X K``).

        ``selective`` keeps the matmul outputs: the projection (``J``), the scan's ``C B^T``
        (``G L`` per padded step), its diagonal-block output (``E``), the starting states'
        read-out (``E``, more than one chunk), the chunk states (``n H P N`` per sequence) and
        ``out_proj``'s partial sum (``d``). ``full`` keeps nothing of its own.

        On CUDA (mamba_ssm's ``mamba_chunk_scan_combined`` and causal-conv1d) the kernels keep
        their inputs and output and the per-chunk cumulative decays instead of the padded conv
        output, the chunk states and the read-out; that path is not measured here. The scan
        and the gated norm compute in at least fp32: their tensors (x, B, C, dt, states,
        read-out, the norm's) count 4 bytes under bf16.

        Under context parallelism (``cp > 1``: ``seq_len`` is a rank's share, run as its two
        chunks side by side, rows of ``T / 2``; :mod:`composer.parallel.context.recurrent`) the
        conv and the scan count per row of ``T / 2`` (chunks, padding, states), the conv's
        input is copied with its halo (``X (T / 2 + K - 1) / (T / 2)``) and its output padded
        once more, every row starts from a passed state (the read-out is always kept), and the
        end-state pass (:func:`composer.kernels.scan.ssd_end_state`) keeps the cumulative decay
        (``H`` in fp64), ``dt`` again (``3 H``), the decay to the end and its weights (``2 H``),
        its product operands (``E + G N``), and the passed states (``2 cp - 1`` of ``H P N``
        per sequence, plus each row's start); ``selective`` keeps each row's end state (the
        pass's product) besides."""
        m = cfg.mamba
        assert m is not None
        if ac == "full":
            return 0.0
        d, T = cfg.d_model, max(seq_len, 1)
        H, G, P, N, K = m.n_heads / tp, m.n_groups / tp, m.d_head, m.d_state, m.d_conv
        E = H * P
        X, J = E + 2 * G * N, 2 * E + 2 * G * N + H
        rows, Tr = cp_rows(T, cp)  # the rank's two chunks under cp, each a row
        L = max(1, min(m.chunk_size, 64, Tr))
        n = -(-Tr // L)
        padded = n * L / Tr
        states = n * H * P * N / Tr
        readout = E * padded if n > 1 or cp > 1 else 0.0
        wide = max(size, 4)  # the scan and the gated norm compute in >= fp32
        passing = 0.0
        if cp > 1:  # the end-state pass and the states passed between the chunks
            passing = wide * (5 * H + E + G * N + (2 * cp - 1 + rows) * H * P * N / T) + 8 * H
        if ac == "selective":  # under cp also each row's end state (a batched product)
            ends = rows * H * P * N / T if cp > 1 else 0.0
            scan = G * L * padded + E * padded + readout + states + ends
            return size * (J + d) + wide * scan
        if m.gated_norm:  # z's copy in >= fp32 (bf16), silu(z), y and its views, 1/rms
            gate = wide * (4 * E + E / _norm_group_size(m)) + size * E
            gate += wide * E if size < 4 else 0
        else:
            gate = wide * 2 * E + size * E
        per_call = (d * J + X * K) / T
        conv = X * (Tr + K - 1) / Tr
        if cp > 1:
            conv += X * (Tr + 2 * (K - 1)) / Tr
        # the scan's x, B and C (the activated conv output) in >= fp32, dt, states, read-out
        scan = X + 3 * H + states + readout
        return size * (d + J + conv + per_call) + wide * scan + gate + passing

def mamba2_ref(x: torch.Tensor, weights: dict[str, torch.Tensor], cfg: ModelConfig,
               doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-math twin of :class:`Mamba2Mixer`; ``weights`` uses its state-dict names.

    Uses the sequential :func:`ssd_scan_ref`, the causal convolution as a sum over taps, and
    softplus as ``log1p(exp(.))``. Meant for fp64 inputs and weights. With ``doc_ids`` a tap
    reading an earlier document's input reads 0, and the scan restarts at each document.
    """
    m = cfg.mamba
    assert m is not None
    d_inner, d_bc, conv_dim = _sizes(m)
    b, T, _ = x.shape
    zxbcdt = x @ weights["in_proj.weight"].T
    if "in_proj.bias" in weights:
        zxbcdt = zxbcdt + weights["in_proj.bias"]
    if m.multipliers is not None:  # part by part: z, x, B, C, dt
        bounds = [0, d_inner, 2 * d_inner, 2 * d_inner + d_bc, 2 * d_inner + 2 * d_bc,
                  zxbcdt.shape[-1]]
        zxbcdt = torch.cat([zxbcdt[..., lo:hi] * v for lo, hi, v
                            in zip(bounds[:-1], bounds[1:], m.multipliers, strict=True)], -1)
    z = zxbcdt[..., :d_inner]
    xbc = zxbcdt[..., d_inner : d_inner + conv_dim]
    dt = zxbcdt[..., d_inner + conv_dim :]

    # Tap k of the cross-correlation weight multiplies the input k - (K - 1) steps away.
    w, K = weights["conv1d.weight"][:, 0, :], m.d_conv
    conv = torch.zeros_like(xbc)
    for k in range(K):
        lag = K - 1 - k
        if lag >= T:
            continue
        src = xbc[:, : T - lag]
        if doc_ids is not None:  # the input lag steps back, only from the same document
            src = src * (doc_ids[:, : T - lag] == doc_ids[:, lag:])[..., None]
        conv[:, lag:] = conv[:, lag:] + w[:, k] * src
    if "conv1d.bias" in weights:
        conv = conv + weights["conv1d.bias"]
    xbc = conv / (1 + torch.exp(-conv))
    xs, B, C = xbc[..., :d_inner], xbc[..., d_inner : d_inner + d_bc], xbc[..., d_inner + d_bc :]

    dt = torch.log1p(torch.exp(dt + weights["dt_bias"]))
    dt = torch.clamp(dt, min=m.dt_limit[0], max=m.dt_limit[1])
    A = -torch.exp(weights["A_log"])
    y = ssd_scan_ref(
        xs.reshape(b, T, m.n_heads, m.d_head),
        dt,
        A,
        B.reshape(b, T, m.n_groups, m.d_state),
        C.reshape(b, T, m.n_groups, m.d_state),
        D_H=weights["D"],
        doc_ids=doc_ids,
    )
    y = y.reshape(b, T, d_inner)
    if not m.gated_norm:
        y = y * z / (1 + torch.exp(-z))
    elif m.norm_before_gate:
        y = gated_rms_norm_ref(y, None, weights["norm.weight"], _norm_group_size(m), cfg.norm_eps)
        y = y * z / (1 + torch.exp(-z))
    else:
        y = gated_rms_norm_ref(y, z, weights["norm.weight"], _norm_group_size(m), cfg.norm_eps)
    out = y @ weights["out_proj.weight"].T
    if "out_proj.bias" in weights:
        out = out + weights["out_proj.bias"]
    return out


KIND = LayerKind("M", "Mamba-2", Mamba2Mixer, "mamba", MambaConfig, validate_mamba,
                 always=True, halo=lambda cfg: cfg.mamba.d_conv - 1)
"""``M``: the Mamba-2 mixer; a context-parallel chunk needs the ``d_conv - 1`` inputs before it."""
