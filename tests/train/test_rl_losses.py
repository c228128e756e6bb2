"""The GRPO math of composer.train.rl.losses against closed forms, in fp64: group/batch/none
advantages, the zero-std filter, DAPO's overlong penalty, each loss aggregation on ragged masked
tensors (also split over two "ranks"), the clipped-token rule on both sides of both boundaries,
the k3 KL term, and at K = 1 with no KL the token-mean gradient equal to REINFORCE's
``-(1/N) sum_i A_i grad log pi(y_i)`` (computed by hand for a softmax policy)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from composer.train.rl.losses import (
    group_advantages,
    overlong_penalty,
    policy_loss_terms,
    token_weights,
    zero_std_groups,
)

F64 = torch.float64
REWARDS = [[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.5, 1.0, 0.25]]
# ragged completions (lengths 5, 3, 1, 4, 0) and a masked hole in row 0 (a truncated token)
MASK = torch.tensor([[1, 1, 0, 1, 1, 1],
                     [1, 1, 1, 0, 0, 0],
                     [1, 0, 0, 0, 0, 0],
                     [1, 1, 1, 1, 0, 0],
                     [0, 0, 0, 0, 0, 0]], dtype=F64)
TERMS = torch.arange(1.0, 31.0, dtype=F64).reshape(5, 6) ** 1.5 / 7  # distinct per token


def test_group_advantages_equal_their_formulas() -> None:
    r = torch.tensor(REWARDS, dtype=F64)
    every = [x for row in REWARDS for x in row]
    for scale in ("group", "batch", "none"):
        got = group_advantages(r, scale)
        for p, row in enumerate(REWARDS):
            mean = statistics.fmean(row)
            std = {"group": statistics.stdev(row), "batch": statistics.stdev(every),
                   "none": None}[scale]
            want = [(x - mean) if std is None else (x - mean) / (std + 1e-4) for x in row]
            assert got[p].tolist() == pytest.approx(want, rel=1e-14, abs=1e-15), (scale, p)
    assert group_advantages(r)[1].abs().max().item() == 0.0  # equal rewards: no signal
    assert group_advantages(r.float()).dtype == torch.float32
    shifted = r + torch.tensor([[3.0], [-2.0], [0.5]], dtype=F64)  # a baseline per group
    torch.testing.assert_close(group_advantages(shifted), group_advantages(r), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="scale must be group, batch or none, not 'std'"):
        group_advantages(r, "std")  # type: ignore[arg-type]


def test_zero_std_groups_are_the_groups_of_equal_rewards() -> None:
    r = torch.tensor(REWARDS + [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1e-9]])
    assert zero_std_groups(r).tolist() == [False, True, False, True, False]


def test_overlong_penalty_values() -> None:
    got = overlong_penalty(torch.arange(13), max_new=10, buffer=4, penalty=0.5)
    assert got.tolist() == [0.0] * 7 + [-0.125, -0.25, -0.375, -0.5, -0.5, -0.5]
    assert not torch.signbit(got[:7]).any()  # zeros, not -0.0
    assert overlong_penalty(torch.arange(11), 10, 0).tolist() == [0.0] * 11
    assert overlong_penalty(torch.tensor([10, 9]), 10, 10, 1.0).tolist() == pytest.approx(
        [-1.0, -0.9], rel=1e-7)
    with pytest.raises(ValueError, match=r"overlong buffer must be in \[0, max_new_tokens=10\]"):
        overlong_penalty(torch.arange(3), 10, 11)


def closed_form(agg: str, max_new: int) -> float:
    """The aggregation written out over the rows of MASK and TERMS (plain Python)."""
    rows = [[t for t, m in zip(terms, mask, strict=True) if m]
            for terms, mask in zip(TERMS.tolist(), MASK.tolist(), strict=True)]
    n_seqs = len(rows)
    if agg == "token-mean":
        return sum(map(sum, rows)) / sum(map(len, rows))
    if agg == "seq-mean-token-mean":
        return sum(sum(row) / len(row) for row in rows if row) / n_seqs
    return sum(sum(row) / max_new for row in rows) / n_seqs


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_each_aggregation_equals_its_closed_form_over_the_global_batch(agg: str) -> None:
    n_tokens, n_seqs, max_new = MASK.sum().item(), MASK.shape[0], 8
    want = closed_form(agg, max_new)
    weights = token_weights(MASK, agg, n_tokens, n_seqs, max_new)  # type: ignore[arg-type]
    assert weights.dtype == F64
    assert (weights * TERMS).sum().item() == pytest.approx(want, rel=1e-14)
    assert weights[MASK == 0].abs().max().item() == 0.0
    # two "ranks" holding rows 0-1 and 2-4, weighting with the global counts: their sums add up
    split = sum((token_weights(MASK[rows], agg, n_tokens, n_seqs, max_new)  # type: ignore
                 * TERMS[rows]).sum().item() for rows in (slice(0, 2), slice(2, 5)))
    assert split == pytest.approx(want, rel=1e-14)
    assert token_weights(MASK.bool(), agg, n_tokens, n_seqs, max_new).dtype == torch.float32


def test_aggregation_refusals_and_empty_batches() -> None:
    with pytest.raises(ValueError, match="loss aggregation must be one of token-mean, "
                                         "seq-mean-token-mean, seq-mean-token-sum-norm"):
        token_weights(MASK, "mean", 4, 2, 8)  # type: ignore[arg-type]
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert token_weights(MASK * 0, agg, 0, 0, 8).abs().sum().item() == 0.0  # type: ignore


def surrogate(rho: float, a: float, lo: float, hi: float) -> float:
    return -min(rho * a, min(max(rho, 1 - lo), 1 + hi) * a)


def test_clipping_engages_exactly_where_the_rule_says() -> None:
    delta = 1e-3
    rhos = [0.8 - delta, 0.8, 0.8 + delta, 1.0, 1.28 - delta, 1.28, 1.28 + delta]
    advs = [1.5, -0.7, 0.0]
    logp_old = torch.linspace(-3.0, -0.5, len(rhos), dtype=F64).repeat(len(advs), 1)
    logp = (logp_old + torch.tensor(rhos, dtype=F64).log()).requires_grad_()
    # the boundaries exactly at the ratios as computed (exp(log x) need not give x back):
    # 1 - (1 - r) == r and 1 + (r - 1) == r exactly for r in [0.5, 2]
    computed = torch.exp(logp.detach() - logp_old)[0].tolist()
    lo, hi = 1 - computed[1], computed[5] - 1
    per_token, stats = policy_loss_terms(logp, logp_old, torch.tensor(advs, dtype=F64), lo, hi)
    ratio = stats["ratio"]
    assert ratio[0].tolist() == pytest.approx(rhos, rel=1e-12)
    assert (ratio[0, 1].item(), ratio[0, 5].item()) == (1 - lo, 1 + hi)
    want = [[(a > 0 and r > 1 + hi) or (a < 0 and r < 1 - lo) for r in row]
            for a, row in zip(advs, ratio.tolist(), strict=True)]
    assert stats["clipped"].tolist() == want
    # by position: A > 0 clips only above 1 + hi, A < 0 only below 1 - lo, A == 0 never,
    # and the exact boundaries do not count
    assert want == [[False] * 6 + [True], [True] + [False] * 6, [False] * 7]
    for i, a in enumerate(advs):
        for j, r in enumerate(ratio[i].tolist()):
            assert per_token[i, j].item() == pytest.approx(surrogate(r, a, lo, hi), rel=1e-14)
    per_token.sum().backward()
    grad = logp.grad
    # the clipped tokens get no gradient; every other token (A != 0) gets -A * rho
    assert grad[stats["clipped"]].abs().max().item() == 0.0
    for i, a in enumerate(advs[:2]):
        for j, r in enumerate(ratio[i].tolist()):
            if not want[i][j]:
                assert grad[i, j].item() == pytest.approx(-a * r, rel=1e-12), (i, j)
    assert grad[2].abs().max().item() == 0.0


def test_k3_kl_term() -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.1]], dtype=F64, requires_grad=True)
    logp_ref = torch.tensor([[-1.5, -1.0, -0.1]], dtype=F64)
    adv = torch.tensor([0.0], dtype=F64)  # no surrogate: the KL term alone
    per_token, stats = policy_loss_terms(logp, logp.detach(), adv, 0.2, 0.2, logp_ref, 0.3)
    d = (logp_ref - logp.detach()).tolist()[0]
    k3 = [math.exp(x) - x - 1 for x in d]
    assert stats["kl"].tolist()[0] == pytest.approx(k3, rel=1e-14)
    assert per_token.tolist()[0] == pytest.approx([0.3 * k for k in k3], rel=1e-14)
    assert stats["kl"][0, 2].item() == 0.0 and min(k3) >= 0.0
    per_token.sum().backward()  # d k3 / d logp = 1 - exp(d)
    assert logp.grad.tolist()[0] == pytest.approx([0.3 * (1 - math.exp(x)) for x in d],
                                                  rel=1e-13)
    _, stats = policy_loss_terms(logp, logp.detach(), adv, 0.2, 0.2)
    assert stats["kl"].abs().sum().item() == 0.0
    with pytest.raises(ValueError, match=r"kl_coef > 0 needs the reference log-probs"):
        policy_loss_terms(logp, logp.detach(), adv, 0.2, 0.2, None, 0.1)


def test_token_mean_gradient_at_k1_is_reinforce() -> None:
    """A softmax policy with one logit table per position, ``pi(y_t) = softmax(theta_t)[y_t]``:
    the gradient of the token-mean clipped loss at rho = 1 (K = 1, logp_old = logp.detach(),
    kl 0) equals ``-(1/N) sum_i A_i sum_t m_it (e_{y_it} - softmax(theta_t))`` by hand."""
    gen = torch.Generator().manual_seed(0)
    n_seqs, length, vocab = 5, 6, 7
    theta = torch.randn(length, vocab, generator=gen, dtype=F64, requires_grad=True)
    ys = torch.randint(0, vocab, (n_seqs, length), generator=gen)
    adv = torch.tensor([1.3, -0.4, 0.0, 2.0, -1.1], dtype=F64)
    mask = MASK[:, :length].clone()
    mask[4, :2] = 1  # every sequence has a token here (row 4 of MASK had none)
    logp = torch.log_softmax(theta, dim=-1).expand(n_seqs, -1, -1)
    logp = logp.gather(-1, ys.unsqueeze(-1)).squeeze(-1) * mask  # 0 on masked positions
    per_token, stats = policy_loss_terms(logp, logp.detach(), adv, 0.2, 0.28)
    n_tokens = mask.sum().item()
    loss = (token_weights(mask, "token-mean", n_tokens, n_seqs, length) * per_token).sum()
    (grad,) = torch.autograd.grad(loss, theta)
    assert not stats["clipped"].any() and stats["ratio"].eq(1).all()
    probs = torch.softmax(theta.detach(), dim=-1)
    want = torch.zeros(length, vocab, dtype=F64)
    for i in range(n_seqs):
        for t in range(length):
            if mask[i, t]:
                want[t] -= adv[i] * (torch.nn.functional.one_hot(ys[i, t], vocab) - probs[t])
    want /= n_tokens
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-15)
    assert loss.item() == pytest.approx(-(adv[:, None] * mask).sum().item() / n_tokens, rel=1e-14)
