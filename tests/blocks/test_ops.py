"""The recurrent mixers' time-mixing ops (composer.blocks.ops) and their context-parallel
variants (composer.parallel.context.recurrent), in fp64 and in one process: threads stand in for
the ranks of a cp group (its all-gather and reduce-scatter exchange through shared slots), so
``HaloConv`` and ``StatePassing`` run their whole recurrence over 2N chunks and over adaptive
pieces, and must equal the op run whole, outputs and gradients, for Mamba-2's scan, the delta
rule and a kind defined here (a scalar-decay linear attention that only subclasses
``LinearRecurrence``); the mixers with their ops swapped equal the mixers. Real gloo ranks:
tests/parallel/test_context.py."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from composer.blocks.cache import Step
from composer.blocks.gdn import DeltaRule, GatedDeltaNet
from composer.blocks.mamba2 import Mamba2Mixer, SSDScan
from composer.blocks.ops import CausalConv, LinearRecurrence, keep_mask
from composer.blocks.protocol import time_ops
from composer.blocks.split import SplitCausalConv1d
from composer.config import GDNConfig, MambaConfig, ModelConfig
from composer.parallel.context import layout as cp_layout
from composer.parallel.context.adaptive import _adaptive_meta, adaptive_layout
from composer.parallel.context.layout import CPContext, local_index
from composer.parallel.context.recurrent import HaloConv, StatePassing
from composer.parallel.context.variants import variant_factory

F64 = torch.float64


class DecayAttention(LinearRecurrence):
    """A kind's own recurrence: ``S_t = a_t S_{t-1} + k_t v_t^T``, ``y_t = S_t^T q_t``
    (``q, k [B, T, K]``, ``v [B, T, V]``, ``a [B, T]`` in (0, 1]), written step by step."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, *,
                doc_ids: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                step: Step | None = None, **_: Any) -> torch.Tensor:
        return self._run(q, k, v, a, doc_ids, initial_state)[0]

    def _run(self, q, k, v, a, doc_ids, S):
        b, T, K = k.shape
        S = q.new_zeros(b, K, v.shape[-1]) if S is None else S
        M = q.new_ones(b)
        ys = []
        for t in range(T):
            a_t = a[:, t]
            if doc_ids is not None and t > 0:
                a_t = a_t * (doc_ids[:, t] == doc_ids[:, t - 1]).to(a.dtype)
            S = a_t[:, None, None] * S + k[:, t, :, None] * v[:, t, None, :]
            M = a_t * M
            ys.append((S * q[:, t, :, None]).sum(1))
        return torch.stack(ys, 1), S, M

    def end_state(self, q, k, v, a, *, doc_ids=None, **_: Any):
        _, S, M = self._run(q, k, v, a, doc_ids, None)  # a document start zeroes both
        return S, M

    @staticmethod
    def carry(M: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
        return M[..., None, None] * S

    def mask_steps(self, tokens: Sequence[torch.Tensor], keep_BT: torch.Tensor):
        q, k, v, a = tokens
        return q, k * keep_mask(keep_BT, k), v, torch.where(keep_BT, a, torch.ones_like(a))


class ThreadGroup:
    """One rank's handle on a group of threads: a barrier and a slot per rank."""

    def __init__(self, rank: int, slots: list, barrier: threading.Barrier) -> None:
        self.rank, self.slots, self.barrier = rank, slots, barrier

    def exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[self.rank] = x.contiguous()
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()  # every rank has read the slots before the next exchange
        return out


def _all_gather(x: torch.Tensor, dim: int, group: ThreadGroup, size: int) -> torch.Tensor:
    return torch.cat(group.exchange(x), dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: ThreadGroup, size: int,
                    rank: int) -> torch.Tensor:
    return sum(group.exchange(x)).chunk(size, dim)[rank].contiguous()


@pytest.fixture(autouse=True)
def threads_as_ranks(monkeypatch):
    monkeypatch.setattr(cp_layout, "all_gather", _all_gather)
    monkeypatch.setattr(cp_layout, "reduce_scatter", _reduce_scatter)


def in_ranks(n: int, fn: Callable[[int, ThreadGroup], Any]) -> list:
    """``fn(rank, group)`` on ``n`` threads at once (a failing rank aborts the others)."""
    slots: list = [None] * n
    barrier = threading.Barrier(n, timeout=120)
    out: list = [None] * n
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            out[r] = fn(r, ThreadGroup(r, slots, barrier))
        except BaseException as e:  # noqa: BLE001  (re-raised below, in the test's thread)
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


DOC_BT = torch.tensor([[0] * 9 + [1] * 3 + [2] * 12, [0] * 24])
"""Two rows of 24: documents across the chunk boundaries and one whole row."""


def _chunk_cp(group: ThreadGroup, n: int, doc_BT: torch.Tensor | None,
              T: int) -> tuple[CPContext, torch.Tensor]:
    """Rank ``group.rank``'s context and its tokens' positions in the 2N-chunk layout."""
    cp = CPContext(group=group, size=n, rank=group.rank)
    idx = local_index(T, n, group.rank)
    cp.set_rows(T, idx.expand(2, -1), doc_BT)
    return cp, idx


def _adaptive_cp(group: ThreadGroup, n: int) -> tuple[CPContext, torch.Tensor]:
    """Rank ``group.rank``'s context and its tokens' positions in the flattened rows, in the
    adaptive layout of :data:`DOC_BT` (the two long documents cut in ``2n`` pieces)."""
    cp = CPContext(group=group, size=n, rank=group.rank, adaptive=True)
    cp.layout = adaptive_layout(DOC_BT.numpy(), n, min_tokens=10, halo=3)
    assert sum(p.prev is not None for p in cp.layout.pieces) == 2 * (2 * n - 1)
    _adaptive_meta(cp, torch.device("cpu"))
    T = DOC_BT.shape[1]
    mine = [cp.layout.pieces[i] for i in cp.layout.of_rank(group.rank)]
    idx = torch.cat([torch.arange(p.row * T + p.start, p.row * T + p.start + p.length)
                     for p in mine])
    return cp, idx



def _tokens(op: LinearRecurrence, b: int, T: int, gen: torch.Generator) -> tuple[list, dict]:
    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=F64)

    if isinstance(op, SSDScan):
        consts = dict(A_H=-torch.rand(4, generator=gen, dtype=F64) - 0.5, chunk_size=5,
                      D_H=r(4), dt_bias_H=r(4), dt_softplus=True, dt_limit=(0.0, float("inf")))
        return [r(b, T, 4, 3), r(b, T, 4), r(b, T, 2, 5), r(b, T, 2, 5)], consts
    if isinstance(op, DeltaRule):
        q, k = (torch.nn.functional.normalize(r(b, T, 2, 4), dim=-1) for _ in range(2))
        g = -torch.rand(b, T, 4, generator=gen, dtype=F64)
        beta = torch.rand(b, T, 4, generator=gen, dtype=F64)
        return [q, k, r(b, T, 4, 3), g, beta], {"chunk_size": 5}
    a = torch.rand(b, T, generator=gen, dtype=F64) * 0.5 + 0.5
    return [r(b, T, 4), r(b, T, 4), r(b, T, 3), a], {}


def _weights(like: torch.Tensor) -> torch.Tensor:
    return torch.linspace(-1, 1, like.numel(), dtype=like.dtype).view_as(like)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and (a - b).abs().max() < 1e-10


OPS = [SSDScan, DeltaRule, DecayAttention]


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``[B, T, ...] -> [1, B T, ...]``: the rows end to end (the adaptive layout's tokens)."""
    return t.reshape(1, t.shape[0] * t.shape[1], *t.shape[2:])


def _rows(t: torch.Tensor, b: int) -> torch.Tensor:
    return t.reshape(b, t.shape[1] // b, *t.shape[2:])


def _check_ranks(variant: Callable, cut: Callable, tokens: list[torch.Tensor],
                 ref: torch.Tensor, n: int) -> None:
    """Every rank's ``variant(cp, its tokens)`` equals ``ref`` at its tokens, and so do the
    gradients of a weighted sum of the outputs (every rank's backward exchanging too)."""
    leaves = [t.detach().requires_grad_() for t in tokens]
    w = _weights(ref)
    ref_grads = torch.autograd.grad((ref * w).sum(), tokens)

    def rank(r: int, group: ThreadGroup) -> tuple:
        cp, idx = cut(group)
        local = [t.detach()[:, idx].requires_grad_() for t in leaves]
        y = variant(cp, local, idx)
        grads = torch.autograd.grad((y * w[:, idx]).sum(), local)
        return idx, y.detach(), grads

    for idx, y, grads in in_ranks(n, rank):
        _close(y, ref[:, idx])
        for g, gr in zip(grads, ref_grads, strict=True):
            _close(g, gr[:, idx])


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("op_cls", OPS)
def test_state_passing_over_chunks_equals_the_op_whole(op_cls, docs: bool, n: int) -> None:
    op, (b, T) = op_cls(), DOC_BT.shape
    doc_BT = DOC_BT if docs else None
    tokens, consts = _tokens(op, b, T, torch.Generator().manual_seed(0))
    tokens = [t.requires_grad_() for t in tokens]
    ref = op(*tokens, doc_ids=doc_BT, **consts)

    def variant(cp: CPContext, local: list, idx: torch.Tensor) -> torch.Tensor:
        docs_local = None if doc_BT is None else doc_BT[:, idx]
        return StatePassing(op, cp)(*local, doc_ids=docs_local, **consts)

    _check_ranks(variant, lambda g: _chunk_cp(g, n, doc_BT, T), tokens, ref, n)


@pytest.mark.parametrize("op_cls", OPS)
def test_state_passing_over_adaptive_pieces_equals_the_op_whole(op_cls) -> None:
    """Long documents in 2N pieces across the ranks (their states passed along the pieces),
    short ones whole; a rank's pieces run as padded rows whose padding is identity steps."""
    op, (b, T) = op_cls(), DOC_BT.shape
    tokens, consts = _tokens(op, b, T, torch.Generator().manual_seed(1))
    flat = [_flat(t).requires_grad_() for t in tokens]
    ref = _flat(op(*(_rows(t, b) for t in flat), doc_ids=DOC_BT, **consts))

    def variant(cp: CPContext, local: list, idx: torch.Tensor) -> torch.Tensor:
        return StatePassing(op, cp)(*local, **consts)

    _check_ranks(variant, lambda g: _adaptive_cp(g, 2), flat, ref, 2)


def _conv(channels: int = 6, kernel: int = 4) -> SplitCausalConv1d:
    conv = SplitCausalConv1d({"a": 2, "b": channels - 2}, kernel, bias=True).double()
    conv.reset_parameters(torch.Generator().manual_seed(2))
    return conv


@pytest.mark.parametrize("docs", [False, True])
def test_halo_conv_equals_the_conv_whole(docs: bool) -> None:
    conv, op, doc_BT = _conv(), CausalConv(), DOC_BT if docs else None
    x = torch.randn(2, 24, 6, dtype=F64, generator=torch.Generator().manual_seed(3),
                    requires_grad=True)

    def chunks(cp: CPContext, local: list, idx: torch.Tensor) -> torch.Tensor:
        return HaloConv(op, cp)(local[0], conv)

    _check_ranks(chunks, lambda g: _chunk_cp(g, 2, doc_BT, 24), [x],
                 op(x, conv, doc_ids=doc_BT), 2)

    def pieces(cp: CPContext, local: list, idx: torch.Tensor) -> torch.Tensor:
        return HaloConv(op, cp)(local[0], conv)

    flat = _flat(x.detach()).requires_grad_()
    _check_ranks(pieces, lambda g: _adaptive_cp(g, 2), [flat],
                 _flat(op(_rows(flat, 2), conv, doc_ids=DOC_BT)), 2)


def _mixers() -> list[torch.nn.Module]:
    mamba = ModelConfig(pattern="M", d_model=16, init_std=0.2,
                        mamba=MambaConfig(n_heads=4, d_head=4, d_state=5, n_groups=2,
                                          chunk_size=5))
    gdn = ModelConfig(pattern="G", d_model=16, init_std=0.2,
                      gdn=GDNConfig(n_heads=4, n_kv_heads=2, d_head_k=4, d_head_v=3,
                                    chunk_size=5))
    out = []
    for cls, cfg in ((Mamba2Mixer, mamba), (GatedDeltaNet, gdn)):
        mixer = cls(cfg)
        mixer.reset_parameters(torch.Generator().manual_seed(4))
        out.append(mixer.double())
    return out


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("index", [0, 1])
def test_mixers_with_their_ops_swapped_equal_the_mixers(index: int, adaptive: bool) -> None:
    """What ``apply_cp`` does to a mixer (its declared ops swapped for the registered
    variants): the same state dict, and on each rank the mixer's outputs at its tokens."""
    mixer = _mixers()[index]
    x = torch.randn(1, 48, 16, dtype=F64, generator=torch.Generator().manual_seed(5),
                    requires_grad=True)  # the rows end to end
    x_rows = _rows(x, 2)
    ref = mixer(x_rows, doc_ids=DOC_BT)
    assert [type(op).__name__ for _, op in time_ops(mixer)][0] == "CausalConv"
    keys = set(mixer.state_dict())
    copies = [copy.deepcopy(mixer) for _ in range(2)]  # one a rank: the swaps are per rank

    def variant(cp: CPContext, local: list, idx: torch.Tensor) -> torch.Tensor:
        rank_mixer = copies[cp.rank]
        for name, op in time_ops(rank_mixer):
            setattr(rank_mixer, name, variant_factory(op)(op, cp))
        assert set(rank_mixer.state_dict()) == keys
        docs = _flat(DOC_BT)[:, idx] if adaptive else DOC_BT[:, idx]
        return rank_mixer(local[0], doc_ids=docs)

    if adaptive:
        _check_ranks(variant, lambda g: _adaptive_cp(g, 2), [x], _flat(ref), 2)
    else:
        _check_ranks(variant, lambda g: _chunk_cp(g, 2, DOC_BT, 24), [x_rows], ref, 2)
