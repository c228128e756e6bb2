"""Causal self-attention: MHA / GQA / MQA, RoPE or no position embedding, optional qk-norm.

Vaswani et al. 2017 §3.2: ``softmax(q k^T * scale + causal_mask) v`` per head, with key/value heads
shared by ``n_heads / n_kv_heads`` query heads (GQA, Ainslie et al. 2023). RoPE (Su et al. 2021)
in the rotate-half layout that transformers and Megatron use: channel ``i`` pairs with
``i + d_rot/2``; only the first ``rotary_fraction * d_head`` channels rotate. Llama-3 frequency
scaling divides low frequencies by ``factor`` and blends the middle band. qk-norm is an RMSNorm
applied before RoPE, over each head's channels (``qk_norm_scope: head``, Qwen3, GLM-4.5) or over
the whole q / k projection at once (``all``, MiniMax-M2: one RMS across every head, a weight per
channel of every head).

Output gate (``output_gate``, Qwen3-Next / Qwen3.5 "gated attention", Qiu et al. 2025): ``q_proj``
emits ``2 * d_head`` rows per head, ``[q_h; g_h]`` (transformers' layout, so conversion copies the
rows as they are), and the attention output is multiplied by ``sigmoid(g)`` channel by channel
before ``o_proj``. With ``ModelConfig.norm_zero_centered`` the qk-norms scale by ``1 + w``.

Packed documents (``doc_ids``, :mod:`composer.kernels.packing`; Megatron's reset-attention-mask and
reset-position-ids): the mask is block-diagonal causal (a query sees the earlier keys of its own
document) and RoPE positions restart at 0 at each document.

The time mixing is one parameterless op, ``core`` (:class:`CausalAttention`: RoPE, SDPA, the
decoding cache); the projections, qk-norms and gate around it are token-wise. Context
parallelism swaps ``core`` for its ``kv_gather`` variant (``composer/parallel/context``).

Legend: B batch, T time, D model width, H query heads, K kv heads, E head width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from composer.blocks.cache import KVState, Step, StepContext, attention_mask
from composer.blocks.kind import LayerKind
from composer.blocks.mrope import mrope_cos_sin, mrope_rows
from composer.blocks.norm import RMSNorm
from composer.blocks.plan import (
    ZEROS,
    DivideEachOther,
    Divisible,
    Init,
    Normal,
    ParallelPlan,
    init_module,
)
from composer.blocks.protocol import TimeMixingOp
from composer.config import ConfigError, ModelConfig, positive
from composer.kernels import sdpa_context
from composer.kernels.packing import doc_positions
from composer.kernels.sdpa import doc_sdpa

# ---------------------------------------------------------------- the kind's config section


@dataclass
class RopeScaling:
    """Llama-3 style frequency scaling of RoPE (``rope_type: llama3`` in transformers)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass
class AttentionConfig:
    n_heads: int = 4
    n_kv_heads: int | None = None
    """Key/value heads (GQA); ``None`` means ``n_heads`` (MHA), 1 is MQA."""
    d_head: int | None = None
    """Per-head width; ``None`` means ``d_model // n_heads``."""
    position: Literal["rope", "none"] = "rope"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rotary_fraction: float = 1.0
    """Fraction of each head's channels that RoPE rotates (Bamba uses 0.5)."""
    qk_norm: bool = False
    qk_norm_scope: Literal["head", "all"] = "head"
    """What the qk-norm RMS runs over: each head's channels (Qwen3, GLM-4.5) or the whole q / k
    projection, all heads at once (MiniMax-M2; its weight is ``n_heads * d_head`` wide)."""
    qkv_bias: bool = False
    out_bias: bool = False
    softmax_scale: float | None = None
    """Score scale; ``None`` means ``1/sqrt(d_head)``."""
    output_gate: bool = False
    """A sigmoid gate on the attention output before ``o_proj`` (Qwen3-Next, Qwen3.5): ``q_proj``
    is twice as wide, per head ``[q_h; g_h]``, and ``o = o * sigmoid(g)`` channel by channel."""
    mrope_section: list[int] | None = None
    """M-RoPE (vision-language models, :mod:`composer.blocks.mrope`): how many of the
    ``d_rot / 2`` rotary frequencies read each position row ``[t, h, w]`` (Qwen3.5:
    ``[11, 11, 10]`` with ``rotary_fraction`` 0.25 of 256-wide heads); None: 1-D RoPE. Text-only
    input (three equal rows) gives exactly the 1-D tables."""
    mrope_interleaved: bool = True
    """Qwen3.5's interleaved sections (frequency ``i`` reads row ``i % 3`` within the sections);
    False: Qwen2-VL's contiguous blocks."""


def validate_attention(a: AttentionConfig, cfg: ModelConfig) -> None:
    d_model = cfg.d_model
    positive(a, "attention.", ("n_heads", "n_kv_heads", "d_head", "rope_theta", "softmax_scale"))
    kv = a.n_kv_heads or a.n_heads
    if a.n_heads % kv:
        raise ConfigError(f"attention.n_heads ({a.n_heads}) must be divisible by "
                          f"attention.n_kv_heads ({kv})")
    if a.d_head is None and d_model % a.n_heads:
        raise ConfigError(f"d_model ({d_model}) must be divisible by attention.n_heads "
                          f"({a.n_heads}) unless attention.d_head is set")
    d_head = a.d_head or d_model // a.n_heads
    rotary = int(d_head * a.rotary_fraction)
    if not 0.0 < a.rotary_fraction <= 1.0 or rotary % 2:
        raise ConfigError(f"attention.rotary_fraction ({a.rotary_fraction}) must be in (0, 1] "
                          f"and rotate an even number of the {d_head} head channels")
    if a.mrope_section is not None:
        if a.position != "rope":
            raise ConfigError("attention.mrope_section needs attention.position 'rope'")
        try:
            mrope_rows(rotary // 2, a.mrope_section, a.mrope_interleaved)
        except ValueError as exc:
            raise ConfigError(f"attention.{exc}") from None


def d_head_of(cfg: ModelConfig) -> int:
    a = cfg.attention
    assert a is not None
    return a.d_head or cfg.d_model // a.n_heads


def rope_frequencies(d_rot: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies ``theta^(-2i/d_rot)``, with Llama-3 scaling when given (fp64)."""
    # an explicit CPU device: the model may be built under a meta-device context
    inv_freq = 1.0 / theta ** (torch.arange(0, d_rot, 2, dtype=torch.float64, device="cpu") / d_rot)
    if scaling is None:
        return inv_freq
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(middle, blended, out)


def rope_cos_sin(t: int, inv_freq: torch.Tensor, device: torch.device,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` tables ``[T, d_rot]`` in at least fp32 math, cast to ``dtype``."""
    math_dtype = torch.promote_types(dtype, torch.float32)
    pos = torch.arange(t, device=device, dtype=math_dtype)
    angles = torch.outer(pos, inv_freq.to(device=device, dtype=math_dtype))
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_cos_sin_at(pos_BT: torch.Tensor, inv_freq: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope_cos_sin` at per-row positions: ``[B, 1, T, d_rot]`` tables (one per row,
    shared by the heads) for integer positions ``pos_BT``; the same products as there."""
    math_dtype = torch.promote_types(dtype, torch.float32)
    angles = pos_BT.to(math_dtype)[..., None] * inv_freq.to(pos_BT.device, math_dtype)
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x_BHTE: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d_rot = cos.shape[-1]
    half = d_rot // 2
    if d_rot == x_BHTE.shape[-1]:  # the whole head rotates: no slicing, one concat
        return x_BHTE * cos + torch.cat([-x_BHTE[..., half:], x_BHTE[..., :half]], -1) * sin
    rot, rest = x_BHTE[..., :d_rot], x_BHTE[..., d_rot:]
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


class Rotary:
    """One mixer's RoPE: inverse frequencies ``inv_freq`` (fp64, on the CPU) and the gain of the
    cos/sin tables (YaRN's attention factor for multi-latent attention; 1 otherwise). Holds no
    parameters: the table of the last length is kept while the length, device and dtype
    repeat (a training run asks for one length)."""

    def __init__(self, inv_freq: torch.Tensor, gain: float = 1.0,
                 mrope_section: list[int] | None = None, mrope_interleaved: bool = True) -> None:
        self.inv_freq, self.gain = inv_freq, gain
        self._table: tuple | None = None
        self.mrope_section, self.mrope_interleaved = mrope_section, mrope_interleaved

    def mrope(self, pos_3BT: torch.Tensor, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """M-RoPE tables at the three position rows ``pos_3BT`` (``mrope_section`` set)."""
        assert self.mrope_section is not None
        cos, sin = mrope_cos_sin(pos_3BT, self.inv_freq, self.mrope_section,
                                 interleaved=self.mrope_interleaved, dtype=dtype)
        return self._gain(cos), self._gain(sin)

    def table(self, t: int, device: torch.device,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``/``sin`` ``[T, d_rot]`` at positions ``0 .. t - 1``."""
        key = (t, device, dtype)
        if self._table is None or self._table[0] != key:
            cos, sin = rope_cos_sin(t, self.inv_freq, device, dtype)
            self._table = (key, self._gain(cos), self._gain(sin))
        return self._table[1], self._table[2]

    def at(self, pos_BT: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``/``sin`` ``[B, 1, T, d_rot]`` at per-row integer positions ``pos_BT``."""
        cos, sin = rope_cos_sin_at(pos_BT, self.inv_freq, dtype)
        return self._gain(cos), self._gain(sin)

    def for_call(self, like: torch.Tensor, doc_ids: torch.Tensor | None,
                 step: Step | None, positions: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables of one call on ``like`` ``[B, H, T, E]``: the decoding step's positions,
        or the M-RoPE rows ``positions`` ``[3, B, T]`` of a forward with images, or positions
        restarting at each document, or ``0 .. T - 1``."""
        if step is not None:
            pos_3BT = step.ctx.pos_3BT
            if pos_3BT is not None and self.mrope_section is not None:
                return self.mrope(pos_3BT, like.dtype)
            return self.at(step.ctx.pos_BT, like.dtype)
        if positions is not None and self.mrope_section is not None:
            return self.mrope(positions, like.dtype)
        if doc_ids is not None:
            return self.at(doc_positions(doc_ids), like.dtype)
        return self.table(like.shape[2], like.device, like.dtype)

    def _gain(self, table: torch.Tensor) -> torch.Tensor:
        return table * self.gain if self.gain != 1.0 else table


class CausalAttention(TimeMixingOp):
    """The time mixing of :class:`Attention`: RoPE, then causal (or block-diagonal, by
    ``doc_ids``) SDPA; with a decoding ``step`` the new keys and values go into its
    :class:`~composer.blocks.cache.KVState` and the queries attend to every real slot so far.
    Context parallelism replaces it by ``kv_gather`` (:mod:`composer.parallel.context.
    attention`)."""

    context = "kv_gather"

    def forward(self, q_BHTE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor,
                rotary: Rotary | None, scale: float, *, doc_ids: torch.Tensor | None = None,
                step: Step | None = None, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``o [B, H, T, E]`` from q ``[B, H, T, E]``, k and v ``[B, K, T, E]`` before RoPE
        (``positions``: M-RoPE rows, :meth:`Rotary.for_call`)."""
        if rotary is not None:
            cos, sin = rotary.for_call(q_BHTE, doc_ids, step, positions)
            q_BHTE, k_BKTE = apply_rope(q_BHTE, cos, sin), apply_rope(k_BKTE, cos, sin)
        if step is not None:
            return _cached_attention(q_BHTE, k_BKTE, v_BKTE, step.state, step.ctx, scale)
        if doc_ids is not None:  # block-diagonal causal: each document attends to itself only
            return doc_sdpa(q_BHTE, k_BKTE, v_BKTE, doc_ids, scale)
        with sdpa_context(q_BHTE):  # flash first on CUDA; CPU untouched (kernels.sdpa)
            return F.scaled_dot_product_attention(
                q_BHTE, k_BKTE, v_BKTE, is_causal=True, scale=scale,
                enable_gqa=q_BHTE.shape[1] != k_BKTE.shape[1])


def _cached_attention(q_BHTE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor,
                      state: KVState, ctx: StepContext, scale: float) -> torch.Tensor:
    """The new keys and values (after RoPE) written into slots ``ctx.start : ctx.end``, the
    new queries attending to every real slot so far."""
    state.k_BKSE[:, :, ctx.start:ctx.end] = k_BKTE
    state.v_BKSE[:, :, ctx.start:ctx.end] = v_BKTE
    k_BKSE, v_BKSE = state.k_BKSE[:, :, :ctx.end], state.v_BKSE[:, :, :ctx.end]
    mask = attention_mask(ctx)
    with sdpa_context(q_BHTE):
        return F.scaled_dot_product_attention(
            q_BHTE, k_BKSE, v_BKSE, attn_mask=mask, is_causal=mask is None and ctx.start == 0,
            scale=scale, enable_gqa=q_BHTE.shape[1] != k_BKSE.shape[1])


class Attention(nn.Module):
    """``layers.i.mixer.{q_proj,k_proj,v_proj,o_proj}`` (+ ``q_norm``, ``k_norm``); the time
    mixing is ``core`` (:class:`CausalAttention`), everything around it token-wise."""

    uses_doc_ids = True
    uses_positions = True
    """``forward`` takes ``doc_ids`` (the residual layer passes them only to mixers that do)."""
    ops = ("core",)

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0, d_in: int | None = None) -> None:
        """``d_in``: the projections' input width when not ``d_model`` (Zamba2's shared block
        attends over ``[h; embeddings]``, ``2 * d_model``); ``o_proj`` gives ``d_model``."""
        super().__init__()
        a = cfg.attention
        assert a is not None
        d_in = d_in or cfg.d_model
        self.layer_idx = layer_idx
        self.n_heads = a.n_heads
        self.n_kv_heads = a.n_kv_heads or a.n_heads
        self.d_head = d_head_of(cfg)
        self.scale = a.softmax_scale if a.softmax_scale is not None else self.d_head**-0.5
        self.init_std = cfg.init_std
        self.output_gate = a.output_gate
        q_rows = self.n_heads * self.d_head * (2 if a.output_gate else 1)
        self.q_proj = nn.Linear(d_in, q_rows, bias=a.qkv_bias)
        self.k_proj = nn.Linear(d_in, self.n_kv_heads * self.d_head, bias=a.qkv_bias)
        self.v_proj = nn.Linear(d_in, self.n_kv_heads * self.d_head, bias=a.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.d_head, cfg.d_model, bias=a.out_bias)
        self.qk_norm = a.qk_norm
        self.qk_norm_all = a.qk_norm and a.qk_norm_scope == "all"
        if a.qk_norm:
            q_width, k_width = ((self.n_heads * self.d_head, self.n_kv_heads * self.d_head)
                                if self.qk_norm_all else (self.d_head, self.d_head))
            self.q_norm = RMSNorm(q_width, cfg.norm_eps, cfg.norm_zero_centered)
            self.k_norm = RMSNorm(k_width, cfg.norm_eps, cfg.norm_zero_centered)
        self.rotary: Rotary | None = None
        if a.position == "rope":
            d_rot = int(self.d_head * a.rotary_fraction)
            self.rotary = Rotary(rope_frequencies(d_rot, a.rope_theta, a.rope_scaling),
                                 mrope_section=a.mrope_section,
                                 mrope_interleaved=a.mrope_interleaved)
        self.core = CausalAttention()

    def init_rules(self) -> dict[str, Init]:
        return {"*_proj.weight": Normal(self.init_std), "*_proj.bias": ZEROS}

    def lora_targets(self) -> dict[str, str]:
        """The projections LoRA may adapt (:mod:`composer.lora`): transformers' names."""
        return {name: name for name in ("q_proj", "k_proj", "v_proj", "o_proj")}

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        init_module(self, generator)

    def forward(self, x_BTD: torch.Tensor, *, doc_ids: torch.Tensor | None = None,
                step: Step | None = None, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        """With ``step`` the new tokens continue from its keys and values (and leave theirs);
        ``positions``: the M-RoPE rows ``[3, B, T]`` of a forward with images."""
        q_BHTE, k_BKTE, v_BKTE, gate_BTX = self._project(x_BTD)
        o_BHTE = self.core(q_BHTE, k_BKTE, v_BKTE, self.rotary, self.scale, doc_ids=doc_ids,
                           step=step, positions=positions)
        return self._output(o_BHTE, gate_BTX)

    def _project(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                     torch.Tensor | None]:
        """``q [B, H, T, E]``, ``k``, ``v [B, K, T, E]`` (qk-normed, before RoPE) and the output
        gate ``[B, T, H * E]`` (or None)."""
        b, t, _ = x_BTD.shape
        # -1: the head counts follow the weights (a tensor-parallel rank holds some of the heads)
        q, k = self.q_proj(x_BTD), self.k_proj(x_BTD)
        gate_BTX = None
        if self.output_gate:  # per head [q_h; g_h]
            qg = q.view(b, t, -1, 2 * self.d_head)
            q, gate_BTX = qg[..., :self.d_head].reshape(b, t, -1), qg[..., self.d_head:]
            gate_BTX = gate_BTX.reshape(b, t, -1)
        if self.qk_norm_all:  # one RMS over every head's channels
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(b, t, -1, self.d_head), k.view(b, t, -1, self.d_head)
        v = self.v_proj(x_BTD).view(b, t, -1, self.d_head)
        if self.qk_norm and not self.qk_norm_all:
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), gate_BTX

    def _output(self, o_BHTE: torch.Tensor, gate_BTX: torch.Tensor | None) -> torch.Tensor:
        b, _, t, _ = o_BHTE.shape
        o_BTX = o_BHTE.transpose(1, 2).reshape(b, t, -1)
        if gate_BTX is not None:
            o_BTX = o_BTX * torch.sigmoid(gate_BTX)
        return self.o_proj(o_BTX)

    def init_cache(self, batch: int, max_len: int, device: torch.device,
                   dtype: torch.dtype) -> KVState:
        """Preallocated keys and values for ``max_len`` slots (:mod:`composer.blocks.cache`)."""
        kv = self.k_proj.weight.shape[0] // self.d_head
        shape = (batch, kv, max_len, self.d_head)
        return KVState(torch.zeros(shape, device=device, dtype=dtype),
                       torch.zeros(shape, device=device, dtype=dtype))

    def parallel_plan(self) -> ParallelPlan:
        """Heads split over ``tp``: q/k/v column parallel (k/v replicated, each rank keeping its
        head, when there are fewer kv heads than ranks), o row parallel; the qk-norms replicated
        with partial gradients."""
        # with the output gate a head is 2 * d_head contiguous q rows: an even split keeps heads
        return ParallelPlan(colwise=("q_proj",), heads={"k_proj": self.n_kv_heads,
                                                        "v_proj": self.n_kv_heads},
                            rowwise=("o_proj",), partial=("q_norm.weight", "k_norm.weight"))

    @staticmethod
    def layout_rules(cfg: ModelConfig) -> list[Divisible | DivideEachOther | Unsplit]:
        a = cfg.attention
        assert a is not None
        rules: list[Divisible | DivideEachOther | Unsplit] = [
            Divisible("attention.n_heads", a.n_heads),
            DivideEachOther("attention.n_kv_heads", a.n_kv_heads or a.n_heads,
                            "kv heads are split, or replicated when fewer than tp")]
        if a.qk_norm and a.qk_norm_scope == "all":
            # Split heads would each normalise over their own shard: the RMS needs a sum over
            # the tp ranks, which this block (single-device) does not declare yet.
            rules.append(Unsplit("attention.qk_norm_scope='all' (one RMS over all heads)"))
        return rules

    @staticmethod
    def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
        """Projections ``2 * weights`` plus scores and weighted sum ``2 * 2 * H * E * seq_len``
        (full, non-causal-discounted context, as Megatron and PaLM count it)."""
        a = cfg.attention
        assert a is not None
        e, kv = d_head_of(cfg), a.n_kv_heads or a.n_heads
        proj = cfg.d_model * e * ((3 if a.output_gate else 2) * a.n_heads + 2 * kv)
        return 2 * proj + 4 * a.n_heads * e * seq_len


@dataclass(frozen=True)
class Unsplit:
    """A layout rule: the block cannot be split over mesh dimension ``dim`` at all."""

    what: str
    dim: str = "tp"

    def problem(self, sizes: dict[str, int]) -> str | None:
        size = sizes[self.dim]
        return f"{self.what} cannot be split over {self.dim} ({size}); use {self.dim}=1" \
            if size > 1 else None


def attention_ref(x: torch.Tensor, w: dict[str, torch.Tensor], a: AttentionConfig, d_head: int,
                  eps: float = 1e-5, doc_ids: torch.Tensor | None = None,
                  zero_centered: bool = False) -> torch.Tensor:
    """Plain-math twin of :class:`Attention`: explicit pair rotations, explicit mask, loops over
    heads. ``w`` holds ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` matrices (and optional
    ``*_bias``, ``q_norm``, ``k_norm``). With ``doc_ids`` (non-decreasing) positions count from
    each document's first token and keys of other documents are masked. With ``output_gate``
    ``q_proj`` holds rows ``[q_h; g_h]`` per head; ``zero_centered`` qk-norms scale by ``1 + w``."""
    b, t, _ = x.shape
    kv = a.n_kv_heads or a.n_heads
    q = x @ w["q_proj"].T + w.get("q_bias", 0)
    gates = []
    if a.output_gate:
        rows = [q[..., h * 2 * d_head:(2 * h + 1) * d_head] for h in range(a.n_heads)]
        gates = [q[..., (2 * h + 1) * d_head:(2 * h + 2) * d_head] for h in range(a.n_heads)]
        q = torch.cat(rows, -1)
    w = dict(w)
    for n in ("q_norm", "k_norm"):
        if n in w and zero_centered:
            w[n] = 1 + w[n]
    k = x @ w["k_proj"].T + w.get("k_bias", 0)
    v = (x @ w["v_proj"].T + w.get("v_bias", 0)).view(b, t, kv, d_head)
    whole = a.qk_norm_scope == "all"
    if "q_norm" in w and whole:  # the RMS of the whole projection (all heads)
        q = w["q_norm"] * q / torch.sqrt((q * q).sum(-1, keepdim=True) / q.shape[-1] + eps)
        k = w["k_norm"] * k / torch.sqrt((k * k).sum(-1, keepdim=True) / k.shape[-1] + eps)
    q, k = q.view(b, t, a.n_heads, d_head), k.view(b, t, kv, d_head)
    if "q_norm" in w and not whole:
        q = w["q_norm"] * q / torch.sqrt((q * q).mean(-1, keepdim=True) + eps)
        k = w["k_norm"] * k / torch.sqrt((k * k).mean(-1, keepdim=True) + eps)
    pos = torch.arange(t).expand(b, t)
    mask = torch.full((t, t), float("-inf"), dtype=x.dtype).triu(1)
    if doc_ids is not None:
        first = torch.stack([torch.searchsorted(row, row, right=False) for row in doc_ids])
        pos = pos - first  # searchsorted: the index of the first token with the same id
        mask = mask.masked_fill(doc_ids[:, :, None] != doc_ids[:, None, :], float("-inf"))
    if a.position == "rope":
        d_rot = int(d_head * a.rotary_fraction)
        inv_freq = rope_frequencies(d_rot, a.rope_theta, a.rope_scaling).to(x.dtype)
        q, k = _rotate_pairs(q, inv_freq, pos), _rotate_pairs(k, inv_freq, pos)
    scale = a.softmax_scale if a.softmax_scale is not None else d_head**-0.5
    heads = []
    for h in range(a.n_heads):
        g = h // (a.n_heads // kv)
        scores = q[:, :, h] @ k[:, :, g].transpose(1, 2) * scale + mask
        o = torch.softmax(scores, -1) @ v[:, :, g]
        heads.append(o / (1 + torch.exp(-gates[h])) if gates else o)
    return torch.cat(heads, -1) @ w["o_proj"].T + w.get("o_bias", 0)


def _rotate_pairs(x: torch.Tensor, inv_freq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs ``(i, i + d_rot/2)`` by angle ``pos * inv_freq[i]``, one at a time
    (``pos`` ``[B, T]``)."""
    out = x.clone()
    half = inv_freq.shape[0]
    pos = pos.to(x.dtype)[..., None]
    for i in range(half):
        ang = pos * inv_freq[i]
        a, b = x[..., i], x[..., i + half]
        out[..., i] = a * torch.cos(ang) - b * torch.sin(ang)
        out[..., i + half] = a * torch.sin(ang) + b * torch.cos(ang)
    return out


KIND = LayerKind("*", "attention", Attention, "attention", AttentionConfig, validate_attention,
                 always=True)
"""``*``: causal self-attention (its section is present by default)."""
