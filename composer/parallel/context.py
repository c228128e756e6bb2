"""Context parallelism (``--cp N``): each sequence split over ``N`` ranks, exact for every layer
kind, applied from outside the blocks.

Load balance. A row of ``T`` tokens is cut into ``2N`` chunks of ``L = T / 2N``; rank ``r``
holds chunks ``r`` and ``2N - 1 - r`` (Megatron-Core's layout: under a causal mask the early
chunks are cheap and the late ones dear, and each rank gets one of each). The ranks of a cp
group read the same rows; each computes its two chunks, side by side, as a ``(B, 2L)`` row.

What crosses ranks, per layer kind:

- **Attention** (``Attention``): keys and values are all-gathered (Megatron's ``all_gather``
  CP; the point-to-point ring with log-sum-exp merging is not built), and each local chunk
  ``c`` attends to keys ``[0, (c + 1) L)`` under the causal mask of global positions (and of
  documents, with ``doc_ids``: a document that spans ranks stays whole). RoPE takes global
  positions (or positions within the document). The backward reduce-scatters the keys' and
  values' gradients back to their chunks.
- **Mamba-2 and gated delta nets**: chunk state passing. Both recurrences are linear in the
  state, ``S_end = M S_start + S_local`` per chunk, where ``S_local`` is the chunk's end state
  from zero and ``M`` its transition (a decay per head for Mamba-2; a ``K x K`` matrix per head
  for the delta rule). Each rank computes both for its chunks in one scan (the input widened by
  ``[0 | I]`` columns started from ``[0 | I]``: the extra columns come out as ``M``), the
  ``(S_local, M)`` of every chunk are all-gathered (a few state-sized tensors per layer), every
  rank runs the recurrence over the ``2N`` chunks, and scans its chunks again from their true
  starting states. That is exact, needs no divisibility of heads or groups, and keeps
  communication at the state's size; its cost is a second scan per layer. (The alternative,
  Megatron's head all-to-all, moves ``(B, T, X)`` activations twice per layer and needs the
  heads and groups to divide by ``N``.) The convolution gets its ``K - 1`` halo inputs from the
  preceding chunk (an all-gather of each chunk's tail). Document isolation: a state never
  passes a document start (the scan masks those inside a chunk, the chunk-start mask those at
  a chunk boundary) and the halo is masked by the documents' ids.
- MLP and MoE are token-wise; the MoE load statistics are summed over ``dp x cp``
  (:mod:`composer.parallel.mesh`).

Loss. Targets are shifted on the whole row before it is cut (a chunk's last target is the
first token of the next chunk, on another rank), then each rank's loss is the mean over the
whole rows: the sum of its tokens' cross-entropies, summed over the cp group in the forward and
divided by the rows' predicted tokens. Its gradient is the rank's own tokens' times ``N``, so
that data parallelism, which averages over ``dp x cp``, gives the mean over the batch. To the
training loop a cp rank is a data-parallel rank that holds the rows' loss. A row of
``2 N L + 1`` tokens (the data path's ``seq_len + 1``) loses its last token as an input: it
is only a target, so the loss is the same, and only the MoE load statistics (which count
every input token at cp = 1) see the difference.

- **Multi-latent attention** (``+``): the same, with the normalised latents and RoPE keys
  all-gathered (``C + R`` numbers a token instead of ``2 K E``) and expanded into per-head
  keys and values on every rank.

With pipeline parallelism the pipeline cuts the rows (:class:`composer.parallel.pipeline.
Pipeline`), the stages carry the rows' doc ids and positions with each micro-batch, and the
last stage's cross-entropy sums are summed over the cp group.

Multi-token prediction: each depth's shifted inputs and targets are taken from the whole rows
(every cp rank reads them) at the rank's positions, so nothing is lost at chunk boundaries;
its layers are cut like the trunk's, and each depth's loss is the rows' mean.

Not built yet: ``--cp`` with ``--ep``, adaptive cp; each is refused with one line.

Legend: B batch, T global time, L chunk length, H heads, K kv heads, E head width, X channels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from composer.blocks.loss import IGNORE_INDEX
from composer.parallel.comm import AllReduceForward, ScaleGrad, all_gather, reduce_scatter
from composer.parallel.mesh import LayoutError, ParallelDims

# ---------------------------------------------------------------- the layout


def chunk_owner(c: int, n: int) -> tuple[int, int]:
    """``(rank, slot)`` holding global chunk ``c`` of ``2n``."""
    return (c, 0) if c < n else (2 * n - 1 - c, 1)


def rank_chunks(rank: int, n: int) -> tuple[int, int]:
    return rank, 2 * n - 1 - rank


def local_index(t: int, n: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The global positions of rank ``rank``'s tokens, in its order (chunk ``r``, then chunk
    ``2n - 1 - r``)."""
    chunk = t // (2 * n)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device)
                      for c in rank_chunks(rank, n)])


@dataclass
class CPContext:
    """The cp group and the current batch's global view (set by the model's pre-hook)."""

    group: Any
    size: int
    rank: int
    T: int = 0
    """The whole rows' length."""
    pos_BT: torch.Tensor | None = None
    """RoPE positions of the local tokens: global, or within their document."""
    seg_BT: torch.Tensor | None = None
    """The whole rows' document segments (:func:`composer.kernels.docs.doc_segments`), or None."""
    doc_BT: torch.Tensor | None = None
    """The whole rows' doc ids (cut to ``T``), or None."""
    rows_doc: torch.Tensor | None = None
    rows_ids: torch.Tensor | None = None
    """The uncut rows (multi-token prediction's shifted inputs and targets)."""
    n_local: torch.Tensor | None = None
    n_rows: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)
    adaptive: bool = False
    """``--cp-adaptive`` (:func:`adaptive_layout`): short documents whole on one rank."""
    min_tokens: int | None = None
    """Documents of at least this many tokens are split (default: ``T / size``)."""
    layout: Any = None
    """The current batch's adaptive :class:`Layout` (None: the 2N-chunk layout)."""

    @property
    def L(self) -> int:
        return self.T // (2 * self.size)

    def set_rows(self, t: int, pos_BT: torch.Tensor, doc_BT: torch.Tensor | None,
                 ids_BT: torch.Tensor | None = None) -> None:
        """The rows about to run: the length cut (``t``), the local tokens' RoPE positions, the
        whole rows' doc ids (or None) and, for multi-token prediction, ids (uncut: a row of
        ``t + 1`` keeps its last token, a target)."""
        from composer.kernels.docs import doc_segments

        self.T, self.pos_BT, self.rows_ids = t, pos_BT, ids_BT
        self.rows_doc = doc_BT
        self.doc_BT = None if doc_BT is None else doc_BT[:, :t]
        self.seg_BT = None if doc_BT is None else doc_segments(self.doc_BT)

    @property
    def chunks(self) -> tuple[int, int]:
        return rank_chunks(self.rank, self.size)


class _GatherChunks(torch.autograd.Function):
    """Every chunk of the rows along ``dim``, in global order, from each rank's two (side by
    side along ``dim``); the backward sums the gradients over the ranks and returns each its
    own chunks' (one reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp: CPContext, dim: int) -> torch.Tensor:
        ctx.cp, ctx.dim = cp, dim
        n = cp.size
        x0 = x.movedim(dim, 0)
        m = x0.shape[0] // 2
        out = all_gather(x0, 0, cp.group, n).view(2 * n, m, *x0.shape[1:])  # rank-major
        order = [2 * r + s for r, s in (chunk_owner(c, n) for c in range(2 * n))]
        return out[order].reshape(2 * n * m, *x0.shape[1:]).movedim(0, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cp, dim, n = ctx.cp, ctx.dim, ctx.cp.size
        g0 = g.movedim(dim, 0)
        m = g0.shape[0] // (2 * n)
        g0 = g0.reshape(2 * n, m, *g0.shape[1:])
        rank_major = [c for r in range(n) for c in rank_chunks(r, n)]
        stacked = g0[rank_major].reshape(2 * n * m, *g0.shape[2:])
        mine = reduce_scatter(stacked, 0, cp.group, n, cp.rank)
        return mine.movedim(0, dim), None, None


def gather_chunks(x: torch.Tensor, cp: CPContext, dim: int) -> torch.Tensor:
    return _GatherChunks.apply(x, cp, dim)


def _global_chunks(x: torch.Tensor, cp: CPContext) -> torch.Tensor:
    """``x`` ``[B, 2, ...]`` (this rank's two chunks' items) -> ``[B, 2N, ...]``."""
    return gather_chunks(x, cp, 1)


# ---------------------------------------------------------------- attention


def cp_attention_forward(self: nn.Module, x_BTD: torch.Tensor, *,
                         doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """:class:`composer.blocks.attention.Attention` over the whole rows (module docstring)."""
    from composer.blocks.attention import apply_rope, rope_cos_sin_at

    cp: CPContext = self.cp
    q_BHTE, k_BKTE, v_BKTE, gate_BTX = self._project(x_BTD)
    if self.rope:
        cos, sin = rope_cos_sin_at(cp.pos_BT, self.inv_freq, q_BHTE.dtype)
        q_BHTE, k_BKTE = apply_rope(q_BHTE, cos, sin), apply_rope(k_BKTE, cos, sin)
    if cp.layout is not None:
        return self._output(adaptive_attention(q_BHTE, k_BKTE, v_BKTE, cp, self.scale),
                            gate_BTX)
    k_all, v_all = gather_chunks(k_BKTE, cp, 2), gather_chunks(v_BKTE, cp, 2)
    return self._output(chunk_attention(q_BHTE, k_all, v_all, cp, self.scale), gate_BTX)


def chunk_attention(q_BHTE: torch.Tensor, k_BKSE: torch.Tensor, v_BKSE: torch.Tensor,
                    cp: CPContext, scale: float) -> torch.Tensor:
    """This rank's queries (its two chunks) against every key of the rows: chunk ``c`` sees
    keys ``[0, (c + 1) L)`` under the causal mask of global positions, and its own document's
    only when the rows are packed."""
    from composer.kernels import sdpa_context

    L = cp.L
    outs = []
    if cp.seg_BT is None and q_BHTE.device.type == "cpu":
        # no mask at all: each chunk's keys as a causal diagonal block and an unmasked prefix,
        # merged by their log-sum-exps (memory linear in the keys; a boolean mask would be
        # converted to an L x (c + 1) L float bias and kept for the backward)
        if k_BKSE.shape[1] != q_BHTE.shape[1]:
            rep = q_BHTE.shape[1] // k_BKSE.shape[1]
            k_BKSE, v_BKSE = (k_BKSE.repeat_interleave(rep, 1), v_BKSE.repeat_interleave(rep, 1))
        e_qk, e_v = q_BHTE.shape[-1], v_BKSE.shape[-1]
        if e_v != e_qk:  # the kernel wants one head width: zero columns change nothing
            width = max(e_qk, e_v)
            q_BHTE, k_BKSE = F.pad(q_BHTE, (0, width - e_qk)), F.pad(k_BKSE, (0, width - e_qk))
            v_BKSE = F.pad(v_BKSE, (0, width - e_v))
        for slot, c in enumerate(cp.chunks):
            q = q_BHTE[:, :, slot * L:(slot + 1) * L]
            end = (c + 1) * L
            outs.append(_PrefixCausalAttention.apply(q, k_BKSE[:, :, :end], v_BKSE[:, :, :end],
                                                     scale))
        return torch.cat(outs, dim=2)[..., :e_v]
    for slot, c in enumerate(cp.chunks):
        q = q_BHTE[:, :, slot * L:(slot + 1) * L]
        end = (c + 1) * L
        mask = torch.ones(L, end, dtype=torch.bool, device=q.device).tril_(c * L)
        if cp.seg_BT is not None:
            seg_q, seg_k = cp.seg_BT[:, c * L:end], cp.seg_BT[:, :end]
            mask = (mask & (seg_q[:, :, None] == seg_k[:, None, :]))[:, None]
        with sdpa_context(q):
            outs.append(F.scaled_dot_product_attention(
                q, k_BKSE[:, :, :end], v_BKSE[:, :, :end], attn_mask=mask, scale=scale,
                enable_gqa=q.shape[1] != k_BKSE.shape[1]))
    return torch.cat(outs, dim=2)


class _PrefixCausalAttention(torch.autograd.Function):
    """Queries ``[B, H, L, E]`` that are the last ``L`` positions of keys ``[B, H, S, E]``:
    attention over the keys before them (no mask) and the causal ``L x L`` block, each by
    torch's CPU flash kernel, merged by their log-sum-exps; the backward runs the kernel's
    backward on each block with the merged output and log-sum-exp (as ring attention does),
    which gives the exact gradient of the merged attention."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> torch.Tensor:
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        L, S = q.shape[2], k.shape[2]
        blocks = [(0, S - L, False), (S - L, S, True)] if S > L else [(0, S, True)]
        outs = [flash(q, k[:, :, a:b], v[:, :, a:b], 0.0, causal, scale=scale)
                for a, b, causal in blocks]
        if len(outs) == 1:
            o, lse = outs[0]
        else:
            (o1, l1), (o2, l2) = outs
            lse = torch.logaddexp(l1, l2)
            o = (o1 * (l1 - lse).exp()[..., None].to(o1.dtype)
                 + o2 * (l2 - lse).exp()[..., None].to(o2.dtype))
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.blocks, ctx.scale = blocks, scale
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor, ...]:
        back = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        q, k, v, o, lse = ctx.saved_tensors
        dq = torch.zeros_like(q)
        dks, dvs = [], []
        for a, b, causal in ctx.blocks:
            dq_b, dk_b, dv_b = back(do.contiguous(), q, k[:, :, a:b], v[:, :, a:b], o, lse, 0.0,
                                    causal, scale=ctx.scale)
            dq += dq_b
            dks.append(dk_b)
            dvs.append(dv_b)
        return dq, torch.cat(dks, 2), torch.cat(dvs, 2), None


def cp_mla_forward(self: nn.Module, x_BTD: torch.Tensor, *,
                   doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """:class:`composer.blocks.mla.MLA` over the whole rows: the normalised
    latents and RoPE keys (``C + R`` numbers a token) are all-gathered, and every rank expands
    them into per-head keys and values (module docstring)."""
    from composer.blocks.attention import apply_rope, rope_cos_sin_at

    cp: CPContext = self.cp
    self._check_length(cp.T)
    b, t, _ = x_BTD.shape
    qn_BHTN, qr_BHTR, c_BTC, kr_BTR = self._project(x_BTD)
    cos, sin = rope_cos_sin_at(cp.pos_BT, self.inv_freq, qn_BHTN.dtype)
    cos, sin = self._gain(cos), self._gain(sin)
    qr_BHTR = apply_rope(qr_BHTR, cos, sin)
    kr_B1TR = apply_rope(kr_BTR[:, None], cos, sin)
    if cp.layout is not None:
        n_max = cp.layout.max_tokens
        c_BSC, kr_B1SR = gather_padded(c_BTC, cp, 1, n_max), gather_padded(kr_B1TR, cp, 2, n_max)
    else:
        c_BSC, kr_B1SR = gather_chunks(c_BTC, cp, 1), gather_chunks(kr_B1TR, cp, 2)
    h, S = qn_BHTN.shape[1], c_BSC.shape[1]
    kv = self.kv_b_proj(c_BSC).view(b, S, -1, self.d_nope + self.d_v)
    kn_BHSN, v_BHSV = kv.transpose(1, 2).split([self.d_nope, self.d_v], dim=-1)
    q_BHTQ = torch.cat([qn_BHTN, qr_BHTR], dim=-1)
    k_BHSQ = torch.cat([kn_BHSN, kr_B1SR.expand(-1, h, -1, -1)], dim=-1)
    if cp.layout is not None:
        from composer.kernels import sdpa_context

        with sdpa_context(q_BHTQ):
            o_BHTV = F.scaled_dot_product_attention(q_BHTQ, k_BHSQ, v_BHSV,
                                                    attn_mask=cp.extra["mask"], scale=self.scale)
    else:
        o_BHTV = chunk_attention(q_BHTQ, k_BHSQ, v_BHSV, cp, self.scale)
    return self.o_proj(o_BHTV.transpose(1, 2).reshape(b, t, -1))


# ---------------------------------------------------------------- recurrences


def halo_conv(x_BTX: torch.Tensor, conv: nn.Module, cp: CPContext) -> torch.Tensor:
    """``silu(conv(x))`` of this rank's two chunks as ``[2B, L, X]`` rows (slot-major within
    each batch row), each preceded by the ``K - 1`` inputs before it in the whole row."""
    from composer.kernels import conv_silu

    b, _, X = x_BTX.shape
    L = cp.L
    h = conv.kernel - 1
    x_B2LX = x_BTX.view(b, 2, L, X)
    if h == 0:
        rows = x_B2LX.reshape(2 * b, L, X)
        return conv_silu(rows, conv, _chunk_docs(cp, b, 0))
    tails = _global_chunks(x_B2LX[:, :, L - h:].contiguous(), cp)  # [B, 2N, h, X]
    halo = torch.stack([tails[:, c - 1] if c > 0 else torch.zeros_like(tails[:, 0])
                        for c in cp.chunks], 1)
    rows = torch.cat([halo, x_B2LX], dim=2).reshape(2 * b, h + L, X)
    return conv_silu(rows, conv, _chunk_docs(cp, b, h))[:, h:]


def _chunk_docs(cp: CPContext, b: int, halo: int) -> torch.Tensor | None:
    """The doc ids of this rank's chunk rows (``[2B, halo + L]``, the halo included; a halo
    before the row's start takes the first token's id: its inputs are zeros)."""
    if cp.doc_BT is None:
        return None
    L = cp.L
    rows = []
    for c in cp.chunks:
        start = c * L - halo
        ids = cp.doc_BT[:, max(start, 0):(c + 1) * L]
        if start < 0:
            ids = torch.cat([ids[:, :1].expand(-1, -start), ids], 1)
        rows.append(ids)
    return torch.stack(rows, 1).reshape(2 * b, halo + L)


def _continues(cp: CPContext) -> torch.Tensor | None:
    """``[B, 2N]``: 1 where chunk ``c`` continues the document of the token before it (always
    for ``c > 0`` without documents; never for ``c = 0``)."""
    if cp.doc_BT is None:
        return None
    L = cp.L
    starts = torch.arange(2 * cp.size, device=cp.doc_BT.device) * L
    prev = cp.doc_BT[:, (starts - 1).clamp(min=0)]
    same = (cp.doc_BT[:, starts] == prev)
    same[:, 0] = False
    return same


def pass_states(local_B2N_: torch.Tensor, trans_B2N_: torch.Tensor, cp: CPContext,
                apply: Any) -> torch.Tensor:
    """The state entering each of this rank's chunks, ``[B, 2, ...]``: the recurrence
    ``start[c] = apply(trans[c-1], start[c-1]) + local[c-1]`` over every chunk of the rows
    (``start[0] = 0``; zero where a document starts at the chunk)."""
    local = _global_chunks(local_B2N_, cp)
    trans = _global_chunks(trans_B2N_, cp)
    cont = _continues(cp)
    starts = [torch.zeros_like(local[:, 0])]
    for c in range(1, 2 * cp.size):
        s = apply(trans[:, c - 1], starts[c - 1]) + local[:, c - 1]
        if cont is not None:
            s = s * cont[:, c].view(-1, *([1] * (s.dim() - 1))).to(s.dtype)
        starts.append(s)
    return torch.stack([starts[c] for c in cp.chunks], 1)


def cp_mamba_forward(self: nn.Module, x_BTD: torch.Tensor, *,
                     doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """:class:`composer.blocks.mamba2.Mamba2Mixer` over the whole rows: the convolution with
    its halo, the scan with chunk state passing (module docstring)."""
    from composer.kernels import mamba_scan

    cp: CPContext = self.cp
    if cp.layout is not None:
        return adaptive_mamba_forward(self, x_BTD)
    b, T, _ = x_BTD.shape
    L, chunk = cp.L, self.mamba_cfg.chunk_size
    z_BTE, xBC_BTX, dt_BTH = self.project(x_BTD)
    conv_RLX = halo_conv(xBC_BTX, self.conv1d, cp).contiguous()  # R = 2B chunk rows
    x_RLHP, B_RLGN, C_RLGN, A_H, extra = self.scan_inputs(conv_RLX)
    dt_RLH = dt_BTH.reshape(2 * b, L, -1)
    docs = _chunk_docs(cp, b, 0)
    R, _, H, P = x_RLHP.shape
    N = B_RLGN.shape[-1]
    # one scan for each chunk's (S_local, decay): x widened by a zero column, started at [0 | 1]
    x_aug = torch.cat([x_RLHP, x_RLHP.new_zeros(R, L, H, 1)], -1)
    init = x_RLHP.new_zeros(R, H, P + 1, N, dtype=torch.promote_types(x_RLHP.dtype,
                                                                       torch.float32))
    init[:, :, P] = 1.0
    _, end_RHQN = mamba_scan(x_aug, dt_RLH, A_H, B_RLGN, C_RLGN, chunk, **extra, doc_ids=docs,
                             initial_state_BHPN=init, return_final_state=True)
    local = end_RHQN[:, :, :P].reshape(b, 2, H, P, N)
    decay = end_RHQN[:, :, P, 0].reshape(b, 2, H)
    start = pass_states(local, decay, cp, lambda d, s: d[..., None, None] * s)
    y_RLHP = mamba_scan(x_RLHP, dt_RLH, A_H, B_RLGN, C_RLGN, chunk, **extra, doc_ids=docs,
                        initial_state_BHPN=start.reshape(R, H, P, N))
    return self.finish(y_RLHP.reshape(b, T, H, P), z_BTE, x_BTD.dtype)


def cp_gdn_forward(self: nn.Module, x_BTD: torch.Tensor, *,
                   doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """:class:`composer.blocks.gdn.GatedDeltaNet` over the whole rows: the convolution with its
    halo, the delta rule with chunk state passing (module docstring)."""
    from composer.kernels.gdn import gated_delta_rule

    cp: CPContext = self.cp
    if cp.layout is not None:
        return adaptive_gdn_forward(self, x_BTD)
    b, T, _ = x_BTD.shape
    L, chunk = cp.L, self.gdn_cfg.chunk_size
    conv_RLX = halo_conv(self.project(x_BTD), self.conv1d, cp)
    x_RLD = x_BTD.reshape(2 * b, L, -1)
    q, k, v_RLHV, g, beta = self.rule_inputs(conv_RLX, x_RLD)
    docs = _chunk_docs(cp, b, 0)
    R, _, H, V = v_RLHV.shape
    K = q.shape[-1]
    # one pass for each chunk's (S_local, M): v widened by K zero columns, started at [0 | I]
    v_aug = torch.cat([v_RLHV, v_RLHV.new_zeros(R, L, H, K)], -1)
    init = v_RLHV.new_zeros(R, H, K, V + K)
    init[..., V:] = torch.eye(K, dtype=init.dtype, device=init.device)
    _, end_RHKW = gated_delta_rule(q, k, v_aug, g, beta, chunk, initial_state_BHKV=init,
                                   return_final_state=True, doc_ids=docs)
    local = end_RHKW[..., :V].reshape(b, 2, H, K, V)
    trans = end_RHKW[..., V:].reshape(b, 2, H, K, K)
    start = pass_states(local, trans, cp, lambda m, s: m @ s)
    o_RLHV = gated_delta_rule(q, k, v_RLHV, g, beta, chunk, doc_ids=docs,
                              initial_state_BHKV=start.reshape(R, H, K, V))
    return self.finish(o_RLHV.reshape(b, T, H, V), x_BTD)


# ---------------------------------------------------------------- multi-token prediction


def cp_mtp_forward(self: nn.Module, g_BTD: torch.Tensor, input_ids: torch.Tensor | None,
                   labels: torch.Tensor | None, *, embed: Any, readout: Any,
                   weight_VD: torch.Tensor, doc_ids: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """:class:`composer.blocks.mtp.MultiTokenPrediction` on this rank's chunks: each depth's
    shifted ids, keep mask and targets come from the whole (uncut) rows, then this rank's
    positions; each depth's loss is the rows' mean (:func:`rows_mean`). The ids are the labels
    (the engine's convention)."""
    from composer.blocks.mtp import depth_inputs, segments

    cp: CPContext = self.cp
    ids = cp.rows_ids
    idx = local_index(cp.T, cp.size, cp.rank, ids.device)
    seg_BT = segments(ids, cp.rows_doc)
    inputs = [depth_inputs(ids, ids, seg_BT, k) for k in range(1, len(self) + 1)]
    counts = torch.stack([(t[:, :cp.T] != IGNORE_INDEX).sum() for _, _, t in inputs])
    totals = counts.tolist()  # one host sync for every depth, as without cp
    total = g_BTD.new_zeros((), dtype=torch.promote_types(g_BTD.dtype, torch.float32))
    losses = []
    for depth, (ids_BT, keep_BT, target_BT), n_rows, n in zip(self, inputs, counts, totals,
                                                              strict=True):
        target_BT = target_BT[:, idx]
        g_BTD = depth(g_BTD, embed(ids_BT[:, idx]), keep_BT[:, idx], doc_ids=doc_ids)
        if n == 0:
            losses.append(total.new_full((), float("nan")))
            continue
        ce, _ = readout(g_BTD, weight_VD, None, targets_BT=safe_targets(target_BT))
        ce = rows_mean(ce, (target_BT != IGNORE_INDEX).sum(), n_rows, cp)
        total = total + ce
        losses.append(ce.detach())
    return total * (self.loss_weight / len(self)), tuple(losses)


# ---------------------------------------------------------------- adaptive cp


@dataclass
class Piece:
    """A contiguous span ``[start, start + length)`` of row ``row``, inside one document (which
    starts at ``doc_start``), on rank ``rank`` at offset ``offset`` of its tokens; ``prev`` is
    the global index of the piece before it in its document (split documents), or None."""

    row: int
    start: int
    length: int
    doc_start: int
    rank: int = 0
    offset: int = 0
    prev: int | None = None


@dataclass
class Layout:
    """Adaptive cp's placement of one batch of packed rows (:func:`adaptive_layout`)."""

    pieces: list[Piece]
    """In global order: by row, then position."""
    size: int
    T: int

    def of_rank(self, r: int) -> list[int]:
        return [i for i, p in enumerate(self.pieces) if p.rank == r]

    def tokens(self, r: int) -> int:
        return sum(self.pieces[i].length for i in self.of_rank(r))

    @property
    def max_tokens(self) -> int:
        return max(self.tokens(r) for r in range(self.size))

    @property
    def max_pieces(self) -> int:
        return max(len(self.of_rank(r)) for r in range(self.size))


def adaptive_layout(doc_BT: Any, n: int, min_tokens: int, halo: int) -> Layout:
    """Documents of at least ``min_tokens`` tokens (and long enough that each of ``2n`` pieces
    covers a convolution ``halo``) are cut into ``2n`` pieces, piece ``j`` on rank ``j`` or
    ``2n - 1 - j`` (the causal balance); every shorter document goes whole to the rank with
    the fewest tokens so far (longest first; ties to the lower rank). Deterministic: every
    rank computes the same layout from the same doc ids."""
    import numpy as np

    doc = np.asarray(doc_BT)
    B, T = doc.shape
    spans = []
    for b in range(B):
        cuts = [0, *(np.nonzero(doc[b, 1:] != doc[b, :-1])[0] + 1).tolist(), T]
        spans += [(b, s, e) for s, e in zip(cuts[:-1], cuts[1:], strict=True)]
    load = [0] * n
    pieces: list[Piece] = []
    short = []
    for b, s, e in spans:
        length = e - s
        if length >= max(min_tokens, 2 * n * max(halo, 1)):
            base, extra = divmod(length, 2 * n)
            start = s
            for j in range(2 * n):
                k = base + (1 if j < extra else 0)
                rank = j if j < n else 2 * n - 1 - j
                pieces.append(Piece(b, start, k, s, rank))
                load[rank] += k
                start += k
        else:
            short.append((b, s, e))
    for b, s, e in sorted(short, key=lambda x: (-(x[2] - x[1]), x[0], x[1])):
        rank = min(range(n), key=lambda r: (load[r], r))
        pieces.append(Piece(b, s, e - s, s, rank))
        load[rank] += e - s
    pieces.sort(key=lambda p: (p.row, p.start))
    offsets = [0] * n
    last_of_doc: dict[tuple[int, int], int] = {}
    for i, p in enumerate(pieces):
        p.offset = offsets[p.rank]
        offsets[p.rank] += p.length
        p.prev = last_of_doc.get((p.row, p.doc_start))
        last_of_doc[(p.row, p.doc_start)] = i
    return Layout(pieces, n, T)


@dataclass
class PieceRows:
    """This rank's pieces as rows ``[P, Lmax]``: ``index`` (into the rank's tokens, ``-1`` on
    the padding after a piece), their global piece numbers and the validity mask."""

    index: torch.Tensor
    valid: torch.Tensor
    ids: list[int]


def _piece_rows(layout: Layout, rank: int, device: torch.device) -> PieceRows:
    mine = layout.of_rank(rank)
    L = max((layout.pieces[i].length for i in mine), default=1)
    index = torch.full((max(len(mine), 1), L), -1, dtype=torch.long)
    for row, i in enumerate(mine):
        p = layout.pieces[i]
        index[row, :p.length] = torch.arange(p.offset, p.offset + p.length)
    index = index.to(device)
    return PieceRows(index, index >= 0, mine)


def to_rows(x_BT_: torch.Tensor, rows: PieceRows, fill: float = 0.0) -> torch.Tensor:
    """``[1, T_r, ...]`` (a rank's tokens) -> ``[P, Lmax, ...]`` (its pieces, padded)."""
    flat = x_BT_[0]
    out = flat[rows.index.clamp(min=0)]
    mask = rows.valid.view(*rows.valid.shape, *([1] * (out.dim() - 2)))
    return torch.where(mask, out, torch.full_like(out, fill))


def from_rows(y_PL_: torch.Tensor, rows: PieceRows, n_tokens: int) -> torch.Tensor:
    """The inverse of :func:`to_rows`: ``[1, T_r, ...]``."""
    flat = y_PL_[rows.valid]  # row-major: pieces in offset order
    return flat[None, :n_tokens]


class _GatherPadded(torch.autograd.Function):
    """Every rank's ``x`` along ``dim`` padded to ``n_max`` and concatenated (rank-major); the
    backward sums the gradients over the ranks and returns this rank's unpadded part."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp: CPContext, dim: int, n_max: int) -> torch.Tensor:
        ctx.cp, ctx.dim, ctx.n = cp, dim, x.shape[dim]
        x0 = x.movedim(dim, 0)
        pad = x0.new_zeros(n_max - x0.shape[0], *x0.shape[1:])
        out = all_gather(torch.cat([x0, pad]), 0, cp.group, cp.size)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        cp = ctx.cp
        mine = reduce_scatter(g.movedim(ctx.dim, 0).contiguous(), 0, cp.group, cp.size,
                              cp.rank)
        return mine[:ctx.n].movedim(0, ctx.dim), None, None, None


def gather_padded(x: torch.Tensor, cp: CPContext, dim: int, n_max: int) -> torch.Tensor:
    return _GatherPadded.apply(x, cp, dim, n_max)


def adaptive_attention(q_BHTE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor,
                       cp: CPContext, scale: float) -> torch.Tensor:
    """This rank's queries against every rank's keys (gathered, padded), masked to the same
    document and earlier positions."""
    from composer.kernels import sdpa_context

    n_max = cp.layout.max_tokens
    k_all, v_all = gather_padded(k_BKTE, cp, 2, n_max), gather_padded(v_BKTE, cp, 2, n_max)
    with sdpa_context(q_BHTE):
        return F.scaled_dot_product_attention(
            q_BHTE, k_all, v_all, attn_mask=cp.extra["mask"], scale=scale,
            enable_gqa=q_BHTE.shape[1] != k_all.shape[1])


def _adaptive_meta(cp: CPContext, device: torch.device) -> None:
    """Per batch: the attention mask ``[1, 1, T_r, N * n_max]`` (same document, not later),
    the rank's piece rows, and the RoPE positions within documents."""
    layout, n_max = cp.layout, cp.layout.max_tokens
    doc = torch.full((cp.size, n_max), -1, dtype=torch.long)
    pos = torch.zeros((cp.size, n_max), dtype=torch.long)
    for p in layout.pieces:
        key = p.row * layout.T + p.doc_start
        doc[p.rank, p.offset:p.offset + p.length] = key
        pos[p.rank, p.offset:p.offset + p.length] = torch.arange(p.start, p.start + p.length)
    doc, pos = doc.to(device), pos.to(device)
    n = layout.tokens(cp.rank)
    q_doc, q_pos = doc[cp.rank, :n], pos[cp.rank, :n]
    k_doc, k_pos = doc.reshape(-1), pos.reshape(-1)
    mask = (q_doc[:, None] == k_doc[None, :]) & (k_pos[None, :] <= q_pos[:, None])
    cp.extra["mask"] = mask[None, None]
    cp.extra["rows"] = _piece_rows(layout, cp.rank, device)
    starts = torch.tensor([layout.pieces[i].doc_start for i in layout.of_rank(cp.rank)
                           for _ in range(layout.pieces[i].length)], dtype=torch.long)
    cp.pos_BT = (q_pos - starts.to(device))[None]


def adaptive_halo_conv(x_1TX: torch.Tensor, conv: nn.Module, cp: CPContext) -> torch.Tensor:
    """``silu(conv(x))`` of this rank's pieces as padded rows ``[P, Lmax, X]``, each preceded
    by the ``K - 1`` inputs before it in its document (the previous piece's tail, gathered)."""
    from composer.kernels import conv_silu

    rows, layout = cp.extra["rows"], cp.layout
    h = conv.kernel - 1
    x_PLX = to_rows(x_1TX, rows)
    if h == 0:
        return conv_silu(x_PLX, conv)
    lengths = torch.tensor([layout.pieces[i].length for i in rows.ids], device=x_PLX.device)
    tail_idx = (lengths[:, None] - h + torch.arange(h, device=x_PLX.device)).clamp(min=0)
    tails = torch.gather(x_PLX, 1, tail_idx[..., None].expand(-1, -1, x_PLX.shape[-1]))
    p_max = layout.max_pieces
    all_tails = gather_padded(tails, cp, 0, p_max)  # [N * p_max, h, X]
    slot = {g: r * p_max + layout.of_rank(r).index(g) for r in range(cp.size)
            for g in layout.of_rank(r)}
    halo = torch.stack([all_tails[slot[layout.pieces[g].prev]]
                        if layout.pieces[g].prev is not None else torch.zeros_like(tails[0])
                        for g in rows.ids])
    return conv_silu(torch.cat([halo, x_PLX], 1), conv)[:, h:]


def adaptive_pass_states(local_P_: torch.Tensor, trans_P_: torch.Tensor, cp: CPContext,
                         apply: Any) -> torch.Tensor:
    """The state entering each of this rank's pieces: the previous piece's end state
    ``apply(trans, start) + local`` along each split document (0 for a document's first)."""
    layout, rows, p_max = cp.layout, cp.extra["rows"], cp.layout.max_pieces
    local = gather_padded(local_P_, cp, 0, p_max)
    trans = gather_padded(trans_P_, cp, 0, p_max)
    slot = {g: r * p_max + layout.of_rank(r).index(g) for r in range(cp.size)
            for g in layout.of_rank(r)}
    start: dict[int, torch.Tensor] = {}
    zero = torch.zeros_like(local[0])
    for g, p in enumerate(layout.pieces):  # global order: a piece's prev comes first
        if p.prev is None:
            start[g] = zero
        else:
            q = slot[p.prev]
            start[g] = apply(trans[q], start[p.prev]) + local[q]
    return torch.stack([start[g] for g in rows.ids])


def adaptive_mamba_forward(self: nn.Module, x_BTD: torch.Tensor) -> torch.Tensor:
    from composer.kernels import mamba_scan

    cp: CPContext = self.cp
    rows = cp.extra["rows"]
    n = x_BTD.shape[1]
    chunk = self.mamba_cfg.chunk_size
    z_BTE, xBC_BTX, dt_BTH = self.project(x_BTD)
    conv_PLX = adaptive_halo_conv(xBC_BTX, self.conv1d, cp).contiguous()
    x_PLHP, B_PLGN, C_PLGN, A_H, extra = self.scan_inputs(conv_PLX)
    # padding after a piece: dt -> softplus(-1e4) = 0 and x = 0, so the state neither decays
    # nor takes input there, and the end state is the piece's
    dt_PLH = to_rows(dt_BTH, rows, fill=-1e4)
    x_PLHP = x_PLHP * rows.valid[..., None, None].to(x_PLHP.dtype)
    R, L, H, P = x_PLHP.shape
    N = B_PLGN.shape[-1]
    x_aug = torch.cat([x_PLHP, x_PLHP.new_zeros(R, L, H, 1)], -1)
    init = x_PLHP.new_zeros(R, H, P + 1, N, dtype=torch.promote_types(x_PLHP.dtype,
                                                                       torch.float32))
    init[:, :, P] = 1.0
    _, end = mamba_scan(x_aug, dt_PLH, A_H, B_PLGN, C_PLGN, chunk, **extra,
                        initial_state_BHPN=init, return_final_state=True)
    start = adaptive_pass_states(end[:, :, :P].contiguous(), end[:, :, P, 0].contiguous(), cp,
                                 lambda d, s: d[..., None, None] * s)
    y_PLHP = mamba_scan(x_PLHP, dt_PLH, A_H, B_PLGN, C_PLGN, chunk, **extra,
                        initial_state_BHPN=start)
    return self.finish(from_rows(y_PLHP, rows, n), z_BTE, x_BTD.dtype)


def adaptive_gdn_forward(self: nn.Module, x_BTD: torch.Tensor) -> torch.Tensor:
    from composer.kernels.gdn import gated_delta_rule

    cp: CPContext = self.cp
    rows = cp.extra["rows"]
    n = x_BTD.shape[1]
    chunk = self.gdn_cfg.chunk_size
    conv_PLX = adaptive_halo_conv(self.project(x_BTD), self.conv1d, cp)
    q, k, v, g, beta = self.rule_inputs(conv_PLX, to_rows(x_BTD, rows))
    # padding after a piece: no decay (g = 0) and no update (beta = 0, k = q = 0)
    valid = rows.valid.to(g.dtype)
    q, k = q * valid[..., None, None], k * valid[..., None, None]
    g, beta = g * valid[..., None], beta * valid[..., None]
    R, L, H, V = v.shape
    K = q.shape[-1]
    v_aug = torch.cat([v, v.new_zeros(R, L, H, K)], -1)
    init = v.new_zeros(R, H, K, V + K)
    init[..., V:] = torch.eye(K, dtype=init.dtype, device=init.device)
    _, end = gated_delta_rule(q, k, v_aug, g, beta, chunk, initial_state_BHKV=init,
                              return_final_state=True)
    start = adaptive_pass_states(end[..., :V].contiguous(), end[..., V:].contiguous(), cp,
                                 lambda m, s: m @ s)
    o = gated_delta_rule(q, k, v, g, beta, chunk, initial_state_BHKV=start)
    return self.finish(from_rows(o, rows, n), x_BTD)


# ---------------------------------------------------------------- the model


def _cp_class(cls: type, forward: Any) -> type:
    name = f"ContextParallel{cls.__name__}"
    cached = _CLASSES.get((cls, name))
    if cached is None:
        cached = _CLASSES[(cls, name)] = type(name, (cls,), {"forward": forward})
    return cached


_CLASSES: dict = {}


def _forwards() -> dict[type, Any]:
    from composer.blocks.attention import Attention
    from composer.blocks.gdn import GatedDeltaNet
    from composer.blocks.mamba2 import Mamba2Mixer
    from composer.blocks.mla import MLA

    return {Attention: cp_attention_forward, Mamba2Mixer: cp_mamba_forward,
            GatedDeltaNet: cp_gdn_forward, MLA: cp_mla_forward}


def check_cp(model: nn.Module, cp: int) -> None:
    """Refuse what context parallelism cannot run (one line): a layer kind it does not split."""
    if cp == 1:
        return
    from composer.blocks.model import named_layers

    forwards = _forwards()
    for key, layer in named_layers(model):
        mixer = layer.mixer
        if getattr(mixer, "stateless", False) or type(mixer) in forwards:
            continue
        raise LayoutError(f"--cp: {key} ({getattr(layer, 'symbol', '?')!r}, "
                          f"{type(mixer).__name__}) has no context-parallel form yet")


def cp_length(cp: int, row_len: int) -> int:
    """The tokens of a row that context parallelism cuts: all of them, or all but the last when
    one is left over (the data path's ``seq_len + 1`` rows: the last token is only a target)."""
    return row_len - 1 if row_len % (2 * cp) == 1 else row_len


def check_cp_length(cfg: Any, cp: int, row_len: int) -> None:
    """The rows (or all but their last token) must cut into ``2 cp`` chunks, none shorter than
    a convolution's halo."""
    n = cp_length(cp, row_len)
    if n % (2 * cp):
        raise LayoutError(f"--cp {cp}: rows of {row_len} tokens do not cut into 2 x cp = "
                          f"{2 * cp} chunks (the sequence length must be a multiple of "
                          f"{2 * cp})")
    chunk = n // (2 * cp)
    for name in ("mamba", "gdn"):
        section = getattr(cfg, name, None)
        if section is not None and chunk < section.d_conv - 1:
            raise LayoutError(f"--cp {cp}: chunks of {chunk} tokens are shorter than the "
                              f"{name} convolution's halo of {section.d_conv - 1}")


def safe_targets(targets_BT: torch.Tensor) -> torch.Tensor:
    """``targets`` with position ``(0, 0)`` made a real target when there is none at all: a
    mean over no tokens is 0 / 0 (and so is its gradient); the caller multiplies the mean by
    the true count, 0, so the substitute never counts. No host synchronisation."""
    none = (targets_BT != IGNORE_INDEX).sum() == 0
    out = targets_BT.clone()
    out[0, 0] = torch.where(none, torch.zeros_like(out[0, 0]), out[0, 0])
    return out


def rows_mean(ce_local: torch.Tensor, n_local: torch.Tensor, n_rows: torch.Tensor,
              cp: CPContext) -> torch.Tensor:
    """The rows' mean from this rank's mean over its ``n_local`` tokens: the token sums added
    over the cp group in the forward, the gradient ``cp`` times this rank's (module
    docstring)."""
    token_sum = ce_local * n_local.to(ce_local.dtype)
    mean = AllReduceForward.apply(token_sum / n_rows.to(ce_local.dtype), cp.group)
    return ScaleGrad.apply(mean, float(cp.size))


@dataclass
class CutRows:
    """Rows cut for this rank (:func:`cut_rows`)."""

    ids: torch.Tensor
    targets: torch.Tensor
    doc_ids: torch.Tensor | None
    """This rank's tokens' doc ids (the mixers that are not cp-aware read them)."""
    pos: torch.Tensor
    rows_doc_ids: torch.Tensor | None
    """The whole rows' doc ids, uncut (what the cp mixers read, cut to ``t``)."""
    rows_ids: torch.Tensor
    """The whole rows' ids, uncut."""
    t: int
    n_rows: torch.Tensor
    """Predicted tokens of the whole rows."""
    n_local: torch.Tensor


def cut_rows(cp: CPContext, ids: torch.Tensor, labels: torch.Tensor,
             doc: torch.Tensor | None, model_cfg: Any) -> CutRows:
    """Shift the targets on the whole rows (masked at document starts), then keep this rank's
    chunks of ids, targets and doc ids, and its tokens' RoPE positions."""
    from composer.blocks.model import mask_doc_boundaries, shift_labels
    from composer.kernels.docs import doc_positions

    check_cp_length(model_cfg, cp.size, ids.shape[1])
    rows_ids, rows_doc = ids, doc
    targets = shift_labels(labels if doc is None else mask_doc_boundaries(labels, doc))
    t = cp_length(cp.size, ids.shape[1])
    if t < ids.shape[1]:  # the last token is only a target: not an input of anything
        ids, targets = ids[:, :t], targets[:, :t]
        doc = None if doc is None else doc[:, :t]
    idx = local_index(t, cp.size, cp.rank, ids.device)
    pos = idx.expand(ids.shape[0], -1) if doc is None else doc_positions(doc)[:, idx]
    local_targets = targets[:, idx]
    n_local = (local_targets != IGNORE_INDEX).sum()
    return CutRows(ids[:, idx], local_targets, None if doc is None else doc[:, idx], pos,
                   rows_doc, rows_ids, t, (targets != IGNORE_INDEX).sum(), n_local)


def _pre_hook(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    cp: CPContext = model.cp
    ids = args[0] if args else kwargs.pop("input_ids")
    labels = args[1] if len(args) > 1 else kwargs.pop("labels", None)
    if labels is None:
        raise ValueError("under context parallelism the model computes the loss (give labels); "
                         "its logits would be this rank's chunks only")
    if model.mtp is not None and labels is not ids and not torch.equal(labels, ids):
        raise ValueError("under context parallelism multi-token prediction takes the ids as "
                         "labels (as the training engine gives them)")
    cp.layout = None
    if cp.adaptive:
        return _adaptive_cut(model, cp, ids, labels, kwargs)
    rows = cut_rows(cp, ids, labels, kwargs.get("doc_ids"), model.config)
    cp.set_rows(rows.t, rows.pos, rows.rows_doc_ids, rows.rows_ids)
    cp.n_rows, cp.n_local = rows.n_rows, rows.n_local
    kwargs = {**kwargs, "targets": safe_targets(rows.targets)}
    if rows.doc_ids is not None:
        kwargs["doc_ids"] = rows.doc_ids
    return (rows.ids,), kwargs


def _halo(cfg: Any) -> int:
    return max([s.d_conv - 1 for s in (cfg.mamba, cfg.gdn) if s is not None], default=0)


def _adaptive_cut(model: nn.Module, cp: CPContext, ids: torch.Tensor, labels: torch.Tensor,
                  kwargs: dict) -> tuple[tuple, dict]:
    """The adaptive layout of the rows (:func:`adaptive_layout`): this rank's tokens as one row
    of its pieces, their targets, and per-token document keys."""
    from composer.blocks.model import mask_doc_boundaries, shift_labels

    doc = kwargs.get("doc_ids")
    if doc is None:
        raise LayoutError("--cp-adaptive places whole documents: it needs packed rows with "
                          "doc ids (--document-isolation)")
    if model.mtp is not None:
        raise LayoutError("--cp-adaptive with multi-token prediction is not built yet")
    b, t = ids.shape
    targets = shift_labels(mask_doc_boundaries(labels, doc))
    layout = adaptive_layout(doc.cpu().numpy(), cp.size, cp.min_tokens or t // cp.size,
                             _halo(model.config))
    cp.layout, cp.T = layout, t
    mine = [layout.pieces[i] for i in layout.of_rank(cp.rank)]
    idx = torch.cat([torch.arange(p.row * t + p.start, p.row * t + p.start + p.length)
                     for p in mine]).to(ids.device)
    keys = torch.cat([torch.full((p.length,), p.row * t + p.doc_start) for p in mine])
    _adaptive_meta(cp, ids.device)
    local_targets = targets.reshape(-1)[idx][None]
    cp.n_rows = (targets != IGNORE_INDEX).sum()
    cp.n_local = (local_targets != IGNORE_INDEX).sum()
    kwargs = {**kwargs, "targets": safe_targets(local_targets),
              "doc_ids": keys.to(ids.device)[None]}
    return (ids.reshape(-1)[idx][None],), kwargs


def _post_hook(model: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
    """The rows' mean cross-entropy (module docstring: summed over the group in the forward,
    the gradient ``N`` times this rank's)."""
    cp: CPContext = model.cp
    extra = out.aux_loss + out.mtp_loss
    out.loss = rows_mean(out.loss - extra, cp.n_local, cp.n_rows, cp) + extra
    return out


def apply_cp(model: nn.Module, dims: ParallelDims) -> None:
    """Swap every sequence-mixing layer for its context-parallel form (same parameters and
    keys) and make the model cut its rows (module docstring); under pipeline parallelism the
    pipeline cuts them (``model.cp`` tells it). On the meta device, before data parallelism
    wraps the layers."""
    from composer.blocks.model import named_layers

    check_cp(model, dims.cp)
    if dims.cp_adaptive and dims.pp > 1:
        raise LayoutError("--cp-adaptive with --pp is not built yet")
    mesh = dims.cp_mesh
    cp = CPContext(group=mesh.get_group(), size=dims.cp, rank=mesh.get_local_rank(),
                   adaptive=dims.cp_adaptive, min_tokens=dims.cp_min_tokens)
    forwards = _forwards()
    for _, layer in named_layers(model):  # the MTP depths' layers too
        mixer = layer.mixer
        fwd = forwards.get(type(mixer))
        if fwd is not None:
            mixer.__class__ = _cp_class(type(mixer), fwd)
            mixer.cp = cp
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        mtp.__class__ = _cp_class(type(mtp), cp_mtp_forward)
        mtp.takes_targets = True
        mtp.cp = cp
    model.cp = cp
    if dims.pp == 1:
        model.register_forward_pre_hook(_pre_hook, with_kwargs=True)
        model.register_forward_hook(_post_hook, with_kwargs=True)


def is_context_parallel(model: nn.Module) -> bool:
    return isinstance(getattr(model, "cp", None), CPContext)

