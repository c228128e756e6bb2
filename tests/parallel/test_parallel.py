"""Every parallel layout computes what one process computes: eval loss, gradients of every
parameter (gathered), three AdamW steps, and checkpoints saved at one layout and loaded at
another. gloo on CPU, fp32."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import composer
from composer.config import AttentionConfig, MambaConfig, MLPConfig, ModelConfig, MoEConfig
from composer.parallel.launch import run_distributed
from composer.parallel.mesh import LayoutError, ParallelConfig, resolve_layout

PATTERN = "M*-E"


def tiny_cfg() -> ModelConfig:
    return ModelConfig(
        pattern=PATTERN, d_model=32, vocab_size=61,  # a vocabulary that tp=2 does not divide
        attention=AttentionConfig(n_heads=4, n_kv_heads=2, qk_norm=True),
        mamba=MambaConfig(n_heads=4, d_head=8, n_groups=2, d_state=8, chunk_size=8),
        mlp=MLPConfig(d_ff=64),
        moe=MoEConfig(n_experts=4, top_k=2, d_ff=32, n_shared_experts=1, aux_loss_coeff=0.0))


def tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 61, (8, 16))


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def case(layout: dict, cfg_dict: dict, data: np.ndarray, steps: int, fp64: bool = False,
         lr: float = 1e-4) -> dict:
    """Runs in every rank (or in this process for the reference)."""
    from composer.parallel.data import finish_grads
    from composer.parallel.mesh import build_parallel_dims
    from composer.run import build_sharded, evaluate
    from tests.helpers import adamw_steps as train

    cfg = ModelConfig.from_dict(cfg_dict)
    dims = build_parallel_dims(ParallelConfig(**layout))
    # built on meta, parallelised, then each rank initialises its own shards
    model = build_sharded(cfg, dims, seed=7, dtype=torch.float64 if fp64 else None)
    rows = list(data)
    loss, n = evaluate(model, dims, rows, batch_size=2)
    # gradients of one global batch (each dp rank its share)
    share = len(rows) // dims.dp
    mine = torch.from_numpy(data[dims.dp_rank() * share:(dims.dp_rank() + 1) * share]).long()
    model.train()
    model(mine, mine).loss.backward()
    finish_grads(model, dims)
    grads = {k: _full(p.grad).clone() for k, p in model.named_parameters()}
    # A small lr in fp32: Adam turns rounding noise in near-zero gradients into whole-size steps,
    # so at lr 1e-3 any change of summation order moves a few weights by ~5e-5 of the largest
    # (fp64 below shows the layouts agree to 1e-12 at lr 1e-2).
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    result = train(model, dims, opt, rows, steps, batch_size=4, seed=3)
    params = {k: _full(p.detach()).clone() for k, p in model.named_parameters()}
    return {"eval": loss, "n": n, "grads": grads, "losses": result.losses, "params": params}


@pytest.fixture(scope="module")
def reference():
    return case({}, tiny_cfg().to_dict(), tokens(), steps=3)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def check_same(got: dict, ref: dict, tol: float = 1e-5, loss_tol: float = 1e-4) -> None:
    assert got["n"] == ref["n"]
    assert abs(got["eval"] - ref["eval"]) <= tol * abs(ref["eval"])
    assert got["grads"].keys() == ref["grads"].keys()
    worst = max(ref["grads"], key=lambda k: rel(got["grads"][k], ref["grads"][k]))
    assert rel(got["grads"][worst], ref["grads"][worst]) < tol, worst
    assert np.allclose(got["losses"], ref["losses"], rtol=loss_tol, atol=0)
    worst = max(ref["params"], key=lambda k: rel(got["params"][k], ref["params"][k]))
    assert rel(got["params"][worst], ref["params"][worst]) < tol, worst


LAYOUTS_2 = [{"tp": 2}, {"ep": 2}, {"dp": 2}, {"dp": 2, "dp_mode": "replicate"},
             {"tp": 2, "sequence_parallel": False}]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS_2, ids=lambda d: json.dumps(d))
def test_two_processes(reference, layout):
    results = run_distributed(case, 2, layout, tiny_cfg().to_dict(), tokens(), 3)
    for got in results:
        check_same(got, reference)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tp": 2, "dp": 2}, {"tp": 2, "ep": 2}, {"ep": 2}],
                         ids=lambda d: json.dumps(d))
def test_four_processes(reference, layout):
    check_same(run_distributed(case, 4, layout, tiny_cfg().to_dict(), tokens(), 3)[0], reference)


def mqa_cfg() -> ModelConfig:
    """One kv head for two tp ranks: every rank computes it (replicated kv projections)."""
    cfg = tiny_cfg()
    cfg.attention.n_kv_heads = 1
    cfg.attention.qkv_bias = cfg.attention.out_bias = True
    return cfg


@pytest.mark.slow
@pytest.mark.parametrize("world, layout, cfg", [(2, {"tp": 2}, tiny_cfg()),
                                                (2, {"tp": 2}, mqa_cfg()),
                                                (4, {"tp": 2, "ep": 2}, tiny_cfg())],
                         ids=["tp2", "tp2-mqa-bias", "tp2-ep2"])
def test_exact_in_fp64(world, layout, cfg):
    """In fp64 every layout equals one process to rounding, through three AdamW steps at lr 1e-2:
    the fp32 tolerances above are rounding, not approximation."""
    args = (cfg.to_dict(), tokens(), 3, True, 1e-2)
    check_same(run_distributed(case, world, layout, *args)[0], case({}, *args), tol=1e-10,
               loss_tol=1e-12)


def save_then_eval(save_layout: dict, folder: str, data: np.ndarray) -> float:
    from composer.parallel.checkpoint import save_checkpoint
    from composer.run import prepare
    from tests.helpers import adamw_steps as train

    model, dims, opt, _ = prepare(folder + "/portable", ParallelConfig(**save_layout),
                                  optimizer_lr=1e-2)
    train(model, dims, opt, list(data), 2, batch_size=4, seed=1)
    save_checkpoint(folder + "/run", 2, model, opt)
    return 0.0


def eval_at(layout: dict, folder: str, data: np.ndarray) -> tuple[float, int]:
    from composer.run import evaluate, prepare

    model, dims, _, step = prepare(folder + "/run", ParallelConfig(**layout))
    return evaluate(model, dims, list(data))[0], step


@pytest.mark.slow
@pytest.mark.parametrize("save_at, load_at", [({"tp": 2}, [{}, {"dp": 2}]),
                                              ({"dp": 2}, [{"tp": 2}, {}])])
def test_checkpoint_reshards(tmp_path, save_at, load_at):
    composer.save(composer.build_model(tiny_cfg(), seed=2), tmp_path / "portable")
    run_distributed(save_then_eval, 2, save_at, str(tmp_path), tokens())
    losses = []
    for layout in load_at:
        if layout:
            losses.append(run_distributed(eval_at, 2, layout, str(tmp_path), tokens())[0])
        else:
            losses.append(eval_at(layout, str(tmp_path), tokens()))
    (a, step_a), (b, step_b) = losses
    assert step_a == step_b == 2
    assert abs(a - b) <= 1e-6 * abs(a)


def test_layout_errors():
    with pytest.raises(LayoutError, match="world size 1 is not a multiple of tp"):
        resolve_layout(ParallelConfig(tp=2), 1)
    with pytest.raises(LayoutError, match="world size 2 is not a multiple of tp"):
        resolve_layout(ParallelConfig(tp=3), 2)
    with pytest.raises(LayoutError, match="ep \\(3\\) must divide dp"):
        resolve_layout(ParallelConfig(ep=3), 4)
    dims = resolve_layout(ParallelConfig(tp=2, ep=2), 4)
    assert (dims.dp, dims.dp_outer) == (2, 1)
    from composer.build.builder import check_model

    cfg = tiny_cfg()
    cfg.attention.n_heads = 6
    cfg.attention.n_kv_heads = 3
    with pytest.raises(LayoutError, match=r"attention.n_kv_heads \(3\) and tp \(2\)"):
        check_model(resolve_layout(ParallelConfig(tp=2), 2), cfg)
    with pytest.raises(LayoutError, match=r"moe.n_experts \(4\) is not divisible by ep \(8\)"):
        check_model(resolve_layout(ParallelConfig(ep=8), 8), tiny_cfg())


@pytest.mark.slow
def test_cli_refuses_bad_layouts(tmp_path):
    composer.save(composer.build_model(tiny_cfg()), tmp_path / "ck")
    np.save(tmp_path / "t.npy", tokens())
    for extra in (["--tp", "2"], ["--ep", "2"]):
        proc = subprocess.run([sys.executable, "-m", "composer", "eval", str(tmp_path / "ck"),
                               "--tokens", str(tmp_path / "t.npy"), *extra],
                              capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
        assert "world size 1 is not a multiple" in proc.stderr or "ep (2) must divide" \
            in proc.stderr
