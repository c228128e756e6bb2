"""Document isolation (``doc_ids``): a packed row computes what each of its documents computes
alone, in every layer kind: logits (fp32 1e-5, fp64 1e-10), the loss, the gradients (fp64), the
SSD scan with resets against its recurrence; ``doc_ids=None`` is bit-identical to no keyword."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from composer.blocks.attention import Attention, attention_ref
from composer.blocks.layer import Layer
from composer.blocks.mamba2 import Mamba2Mixer, mamba2_ref
from composer.blocks.model import mask_doc_boundaries
from composer.build.builder import build_model
from composer.config import (
    AttentionConfig,
    MambaConfig,
    MLPConfig,
    ModelConfig,
    MoEConfig,
    d_head_of,
)
from composer.kernels.packing import doc_causal_mask, doc_positions, doc_segments, seq_idx
from composer.kernels.ssd import ssd_scan, ssd_scan_ref
from tests.helpers import randomize

F64 = torch.float64
CHUNK = 8
# Lengths that do (8, 16) and do not (13, 11, 5, 1, 3) divide the chunk; a length-1 document.
ROWS = ([8, 13, 11], [5, 1, 16, 10])


def cfg() -> ModelConfig:
    return ModelConfig(
        pattern="M*-E", d_model=32, vocab_size=61,
        attention=AttentionConfig(n_heads=4, n_kv_heads=2),
        mamba=MambaConfig(n_heads=4, d_head=8, n_groups=2, d_state=8, chunk_size=CHUNK),
        mlp=MLPConfig(d_ff=64), moe=MoEConfig(n_experts=4, top_k=2, d_ff=32))


def model(dtype: torch.dtype = torch.float32) -> nn.Module:
    m = build_model(cfg(), seed=0)
    randomize(m, seed=1)
    return m.to(dtype)


def doc_ids_of(lengths: list[int], first: int = 0) -> torch.Tensor:
    return torch.cat([torch.full((n,), first + i) for i, n in enumerate(lengths)])


def packed(rows: tuple[list[int], ...] = ROWS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, doc_ids)`` for rows of equal total length; ids as the loader numbers documents
    (globally increasing, not from 0), which must not matter."""
    t = sum(rows[0])
    assert all(sum(r) == t for r in rows)
    ids = torch.randint(0, 61, (len(rows), t), generator=torch.Generator().manual_seed(seed))
    docs = torch.stack([doc_ids_of(r, first=10 * i + 3) for i, r in enumerate(rows)])
    return ids, docs


def alone(m: nn.Module, ids: torch.Tensor, rows: tuple[list[int], ...]) -> torch.Tensor:
    """Each document run by itself, its logits put back at its place in the row."""
    return torch.stack([torch.cat([m(piece) for piece in row.split(r, 1)], 1)[0]
                        for row, r in zip(ids[:, None], rows, strict=True)])


def test_doc_helpers() -> None:
    docs = torch.tensor([[4, 4, 4, 7, 9, 9], [0, 0, 0, 0, 0, 0]])
    assert doc_positions(docs).tolist() == [[0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 5]]
    assert doc_segments(docs).tolist() == [[0, 0, 0, 1, 2, 2], [0] * 6]
    assert seq_idx(docs).dtype == torch.int32 and seq_idx(docs).is_contiguous()
    mask = doc_causal_mask(docs)[0, 0].int()
    assert mask.tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                             [0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 1, 1]]
    labels = torch.arange(12).view(2, 6)
    assert mask_doc_boundaries(labels, docs).tolist() == [[0, 1, 2, -100, -100, 5],
                                                          [6, 7, 8, 9, 10, 11]]


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (F64, 1e-10)])
@pytest.mark.parametrize("rows", [ROWS[:1], ROWS], ids=["one-row", "two-packings"])
def test_packed_logits_equal_documents_alone(dtype: torch.dtype, tol: float,
                                             rows: tuple[list[int], ...]) -> None:
    m = model(dtype)
    ids, docs = packed(rows)
    with torch.no_grad():
        got, want, mixed = m(ids, doc_ids=docs), alone(m, ids, rows), m(ids)
    torch.testing.assert_close(got, want, atol=tol, rtol=0)
    assert (mixed - want).abs().max() > 0.1  # without doc_ids the documents do see each other


def test_loss_is_token_weighted_mean_of_documents() -> None:
    m = model(F64)
    ids, docs = packed()
    out = m(ids, ids, doc_ids=docs)
    losses, counts = [], []
    for row, lengths in zip(ids, ROWS, strict=True):
        for piece in row[None].split(lengths, 1):
            if piece.shape[1] > 1:  # a one-token document predicts nothing
                losses.append(m(piece, piece).loss)
                counts.append(piece.shape[1] - 1)
    want = sum(n * loss for n, loss in zip(counts, losses, strict=True)) / sum(counts)
    assert out.aux_loss.item() == 0.0
    torch.testing.assert_close(out.loss, want, atol=1e-12, rtol=0)


def test_gradients_are_sums_over_documents() -> None:
    """sum-of-token-losses of the packed batch == sum over documents of theirs, gradients of
    every parameter included (the scan's hand-written backward with resets)."""
    m = model(F64)
    ids, docs = packed()
    n_targets = sum(n - 1 for lengths in ROWS for n in lengths)
    (m(ids, ids, doc_ids=docs).loss * n_targets).backward()
    got = {k: p.grad.clone() for k, p in m.named_parameters()}
    m.zero_grad()
    total = 0
    for row, lengths in zip(ids, ROWS, strict=True):
        for piece in row[None].split(lengths, 1):
            if piece.shape[1] > 1:
                total = total + m(piece, piece).loss * (piece.shape[1] - 1)
    total.backward()
    assert set(got) == {k for k, p in m.named_parameters() if p.grad is not None}
    for k, p in m.named_parameters():
        scale = p.grad.abs().max().item()
        assert scale > 0, k
        torch.testing.assert_close(got[k], p.grad, atol=1e-10 * max(scale, 1.0), rtol=0, msg=k)


def test_none_is_bit_identical() -> None:
    """``doc_ids=None`` takes the same path as no keyword: logits, loss and gradients."""
    m = model()
    ids, _ = packed()
    runs = []
    for kwargs in ({}, {"doc_ids": None}):
        m.zero_grad()
        out = m(ids, ids, return_logits=True, **kwargs)
        out.loss.backward()
        runs.append([out.logits, out.loss, *(p.grad for p in m.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    assert torch.equal(m(ids), m(ids, doc_ids=None))


def _scan_inputs(T: int, b: int = 2, H: int = 4, G: int = 2, P: int = 3, N: int = 5):
    g = torch.Generator().manual_seed(T)
    return {"x_BTHP": torch.randn(b, T, H, P, generator=g, dtype=F64),
            "dt_BTH": torch.rand(b, T, H, generator=g, dtype=F64) * 0.9 + 0.01,
            "A_H": -torch.exp(torch.randn(H, generator=g, dtype=F64)),
            "B_BTGN": torch.randn(b, T, G, N, generator=g, dtype=F64),
            "C_BTGN": torch.randn(b, T, G, N, generator=g, dtype=F64),
            "D_H": torch.randn(H, generator=g, dtype=F64),
            "initial_state_BHPN": torch.randn(b, H, P, N, generator=g, dtype=F64)}


@pytest.mark.parametrize("chunk", [8, 5, 3, 64, 1])
def test_scan_resets_match_recurrence(chunk: int) -> None:
    """Chunks that do and do not divide the documents (8 | 8, 16; 5 | 5 only; 3 | nothing);
    the initial state belongs to the first document, the final state is the last one's."""
    inp = {k: v.requires_grad_() for k, v in _scan_inputs(37).items()}
    docs = torch.stack([doc_ids_of([8, 16, 13]), doc_ids_of([5, 1, 20, 11], first=7)])
    y, h = ssd_scan(**inp, chunk_size=chunk, return_final_state=True, doc_ids=docs)
    y_ref, h_ref = ssd_scan_ref(**inp, return_final_state=True, doc_ids=docs)
    torch.testing.assert_close(y, y_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(h, h_ref, atol=1e-10, rtol=0)
    g = torch.Generator().manual_seed(1)
    wy, wh = torch.randn(y.shape, generator=g, dtype=F64), torch.randn(h.shape, generator=g,
                                                                      dtype=F64)
    grads = torch.autograd.grad((y * wy).sum() + (h * wh).sum(), list(inp.values()))
    grads_ref = torch.autograd.grad((y_ref * wy).sum() + (h_ref * wh).sum(), list(inp.values()))
    for name, got, want in zip(inp, grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0, msg=name)
    # the resets matter: without them the outputs after the first boundary differ
    assert (ssd_scan(**inp, chunk_size=chunk) - y).abs()[:, 8:].max() > 1e-2


def test_scan_document_equals_scan_alone() -> None:
    """The second document of a packed scan equals that document scanned from zero."""
    inp = _scan_inputs(29, b=1)
    inp.pop("initial_state_BHPN")
    docs = doc_ids_of([10, 19])[None]
    y = ssd_scan(**inp, chunk_size=CHUNK, doc_ids=docs)
    tail = {k: (v[:, 10:] if v.dim() > 1 else v) for k, v in inp.items()}
    torch.testing.assert_close(y[:, 10:], ssd_scan(**tail, chunk_size=CHUNK), atol=1e-12, rtol=0)


def test_mixers_match_their_twins_with_docs() -> None:
    c = cfg()
    ids, docs = packed()
    x = torch.randn(*ids.shape, 32, generator=torch.Generator().manual_seed(3), dtype=F64)
    attn = Attention(c).double()
    randomize(attn, seed=2)
    w = {n: getattr(attn, n).weight for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    mamba = Mamba2Mixer(c).double()
    randomize(mamba, seed=4)
    weights = {k: v.detach() for k, v in mamba.state_dict().items()}
    with torch.no_grad():
        want = attention_ref(x, w, c.attention, d_head_of(c), c.norm_eps, doc_ids=docs)
        torch.testing.assert_close(attn(x, doc_ids=docs), want, atol=1e-10, rtol=0)
        want = mamba2_ref(x, weights, c, doc_ids=docs)
        torch.testing.assert_close(mamba(x, doc_ids=docs), want, atol=1e-10, rtol=0)


class _PlainMixer(nn.Module):
    """A user-registered mixer that knows nothing of documents."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def test_layer_passes_doc_ids_only_to_mixers_that_take_them() -> None:
    layer = Layer(cfg(), 0, mixer=_PlainMixer(), symbol="X")
    x = torch.randn(2, 32, 32)
    _, docs = packed()
    assert torch.equal(layer(x, doc_ids=docs), layer(x))


def test_activation_checkpointing_keeps_doc_ids() -> None:
    from composer.parallel.parallelize import apply_ac

    ids, docs = packed()
    runs = []
    for ac in (False, True):
        m = model(F64)
        if ac:
            apply_ac(m, "full")
        out = m(ids, ids, doc_ids=docs)
        out.loss.backward()
        runs.append([out.loss, *(p.grad for p in m.parameters())])
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_doc_ids_shape_is_checked() -> None:
    ids, docs = packed()
    with pytest.raises(ValueError, match=r"doc_ids must be integers shaped like input_ids"):
        model()(ids, doc_ids=docs[:, :-1])
