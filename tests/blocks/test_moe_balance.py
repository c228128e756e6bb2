"""MoE balancing and capacity on one process: the aux-loss-free bias update on crafted routing,
the sequence-wise and global-batch balance losses against their term-by-term twins, and token
dropping against the plain-math rule."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from composer.blocks.moe import (
    MoE,
    capacity,
    drop_ref,
    moe_ref,
    router_ref,
    seq_aux_loss_ref,
    within_capacity,
)
from composer.config import ConfigError, ModelConfig, MoEConfig
from composer.parallel.expert import finish_moe_step

D, E = 4, 4


def crafted_moe(rate: float = 1e-3, **kw: object) -> MoE:
    """Router weight ``10 I``: the token ``x = e_i`` chooses expert ``i`` (top-1, sigmoid)."""
    moe_cfg = MoEConfig(n_experts=E, top_k=1, d_ff=8, score_func="sigmoid",
                        score_correction_bias=True, bias_update_rate=rate, **kw)
    cfg = ModelConfig(pattern="E", d_model=D, init_std=0.3, attention=None, mamba=None,
                      moe=moe_cfg).validate()
    moe = MoE(cfg)
    moe.reset_parameters(torch.Generator().manual_seed(0))
    with torch.no_grad():
        moe.router.weight.copy_(10 * torch.eye(E))
    return moe.train()


def tokens_for(experts: list[int]) -> torch.Tensor:
    return torch.eye(D)[experts][None]  # [1, N, D]


def expected_bias(start: torch.Tensor, signs: list[float], rate: float) -> torch.Tensor:
    return start + rate * torch.tensor(signs)


def test_bias_update_follows_the_rule_over_micro_batches() -> None:
    moe = crafted_moe()
    with torch.no_grad():
        moe.router.score_bias.copy_(torch.tensor([0.0, 0.0625, -0.125, 0.03125]))
    start = moe.router.score_bias.clone()
    moe(tokens_for([0, 0, 0, 1])).sum().backward()  # two micro-batches of one step
    moe(tokens_for([0, 0, 1, 2])).sum().backward()
    with torch.no_grad():  # evaluation forwards do not count
        moe(tokens_for([3] * 8))
    moe.eval()
    moe(tokens_for([3] * 8))
    moe.train()
    assert torch.equal(moe.router.load_E, torch.tensor([5.0, 2.0, 1.0, 0.0]))
    finish_moe_step(moe)
    # mean 2: expert 0 (5) down, expert 1 (2, exactly the mean) stays, experts 2 and 3 up
    assert torch.equal(moe.router.score_bias, expected_bias(start, [-1, 0, 1, 1], 1e-3))
    assert moe.router.score_bias.dtype == torch.float32 and moe.router.load_E is None
    # the next step starts from zero loads
    after_one = moe.router.score_bias.clone()
    moe(tokens_for([3, 3, 2, 1])).sum().backward()
    finish_moe_step(moe)
    # loads [0, 1, 1, 2], mean 1
    assert torch.equal(moe.router.score_bias, expected_bias(after_one, [1, 0, 0, -1], 1e-3))


def test_a_skipped_step_or_rate_zero_leaves_the_bias() -> None:
    moe = crafted_moe()
    moe(tokens_for([0, 0, 0, 1])).sum().backward()
    finish_moe_step(moe, stepped=False)
    assert torch.equal(moe.router.score_bias, torch.zeros(E)) and moe.router.load_E is None
    off = crafted_moe(rate=0.0)
    off(tokens_for([0, 0, 0, 1])).sum().backward()
    assert off.router.load_E is None
    finish_moe_step(off)
    assert torch.equal(off.router.score_bias, torch.zeros(E))


def test_activation_checkpointing_recomputation_is_not_counted() -> None:
    moe = crafted_moe()
    x = tokens_for([0, 1, 1, 3, 3, 3]).requires_grad_()
    checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert torch.equal(moe.router.load_E, torch.tensor([1.0, 2.0, 0.0, 3.0]))


def test_bias_update_rate_needs_the_bias() -> None:
    with pytest.raises(ConfigError, match=r"moe.bias_update_rate needs the score bias"):
        ModelConfig(pattern="E", moe=MoEConfig(bias_update_rate=1e-3)).validate()
    with pytest.raises(ConfigError, match=r"moe.capacity_factor must be > 0"):
        ModelConfig(pattern="E", moe=MoEConfig(capacity_factor=0.0)).validate()


# ---------------------------------------------------------------- balance losses

DR, ER, F_ = 16, 8, 12


def random_moe(seed: int = 0, **kw: object) -> tuple[MoE, ModelConfig]:
    moe_cfg = MoEConfig(**{"n_experts": ER, "top_k": 2, "d_ff": F_, **kw})
    cfg = ModelConfig(pattern="E", d_model=DR, init_std=0.3, moe=moe_cfg).validate()
    moe = MoE(cfg)
    gen = torch.Generator().manual_seed(seed)
    moe.reset_parameters(gen)
    if moe.router.score_bias is not None:
        moe.router.score_bias.copy_(0.3 * torch.randn(ER, generator=gen))
    return moe.double(), cfg


def random_x(b: int = 3, t: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randn(b, t, DR, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def weights(moe: MoE) -> dict[str, torch.Tensor]:
    return {k: v.detach().double() for k, v in moe.state_dict().items()}


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_sequence_wise_aux_loss_matches_deepseek_v3(score_func: str) -> None:
    kw = {"score_correction_bias": True} if score_func == "sigmoid" else {}
    moe, cfg = random_moe(seq_aux_loss_coeff=0.01, score_func=score_func, **kw)
    x = random_x()
    moe(x)
    torch.testing.assert_close(moe.aux_loss, seq_aux_loss_ref(x, weights(moe), cfg),
                               rtol=1e-12, atol=0)
    # a per-sequence loss differs from the same loss over the concatenated sequences
    assert abs(moe.aux_loss - seq_aux_loss_ref(x.reshape(1, -1, DR), weights(moe), cfg)) > 1e-6
    moe.aux_loss.backward()
    assert moe.router.weight.grad.abs().sum() > 0


def switch_aux(x_ND: torch.Tensor, moe: MoE, counts_E: torch.Tensor, n: float) -> torch.Tensor:
    s_NE = torch.softmax(x_ND @ moe.router.weight.T, -1)
    return moe.moe.aux_loss_coeff * ER * torch.sum(counts_E / n * s_NE.mean(0))


def test_global_batch_scope_counts_the_step_so_far() -> None:
    moe, cfg = random_moe(aux_loss_coeff=0.1, aux_loss_scope="global_batch")
    x1, x2 = random_x(2, 8, seed=1), random_x(2, 8, seed=2)
    counts = [(router_ref(x.reshape(-1, DR), moe.router.weight, cfg.moe) > 0).double().sum(0)
              for x in (x1, x2)]
    moe(x1)
    torch.testing.assert_close(moe.aux_loss, switch_aux(x1.reshape(-1, DR), moe, counts[0], 16))
    moe(x2)  # f from both micro-batches (32 tokens), P from the second
    torch.testing.assert_close(moe.aux_loss, switch_aux(x2.reshape(-1, DR), moe,
                                                        counts[0] + counts[1], 32))
    moe.end_step()
    moe(x2)
    torch.testing.assert_close(moe.aux_loss, switch_aux(x2.reshape(-1, DR), moe, counts[1], 16))
    moe.eval()  # evaluation: the micro-batch's own loads
    moe(x1)
    torch.testing.assert_close(moe.aux_loss, switch_aux(x1.reshape(-1, DR), moe, counts[0], 16))


# ---------------------------------------------------------------- capacity


CAPACITY_CASES = {
    "softmax_swiglu": dict(),
    "sigmoid_bias_shared_relu2": dict(score_func="sigmoid", score_correction_bias=True,
                                      routed_scaling_factor=2.5, n_shared_experts=1,
                                      activation="relu2"),
}


@pytest.mark.parametrize("name", list(CAPACITY_CASES))
def test_large_capacity_equals_dropless(name: str) -> None:
    kw = CAPACITY_CASES[name]
    dropless, _ = random_moe(**kw)
    roomy, cfg = random_moe(capacity_factor=ER / 2, **kw)  # C = N: nothing can be dropped
    assert capacity(cfg.moe, 24) == 24
    x = random_x().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    y, y2 = dropless(x), roomy(x2)
    assert torch.equal(y, y2)
    y.square().sum().backward()
    y2.square().sum().backward()
    assert torch.equal(x.grad, x2.grad)
    for (k, p), p2 in zip(dropless.named_parameters(), roomy.parameters(), strict=True):
        assert torch.equal(p.grad, p2.grad), k


@pytest.mark.parametrize("name", list(CAPACITY_CASES))
def test_small_capacity_drops_exactly_the_rule(name: str) -> None:
    moe, cfg = random_moe(capacity_factor=0.5, **CAPACITY_CASES[name])
    x = random_x()
    x_ND = x.reshape(-1, DR)
    cap = capacity(cfg.moe, 24)
    assert cap == 3  # ceil(0.5 * 24 * 2 / 8)
    w_NE = router_ref(x_ND, moe.router.weight, cfg.moe, moe.router.score_bias)
    kept_NE = drop_ref(w_NE, cap)
    n_dropped = int(((w_NE > 0) & (kept_NE == 0)).sum())
    assert n_dropped >= 10 and ((kept_NE > 0).sum(0) <= cap).all()
    # the block's keep mask is the rule's
    w_NK, idx_NK, _ = moe.router(x_ND)
    keep_NK = within_capacity(idx_NK, w_NK, ER, cap).view_as(idx_NK)
    assert torch.equal(keep_NK, kept_NE.gather(1, idx_NK) > 0)
    # and the output is the reference's with the dropped weights zeroed
    torch.testing.assert_close(moe(x), moe_ref(x, weights(moe), cfg), rtol=0, atol=1e-12)


def test_a_token_dropped_everywhere_leaves_the_layer_as_zero() -> None:
    moe, cfg = random_moe(capacity_factor=0.25)  # C = ceil(0.25 * 24 * 2 / 8) = 2
    x = random_x()
    w_NE = drop_ref(router_ref(x.reshape(-1, DR), moe.router.weight, cfg.moe), 2)
    gone = (w_NE == 0).all(1)
    assert gone.sum() >= 4
    x = x.requires_grad_()
    y_ND = moe(x).reshape(-1, DR)
    assert (y_ND[gone] == 0).all() and (y_ND[~gone] != 0).all()
    y_ND.sum().backward()
    assert (x.grad.reshape(-1, DR)[gone] == 0).all()  # nothing reaches it, not even the router


# ---------------------------------------------------------------- grouped expert GEMMs


@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_grouped_path_equals_the_loop_with_padding_rows(activation: str) -> None:
    """The CUDA path's math (``torch._grouped_mm``, padding rows folded into the last group)
    run on the CPU, forward only: torch 2.13's CPU kernel has no backward and no fp64."""
    from composer.blocks.moe import Experts

    experts = Experts(4, 16, 8, activation)
    gen = torch.Generator().manual_seed(0)
    for p in experts.parameters():
        p.data.normal_(0, 0.3, generator=gen)
    x_AD = torch.randn(23, 16, generator=gen)
    n_tokens_E = torch.tensor([5, 0, 9, 4])  # 18 rows, then 5 rows of padding
    loop = experts._loop(x_AD, n_tokens_E)
    grouped = experts._grouped(x_AD, n_tokens_E)
    assert (loop[18:] == 0).all() and (grouped[18:] == 0).all()
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_no_grad_forward_takes_the_grouped_path_with_the_same_result(
        capacity_factor: float | None) -> None:
    moe, _ = random_moe(capacity_factor=capacity_factor, n_shared_experts=1)
    moe.float()
    x = random_x().float()
    calls = []
    hook = moe.experts.register_forward_hook(
        lambda m, args, out: calls.append(torch.is_grad_enabled()))
    y_loop = moe(x)
    from composer.blocks.moe import grouped_mm_dtype

    assert grouped_mm_dtype(x.reshape(-1, DR), moe.experts.up_proj) is None
    with torch.no_grad():
        assert grouped_mm_dtype(x.reshape(-1, DR), moe.experts.up_proj) == torch.float32
        y_grouped = moe(x)
    hook.remove()
    assert calls == [True, False]
    torch.testing.assert_close(y_grouped, y_loop, rtol=1e-6, atol=1e-6)
