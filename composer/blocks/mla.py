"""Multi-latent attention (MLA): DeepSeek-V2 §2.1, as DeepSeek-V3 and Kimi-K2 use it.

Keys and values come from one compressed latent per token, queries from an optional low-rank
bottleneck; position enters through a few extra RoPE channels per head, with one RoPE key shared
by all heads (it cannot be folded into the latent):

    q       = q_b(rms(q_a(x)))          or  q_proj(x)           [H, N + R]   (nope | rope)
    [c, kr] = kv_a(x)                                           c: [C], kr: [R] (one head)
    [kn, v] = kv_b(rms(c))                                      [H, N], [H, V]
    k_h     = [kn_h, rope(kr)],   q_h = [qn_h, rope(qr_h)]
    o       = o_proj(concat_h softmax(q_h k_h^T * scale + causal) v_h)

``mla.rope: false`` (Kimi Linear's ``mla_use_nope``) leaves the ``R`` channels unrotated: a
position-free MLA whose shared ``kr`` is one more key channel group.

``scale = (N + R)^-1/2``, times YaRN's ``mscale(factor, mscale_all_dim)^2`` when the RoPE uses
YaRN (Peng et al. 2023) with ``mscale_all_dim``; YaRN also multiplies the cos/sin tables by its
attention factor, which scales the RoPE channels only. RoPE is the rotate-half layout of
``attention.py`` (channel ``i`` pairs with ``i + R/2``). DeepSeek's checkpoints store the RoPE rows
of ``q_b_proj`` and ``kv_a_proj_with_mqa`` pair-interleaved (``rope_interleave``); the converter
permutes them once on import (``tools/convert/deepseek_v3.py``), so this block has one convention.

The time mixing is one parameterless op, ``core`` (:class:`LatentAttention`), handed the latents
before ``kv_b`` and a :class:`LatentExpand` of ``kv_b``: the training form (per-head k and v
materialised, then SDPA), or for decoding the absorbed form (scores against the latent), the
same math with ``kv_b`` folded into q and o. Context parallelism swaps ``core`` for its
``latent_gather`` variant (``composer/parallel/context``).

DeepSeek-V3.2 adds a DSA indexer that keeps the top ``index_topk`` keys per query; up to that
length it keeps every causal key, so the layer is this dense one. ``mla.max_dense_len`` (set from
``index_topk``) makes longer sequences a ``ValueError`` rather than a different computation.

Packed documents (``doc_ids``): block-diagonal causal mask and RoPE positions that restart at each
document, as in ``attention.py``; on CUDA the masked cases (documents, a padded prompt, cached calls
of several tokens) go through FlexAttention's block masks (:mod:`composer.kernels.flex`).

Legend: B batch, T time, D model width, H heads, C kv latent rank, N nope width, R rope width,
V value width, Q = N + R query/key width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from composer.blocks.attention import Rotary, apply_rope, rope_frequencies
from composer.blocks.attn_core import flex_step
from composer.blocks.cache import (
    LatentState,
    Step,
    attention_mask,
    attention_visible,
    needs_mask,
)
from composer.blocks.kind import LayerKind
from composer.blocks.norm import RMSNorm
from composer.blocks.plan import Divisible, Init, Normal, ParallelPlan, init_module
from composer.blocks.protocol import TimeMixingOp
from composer.blocks.rope import yarn_frequencies, yarn_gain, yarn_mscale
from composer.config import ConfigError, ModelConfig, positive
from composer.kernels import sdpa_context
from composer.kernels.flex import Visible, flex_attend
from composer.kernels.linear import Linear
from composer.kernels.sdpa import doc_sdpa

# ---------------------------------------------------------------- the kind's config section


@dataclass
class YarnScaling:
    """YaRN frequency interpolation (Peng et al. 2023; ``rope_type: yarn`` in transformers, as
    DeepSeek-V3 and Kimi-K2 use it). ``mscale`` / ``mscale_all_dim`` follow DeepSeek: the cos/sin
    tables are multiplied by ``attention_factor`` (default ``g(mscale) / g(mscale_all_dim)``, or
    ``g(1)`` unless both are set, with ``g(m) = 0.1 m ln(factor) + 1``), and MLA's softmax scale by
    ``g(mscale_all_dim)^2`` when ``mscale_all_dim`` is set."""

    factor: float = 40.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    """Round the correction range outwards to whole dimensions (transformers' default)."""


@dataclass
class MLAConfig:
    """Multi-latent attention (DeepSeek-V2 §2.1): low-rank q, a compressed kv latent, and one
    shared RoPE key head; per head ``d_head_nope + d_head_rope`` query/key and ``d_head_v``
    value channels."""

    n_heads: int = 4
    q_lora_rank: int | None = None
    """Rank of the query down-projection; ``None`` means a full ``q_proj``."""
    kv_lora_rank: int = 64
    d_head_nope: int = 32
    d_head_rope: int = 16
    d_head_v: int = 32
    rope: bool = True
    """RoPE on the ``d_head_rope`` channels. ``False``: the NoPE MLA of Kimi Linear
    (``mla_use_nope``): those channels, the shared key's included, pass unrotated."""
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    norm_eps: float = 1e-6
    """Epsilon of the two latent RMSNorms (transformers keeps them at 1e-6)."""
    softmax_scale: float | None = None
    """Score scale; ``None`` means ``(d_head_nope + d_head_rope)^-1/2`` times YaRN's mscale^2."""
    max_dense_len: int | None = None
    """Longest sequence this dense block computes exactly; longer ones are refused. Set from
    DeepSeek-V3.2's ``index_topk``: its DSA indexer keeps the top ``index_topk`` keys per query,
    which is every causal key up to that length, and sparse attention is not built. ``None``: no
    limit (plain MLA)."""


def validate_mla(m: MLAConfig, cfg: ModelConfig) -> None:
    positive(m, "mla.", ("n_heads", "q_lora_rank", "kv_lora_rank", "d_head_nope", "d_head_rope",
                          "d_head_v", "rope_theta", "norm_eps", "softmax_scale",
                          "max_dense_len"))
    if m.d_head_rope % 2:
        raise ConfigError(f"mla.d_head_rope ({m.d_head_rope}) must be even (RoPE rotates pairs)")
    y = m.rope_scaling
    if y is not None:
        positive(y, "mla.rope_scaling.", ("factor", "original_max_position", "beta_fast",
                                           "beta_slow", "attention_factor"))


def default_mla(d_model: int) -> MLAConfig:
    """The per-head widths of the defaults, one 32+16-channel head per 64 model channels and a
    kv latent of ``d_model / 4`` (at ``d_model`` 256, the dataclass's defaults)."""
    width = d_model if isinstance(d_model, int) and d_model > 0 else 256
    return MLAConfig(n_heads=max(1, width // 64), kv_lora_rank=max(8, width // 4))


def mla_rope(m: MLAConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies for the RoPE channels and the gain of the cos/sin tables."""
    y = m.rope_scaling
    if y is None:
        return rope_frequencies(m.d_head_rope, m.rope_theta, None), 1.0
    return yarn_frequencies(m.d_head_rope, m.rope_theta, y), yarn_gain(y)


def mla_softmax_scale(m: MLAConfig) -> float:
    if m.softmax_scale is not None:
        return m.softmax_scale
    scale = (m.d_head_nope + m.d_head_rope) ** -0.5
    y = m.rope_scaling
    if y is not None and y.mscale_all_dim:
        scale *= yarn_mscale(y.factor, y.mscale_all_dim) ** 2
    return scale


@dataclass(frozen=True)
class LatentExpand:
    """The mixer's ``kv_b_proj`` as the core sees it: per-head keys and values from latents
    (the training form) and the per-head blocks of its weight (the absorbed form). Built per
    call, so it always holds the projection the mixer holds now (tensor parallelism swaps
    it)."""

    proj: nn.Linear
    d_nope: int
    d_v: int

    def __call__(self, c_BSC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``kn [B, H, S, N]`` and ``v [B, H, S, V]``."""
        b, s, _ = c_BSC.shape
        # -1: the head count follows the weights (a tensor-parallel rank holds some of the heads)
        kv = self.proj(c_BSC).view(b, s, -1, self.d_nope + self.d_v)
        kn_BHSN, v_BHSV = kv.transpose(1, 2).split([self.d_nope, self.d_v], dim=-1)
        return kn_BHSN, v_BHSV

    def heads(self, h: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_k [H, N, C]`` and ``W_v [H, V, C]``."""
        w = self.proj.weight.view(h, self.d_nope + self.d_v, -1)
        return w[:, :self.d_nope], w[:, self.d_nope:]


def latent_keys(qn_BHTN: torch.Tensor, qr_BHTR: torch.Tensor, c_BSC: torch.Tensor,
                kr_B1SR: torch.Tensor, expand: LatentExpand
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The training form's queries ``[B, H, T, Q]``, per-head keys ``[B, H, S, Q]`` and values
    ``[B, H, S, V]``: the latents expanded, the shared RoPE key repeated for every head."""
    kn_BHSN, v_BHSV = expand(c_BSC)
    q_BHTQ = torch.cat([qn_BHTN, qr_BHTR], dim=-1)
    k_BHSQ = torch.cat([kn_BHSN, kr_B1SR.expand(-1, qn_BHTN.shape[1], -1, -1)], dim=-1)
    return q_BHTQ, k_BHSQ, v_BHSV


class LatentAttention(TimeMixingOp):
    """The time mixing of :class:`MLA`, from the latents before ``kv_b_proj``: RoPE on the
    query's and the shared key's RoPE channels, then the training form (causal or by
    ``doc_ids``). With a decoding ``step`` the latents and RoPE keys go into its
    :class:`~composer.blocks.cache.LatentState`; a prompt attends in the training form, later
    tokens in the absorbed form, against the cached latents without expanding them per head:

        score_h(t, s) = (W_k,h^T qn_h,t) . c_s + qr_h,t . kr_s,   o_h = W_v,h sum_s p c_s

    with ``W_k,h`` / ``W_v,h`` head ``h``'s rows of ``kv_b_proj``. Context parallelism replaces
    it by ``latent_gather`` (:mod:`composer.parallel.context.attention`)."""

    context = "latent_gather"

    def __init__(self, max_dense_len: int | None) -> None:
        super().__init__()
        self.max_dense_len = max_dense_len

    def forward(self, qn_BHTN: torch.Tensor, qr_BHTR: torch.Tensor, c_BTC: torch.Tensor,
                kr_BTR: torch.Tensor, expand: LatentExpand, rotary: Rotary | None, scale: float, *,
                doc_ids: torch.Tensor | None = None, step: Step | None = None) -> torch.Tensor:
        """``o [B, H, T, V]`` from the query parts ``[B, H, T, N | R]``, the normalised latent
        ``[B, T, C]`` and the RoPE key ``[B, T, R]`` (both before RoPE)."""
        self.check_length(step.ctx.end if step is not None else qn_BHTN.shape[2])
        kr_B1TR = kr_BTR[:, None]
        if rotary is not None:  # None: no position at all (mla.rope false)
            cos, sin = rotary.for_call(qn_BHTN, doc_ids, step)
            qr_BHTR = apply_rope(qr_BHTR, cos, sin)
            kr_B1TR = apply_rope(kr_B1TR, cos, sin)
        mask, visible = None, None
        if step is not None:
            state, ctx = step.state, step.ctx
            state.c_BSC[:, ctx.start:ctx.end] = c_BTC
            state.kr_BSR[:, ctx.start:ctx.end] = kr_B1TR[:, 0]
            doc_ids = None
            if flex_step(qn_BHTN) and needs_mask(ctx):  # CUDA: a block mask, not [T, S]
                visible = attention_visible(ctx)
            else:
                mask = attention_mask(ctx)
            if not step.fresh:
                return _absorbed(qn_BHTN, qr_BHTR, state, ctx.end, mask, expand, scale, visible)
        q_BHTQ, k_BHTQ, v_BHTV = latent_keys(qn_BHTN, qr_BHTR, c_BTC, kr_B1TR, expand)
        if visible is not None:
            return flex_attend(q_BHTQ, k_BHTQ, v_BHTV, scale, visible)
        if doc_ids is not None:  # block-diagonal causal: each document attends to itself only
            return doc_sdpa(q_BHTQ, k_BHTQ, v_BHTV, doc_ids, scale)
        with sdpa_context(q_BHTQ):  # flash first on CUDA; CPU untouched (kernels.sdpa)
            return F.scaled_dot_product_attention(q_BHTQ, k_BHTQ, v_BHTV, attn_mask=mask,
                                                  is_causal=mask is None, scale=scale)

    def check_length(self, t: int) -> None:
        """Refuse rows longer than ``max_dense_len`` (the whole rows' length under cp)."""
        if self.max_dense_len is not None and t > self.max_dense_len:
            n = self.max_dense_len
            raise ValueError(f"MLA: sequence of {t} tokens exceeds mla.max_dense_len={n}: sparse "
                             f"attention (DeepSeek-V3.2's indexer, top-k {n}) is not built; "
                             f"sequences up to {n} tokens are exact")


def _absorbed(qn_BHTN: torch.Tensor, qr_BHTR: torch.Tensor, state: LatentState, end: int,
              mask: torch.Tensor | None, expand: LatentExpand, scale: float,
              visible: Visible | None = None) -> torch.Tensor:
    """New queries against the cached slots ``:end`` in the absorbed form
    (:class:`LatentAttention`), under ``mask`` or (CUDA) FlexAttention's ``visible``."""
    w_k_HNC, w_v_HVC = expand.heads(qn_BHTN.shape[1])
    q_lat_BHTC = torch.einsum("bhtn,hnc->bhtc", qn_BHTN, w_k_HNC)
    c_B1SC = state.c_BSC[:, None, :end]
    # one shared "kv head": keys [latent | RoPE key], values the latent
    k_B1SX = torch.cat([c_B1SC, state.kr_BSR[:, None, :end]], dim=-1)
    q_BHTX = torch.cat([q_lat_BHTC, qr_BHTR], dim=-1)
    if visible is not None:
        o_lat_BHTC = flex_attend(q_BHTX, k_B1SX, c_B1SC, scale, visible)
    else:
        o_lat_BHTC = F.scaled_dot_product_attention(q_BHTX, k_B1SX, c_B1SC, attn_mask=mask,
                                                    scale=scale, enable_gqa=True)
    return torch.einsum("bhtc,hvc->bhtv", o_lat_BHTC, w_v_HVC)


class MLA(nn.Module):
    """``layers.i.mixer.{q_proj | q_a_proj, q_a_norm, q_b_proj}``, ``kv_a_proj``,
    ``kv_a_norm``, ``kv_b_proj``, ``o_proj`` (no biases); the time mixing is ``core``
    (:class:`LatentAttention`), everything around it token-wise."""

    uses_doc_ids = True
    """``forward`` takes ``doc_ids`` (the residual layer passes them only to mixers that do)."""
    ops = ("core",)

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        m = cfg.mla
        assert m is not None
        self.n_heads, self.q_lora_rank, self.kv_lora_rank = m.n_heads, m.q_lora_rank, \
            m.kv_lora_rank
        self.d_nope, self.d_rope, self.d_v = m.d_head_nope, m.d_head_rope, m.d_head_v
        self.d_qk = self.d_nope + self.d_rope
        self.init_std = cfg.init_std
        d, h = cfg.d_model, m.n_heads
        if m.q_lora_rank is None:
            self.q_proj = Linear(d, h * self.d_qk, bias=False)
        else:
            self.q_a_proj = Linear(d, m.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(m.q_lora_rank, m.norm_eps)
            self.q_b_proj = Linear(m.q_lora_rank, h * self.d_qk, bias=False)
        self.kv_a_proj = Linear(d, m.kv_lora_rank + self.d_rope, bias=False)
        self.kv_a_norm = RMSNorm(m.kv_lora_rank, m.norm_eps)
        self.kv_b_proj = Linear(m.kv_lora_rank, h * (self.d_nope + self.d_v), bias=False)
        self.o_proj = Linear(h * self.d_v, d, bias=False)
        self.rotary = Rotary(*mla_rope(m)) if m.rope else None
        self.scale = mla_softmax_scale(m)
        self.core = LatentAttention(m.max_dense_len)

    def init_rules(self) -> dict[str, Init]:
        return {"*_proj.weight": Normal(self.init_std)}

    def lora_targets(self) -> dict[str, str]:
        """The projections LoRA may adapt (:mod:`composer.lora`). ``kv_b_proj``'s adapter acts
        through its forward (the training form); decoding's absorbed form reads its weight, so
        generate from a merged model (:func:`composer.lora.merge_lora`)."""
        q = ("q_proj",) if self.q_lora_rank is None else ("q_a_proj", "q_b_proj")
        return {name: name for name in (*q, "kv_a_proj", "kv_b_proj", "o_proj")}

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        init_module(self, generator)

    def forward(self, x_BTD: torch.Tensor, *, doc_ids: torch.Tensor | None = None,
                step: Step | None = None) -> torch.Tensor:
        """With ``step`` the new tokens continue from its latents (and leave theirs)."""
        b, t, _ = x_BTD.shape
        qn_BHTN, qr_BHTR, c_BTC, kr_BTR = self._project(x_BTD)
        expand = LatentExpand(self.kv_b_proj, self.d_nope, self.d_v)
        o_BHTV = self.core(qn_BHTN, qr_BHTR, c_BTC, kr_BTR, expand, self.rotary, self.scale,
                           doc_ids=doc_ids, step=step)
        return self.o_proj(o_BHTV.transpose(1, 2).reshape(b, t, -1))

    def _project(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The no-RoPE and RoPE parts of q ``[B, H, T, N | R]``, the normalised latent
        ``[B, T, C]`` and the shared RoPE key ``[B, T, R]`` (before RoPE)."""
        b, t, _ = x_BTD.shape
        if self.q_lora_rank is None:
            q = self.q_proj(x_BTD)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x_BTD)))
        # -1: the head count follows the weights (a tensor-parallel rank holds some of the heads)
        q_BHTQ = q.view(b, t, -1, self.d_qk).transpose(1, 2)
        qn_BHTN, qr_BHTR = q_BHTQ.split([self.d_nope, self.d_rope], dim=-1)
        c_BTC, kr_BTR = self.kv_a_proj(x_BTD).split([self.kv_lora_rank, self.d_rope], dim=-1)
        return qn_BHTN, qr_BHTR, self.kv_a_norm(c_BTC), kr_BTR

    def init_cache(self, batch: int, max_len: int, device: torch.device,
                   dtype: torch.dtype) -> LatentState:
        """The normalised latent and the RoPE key of ``max_len`` slots: ``C + R`` numbers per
        token for all heads (:mod:`composer.blocks.cache`)."""
        return LatentState(
            torch.zeros(batch, max_len, self.kv_lora_rank, device=device, dtype=dtype),
            torch.zeros(batch, max_len, self.d_rope, device=device, dtype=dtype))

    def parallel_plan(self) -> ParallelPlan:
        """Heads split over ``tp``: the query up-projection (or ``q_proj``) and ``kv_b_proj``
        column parallel (their rows are head-major), ``o_proj`` row parallel. The
        down-projections, the latent norms and the shared RoPE key are replicated: each rank
        back-propagates through its heads only, so their gradients are partial sums."""
        q = ("q_proj",) if self.q_lora_rank is None else ("q_b_proj",)
        return ParallelPlan(colwise=(*q, "kv_b_proj"), rowwise=("o_proj",),
                            partial=("q_a_proj.weight", "q_a_norm.weight", "kv_a_proj.weight",
                                     "kv_a_norm.weight"))

    @staticmethod
    def layout_rules(cfg: ModelConfig) -> list[Divisible]:
        assert cfg.mla is not None
        return [Divisible("mla.n_heads", cfg.mla.n_heads)]

    @staticmethod
    def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
        """Projections ``2 * weights`` plus scores ``2 * H * Q * seq_len`` and weighted sum
        ``2 * H * V * seq_len`` (full context, as ``attention.py`` counts it)."""
        m = cfg.mla
        assert m is not None
        d, h, q = cfg.d_model, m.n_heads, m.d_head_nope + m.d_head_rope
        proj_q = d * h * q if m.q_lora_rank is None else m.q_lora_rank * (d + h * q)
        proj = (proj_q + d * (m.kv_lora_rank + m.d_head_rope)
                + m.kv_lora_rank * h * (m.d_head_nope + m.d_head_v) + h * m.d_head_v * d)
        return 2 * proj + 2 * h * (q + m.d_head_v) * seq_len


    @staticmethod
    def activation_bytes_per_token(cfg: ModelConfig, seq_len: int, ac: str, size: int,
                                   tp: int = 1, cp: int = 1) -> float:
        """Saved for the backward per token on one of ``tp`` ranks (heads split over ``tp``;
        the down-projections, their norms and the shared RoPE key replicated). With ``Q = N +
        R`` (no-RoPE and RoPE head dims), ``V``, the latent width ``C`` and the query LoRA rank
        ``r``, ``ac`` none keeps: the projections' input ``d`` (gathered over the sequence
        under sequence parallel); with a query LoRA its output, the norm's ``1/rms``, scaled
        input and output (``3 r + 1``); the latent projection's output ``C + R``, its norm's
        ``1/rms``, scaled input and output (``+ 1 + 2 C``); the RoPE tables (``2 R`` per
        position, held by the mixer: see ``attention.py``); the per-head query and key after
        RoPE (``2 H Q``), ``kv_b_proj``'s output (``H (N + V)``: the values are a view of it)
        and ``o_proj``'s input (``H V``). The attention itself: where ``Q != V`` the CPU has no
        flash kernel and SDPA's math path keeps the ``T x T`` probabilities (``H T`` per
        token, causal rows full length); with ``Q == V`` (and on CUDA, whose efficient kernel
        takes ``Q != V``) the output and its log-sum-exp instead (``H V + H``). The norms and
        the math path compute in at least fp32: under bf16 they keep fp32 copies (of the
        norms' inputs, q, k, v) and fp32 probabilities, and not the bf16 tensors they read.

        ``selective`` keeps the matmul outputs: the query (LoRA ``r`` and ``H Q``, or ``H
        Q``), the latent ``C + R``, ``kv_b_proj``'s ``H (N + V)``, the attention (math path:
        the scores ``H T`` and the weighted sum ``H V``; flash: output and log-sum-exp) and
        ``o_proj``'s partial sum ``d``, with the tables. ``full``: the tables only.

        Under context parallelism (``cp > 1``, ``seq_len`` a rank's share; :class:`composer.
        parallel.context.attention.GatheredLatent`) the normalised latents and RoPE keys of the
        whole rows are gathered and expanded on every rank, and the CPU's unmasked path pads
        q, k and v to one head width ``W = max(Q, V)`` for the flash kernel: ``none`` keeps the
        gathered latent (``C cp``, ``kv_b_proj``'s input) in place of the local one, q (``H
        Q``), the whole rows' keys and values (``2 H W cp``), the output and log-sum-exp (``H W
        + H``) and ``o_proj``'s input; the tables are made per call (``none`` only).
        ``selective``: the projections (``kv_b_proj``'s over the whole rows, ``H (N + V)
        cp``), the flash blocks as for attention (``(H W + H) (4 cp - 1) / (2 cp)``) and
        ``o_proj``'s ``d``."""
        m = cfg.mla
        assert m is not None
        d, h, T = cfg.d_model, m.n_heads / tp, max(seq_len, 1)
        N, R, V, C, r = m.d_head_nope, m.d_head_rope, m.d_head_v, m.kv_lora_rank, m.q_lora_rank
        Q = N + R
        tables = 2 * R if m.rope else 0
        held = tables if cp == 1 else 0  # the Rotary's cached table; per call under cp
        if ac == "full":
            return size * held
        W = max(Q, V)
        if ac == "selective":
            query = h * Q + (r or 0)
            if cp > 1:
                blocks = (h * W + h) * (4 * cp - 1) / (2 * cp)
                return size * (query + C + R + h * (N + V) * cp + blocks + d)
            attend = h * T + h * V if Q != V else h * V + h  # math path / flash-style kernel
            return size * (held + query + C + R + h * (N + V) + attend + d)
        query = 3 * r + 1 if r is not None else 0
        if cp > 1:
            latent = C + R + 1 + C + C * cp
            core = h * Q + 2 * h * W * cp + h * W + h
            return size * (d + query + latent + tables + core + h * V)
        if Q != V:  # SDPA's math path on the CPU, and the norms, compute in >= fp32
            wide = max(size, 4)
            norm_q = wide * r + 4 + 2 * size * r if r is not None else 0
            norm_in = size * (C + R) if size >= 4 else wide * C  # kv_a's output, or a copy
            values = size * h * (N + V) if size >= 4 else wide * h * V  # kv_b's, or v's copy
            return (size * (d + tables + h * V) + norm_q + norm_in + 4 + 2 * size * C
                    + wide * (2 * h * Q + h * T) + values)
        latent = C + R + 1 + 2 * C
        return size * (d + query + latent + tables + 2 * h * Q + h * (N + V) + h * V + h * V
                       + h)

def mla_ref(x: torch.Tensor, w: dict[str, torch.Tensor], m: MLAConfig,
            doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-math twin of :class:`MLA`: per-head keys and values materialised from the latent,
    explicit pair rotations, explicit mask, a loop over heads. ``w`` is the block's state dict
    (``q_a_proj.weight``, ...)."""
    b, t, _ = x.shape
    n, r, v_dim, h = m.d_head_nope, m.d_head_rope, m.d_head_v, m.n_heads

    def rms(y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * y / torch.sqrt((y * y).mean(-1, keepdim=True) + m.norm_eps)

    if m.q_lora_rank is None:
        q = x @ w["q_proj.weight"].T
    else:
        q = rms(x @ w["q_a_proj.weight"].T, w["q_a_norm.weight"]) @ w["q_b_proj.weight"].T
    q = q.view(b, t, h, n + r)
    kv_a = x @ w["kv_a_proj.weight"].T
    c, k_rope = rms(kv_a[..., :m.kv_lora_rank], w["kv_a_norm.weight"]), kv_a[..., m.kv_lora_rank:]
    w_kv = w["kv_b_proj.weight"].view(h, n + v_dim, m.kv_lora_rank)
    pos = torch.arange(t).expand(b, t)
    mask = torch.full((t, t), float("-inf"), dtype=x.dtype).triu(1)
    if doc_ids is not None:
        first = torch.stack([torch.searchsorted(row, row, right=False) for row in doc_ids])
        pos = pos - first
        mask = mask.masked_fill(doc_ids[:, :, None] != doc_ids[:, None, :], float("-inf"))
    inv_freq, gain = mla_rope(m)

    def rotate(y: torch.Tensor) -> torch.Tensor:
        return _rotate_pairs(y, inv_freq.to(x.dtype), pos) * gain if m.rope else y

    k_rope = rotate(k_rope)
    heads = []
    for i in range(h):
        q_i = torch.cat([q[:, :, i, :n], rotate(q[:, :, i, n:])], -1)
        k_i = torch.cat([c @ w_kv[i, :n].T, k_rope], -1)
        v_i = c @ w_kv[i, n:].T
        scores = q_i @ k_i.transpose(1, 2) * mla_softmax_scale(m) + mask
        heads.append(torch.softmax(scores, -1) @ v_i)
    return torch.cat(heads, -1) @ w["o_proj.weight"].T


def _rotate_pairs(x: torch.Tensor, inv_freq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs ``(i, i + R/2)`` of ``x`` ``[B, T, R]`` by ``pos * inv_freq[i]``."""
    out = x.clone()
    half = inv_freq.shape[0]
    pos = pos.to(x.dtype)
    for i in range(half):
        ang = pos * inv_freq[i]
        a, b = x[..., i], x[..., i + half]
        out[..., i] = a * torch.cos(ang) - b * torch.sin(ang)
        out[..., i + half] = a * torch.sin(ang) + b * torch.cos(ang)
    return out


KIND = LayerKind("+", "multi-latent attention", MLA, "mla", MLAConfig, validate_mla,
                 default=default_mla)
"""``+``: multi-latent attention (its section exists when the pattern uses it, sized by
``d_model``)."""
