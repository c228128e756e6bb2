"""FlexAttention, the CUDA path of every masked attention (composer.kernels.flex), against the
dense-mask torch paths: packed documents (GQA, MLA's widths), sliding window with documents,
attention sinks, the context-parallel chunks, the adaptive layout, and cached calls of several
tokens (KV cache with padding, the ring of a windowed layer, MLA's prompt and absorbed form).

Each case runs twice on the same inputs: the dense path (``probe.on_gpu`` false) and the flex
path (``probe.on_gpu`` true, so the dispatch is the one a CUDA tensor takes). During the flex run
every dense-mask builder raises (``doc_causal_mask``, ``window_mask``, the cached calls'
``attention_mask`` beyond one token, the adaptive layout's ``adaptive_dense_mask``, and any
``attend`` given a mask), and flex must have run. On a CPU flex runs its eager reference
implementation (torch refuses its CPU backward by a Python check only, lifted here); on a GPU
(bench/gpu_check.sh) the same tests run the compiled kernels on CUDA tensors.

Tolerance: fp32 values of order 1 through one softmax; the two paths differ only in summation
order and in how the softmax is normalised (a few ulps, ~1e-6): 1e-5, forward and gradients.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import composer
from composer.blocks import attn_core, mla
from composer.blocks.attn_core import CausalAttention
from composer.config import MLAConfig, ModelConfig, apply_overrides
from composer.kernels import flex, probe
from composer.kernels import sdpa as ksdpa
from composer.kernels.sdpa import doc_sdpa
from composer.parallel.context import adaptive
from composer.parallel.context import attention as cp_attention
from composer.parallel.context.layout import CPContext, local_index

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(atol=1e-5, rtol=1e-5)
T = 40
DOC = torch.tensor([[0] * 7 + [1] * 16 + [2] * 17, [5] * 16 + [6] * 24])  # edges at 16 and not


def _raises(name: str) -> Callable[..., None]:
    def dense(*args, **kwargs) -> None:
        raise AssertionError(f"{name} called on the flex path")
    return dense


def _patch(mp: pytest.MonkeyPatch, use_flex: bool, calls: list) -> None:
    mp.setattr(probe, "on_gpu", lambda t: use_flex)
    if not use_flex:
        return
    import torch.nn.attention.flex_attention as fa
    mp.setattr(fa, "_validate_device", lambda *a: None)  # its CPU backward: eager, by autograd
    functions = flex._functions
    mp.setattr(flex, "_functions", lambda q: calls.append(q.shape) or functions(q))
    for module, name in ((ksdpa, "doc_causal_mask"), (attn_core, "doc_causal_mask"),
                         (adaptive, "adaptive_dense_mask")):
        mp.setattr(module, name, _raises(name))
    window_mask = attn_core.window_mask  # one decoded token: one row, linear in the keys
    mp.setattr(attn_core, "window_mask", lambda q_pos, k_pos, w: (
        window_mask(q_pos, k_pos, w) if len(q_pos) == 1 else _raises("window_mask")()))
    attend = attn_core.attend

    def unmasked(*args, mask=None, **kwargs):
        if mask is not None and mask.shape[-2] > 1:
            raise AssertionError(f"attend with a dense mask {tuple(mask.shape)} on the flex path")
        return attend(*args, mask=mask, **kwargs)
    mp.setattr(attn_core, "attend", unmasked)
    for module in (attn_core, mla):
        mask_of = module.attention_mask
        mp.setattr(module, "attention_mask", lambda ctx, f=mask_of: (
            f(ctx) if ctx.pos_BT.shape[1] == 1 else _raises("attention_mask")()))


def _both(fn: Callable[..., torch.Tensor], leaves: list[torch.Tensor], grads: bool = True
          ) -> None:
    """``fn(*leaves)`` on the dense and the flex path: equal outputs and gradients, and the flex
    run went through flex."""
    results = []
    for use_flex in (False, True):
        calls: list = []
        with pytest.MonkeyPatch.context() as mp:
            _patch(mp, use_flex, calls)
            xs = [x.detach().clone().requires_grad_(grads) for x in leaves]
            with torch.set_grad_enabled(grads):
                out = fn(*xs)
                g = torch.Generator(device=out.device).manual_seed(0)
                do = torch.randn(out.shape, generator=g, device=out.device, dtype=out.dtype)
                gs = torch.autograd.grad(out, xs, do) if grads else ()
        assert bool(calls) == use_flex, calls
        results.append((out.detach(), gs))
    (o_dense, g_dense), (o_flex, g_flex) = results
    torch.testing.assert_close(o_flex, o_dense, **TOL)
    for a, b in zip(g_flex, g_dense, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE)


@pytest.mark.parametrize("heads", [(4, 2, 8, 8), (2, 2, 12, 6)], ids=["gqa", "mla-widths"])
def test_doc_sdpa(heads):
    h, k, e, v = heads
    doc = DOC.to(DEVICE)
    _both(lambda q, k_, v_: doc_sdpa(q, k_, v_, doc, 0.3),
          [_randn(2, h, T, e, seed=1), _randn(2, k, T, e, seed=2), _randn(2, k, T, v, seed=3)])


@pytest.mark.parametrize("case", [
    dict(window=5), dict(window=5, docs=True), dict(sinks=True),
    dict(window=6, docs=True, sinks=True), dict(docs=True, sinks=True)],
    ids=lambda c: "-".join(c))
def test_causal_attention(case):
    op = CausalAttention(case.get("window"))
    doc = DOC.to(DEVICE) if case.get("docs") else None
    leaves = [_randn(2, 4, T, 8, seed=1), _randn(2, 2, T, 8, seed=2), _randn(2, 2, T, 8, seed=3)]
    if case.get("sinks"):
        leaves.append(_randn(4, seed=4))
    _both(lambda q, k, v, *s: op(q, k, v, None, 0.35, doc_ids=doc, sinks=s[0] if s else None),
          leaves)


@pytest.mark.parametrize("case", [dict(), dict(docs=True), dict(docs=True, window=9),
                                  dict(docs=True, sinks=True), dict(window=7, sinks=True)],
                         ids=lambda c: "-".join(c) or "causal")
def test_context_parallel_chunks(case):
    """chunk_attention (cp size 2): each rank's two chunks against the gathered keys."""
    n, t = 2, 48
    doc = torch.tensor([[0] * 10 + [1] * 20 + [2] * 18]).to(DEVICE)
    for rank in range(n):
        cp = CPContext(None, n, rank)
        cp.set_rows(t, torch.zeros(1, t // n, dtype=torch.long), doc if case.get("docs") else None)
        idx = local_index(t, n, rank, DEVICE)
        leaves = [_randn(1, 4, t, 8, seed=1)[:, :, idx], _randn(1, 2, t, 8, seed=2),
                  _randn(1, 2, t, 8, seed=3)]
        if case.get("sinks"):
            leaves.append(_randn(4, seed=4))
        _both(lambda q, k, v, *s, cp=cp: cp_attention.chunk_attention(
            q, k, v, cp, 0.35, case.get("window"), s[0] if s else None), leaves)


@pytest.mark.parametrize("case", [dict(), dict(window=4, sinks=True)],
                         ids=lambda c: "-".join(c) or "docs")
def test_adaptive_layout(case):
    """The adaptive layout's documents (cp size 2): a long document split, short ones whole."""
    n = 2
    doc = torch.tensor([[0] * 24 + [1] * 5 + [2] * 3, [3] * 6 + [4] * 26])
    layout = adaptive.adaptive_layout(doc.numpy(), n, 16, 1)
    for rank in range(n):
        cp = CPContext(None, n, rank, T=doc.shape[1], layout=layout)
        leaves = [_randn(1, 4, layout.tokens(rank), 8, seed=1 + rank),
                  _randn(1, 2, n * layout.max_tokens, 8, seed=5),
                  _randn(1, 2, n * layout.max_tokens, 8, seed=6)]
        if case.get("sinks"):
            leaves.append(_randn(4, seed=4))

        def fn(q, k, v, *s, cp=cp):
            adaptive._adaptive_meta(cp, q.device)  # per batch, on the path's device rule
            return cp_attention._attend(q, k, v, cp, 0.35, case.get("window"),
                                        s[0] if s else None)
        _both(fn, leaves)


def _model(pattern: str, extra: dict) -> composer.HybridModel:
    cfg = ModelConfig(pattern=pattern)
    sizes = {"d_model": 32, "vocab_size": 61, "attention.n_heads": 4,
             "attention.n_kv_heads": 2, "mlp.d_ff": 64, "attention.window": 3, **extra}
    apply_overrides(cfg, [f"{k}={str(v).lower()}" for k, v in sizes.items()])
    if "+" in pattern:
        cfg.mla = MLAConfig(n_heads=2, q_lora_rank=None, kv_lora_rank=16, d_head_nope=8,
                            d_head_rope=4, d_head_v=6)
    model = composer.build_model(cfg.validate(), seed=0).to(DEVICE)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2, generator=torch.Generator(device=DEVICE).manual_seed(1))
    return model.eval()


@pytest.mark.parametrize("pattern,extra", [("W-*-", {"attention.sinks": True}), ("+-", {})],
                         ids=["ring-kv-sinks", "mla"])
def test_cached_calls(pattern, extra):
    """A left-padded prompt, then calls of several tokens (the ring wraps; MLA's later calls
    are its absorbed form), then one token (dense: its mask is one row)."""
    model = _model(pattern, extra)
    ids = torch.randint(0, 61, (2, 14), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]]).to(DEVICE)

    def decode(ids_: torch.Tensor) -> torch.Tensor:
        cache = model.new_cache(2, 14)
        parts = [model.forward_cached(ids_[:, :6], cache, attention_mask=mask, last_only=False)]
        parts += [model.forward_cached(ids_[:, a:b], cache, last_only=False)
                  for a, b in ((6, 9), (9, 13), (13, 14))]
        return torch.cat(parts, 1)
    _both(decode, [ids], grads=False)


def test_mla_packed_documents():
    """MLA's training form by ``doc_ids``, through the whole block (input gradient)."""
    model = _model("+", {})
    block = model.layers["0"].mixer
    doc = DOC.to(DEVICE)
    _both(lambda x: block(x, doc_ids=doc), [_randn(2, T, 32, seed=7)])


def test_disable_switch_keeps_dense_masks(monkeypatch):
    """``COMPOSER_DISABLE_KERNELS=flex``: CUDA tensors back on the dense masks."""
    monkeypatch.setenv(probe.ENV_DISABLE, "flex")
    probe.reset()
    monkeypatch.setattr(probe, "on_gpu", lambda t: True)
    try:
        assert not flex.use_flex(torch.zeros(1))
    finally:
        monkeypatch.delenv(probe.ENV_DISABLE)
        probe.reset()
    assert flex.use_flex(torch.zeros(1))
