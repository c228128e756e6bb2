"""Cached decoding (composer.blocks.cache, composer.generate) against recomputing the whole
sequence, for every built layer kind; padding, sampling, eos and argument errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import composer
from composer.config import ModelConfig, apply_overrides
from composer.inference.decode import filter_logits
from composer.kernels.gdn import gdn_recurrent_ref, gdn_step
from composer.kernels.scan import ssd_step
from composer.kernels.ssd import ssd_scan_ref
from tests.helpers import randomize, rel_err

SIZES = {
    "d_model": 32, "vocab_size": 61,
    "gdn.n_heads": 4, "gdn.n_kv_heads": 2, "gdn.d_head_k": 8, "gdn.d_head_v": 8,
    "gdn.chunk_size": 4,
    "mla.n_heads": 4, "mla.q_lora_rank": 16, "mla.kv_lora_rank": 16, "mla.d_head_nope": 8,
    "mla.d_head_rope": 4, "mla.d_head_v": 8,
    "attention.n_heads": 4, "attention.n_kv_heads": 2,
    "mamba.n_heads": 4, "mamba.d_head": 8, "mamba.n_groups": 2, "mamba.d_state": 8,
    "mamba.chunk_size": 4, "mlp.d_ff": 64, "moe.n_experts": 4, "moe.top_k": 2, "moe.d_ff": 32}
"""Chunk sizes of 4: the prompts below cross chunk boundaries, with a partial last chunk."""

VARIANTS = {
    "every-kind": ("G+M*-E", {}),
    "attention-options": ("*-*E", {"attention.output_gate": True, "attention.qk_norm": True,
                                   "attention.rotary_fraction": 0.5, "post_norm_layers": [2, 3]}),
    "mla-plain-q": ("+-+E", {"mla.q_lora_rank": None}),
    "recurrent-only": ("MGMG", {"mamba.d_conv": 2, "gdn.allow_neg_eigval": True}),
    "kimi-linear": ("K-+E", {"kda.n_heads": 2, "kda.d_head": 8, "kda.chunk_size": 4,
                             "mla.rope": False, "mla.q_lora_rank": None}),
}


def tiny(pattern: str, extra: dict | None = None, seed: int = 0) -> composer.HybridModel:
    cfg = ModelConfig(pattern=pattern)
    values = {**SIZES, **(extra or {})}
    apply_overrides(cfg, [f"{k}={_yaml(v)}" for k, v in values.items()])
    model = composer.build_model(cfg.validate(), seed=seed)
    randomize(model, seed=seed + 1, std=0.1)
    return model.eval()


def _yaml(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    return str(v)


def prompts(vocab: int, lengths: tuple[int, ...] = (11, 6, 1)) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of ``lengths`` and their attention mask."""
    t = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), t), generator=torch.Generator().manual_seed(7))
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, t - n:] = 1
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_steps_equal_the_full_forward(variant: str) -> None:
    """Every step's logits (the prompt's last, then each decoded token's) equal the full forward
    of the sequence so far, padding as an isolated earlier document; the greedy tokens too."""
    model = tiny(*VARIANTS[variant])
    ids, mask = prompts(model.config.vocab_size)
    n_new = 9
    cache = model.new_cache(ids.shape[0], ids.shape[1] + n_new)
    seq, seq_mask = ids, mask
    with torch.no_grad():
        logits = model.forward_cached(ids, cache, attention_mask=mask)
        for _ in range(n_new):
            full = model(seq, doc_ids=seq_mask)[:, -1]
            assert rel_err(logits, full) < 1e-5, rel_err(logits, full)
            token = logits.argmax(-1)
            assert torch.equal(token, full.argmax(-1))
            seq = torch.cat([seq, token[:, None]], 1)
            seq_mask = F.pad(seq_mask, (0, 1), value=1)
            logits = model.forward_cached(token[:, None], cache)
    assert cache.length == ids.shape[1] + n_new
    assert torch.equal(composer.generate(model, ids, n_new, attention_mask=mask),
                       composer.generate(model, ids, n_new, attention_mask=mask,
                                         use_cache=False))


def test_padded_rows_equal_each_prompt_alone() -> None:
    model = tiny("G+M*-E")
    ids, mask = prompts(model.config.vocab_size)
    batch = composer.generate(model, ids, 8, attention_mask=mask)
    for row in range(ids.shape[0]):
        alone = ids[row:row + 1, mask[row].bool()]
        got = composer.generate(model, alone, 8)
        assert torch.equal(batch[row, -8:], got[0, -8:]), row


def test_prompt_in_pieces_equals_one_prefill() -> None:
    """A cached forward of several tokens that continues a cache (the scans from a state, the
    convs from their windows, attention over earlier slots) equals one prefill."""
    model = tiny("G+M*-E")
    ids = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        whole = model.forward_cached(ids, model.new_cache(2, 13), last_only=False)
        cache = model.new_cache(2, 13)
        first = model.forward_cached(ids[:, :6], cache, last_only=False)
        rest = model.forward_cached(ids[:, 6:], cache, last_only=False)
        assert rel_err(torch.cat([first, rest], 1), whole) < 1e-5
        assert rel_err(whole, model(ids)) < 1e-5


def test_decode_steps_equal_the_recurrences_fp64() -> None:
    g = torch.Generator().manual_seed(0)
    b, h, p, n, groups = 2, 4, 3, 5, 2
    x = torch.randn(b, 3, h, p, generator=g, dtype=torch.float64)
    dt = torch.randn(b, 3, h, generator=g, dtype=torch.float64)
    A = -torch.rand(h, generator=g, dtype=torch.float64) - 0.1
    B = torch.randn(b, 3, groups, n, generator=g, dtype=torch.float64)
    C = torch.randn(b, 3, groups, n, generator=g, dtype=torch.float64)
    D = torch.randn(h, generator=g, dtype=torch.float64)
    dt_bias = torch.randn(h, generator=g, dtype=torch.float64)
    soft = F.softplus(dt + dt_bias)
    want, final = ssd_scan_ref(x, soft, A, B, C, D_H=D, return_final_state=True)
    state = torch.zeros(b, h, p, n, dtype=torch.float64)
    got = torch.cat([ssd_step(x[:, t:t + 1], dt[:, t:t + 1], A, B[:, t:t + 1], C[:, t:t + 1],
                              state, D_H=D, dt_bias_H=dt_bias, dt_softplus=True)
                     for t in range(3)], 1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(state, final, rtol=0, atol=1e-12)

    q = F.normalize(torch.randn(b, 3, groups, n, generator=g, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(b, 3, groups, n, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(b, 3, h, p, generator=g, dtype=torch.float64)
    gd = -torch.rand(b, 3, h, generator=g, dtype=torch.float64)
    beta = torch.rand(b, 3, h, generator=g, dtype=torch.float64)
    init = torch.randn(b, h, n, p, generator=g, dtype=torch.float64)
    want, final = gdn_recurrent_ref(q, k, v, gd, beta, initial_state_BHKV=init,
                                    return_final_state=True)
    state = init.clone()
    got = torch.cat([gdn_step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], gd[:, t:t + 1],
                              beta[:, t:t + 1], state) for t in range(3)], 1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(state, final, rtol=0, atol=1e-12)


def _bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for s in cache.layers.values()
               for t in vars(s).values())


def test_recurrent_caches_do_not_grow() -> None:
    recurrent = tiny("MGMG")
    assert _bytes(recurrent.new_cache(1, 512)) == _bytes(recurrent.new_cache(1, 8192))
    attention = tiny("*+")
    assert _bytes(attention.new_cache(1, 1024)) == 2 * _bytes(attention.new_cache(1, 512))


def test_sampling_is_reproducible_and_top_k_1_is_greedy() -> None:
    model = tiny("M*-E")
    ids, mask = prompts(model.config.vocab_size, (7, 4))
    kw = dict(attention_mask=mask, temperature=1.0)
    a = composer.generate(model, ids, 12, seed=5, **kw)
    assert torch.equal(a, composer.generate(model, ids, 12, seed=5, **kw))
    assert not torch.equal(a, composer.generate(model, ids, 12, seed=6, **kw))
    greedy = composer.generate(model, ids, 12, attention_mask=mask)
    assert torch.equal(composer.generate(model, ids, 12, seed=1, top_k=1, **kw), greedy)
    assert torch.equal(composer.generate(model, ids, 12, seed=1, top_p=1e-6, **kw), greedy)


def test_filter_logits() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).log_softmax(-1)
    assert torch.isfinite(filter_logits(logits, top_k=2)).tolist() == [[True, True, False, False]]
    p = logits.exp()[0]
    # the smallest set of most likely tokens reaching p
    keep = torch.isfinite(filter_logits(logits, top_p=float(p[0] + p[1] / 2)))
    assert keep.tolist() == [[True, True, False, False]]
    keep = torch.isfinite(filter_logits(logits, top_p=float(p[0]) - 1e-6))
    assert keep.tolist() == [[True, False, False, False]]


def test_eos_pads_finished_rows_and_stops_early() -> None:
    model = tiny("M*-E")
    ids, mask = prompts(model.config.vocab_size, (7, 4))
    free = composer.generate(model, ids, 10, attention_mask=mask)
    eos = int(free[0, 7 + 2])  # row 0's third new token
    out = composer.generate(model, ids, 10, attention_mask=mask, eos_token_id=[eos],
                            pad_token_id=60)
    new = out[:, 7:]
    first = int((new[0] == eos).nonzero()[0])
    assert torch.equal(new[0, :first + 1], free[0, 7:8 + first])
    assert (new[0, first + 1:] == 60).all()
    both = composer.generate(model, ids, 10, attention_mask=mask,
                             eos_token_id=[int(free[0, 7]), int(free[1, 7])])
    assert both.shape[1] == 8  # both rows ended with their first token


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), "empty prompt"),
    (dict(input_ids=torch.full((1, 3), 61)), "outside the model's vocabulary"),
    (dict(attention_mask=torch.tensor([[1, 1, 0]])), "left padding"),
    (dict(attention_mask=torch.tensor([[0, 0, 0]])), "all padding"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_p=0.0), "top_p"),
])
def test_bad_arguments(kwargs: dict, match: str) -> None:
    model = tiny("M*")
    args = dict(input_ids=torch.ones(1, 3, dtype=torch.long), max_new_tokens=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        composer.generate(model, args.pop("input_ids"), args.pop("max_new_tokens"), **args)


class _Shift(nn.Module):
    """A user mixer without an inference cache: the previous token's input."""

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return F.pad(x_BTD[:, :-1], (0, 0, 1, 0))


def test_a_mixer_without_cache_needs_use_cache_false() -> None:
    model = tiny("M*-")
    model.layers["2"].mixer = _Shift()
    ids = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="layer 2 .* has no inference cache"):
        composer.generate(model, ids, 4)
    assert composer.generate(model, ids, 4, use_cache=False).shape == (1, 7)


def test_mla_max_dense_len_holds_while_decoding() -> None:
    model = tiny("+-", {"mla.max_dense_len": 6})
    ids = torch.ones(1, 4, dtype=torch.long)
    # the last new token is never fed back: 4 + 3 tokens need a context of 6
    assert composer.generate(model, ids, 3).shape == (1, 7)
    with pytest.raises(ValueError, match="max_dense_len=6"):
        composer.generate(model, ids, 4)


def test_fused_weights_are_views_without_grad_and_training_still_works() -> None:
    """Decoding fuses a split projection's parts into one buffer once (a view per call, no
    copy); the parameters stay the same objects, so a later training step still works."""
    model = tiny("M*")
    proj = model.layers["0"].mixer.in_proj
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(2))
    expected = model(ids)
    composer.generate(model, ids, 3)
    with torch.no_grad():
        fused = proj.fused_weight()
        assert fused.data_ptr() == proj.weight_z.data_ptr()  # a view, not a copy
        assert rel_err(model(ids), expected) == 0.0
    assert list(model.parameters()) == params
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    model(ids, ids).loss.backward()
    assert proj.weight_x.grad is not None
    opt.step()
    with torch.no_grad():  # the step moved the parts, and the fused view sees it
        assert not torch.equal(proj.fused_weight(), before["layers.0.mixer.in_proj.weight"])
        assert torch.equal(proj.fused_weight(), torch.cat(proj.weights()))
