"""The training engine on two gloo ranks equals one process: accumulation with data parallel,
the global gradient norm and clipping at tp=2, dp=2 and ep=2, Muon at tp=2 and dp=2, and exact
resume at dp=2 and tp=2. All cases run in one pair of spawned ranks."""

import pytest
import torch

from composer.parallel.launch import run_distributed
from tests.helpers import train_case

pytestmark = pytest.mark.slow  # every test here spawns ranks or processes

MODEL = {"pattern": "M*-E", "set": {
    "d_model": 32, "vocab_size": 61, "attention.n_heads": 4, "attention.n_kv_heads": 2,
    "mamba.n_heads": 4, "mamba.d_head": 8, "mamba.n_groups": 2, "mamba.d_state": 8,
    "mamba.chunk_size": 8, "mlp.d_ff": 64, "moe.n_experts": 4, "moe.top_k": 2, "moe.d_ff": 32,
    "moe.aux_loss_coeff": 0.0}}
BASE = {"model": MODEL, "tokens": "synthetic", "seq_len": 16, "steps": 3,
        "global_batch_size": 8, "lr": 3e-3, "device": "cpu", "precision": "fp32"}
WITH_AUX = {**MODEL, "set": {**MODEL["set"], "moe.aux_loss_coeff": 0.01}}

CASES = {
    "accumulate-dp2": ({"micro_batch_size": 1}, {"micro_batch_size": 8}),
    "clip-tp2": ({"tp": 2, "grad_clip": 0.05, "model": WITH_AUX}, {"grad_clip": 0.05,
                                                                  "model": WITH_AUX}),
    "clip-dp2": ({"grad_clip": 0.05, "model": WITH_AUX}, {"grad_clip": 0.05, "model": WITH_AUX}),
    "clip-ep2": ({"ep": 2, "grad_clip": 0.05, "model": WITH_AUX},
                 {"grad_clip": 0.05, "model": WITH_AUX}),
    "muon-tp2": ({"tp": 2, "optimizer": "muon", "lr": 1e-2}, {"optimizer": "muon", "lr": 1e-2}),
    "muon-dp2": ({"optimizer": "muon", "lr": 1e-2}, {"optimizer": "muon", "lr": 1e-2}),
}
BF16 = {"shard": {"precision": "bf16", "steps": 8},
        "replicate": {"precision": "bf16", "steps": 8, "dp_mode": "replicate"}}
RESUME = {"dp2": {}, "tp2": {"tp": 2}, "dp2-async": {"async_save": True, "save_every": 1},
          "dp2-eval": {"tokens": None, "seq_len": 12, "split": "80,20,0", "eval_every": 1,
                       "eval_iters": 1, "save_every": 1}}
"""``dp2-eval``: an evaluation before every save (FSDP2's roots keep their own weights gathered
after a forward without backward; the save must see the shards)."""


def _muon(case: str) -> bool:
    """Muon orthogonalises in bf16 (torch.optim.Muon's Newton-Schulz) whatever the masters'
    dtype: its cases run in fp32 with a wider tolerance. The others run with fp64 masters and
    compare to 1e-10 (in fp32, AdamW spreads summation-order noise of near-zero gradients into
    parameter differences near 1e-5 that no fp32 bound separates from a wrong factor)."""
    return case.startswith("muon")


def _summary(out: dict) -> dict:
    return {"losses": out["losses"], "norms": [r["grad_norm"] for r in out["rows"]],
            "params": out["params"]}


def muon_steps() -> dict:
    """One ShardedMuon step on the same weight and gradient, whole on one rank and sharded as
    tensor parallel (rows, columns) and FSDP (rows of a 2-D mesh) shard them: every layout's
    step, gathered, must equal torch.optim.Muon's on the whole tensors bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from composer.train.optim import ShardedMuon

    g = torch.Generator().manual_seed(0)
    w, grad = torch.randn(12, 10, generator=g), torch.randn(12, 10, generator=g)
    ref = torch.nn.Parameter(w.clone())
    ref.grad = grad.clone()
    torch.optim.Muon([ref], lr=0.1, weight_decay=0.1, adjust_lr_fn="match_rms_adamw").step()
    mesh = init_device_mesh("cpu", (2,))
    out = {}
    for name, placement in (("rows", Shard(0)), ("cols", Shard(1))):
        p = torch.nn.Parameter(distribute_tensor(w, mesh, [placement]))
        p.grad = distribute_tensor(grad, mesh, [placement])
        ShardedMuon([p], lr=0.1, weight_decay=0.1, adjust_lr_fn="match_rms_adamw").step()
        out[name] = torch.equal(p.full_tensor(), ref.detach())
    return out


def vocab_parallel_loss() -> list[float]:
    """The chunked vocab-parallel head + loss (3 chunks, a vocabulary tp=2 does not divide,
    ignored targets, a logit scale) against the plain single-device twin, in fp64: the loss and
    the gradients of h (summed over tp, as the readout's reduction does) and of W (gathered)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from composer.blocks.loss import IGNORE_INDEX, linear_cross_entropy_ref
    from composer.parallel.vocab import linear_cross_entropy, vocab_sizes

    g = torch.Generator().manual_seed(1)
    h = torch.randn(40, 8, generator=g, dtype=torch.float64)
    w = torch.randn(61, 8, generator=g, dtype=torch.float64)
    t = torch.randint(0, 61, (40,), generator=g)
    t[::7] = IGNORE_INDEX
    rank = dist.get_rank()
    sizes = vocab_sizes(61, 2)
    lo = sum(sizes[:rank])
    tp = SimpleNamespace(size=2, rank=rank, group=dist.group.WORLD)
    hl, wl = h.clone().requires_grad_(), w[lo:lo + sizes[rank]].clone().requires_grad_()
    loss = linear_cross_entropy(hl, wl, t, 61, tp, scale=0.5, chunk_rows=16)
    loss.backward()
    dh = hl.grad.clone()
    dist.all_reduce(dh)
    parts = [torch.zeros(max(sizes), 8, dtype=torch.float64) for _ in range(2)]
    dist.all_gather(parts, torch.nn.functional.pad(wl.grad, (0, 0, 0, max(sizes) - sizes[rank])))
    dw = torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = linear_cross_entropy_ref(hr, wr, t, scale=0.5)
    ref.backward()
    return [float((loss - ref).abs()), float((dh - hr.grad).abs().max()),
            float((dw - wr.grad).abs().max())]


def in_ranks(tmp: str) -> dict:
    results = {"muon-step": muon_steps(), "vocab-loss": vocab_parallel_loss()}
    results |= {f"bf16-{name}": _summary(train_case({**BASE, **mine}))
                for name, mine in BF16.items()}
    results |= {name: _summary(train_case(data_recipe(tmp, name), fp64=True)) for name in DATA}
    results |= {name: _summary(train_case({**BASE, **mine}, fp64=not _muon(name)))
                for name, (mine, _) in CASES.items()}
    for name, layout in RESUME.items():
        if name == "dp2-eval":
            layout = {**layout, "data": f"{tmp}/docs"}
        straight = train_case({**BASE, **layout, "steps": 4, "save": f"{tmp}/{name}-a"})
        first = train_case({**BASE, **layout, "steps": 4, "exit_at_step": 2,
                            "save": f"{tmp}/{name}-b"})
        rest = train_case({}, source=f"{tmp}/{name}-b")
        results[f"resume-{name}"] = {"straight": _summary(straight), "first": first["losses"],
                                     "rest": _summary(rest)}
    return results


def write_dataset(prefix: str) -> None:
    import numpy as np

    from composer.data.indexed import IndexedWriter

    rng = np.random.default_rng(0)
    with IndexedWriter(prefix, np.uint16) as w:
        for _ in range(40):
            w.add_document(rng.integers(0, 61, rng.integers(2, 30)))


DATA = {"data-isolated": {"document_isolation": True, "micro_batch_size": 2},
        "data-blend": {"micro_batch_size": 1}}


def data_recipe(tmp: str, name: str) -> dict:
    data = f"{tmp}/docs" if name == "data-isolated" else ["0.6", f"{tmp}/docs", "0.4",
                                                           f"{tmp}/docs"]
    return {**BASE, **DATA[name], "tokens": None, "data": data, "seq_len": 12, "steps": 3}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    write_dataset(f"{tmp}/docs")
    out = run_distributed(in_ranks, 2, str(tmp))[0]
    out["tmp"] = str(tmp)
    return out


def close(a: dict, b: dict, tol: float) -> None:
    """Largest absolute difference (the weights are O(0.01-1); a relative measure of a tensor
    whose largest entry is small magnifies fp32 rounding that Adam's normalisation spreads)."""
    for k in b:
        err = (a[k].double() - b[k].double()).abs().max()
        assert err <= tol, (k, float(err))


@pytest.mark.parametrize("name", sorted(CASES))
def test_two_ranks_equal_one_process(ranks, name):
    got = ranks[name]
    muon = _muon(name)
    ref = _summary(train_case({**BASE, **CASES[name][1]}, fp64=not muon))
    # Muon: gradients that differ by fp32 rounding can round to neighbouring bf16 values in its
    # Newton-Schulz iteration, so its tolerance is wider.
    assert got["losses"] == pytest.approx(ref["losses"], rel=2e-4 if muon else 1e-10)
    assert got["norms"] == pytest.approx(ref["norms"], rel=3e-3 if muon else 1e-10)
    if name.startswith("clip"):
        assert min(ref["norms"]) > 0.05  # clipping was active in every step
    close(got["params"], ref["params"], 1e-3 if muon else 1e-10)


@pytest.mark.parametrize("mode", sorted(BF16))
def test_bf16_data_parallel_keeps_fp32_masters(ranks, mode):
    """FSDP2's MixedPrecisionPolicy (bf16 compute copies, fp32 reduction) at dp=2 against
    autocast in one process: not the same rounding, so close, not equal."""
    got = ranks[f"bf16-{mode}"]
    ref = _summary(train_case({**BASE, "precision": "bf16", "steps": 8}))
    assert got["losses"] == pytest.approx(ref["losses"], rel=0.02)
    assert got["losses"][-1] < got["losses"][0]
    assert {p.dtype for p in got["params"].values()} == {torch.float32}


@pytest.mark.parametrize("name", sorted(DATA))
def test_indexed_data_at_dp2_equals_one_process(ranks, name):
    """The same samples in the same order at dp=2 (each rank reading its rows), with document
    isolation (a global token count that changes from batch to batch) and with a blend."""
    got = ranks[name]
    ref = _summary(train_case(data_recipe(ranks["tmp"], name), fp64=True))
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-10)
    assert got["norms"] == pytest.approx(ref["norms"], rel=1e-10)
    close(got["params"], ref["params"], 1e-10)


def test_chunked_vocab_parallel_loss_equals_the_plain_loss(ranks):
    assert max(ranks["vocab-loss"]) <= 1e-12, ranks["vocab-loss"]


def test_sharded_muon_step_is_torch_muon(ranks):
    assert ranks["muon-step"] == {"rows": True, "cols": True}


@pytest.mark.parametrize("name", sorted(RESUME))
def test_exact_resume(ranks, name):
    got = ranks[f"resume-{name}"]
    assert got["first"] + got["rest"]["losses"] == got["straight"]["losses"]  # bit for bit
    for k, v in got["straight"]["params"].items():
        assert torch.equal(v, got["rest"]["params"][k]), k
