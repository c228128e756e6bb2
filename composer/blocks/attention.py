"""Causal self-attention: MHA / GQA / MQA, RoPE or no position embedding, optional qk-norm.

Vaswani et al. 2017 §3.2: ``softmax(q k^T * scale + causal_mask) v`` per head, with key/value heads
shared by ``n_heads / n_kv_heads`` query heads (GQA, Ainslie et al. 2023). RoPE
(:mod:`composer.blocks.rope`: rotate-half layout, ``linear`` / ``llama3`` / ``yarn`` scaling)
rotates the first ``rotary_fraction * d_head`` channels of each head. qk-norm is an RMSNorm
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

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from composer.blocks.attn_core import CausalAttention
from composer.blocks.cache import KVState, Step
from composer.blocks.kind import LayerKind
from composer.blocks.mrope import mrope_rows
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
from composer.blocks.rope import (  # noqa: F401  (re-exported: the rotary code lived here)
    RopeScaling,
    Rotary,
    apply_rope,
    rope_cos_sin,
    rope_cos_sin_at,
    rope_frequencies,
    rope_gain,
    rotate_pairs_ref,
)
from composer.config import ConfigError, ModelConfig, positive
from composer.kernels.linear import Linear

# ---------------------------------------------------------------- the kind's config section


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
    key_multiplier: float = 1.0
    """Scales the keys after ``k_proj`` (Falcon-H1's µP ``key_multiplier``, kept as config)."""
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
    window: int | None = None
    """The sliding window of the ``W`` layers (transformers' ``sliding_window``): a query sees
    itself and the ``window - 1`` tokens before it. ``*`` layers ignore it."""
    window_rope_theta: float | None = None
    """The RoPE base of the ``W`` layers, which then rotate without ``rope_scaling`` (Gemma 3's
    ``rope_local_base_freq``); None: the same RoPE as the ``*`` layers (gpt-oss)."""
    sinks: bool = False
    """A learned sink logit per query head (``mixer.sinks`` ``[n_heads]``, gpt-oss) joins every
    softmax denominator (:mod:`composer.blocks.attn_core`); ``*`` and ``W`` layers alike."""


def validate_attention(a: AttentionConfig, cfg: ModelConfig) -> None:
    d_model = cfg.d_model
    positive(a, "attention.", ("n_heads", "n_kv_heads", "d_head", "rope_theta", "softmax_scale",
                               "window", "window_rope_theta", "key_multiplier"))
    if "W" in cfg.parsed.symbols_used() and a.window is None:
        raise ConfigError("pattern symbol 'W' (sliding-window attention) needs attention.window")
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
    if a.rope_scaling is not None:
        positive(a.rope_scaling, "attention.rope_scaling.", (
            "factor", "original_max_position", "beta_fast", "beta_slow", "attention_factor"))
    if a.mrope_section is not None:
        if a.position != "rope":
            raise ConfigError("attention.mrope_section needs attention.position 'rope'")
        try:
            mrope_rows(rotary // 2, a.mrope_section, a.mrope_interleaved)
        except ValueError as exc:
            raise ConfigError(f"attention.{exc}") from None


def rope_of(a: AttentionConfig, windowed: bool) -> tuple[float, RopeScaling | None]:
    """The RoPE base and scaling of a ``*`` layer, or of a ``W`` one (``window_rope_theta``
    unscaled, when set)."""
    if windowed and a.window_rope_theta is not None:
        return a.window_rope_theta, None
    return a.rope_theta, a.rope_scaling


def d_head_of(cfg: ModelConfig) -> int:
    a = cfg.attention
    assert a is not None
    return a.d_head or cfg.d_model // a.n_heads


class Attention(nn.Module):
    """``layers.i.mixer.{q_proj,k_proj,v_proj,o_proj}`` (+ ``q_norm``, ``k_norm``); the time
    mixing is ``core`` (:class:`CausalAttention`), everything around it token-wise."""

    uses_doc_ids = True
    uses_positions = True
    """``forward`` takes ``doc_ids`` (the residual layer passes them only to mixers that do)."""
    ops = ("core",)
    windowed = False
    """A ``W`` layer (:class:`WindowedAttention`): ``attention.window`` and its RoPE."""

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
        self.key_multiplier = float(a.key_multiplier)
        q_rows = self.n_heads * self.d_head * (2 if a.output_gate else 1)
        self.q_proj = Linear(d_in, q_rows, bias=a.qkv_bias)
        self.k_proj = Linear(d_in, self.n_kv_heads * self.d_head, bias=a.qkv_bias)
        self.v_proj = Linear(d_in, self.n_kv_heads * self.d_head, bias=a.qkv_bias)
        self.o_proj = Linear(self.n_heads * self.d_head, cfg.d_model, bias=a.out_bias)
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
            theta, scaling = rope_of(a, self.windowed)
            self.rotary = Rotary(rope_frequencies(d_rot, theta, scaling), rope_gain(scaling),
                                 mrope_section=a.mrope_section,
                                 mrope_interleaved=a.mrope_interleaved)
        if a.sinks:
            self.sinks = nn.Parameter(torch.empty(self.n_heads))
        self.window = a.window if self.windowed else None
        self.core = CausalAttention(self.window)

    def init_rules(self) -> dict[str, Init]:
        return {"*_proj.weight": Normal(self.init_std), "*_proj.bias": ZEROS,
                "sinks": Normal(self.init_std)}

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
                           step=step, positions=positions, sinks=getattr(self, "sinks", None))
        return self._output(o_BHTE, gate_BTX)

    def _project(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                     torch.Tensor | None]:
        """``q [B, H, T, E]``, ``k``, ``v [B, K, T, E]`` (qk-normed, before RoPE) and the output
        gate ``[B, T, H * E]`` (or None)."""
        b, t, _ = x_BTD.shape
        # -1: the head counts follow the weights (a tensor-parallel rank holds some of the heads)
        q, k = self.q_proj(x_BTD), self.k_proj(x_BTD)
        if self.key_multiplier != 1.0:
            k = k * self.key_multiplier
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
        """Preallocated keys and values for ``max_len`` slots, or a ring of ``min(window,
        max_len)`` for a windowed layer (:mod:`composer.blocks.cache`)."""
        kv = self.k_proj.weight.shape[0] // self.d_head
        slots = max_len if self.window is None else min(self.window, max_len)
        shape = (batch, kv, slots, self.d_head)
        return KVState(torch.zeros(shape, device=device, dtype=dtype),
                       torch.zeros(shape, device=device, dtype=dtype))

    def parallel_plan(self) -> ParallelPlan:
        """Heads split over ``tp``: q/k/v column parallel (k/v replicated, each rank keeping its
        head, when there are fewer kv heads than ranks), o row parallel; the qk-norms replicated
        with partial gradients; the sinks split with their query heads."""
        # with the output gate a head is 2 * d_head contiguous q rows: an even split keeps heads
        return ParallelPlan(colwise=("q_proj",), heads={"k_proj": self.n_kv_heads,
                                                        "v_proj": self.n_kv_heads},
                            rowwise=("o_proj",), partial=("q_norm.weight", "k_norm.weight"),
                            shard={"sinks": 0})

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

    @staticmethod
    def activation_bytes_per_token(cfg: ModelConfig, seq_len: int, ac: str, size: int,
                                   tp: int = 1, cp: int = 1) -> float:
        """Saved for the backward per token on one of ``tp`` ranks (heads split over ``tp``),
        with a flash-style kernel (no ``T x T`` scores: the CPU's flash kernel and CUDA's keep
        the same): the projections' input (``d``, gathered over the sequence under sequence
        parallel), q, k and v after rope, the attention output and its log-sum-exp per head; a
        per-head qk-norm keeps each norm's input (in at least fp32), its scaled input and
        ``1/rms`` (fp32). The rope
        tables ``cos``/``sin`` (``2 E`` per position, whole on every rank) are held by the
        mixer's :class:`~composer.blocks.rope.Rotary` for the run's length (per position, so
        per token at micro-batch 1; with document isolation they are per token, made and saved
        each call) and so count under every ``ac``. ``selective`` keeps the matmul and
        attention outputs (q, k, v, output, log-sum-exp, and the output projection's partial
        sum ``d``). ``full``: the tables only. Variants (output gates, sinks, partial rope) are
        not counted.

        Under context parallelism (``cp > 1``; ``seq_len`` is a rank's share, its two chunks of
        the 2N-chunk layout, :mod:`composer.parallel.context.attention`) the keys and values of
        the whole rows are gathered and kept: ``2 kv E cp`` per token, not divided by ``cp``
        (on the CPU's unmasked path repeated to the query heads first, ``2 H E cp``, and each
        chunk's output kept besides the merged one, ``+ H E``); the tables are made per call at
        the tokens' global positions (counted in ``none`` only: recomputed when checkpointed).
        ``selective`` then keeps the projections, each flash block's output and log-sum-exp
        (a chunk ``c`` attends in one block when it is the first, two otherwise: ``(4 cp - 1)
        / (2 cp)`` blocks per token on average over the ranks; the first rank has fewer) and
        ``o_proj``'s partial sum; the gathered keys are gathered again in the backward."""
        a = cfg.attention
        assert a is not None
        e, kv = d_head_of(cfg), a.n_kv_heads or a.n_heads
        h, kv = a.n_heads / tp, max(kv / tp, 1)  # fewer kv heads than ranks: one each
        tables = 0 if a.position == "none" else 2 * e
        held = tables if cp == 1 else 0  # the Rotary's cached table; per call under cp
        if ac == "full":
            return size * held
        qkv = (h + 2 * kv) * e
        core = qkv + h * e + h  # q, k, v; output; log-sum-exp
        if ac == "selective":
            if cp > 1:
                return size * (qkv + (h * e + h) * (4 * cp - 1) / (2 * cp) + cfg.d_model)
            return size * (core + cfg.d_model + held)
        # a qk-norm per head: its input's copy in >= fp32, 1/rms (fp32), the scaled input
        norms = (h + kv) * (max(size, 4) * e + 4 + size * e) if a.qk_norm else 0
        if cp > 1:
            gathered = 2 * (h if kv < h else kv) * e * cp
            core = h * e + gathered + 2 * h * e + h  # q; k, v whole; chunk and merged outputs
        return size * (cfg.d_model + core + tables) + norms


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
                  zero_centered: bool = False, windowed: bool = False) -> torch.Tensor:
    """Plain-math twin of :class:`Attention`: explicit pair rotations, explicit mask, loops over
    heads. ``w`` holds ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` matrices (and optional
    ``*_bias``, ``q_norm``, ``k_norm``). With ``doc_ids`` (non-decreasing) positions count from
    each document's first token and keys of other documents are masked. With ``output_gate``
    ``q_proj`` holds rows ``[q_h; g_h]`` per head; ``zero_centered`` qk-norms scale by ``1 + w``.
    ``windowed``: a ``W`` layer (keys ``window`` or more tokens back masked, its RoPE); ``w``'s
    ``sinks`` (``[H]``): each head's softmax has an extra logit, dropped from the output."""
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
    k = (x @ w["k_proj"].T + w.get("k_bias", 0)) * a.key_multiplier
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
    if windowed:
        mask = mask + torch.full((t, t), float("-inf"), dtype=x.dtype).tril(-a.window)
    if a.position == "rope":
        d_rot = int(d_head * a.rotary_fraction)
        theta, scaling = rope_of(a, windowed)
        inv_freq = rope_frequencies(d_rot, theta, scaling).to(x.dtype)
        gain = rope_gain(scaling)  # YaRN scales cos and sin, so both rotated vectors
        q, k = gain * rotate_pairs_ref(q, inv_freq, pos), gain * rotate_pairs_ref(k, inv_freq, pos)
    scale = a.softmax_scale if a.softmax_scale is not None else d_head**-0.5
    heads = []
    for h in range(a.n_heads):
        g = h // (a.n_heads // kv)
        scores = q[:, :, h] @ k[:, :, g].transpose(1, 2) * scale + mask
        if "sinks" in w:  # exp(sink) joins the denominator only
            e = torch.exp(scores - scores.amax(-1, keepdim=True))
            denom = e.sum(-1, keepdim=True) + torch.exp(w["sinks"][h] - scores.amax(-1, True))
            o = (e / denom) @ v[:, :, g]
        else:
            o = torch.softmax(scores, -1) @ v[:, :, g]
        heads.append(o / (1 + torch.exp(-gates[h])) if gates else o)
    return torch.cat(heads, -1) @ w["o_proj"].T + w.get("o_bias", 0)


class WindowedAttention(Attention):
    """``W``: :class:`Attention` whose queries see the last ``attention.window`` tokens only
    (the same parameters, keys and plan; RoPE from ``window_rope_theta`` when set); its
    decoding cache is a ring of ``window`` slots."""

    windowed = True

    @staticmethod
    def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
        """:meth:`Attention.flops_per_token` over the keys a query sees, ``min(seq_len,
        window)``."""
        a = cfg.attention
        assert a is not None and a.window is not None
        return Attention.flops_per_token(cfg, min(seq_len, a.window))


    @staticmethod
    def activation_bytes_per_token(cfg: ModelConfig, seq_len: int, ac: str, size: int,
                                   tp: int = 1, cp: int = 1) -> float:
        """:meth:`Attention.activation_bytes_per_token` plus, when the sequence is longer than
        the window, the window's mask: on the CPU (and on CUDA without FlexAttention) a ``T x
        T`` boolean mask becomes SDPA's float bias, kept for the backward and made per call
        (``T`` per token in ``none``; recomputed when checkpointed). FlexAttention's block
        mask (CUDA) keeps nothing that grows with ``T``."""
        a = cfg.attention
        assert a is not None and a.window is not None
        base = Attention.activation_bytes_per_token(cfg, seq_len, ac, size, tp, cp)
        masked = seq_len > a.window and cp == 1
        return base + (size * seq_len if masked and ac == "none" else 0.0)

KIND = LayerKind("*", "attention", Attention, "attention", AttentionConfig, validate_attention,
                 always=True)
"""``*``: causal self-attention (its section is present by default)."""
WINDOW_KIND = LayerKind("W", "sliding-window attention", WindowedAttention, "attention")
"""``W``: causal self-attention within ``attention.window`` (reads the ``attention`` section)."""
