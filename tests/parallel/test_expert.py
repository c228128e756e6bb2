"""Expert parallel on gloo: an EP MoE equals the single-process MoE run on all ranks' tokens.

Each spawned rank builds the same reference MoE from a seed, runs it on the concatenation of its
ep group's token batches (every rank regenerates every batch from its seed), and compares with
its own EP forward/backward. Spawning costs seconds, so each spawn checks many cases and returns
error numbers; the asserts run here.

Losses: the reference is ``sum(y * R) / N + aux`` over the group's ``N`` tokens; rank ``r`` uses
``sum(y_r * R_r) / N + aux / ep``. The ranks' losses add up to the reference and every rank's aux
is the group's, so *summed* gradients (router, shared experts) and the experts' own gradients
must equal the reference's. ``test_dp_averaging_with_grad_scale`` checks the other convention,
per-rank mean losses averaged over data parallel, with :func:`expert_grad_scale`.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from composer.blocks.moe import MoE
from composer.config import ModelConfig, MoEConfig
from composer.parallel.expert import apply_ep, expert_grad_scale
from composer.parallel.launch import run_distributed
from composer.parallel.mesh import ParallelConfig, build_parallel_dims

# Spawned ranks unpickle the functions below by module name (tests.parallel.test_expert under
# --import-mode=importlib); plain `pytest`, unlike `python -m pytest`, leaves the repository root
# off the sys.path they inherit.
ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

D, F_ = 16, 12
EXPERT_KEYS = ("experts.gate_proj", "experts.up_proj", "experts.down_proj",
               "experts.gate_proj_bias", "experts.up_proj_bias", "experts.down_proj_bias")
ALWAYS_CHECKED = {"y", "aux", "x.grad", "router.weight", "experts.up_proj", "experts.down_proj"}
CASES: dict[str, dict[str, Any]] = {
    "softmax_shared_swiglu": dict(n_experts=4, n_shared_experts=1),
    "sigmoid_bias_scaled_relu2": dict(score_func="sigmoid", score_correction_bias=True,
                                      routed_scaling_factor=2.5, activation="relu2"),
    # Experts 0 and 1 (both on ep rank 0) win every choice: rank 1 receives no row at all.
    "starved": dict(score_func="sigmoid", score_correction_bias=True, bias=(5.0, 5.0)),
    # Rank 0's tiny tokens all pick experts 0 and 1; rank 1's large ones reach every rank.
    "one_sided": dict(score_func="sigmoid", score_correction_bias=True, bias=(0.4, 0.4),
                      scales=(0.01, 3.0)),
    # gpt-oss: router bias, softmax over the top-k logits, expert biases, clamped SwiGLU
    "gpt_oss": dict(score_func="topk_softmax", router_bias=True, expert_bias=True,
                    swiglu_limit=1.0),
}


def make_cfg(n_experts: int = 8, **moe_kw: Any) -> ModelConfig:
    moe_kw = {k: v for k, v in moe_kw.items() if k not in ("bias", "scales")}
    moe = MoEConfig(n_experts=n_experts, top_k=2, d_ff=F_, aux_loss_coeff=0.01, **moe_kw)
    return ModelConfig(pattern="E", d_model=D, init_std=0.3, moe=moe).validate()


def make_moe(kw: dict[str, Any], dtype: torch.dtype, seed: int = 0) -> MoE:
    moe = MoE(make_cfg(**kw))
    gen = torch.Generator().manual_seed(seed)
    moe.reset_parameters(gen)
    if moe.router.score_bias is not None:
        n = moe.moe.n_experts
        bias = kw.get("bias")
        moe.router.score_bias.copy_(0.5 * torch.randn(n, generator=gen) if bias is None
                                    else torch.tensor(bias + (0.0,) * (n - len(bias))))
    if moe.moe.expert_bias:  # zero-initialised: random, so that their sharding is checked
        with torch.no_grad():
            for name in ("gate_proj_bias", "up_proj_bias", "down_proj_bias"):
                getattr(moe.experts, name).normal_(0, 0.3, generator=gen)
    return moe.to(dtype)


def tokens(kw: dict[str, Any], rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch ``x [1, n, D]`` (n differs per rank) and its loss weights ``R``."""
    gen = torch.Generator().manual_seed(100 + rank)
    n = 7 + 3 * rank
    scale = kw.get("scales", (1.0, 1.0))[rank % 2]
    x = scale * torch.randn(1, n, D, generator=gen, dtype=torch.float64)
    return x.to(dtype), torch.randn(1, n, D, generator=gen, dtype=torch.float64).to(dtype)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def sum_over(t: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """Sum over ``mesh``'s ranks (all ranks when None)."""
    t = t.clone()
    dist.all_reduce(t, group=None if mesh is None else mesh.get_group())
    return t


def check_group(kw: dict[str, Any], ep_mesh: DeviceMesh, dtype: torch.dtype) -> dict[str, Any]:
    """EP on this rank against the reference on its ep group's tokens; relative errors."""
    ranks = dist.get_process_group_ranks(ep_mesh.get_group())
    me, ep = ranks.index(dist.get_rank()), len(ranks)
    batches = [tokens(kw, r, dtype) for r in ranks]
    n_total = sum(x.shape[1] for x, _ in batches)

    ref = make_moe(kw, dtype)
    x_ref = torch.cat([x for x, _ in batches], dim=1).requires_grad_()
    y_ref = ref(x_ref)
    (torch.sum(y_ref * torch.cat([r for _, r in batches], dim=1)) / n_total
     + ref.aux_loss).backward()

    moe = make_moe(kw, dtype)
    apply_ep(moe, ep_mesh)
    x, r = batches[me]
    x.requires_grad_()
    y = moe(x)
    (torch.sum(y * r) / n_total + moe.aux_loss / ep).backward()

    start = sum(b[0].shape[1] for b in batches[:me])
    rows = slice(start, start + x.shape[1])
    errs = {"y": rel_err(y, y_ref[:, rows]), "aux": rel_err(moe.aux_loss, ref.aux_loss),
            "x.grad": rel_err(x.grad, x_ref.grad[:, rows])}
    grads, ref_grads = dict(moe.named_parameters()), dict(ref.named_parameters())
    for name, p in grads.items():
        g = p.grad.full_tensor() if name in EXPERT_KEYS else sum_over(p.grad, ep_mesh)
        errs[name] = rel_err(g, ref_grads[name].grad)
    _, idx_NK, _ = moe.router(x.detach().flatten(0, 1))
    counts_E = torch.bincount(idx_NK.flatten(), minlength=moe.moe.n_experts)
    return {"errs": errs, "sent_to_rank": counts_E.view(ep, -1).sum(1).tolist(),
            "local_grad_sum": moe.experts.up_proj.grad.to_local().abs().sum().item()}


def two_rank_cases(single_dir: str, ep_dir: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    out = {f"{name}/fp64": check_group(kw, mesh, torch.float64) for name, kw in CASES.items()}
    out["softmax_shared_swiglu/fp32"] = check_group(CASES["softmax_shared_swiglu"], mesh,
                                                    torch.float32)
    out["dcp_load"] = dcp_round_trip(mesh, single_dir, ep_dir)
    return out


def dcp_round_trip(mesh: DeviceMesh, single_dir: str, ep_dir: str) -> bool:
    """Load the single-process checkpoint into EP experts, step them, save at ep=2."""
    kw = CASES["sigmoid_bias_scaled_relu2"]
    moe = make_moe(kw, torch.float64, seed=5)
    apply_ep(moe, mesh)
    dcp.load(moe.state_dict(), checkpoint_id=single_dir)
    single = make_moe(kw, torch.float64, seed=11)
    shard = slice(4 * dist.get_rank(), 4 * dist.get_rank() + 4)
    loaded = all(torch.equal(moe.state_dict()[k].to_local(), single.state_dict()[k][shard])
                 for k in EXPERT_KEYS if k in moe.state_dict())
    with torch.no_grad():  # move the weights off any seed so the reverse load proves something
        for p in moe.parameters():
            p.mul_(1.5).add_(0.25)
    dcp.save(moe.state_dict(), checkpoint_id=ep_dir)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
            for k, v in moe.state_dict().items()}
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(ep_dir, "expected.pt"))
    return loaded


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("ep")
    single_dir, ep_dir = str(root / "single"), str(root / "ep2")
    single = make_moe(CASES["sigmoid_bias_scaled_relu2"], torch.float64, seed=11)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(single.state_dict(), checkpoint_id=single_dir, no_dist=True)
    results = run_distributed(two_rank_cases, 2, single_dir, ep_dir, timeout=60)
    return {"ranks": results, "ep_dir": ep_dir}


@pytest.mark.slow
@pytest.mark.parametrize("case", [f"{n}/fp64" for n in CASES] + ["softmax_shared_swiglu/fp32"])
def test_ep_matches_single_process(two_ranks: dict[str, Any], case: str) -> None:
    tol = 1e-5 if case.endswith("fp32") else 1e-12
    for rank, res in enumerate(two_ranks["ranks"]):
        errs = res[case]["errs"]
        assert set(errs) >= ALWAYS_CHECKED and max(errs.values()) < tol, (rank, errs)


@pytest.mark.slow
def test_routing_edge_cases_happened(two_ranks: dict[str, Any]) -> None:
    """Guards the cases above against data that happens to route evenly."""
    s0, s1 = (r["starved/fp64"] for r in two_ranks["ranks"])
    assert s0["sent_to_rank"][1] == s1["sent_to_rank"][1] == 0  # nothing reaches rank 1
    assert s1["local_grad_sum"] == 0.0  # ... whose experts get zero (not missing) gradients
    o0, o1 = (r["one_sided/fp64"] for r in two_ranks["ranks"])
    assert o0["sent_to_rank"] == [2 * 7, 0] and min(o1["sent_to_rank"]) > 0


@pytest.mark.slow
def test_dcp_reshards_between_ep_sizes(two_ranks: dict[str, Any]) -> None:
    assert all(r["dcp_load"] for r in two_ranks["ranks"])  # ep=1 -> ep=2, exact
    moe = make_moe(CASES["sigmoid_bias_scaled_relu2"], torch.float64, seed=3)
    state = moe.state_dict()
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=two_ranks["ep_dir"], no_dist=True)  # ep=2 -> ep=1
    expected = torch.load(os.path.join(two_ranks["ep_dir"], "expected.pt"))
    assert sorted(state) == sorted(expected)
    for k, v in expected.items():
        assert torch.equal(moe.state_dict()[k], v), k


# ---------------------------------------------------------------- 4 ranks: dp_outer x ep


def dp_average_case() -> dict[str, float]:
    """dp_outer=2 x ep=2; per-rank mean losses plus aux, gradients averaged over dp."""
    kw, dtype = CASES["softmax_shared_swiglu"] | {"n_experts": 8}, torch.float64
    mesh = build_parallel_dims(ParallelConfig(ep=2)).mesh
    assert mesh is not None
    ep_mesh, dp = mesh["ep"], dist.get_world_size()
    errs = {f"ep4/{k}": v for k, v in check_group(kw, init_device_mesh("cpu", (4,)),
                                                   dtype)["errs"].items()}

    ref = make_moe(kw, dtype)
    loss = 0.0
    for group in ([0, 1], [2, 3]):  # mean over dp of (per-rank mean loss) + mean of group aux
        batches = [tokens(kw, r, dtype) for r in group]
        y = ref(torch.cat([x for x, _ in batches], dim=1))
        ys = y.split([x.shape[1] for x, _ in batches], dim=1)
        loss = loss + sum(torch.mean(yr * r) for yr, (_, r) in zip(ys, batches, strict=True)) / dp
        loss = loss + ref.aux_loss / 2
    loss.backward()

    moe = make_moe(kw, dtype)
    apply_ep(moe, ep_mesh)
    x, r = tokens(kw, dist.get_rank(), dtype)
    y = moe(x)
    (torch.mean(y * r) + moe.aux_loss).backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in moe.named_parameters():
        if name in EXPERT_KEYS:  # average over the expert's replicas, then rescale
            g = sum_over(p.grad.to_local(), mesh["dp_outer"]) / 2 * expert_grad_scale(2)
            shard = slice(4 * ep_mesh.get_local_rank(), 4 * ep_mesh.get_local_rank() + 4)
            errs[name] = rel_err(g, ref_grads[name].grad[shard])
        else:
            # dp is the whole world here (tp = 1)
            errs[name] = rel_err(sum_over(p.grad, None) / dp, ref_grads[name].grad)
    return errs


@pytest.mark.slow
def test_dp_averaging_with_grad_scale() -> None:
    for rank, errs in enumerate(run_distributed(dp_average_case, 4, timeout=60)):
        assert {"ep4/y", "ep4/aux", "ep4/experts.up_proj", "experts.up_proj",
                "router.weight"} <= set(errs), errs
        assert max(errs.values()) < 1e-12, (rank, errs)


def test_expert_grad_scale() -> None:
    assert expert_grad_scale(1) == 1.0 and expert_grad_scale(4) == 0.25
    with pytest.raises(ValueError, match="ep must be >= 1, got 0"):
        expert_grad_scale(0)
