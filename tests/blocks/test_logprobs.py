"""Per-token log-probs and entropies (``HybridModel.token_logprobs``, chunked) against the plain
twin (whole logits, ``log_softmax``) in fp64 with every gradient; completion targets; LoRA's
``disabled``."""

from __future__ import annotations

import pytest
import torch

import composer.blocks.logprobs as logprobs_mod
from composer.blocks.logprobs import linear_token_logprobs, token_logprobs_ref
from composer.blocks.loss import IGNORE_INDEX
from composer.blocks.model import completion_targets
from composer.build.builder import build_model
from composer.config import ModelConfig, apply_overrides
from composer.lora import LoRAConfig, adapter_names, add_lora, disabled
from tests.helpers import randomize

F64 = torch.float64
TINY = ["d_model=16", "vocab_size=37", "attention.n_heads=2", "attention.n_kv_heads=1",
        "mamba.n_heads=2", "mamba.d_head=8", "mamba.n_groups=1", "mamba.d_state=4",
        "mamba.chunk_size=4", "mlp.d_ff=32", "moe.n_experts=4", "moe.top_k=2", "moe.d_ff=16",
        "moe.n_shared_experts=1", "moe.aux_loss_coeff=0.01", "gdn.n_heads=2",
        "gdn.n_kv_heads=2", "gdn.d_head_k=8", "gdn.d_head_v=8", "gdn.chunk_size=4",
        "mla.n_heads=2", "mla.kv_lora_rank=8", "mla.q_lora_rank=8", "mla.d_head_nope=4",
        "mla.d_head_rope=4", "mla.d_head_v=4"]
PATTERNS = ["M*-", "G*", "+E", "*E"]


def tiny(pattern: str, dtype: torch.dtype = F64, extra: tuple[str, ...] = ()) -> torch.nn.Module:
    cfg = apply_overrides(ModelConfig(pattern=pattern), [*TINY, *extra]).validate()
    model = build_model(cfg, seed=0)
    randomize(model, seed=1, std=0.2)
    return model.to(dtype)


def _batch(vocab: int, b: int = 3, t: int = 30, seed: int = 2):
    """Ids, packed doc ids, and completion targets with ignored positions in every row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    doc_ids = (torch.arange(t) >= t // 3).long().expand(b, t).clone()
    mask = torch.rand(b, t, generator=g) > 0.3
    return ids, doc_ids, completion_targets(ids, mask)


def _weights(shape: torch.Size, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_model_logprobs_and_grads_equal_the_plain_twin_fp64(pattern: str, monkeypatch) -> None:
    """fp64, two chunks of rows (90 rows, 64 a chunk), temperature and logits scaling, packed
    documents: log-probs, entropies, aux loss and every parameter's gradient of a weighted sum
    of both agree with the whole-logits twin to 1e-12."""
    monkeypatch.setattr(logprobs_mod, "CHUNK_ELEMENTS", 1)  # 64 rows a chunk
    model = tiny(pattern, extra=("logits_scaling=1.7",))
    ids, doc_ids, targets = _batch(model.config.vocab_size)
    kw = {"doc_ids": doc_ids, "temperature": 0.8, "entropy": True}
    got = model.token_logprobs(ids, targets, **kw)
    want = token_logprobs_ref(model, ids, targets, **kw)
    assert got.logp.dtype == F64 and got.logp.shape == targets.shape
    ignored = targets == IGNORE_INDEX
    assert bool((got.logp[ignored] == 0).all() and (got.entropy[ignored] == 0).all())
    assert bool((got.logp[~ignored] < 0).all())
    torch.testing.assert_close(got.logp, want.logp, atol=1e-12, rtol=0)
    torch.testing.assert_close(got.entropy, want.entropy, atol=1e-12, rtol=0)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, atol=1e-12, rtol=0)
    if "E" in pattern:
        assert got.aux_loss.item() > 0
    a, c = _weights(targets.shape, 3), _weights(targets.shape, 4)
    params = [p for p in model.parameters()]
    g_got = torch.autograd.grad((a * got.logp + c * got.entropy).sum() + got.aux_loss, params)
    g_want = torch.autograd.grad((a * want.logp + c * want.entropy).sum() + want.aux_loss,
                                 params)
    for (name, _), x, y in zip(model.named_parameters(), g_got, g_want, strict=True):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=0, msg=name)


@pytest.mark.parametrize("rows", [1, 7, 64, 100])
@pytest.mark.parametrize("entropy", [False, True])
def test_head_math_any_chunking_and_one_sided_gradients(rows: int, entropy: bool) -> None:
    """The chunked head on its own: values and the gradients of h and W (each alone, and only
    the log-probs' when the entropy is not used) equal autograd through ``log_softmax``."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(70, 12, generator=g, dtype=F64).requires_grad_()
    w = (torch.randn(53, 12, generator=g, dtype=F64) * 0.5).requires_grad_()
    t = torch.randint(0, 53, (70,), generator=g)
    t[::5] = IGNORE_INDEX
    logp, ent = linear_token_logprobs(h, w, t, 0.3, entropy, chunk_rows=rows)
    z = torch.log_softmax(0.3 * h @ w.T, -1)
    want = torch.where(t != IGNORE_INDEX, z.gather(1, t.clamp(min=0)[:, None])[:, 0], 0.0)
    torch.testing.assert_close(logp, want, atol=1e-12, rtol=0)
    assert (ent is None) != entropy
    a = _weights(logp.shape, 5)
    for inputs in ((h,), (w,), (h, w)):
        got = torch.autograd.grad((a * logp).sum(), inputs, retain_graph=True)
        ref = torch.autograd.grad((a * want).sum(), inputs, retain_graph=True)
        for x, y in zip(got, ref, strict=True):
            torch.testing.assert_close(x, y, atol=1e-12, rtol=0)
    with torch.no_grad():
        again, _ = linear_token_logprobs(h, w, t, 0.3, entropy, chunk_rows=rows)
    assert torch.equal(again, logp.detach())


def test_fp32_model_logprobs_are_fp32_and_close_to_fp64() -> None:
    model = tiny("M*-", torch.float32)
    ids, doc_ids, targets = _batch(model.config.vocab_size)
    got = model.token_logprobs(ids, targets, doc_ids=doc_ids).logp
    want = token_logprobs_ref(model.double(), ids, targets, doc_ids=doc_ids).logp
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max() < 1e-5


def test_temperature_zero_scores_the_logits_own_distribution() -> None:
    model = tiny("*E")
    ids, _, targets = _batch(model.config.vocab_size)
    torch.testing.assert_close(model.token_logprobs(ids, targets, temperature=0.0).logp,
                               model.token_logprobs(ids, targets).logp, atol=0, rtol=0)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        model.token_logprobs(ids, targets, temperature=-1.0)


def test_completion_targets() -> None:
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 0]])
    assert completion_targets(ids, mask).tolist() == [[-100, 7, 8, -100, -100]]
    with pytest.raises(ValueError, match="mask must be shaped like ids"):
        completion_targets(ids, mask[:, :3])


def test_bad_targets_are_one_line_errors() -> None:
    model = tiny("*E")
    ids, _, targets = _batch(model.config.vocab_size)
    with pytest.raises(ValueError, match=r"target 37 is outside the vocabulary \[0, 37\)"):
        model.token_logprobs(ids, targets.masked_fill(targets == 3, 37))
    with pytest.raises(ValueError, match="targets must be integers shaped like input_ids"):
        model.token_logprobs(ids, targets[:, 1:])


@pytest.mark.parametrize("targets", [("all",), ("experts", "q_proj")])
def test_lora_disabled_computes_the_base(targets: tuple[str, ...]) -> None:
    """Random (nonzero) adapters change the logits; inside ``disabled`` the model computes the
    base bit for bit, routed-expert adapters included; on exit (nested too) the adapters are
    back."""
    base = tiny("M*-EG+")
    ids = _batch(base.config.vocab_size)[0]
    with torch.no_grad():
        want = base(ids)
        model = tiny("M*-EG+")
        add_lora(model, LoRAConfig(rank=2, targets=targets))
        names = adapter_names(model)
        g = torch.Generator().manual_seed(9)
        for name, p in model.named_parameters():
            if name in names:
                p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * 0.3)
        adapted = model(ids)
        assert (adapted - want).abs().max() > 1e-3
        with disabled(model):
            assert torch.equal(model(ids), want)
            with disabled(model):  # nested: still off inside, and still off after
                assert torch.equal(model(ids), want)
            assert torch.equal(model(ids), want)
        assert torch.equal(model(ids), adapted)
