"""The recurrent mixers' time-mixing ops (composer.blocks.ops) and their context-parallel
variants (composer.parallel.context.recurrent), in fp64 and in one process: a fake one-rank cp
group (its gathers the identity) still runs the variants' whole recurrence over chunks (2N = 2)
and over adaptive pieces (a long document cut in two), so ``HaloConv`` and ``StatePassing`` must
equal the op run whole, outputs and gradients, for Mamba-2's scan, the delta rule and a kind
defined here (a scalar-decay linear attention that only subclasses ``LinearRecurrence``); the
mixers with their ops swapped equal the mixers. The ranks' exchanges: tests/distributed."""

from __future__ import annotations

from collections.abc import Sequence
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
from composer.parallel.context.layout import CPContext
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


@pytest.fixture(autouse=True)
def one_rank(monkeypatch):
    """A one-rank cp group: every gather and reduce-scatter is the identity."""
    monkeypatch.setattr(cp_layout, "all_gather", lambda x, dim, group, size: x.contiguous())
    monkeypatch.setattr(cp_layout, "reduce_scatter",
                        lambda x, dim, group, size, rank: x.contiguous())


DOC_BT = torch.tensor([[0] * 9 + [1] * 3 + [2] * 12, [0] * 24])
"""Two rows of 24: documents across the chunk boundary (12) and one whole row."""


def _chunk_cp(doc_BT: torch.Tensor | None, T: int) -> CPContext:
    cp = CPContext(group=None, size=1, rank=0)
    cp.set_rows(T, torch.arange(T).expand(2, -1), doc_BT)
    return cp


def _adaptive_cp(doc_BT: torch.Tensor) -> CPContext:
    cp = CPContext(group=None, size=1, rank=0, adaptive=True)
    cp.layout = adaptive_layout(doc_BT.numpy(), 1, min_tokens=10, halo=3)
    assert sum(p.prev is not None for p in cp.layout.pieces) == 2  # documents cut in two
    _adaptive_meta(cp, torch.device("cpu"))
    return cp


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


def _grads(out: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return list(torch.autograd.grad((out * w).sum(), inputs))


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert (a - b).abs().max() < 1e-10


OPS = [SSDScan, DeltaRule, DecayAttention]


@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("op_cls", OPS)
def test_state_passing_over_chunks_equals_the_op_whole(op_cls, docs: bool) -> None:
    op, T = op_cls(), 24
    doc_BT = DOC_BT if docs else None
    tokens, consts = _tokens(op, 2, T, torch.Generator().manual_seed(0))
    tokens = [t.requires_grad_() for t in tokens]
    ref = op(*tokens, doc_ids=doc_BT, **consts)
    got = StatePassing(op, _chunk_cp(doc_BT, T))(*tokens, doc_ids=doc_BT, **consts)
    _close(got, ref)
    for g, r in zip(_grads(got, tokens), _grads(ref, tokens), strict=True):
        _close(g, r)


@pytest.mark.parametrize("op_cls", OPS)
def test_state_passing_over_adaptive_pieces_equals_the_op_whole(op_cls) -> None:
    """The rank's tokens are the rows end to end; padded piece rows are identity steps."""
    op, (b, T) = op_cls(), DOC_BT.shape
    tokens, consts = _tokens(op, b, T, torch.Generator().manual_seed(1))
    tokens = [t.requires_grad_() for t in tokens]
    whole = op(*tokens, doc_ids=DOC_BT, **consts)
    ref = whole.reshape(1, b * T, *whole.shape[2:])
    flat = [t.reshape(1, b * T, *t.shape[2:]) for t in tokens]
    got = StatePassing(op, _adaptive_cp(DOC_BT))(*flat, **consts)
    assert got.shape == ref.shape
    _close(got, ref)
    for g, r in zip(_grads(got, tokens), _grads(ref, tokens), strict=True):
        _close(g, r)


def _conv(channels: int = 6, kernel: int = 4) -> SplitCausalConv1d:
    conv = SplitCausalConv1d({"a": 2, "b": channels - 2}, kernel, bias=True).double()
    conv.reset_parameters(torch.Generator().manual_seed(2))
    return conv


@pytest.mark.parametrize("docs", [False, True])
def test_halo_conv_equals_the_conv_whole(docs: bool) -> None:
    conv, op, doc_BT = _conv(), CausalConv(), DOC_BT if docs else None
    x = torch.randn(2, 24, 6, dtype=F64, generator=torch.Generator().manual_seed(3))
    ref = op(x, conv, doc_ids=doc_BT)
    _close(HaloConv(op, _chunk_cp(doc_BT, 24))(x, conv, doc_ids=doc_BT), ref)
    got = HaloConv(op, _adaptive_cp(DOC_BT))(x.reshape(1, 48, 6), conv)
    _close(got, op(x, conv, doc_ids=DOC_BT).reshape(1, 48, 6))


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
    variants): the same state dict, and the same outputs on the rank's tokens."""
    mixer = _mixers()[index]
    x = torch.randn(2, 24, 16, dtype=F64, generator=torch.Generator().manual_seed(5))
    ref = mixer(x, doc_ids=DOC_BT)
    keys = set(mixer.state_dict())
    cp = _adaptive_cp(DOC_BT) if adaptive else _chunk_cp(DOC_BT, 24)
    ops = time_ops(mixer)
    assert [type(op).__name__ for _, op in ops][0] == "CausalConv"
    for name, op in ops:
        setattr(mixer, name, variant_factory(op)(op, cp))
    assert set(mixer.state_dict()) == keys
    if adaptive:
        got = mixer(x.reshape(1, 48, 16), doc_ids=DOC_BT.reshape(1, 48))
        _close(got, ref.reshape(1, 48, 16))
    else:
        _close(mixer(x, doc_ids=DOC_BT), ref)
