"""MoE: reference-twin checks in fp64/fp32, transformers parity, aux loss, init and gradients."""

from __future__ import annotations

import pytest
import torch

from composer.blocks.moe import MoE, moe_ref, router_ref
from composer.config import ModelConfig, MoEConfig

D, E, F_ = 32, 8, 16

CASES = {
    "softmax_top2_swiglu": dict(),
    "softmax_no_renorm": dict(renormalize=False),
    "sigmoid_bias_scaled_shared_relu2": dict(
        score_func="sigmoid", score_correction_bias=True, routed_scaling_factor=2.5,
        n_shared_experts=1, d_ff_shared=24, activation="relu2"),
    "shared_swiglu_x2": dict(n_shared_experts=2),
    "groups": dict(score_func="sigmoid", score_correction_bias=True, n_expert_groups=4,
                   topk_groups=2, top_k=3),
    "top_k_all": dict(top_k=E),
    "empty_experts": dict(score_func="sigmoid", score_correction_bias=True),
}


def make_cfg(**moe_kw: object) -> ModelConfig:
    moe = MoEConfig(**{"n_experts": E, "top_k": 2, "d_ff": F_, **moe_kw})
    return ModelConfig(pattern="E", d_model=D, init_std=0.3, moe=moe).validate()


def make_moe(cfg: ModelConfig, seed: int = 0, empty: bool = False) -> MoE:
    moe = MoE(cfg)
    gen = torch.Generator().manual_seed(seed)
    moe.reset_parameters(gen)
    if moe.router.score_bias is not None:
        if empty:  # a large bias on experts 0 and 1 wins every choice, starving the rest
            bias = torch.tensor([5.0, 5.0] + [0.0] * (E - 2))
        else:  # comparable to the sigmoid scores, so it changes some choices
            bias = 0.5 * torch.randn(E, generator=gen)
        moe.router.score_bias.copy_(bias)
    return moe


def make_x(dtype: torch.dtype = torch.float64, seed: int = 1) -> torch.Tensor:
    return torch.randn(3, 8, D, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def weights_of(moe: MoE, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(dtype) for k, v in moe.state_dict().items()}


# ---------------------------------------------------------------- reference twin


@pytest.mark.parametrize("name", list(CASES))
def test_moe_matches_ref_fp64(name: str) -> None:
    cfg = make_cfg(**CASES[name])
    moe = make_moe(cfg, empty=name == "empty_experts").double()
    x = make_x()
    y = moe(x)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, moe_ref(x, weights_of(moe, torch.float64), cfg),
                               rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", list(CASES))
def test_moe_fp32_close_to_fp64_ref(name: str) -> None:
    cfg = make_cfg(**CASES[name])
    moe = make_moe(cfg, empty=name == "empty_experts")
    x = make_x()
    y = moe(x.float())
    assert y.dtype == torch.float32 and moe.router.weight.dtype == torch.float32
    ref = moe_ref(x, weights_of(moe, torch.float64), cfg)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


def test_score_bias_and_groups_change_the_choice() -> None:
    """Guards the cases above against a bias or group mask that happens to change nothing."""
    cfg = make_cfg(**CASES["groups"])
    moe = make_moe(cfg)
    x_ND = make_x().reshape(-1, D)
    w = moe.router.weight
    dense = router_ref(x_ND, w, cfg.moe, moe.router.score_bias)
    no_bias = router_ref(x_ND, w, cfg.moe)
    flat = make_cfg(**{**CASES["groups"], "n_expert_groups": 1, "topk_groups": 1})
    no_groups = router_ref(x_ND, w, flat.moe, moe.router.score_bias)
    assert ((dense > 0) != (no_bias > 0)).any()
    assert ((dense > 0) != (no_groups > 0)).any()


def test_empty_experts_get_no_tokens_and_no_gradient() -> None:
    cfg = make_cfg(**CASES["empty_experts"])
    moe = make_moe(cfg, empty=True)
    moe(make_x(torch.float32)).square().sum().backward()
    per_expert = moe.experts.up_proj.grad.abs().sum(dim=(1, 2))
    assert (per_expert[:2] > 0).all() and (per_expert[2:] == 0).all()


def test_gradient_reaches_every_used_expert() -> None:
    cfg = make_cfg(n_shared_experts=1)
    moe = make_moe(cfg)
    x = make_x(torch.float32)
    _, idx_NK, _ = moe.router(x.reshape(-1, D))
    used = torch.bincount(idx_NK.flatten(), minlength=E) > 0
    moe(x).square().sum().backward()
    for p in (moe.experts.gate_proj, moe.experts.up_proj, moe.experts.down_proj):
        assert torch.equal(p.grad.abs().sum(dim=(1, 2)) > 0, used)
    assert moe.router.weight.grad.abs().sum() > 0
    assert moe.shared_experts.up_proj.weight.grad.abs().sum() > 0


def test_bf16_experts_with_fp32_router() -> None:
    cfg = make_cfg(**CASES["sigmoid_bias_scaled_shared_relu2"])
    moe = make_moe(cfg)
    x = make_x(torch.float32)
    y32 = moe(x)
    moe.experts.bfloat16()
    moe.shared_experts.bfloat16()
    y16 = moe(x.bfloat16())
    assert y16.dtype == torch.bfloat16 and moe.router.weight.dtype == torch.float32
    torch.testing.assert_close(y16.float(), y32, rtol=0.05, atol=0.05 * y32.abs().max().item())


# ---------------------------------------------------------------- transformers parity


def randomize(module: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            t.copy_(0.3 * torch.randn(t.shape, generator=gen, dtype=t.dtype))


def hf_out(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = block(x)
    return out[0] if isinstance(out, tuple) else out


def from_gate_up(hf: dict[str, torch.Tensor], router: str = "gate.weight") -> dict:
    gate, up = hf["experts.gate_up_proj"].chunk(2, dim=1)  # gate rows first, as HF .chunk(2)
    return {"router.weight": hf[router], "experts.gate_proj": gate, "experts.up_proj": up,
            "experts.down_proj": hf["experts.down_proj"]}


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_parity_qwen3_moe(norm_topk_prob: bool) -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf_cfg = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F_, num_experts=E,
                            num_experts_per_tok=2, norm_topk_prob=norm_topk_prob)
    block = Qwen3MoeSparseMoeBlock(hf_cfg)
    randomize(block)
    moe = MoE(make_cfg(renormalize=norm_topk_prob))
    moe.load_state_dict(from_gate_up(block.state_dict()))
    x = make_x(torch.float32)
    torch.testing.assert_close(moe(x), hf_out(block, x), rtol=1e-5, atol=1e-5)


def mixtral_pair(aux_loss_coeff: float = 0.0) -> tuple[MoE, torch.nn.Module]:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    hf_cfg = MixtralConfig(hidden_size=D, intermediate_size=F_, num_local_experts=E,
                           num_experts_per_tok=2, hidden_act="silu")
    block = MixtralSparseMoeBlock(hf_cfg).eval()
    randomize(block)
    moe = MoE(make_cfg(aux_loss_coeff=aux_loss_coeff))
    moe.load_state_dict(from_gate_up(block.state_dict()))
    return moe, block


def test_parity_mixtral() -> None:
    moe, block = mixtral_pair()
    x = make_x(torch.float32)
    torch.testing.assert_close(moe(x), hf_out(block, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
def test_parity_nemotron_h(n_group: int, topk_group: int) -> None:
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    hf_cfg = NemotronHConfig(
        hidden_size=D, n_routed_experts=E, moe_intermediate_size=F_,
        moe_shared_expert_intermediate_size=24, num_experts_per_tok=2, routed_scaling_factor=2.5,
        n_group=n_group, topk_group=topk_group, norm_topk_prob=True, mlp_hidden_act="relu2")
    block = NemotronHMoE(hf_cfg)
    randomize(block)  # also gives e_score_correction_bias nonzero values
    cfg = make_cfg(score_func="sigmoid", score_correction_bias=True, routed_scaling_factor=2.5,
                   n_shared_experts=1, d_ff_shared=24, activation="relu2",
                   n_expert_groups=n_group, topk_groups=topk_group)
    moe = MoE(cfg)
    hf = block.state_dict()
    rename = {"gate.weight": "router.weight", "gate.e_score_correction_bias": "router.score_bias"}
    moe.load_state_dict({rename.get(k, k): v for k, v in hf.items()})
    x = make_x(torch.float32)
    torch.testing.assert_close(moe(x), hf_out(block, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
def test_parity_glm4_moe(n_group: int, topk_group: int) -> None:
    """GLM-4.5: sigmoid + score bias + groups, scaled, two shared experts (2 * d_ff wide)."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

    hf_cfg = Glm4MoeConfig(hidden_size=D, n_routed_experts=E, moe_intermediate_size=F_,
                           n_shared_experts=2, num_experts_per_tok=2, routed_scaling_factor=2.5,
                           n_group=n_group, topk_group=topk_group, norm_topk_prob=True)
    block = Glm4MoeMoE(hf_cfg)
    randomize(block, seed=1)
    moe = MoE(make_cfg(score_func="sigmoid", score_correction_bias=True, n_shared_experts=2,
                       routed_scaling_factor=2.5, n_expert_groups=n_group,
                       topk_groups=topk_group))
    hf = block.state_dict()
    ours = from_gate_up(hf) | {"router.score_bias": hf["gate.e_score_correction_bias"]}
    ours |= {k: v for k, v in hf.items() if k.startswith("shared_experts.")}
    moe.load_state_dict(ours)
    x = make_x(torch.float32)
    torch.testing.assert_close(moe(x), hf_out(block, x), rtol=1e-5, atol=1e-5)


def test_parity_minimax_m2() -> None:
    """MiniMax-M2: sigmoid + score bias (held by the block, not the gate), renormalised."""
    from transformers import MiniMaxM2Config
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2SparseMoeBlock

    hf_cfg = MiniMaxM2Config(hidden_size=D, intermediate_size=F_, num_local_experts=E,
                             num_experts_per_tok=2)
    block = MiniMaxM2SparseMoeBlock(hf_cfg).eval()
    randomize(block, seed=2)
    moe = MoE(make_cfg(score_func="sigmoid", score_correction_bias=True))
    hf = block.state_dict()
    moe.load_state_dict(from_gate_up(hf) | {"router.score_bias": hf["e_score_correction_bias"]})
    x = make_x(torch.float32)
    torch.testing.assert_close(moe(x), hf_out(block, x), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- aux loss


def test_aux_loss_matches_transformers_and_trains_the_router() -> None:
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    moe, block = mixtral_pair(aux_loss_coeff=0.01)
    x = make_x(torch.float32)
    moe(x)
    logits = block.gate(x.reshape(-1, D))[0]
    expected = 0.01 * load_balancing_loss_func((logits,), num_experts=E, top_k=2)
    assert moe.aux_loss.ndim == 0 and moe.aux_loss > 0
    torch.testing.assert_close(moe.aux_loss, expected, rtol=1e-6, atol=0)
    moe.aux_loss.backward()
    assert moe.router.weight.grad.abs().sum() > 0
    assert moe.experts.up_proj.grad is None  # the loss sees only the router


def test_aux_loss_sigmoid_uses_normalised_scores() -> None:
    cfg = make_cfg(score_func="sigmoid", aux_loss_coeff=1.0)
    moe = make_moe(cfg)
    x_ND = make_x(torch.float32).reshape(-1, D)
    moe(x_ND[None])
    s_NE = torch.sigmoid(x_ND @ moe.router.weight.T)
    chosen_NE = torch.zeros_like(s_NE).scatter_(1, s_NE.topk(2).indices, 1.0)
    p_E = (s_NE / s_NE.sum(-1, keepdim=True)).mean(0)
    expected = E * (chosen_NE.mean(0) * p_E).sum()
    torch.testing.assert_close(moe.aux_loss, expected, rtol=1e-6, atol=0)


def test_aux_loss_is_zero_without_coefficient() -> None:
    moe = make_moe(make_cfg())
    moe(make_x(torch.float32))
    assert moe.aux_loss.item() == 0.0


# ---------------------------------------------------------------- init, FLOPs


def test_reset_parameters_is_seeded_and_meta_safe() -> None:
    cfg = make_cfg(**CASES["sigmoid_bias_scaled_shared_relu2"])
    a, b, c = make_moe(cfg, seed=3), MoE(cfg), make_moe(cfg, seed=4)
    b.reset_parameters(torch.Generator().manual_seed(3))
    with torch.device("meta"):
        m = MoE(cfg)
    m.to_empty(device="cpu")
    m.reset_parameters(torch.Generator().manual_seed(3))
    for k, v in b.state_dict().items():
        assert torch.equal(v, m.state_dict()[k]), k
    assert torch.equal(b.router.score_bias, torch.zeros(E))
    assert torch.equal(a.experts.up_proj, b.experts.up_proj)  # a's bias was set after reset
    assert not torch.equal(b.experts.up_proj, c.experts.up_proj)
    assert set(MoE.keep_fp32) - {"router.bias"} <= set(b.state_dict())  # bias: router_bias
    assert sorted(b.state_dict()) == [
        "experts.down_proj", "experts.up_proj", "router.score_bias", "router.weight",
        "shared_experts.down_proj.weight", "shared_experts.up_proj.weight"]


def test_flops_per_token() -> None:
    cfg = make_cfg(n_shared_experts=1, d_ff_shared=24)
    expert_params = 3 * D * F_
    expected = 2 * D * E + 2 * expert_params * 2 + 2 * 3 * D * 24
    assert MoE.flops_per_token(cfg, seq_len=128) == expected == 11264
