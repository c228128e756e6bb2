"""LoRA under parallelism (composer/parallel/lora.py): on two gloo ranks, tensor parallel (every
placement kind: column, row, fused per part, replicated with partial gradients, head-selecting
kv projections, routed experts' hidden units), expert parallel, FSDP2 (shard, replicate)
and pipeline parallel train as one process does, the base frozen; a resumed run continues
exactly."""

import pytest
import torch

from composer.parallel.launch import run_distributed
from tests.helpers import train_case

pytestmark = pytest.mark.slow  # every test here spawns ranks

SET = {"d_model": 32, "vocab_size": 61, "attention.n_heads": 4, "attention.n_kv_heads": 1,
       "mamba.n_heads": 4, "mamba.d_head": 8, "mamba.n_groups": 2, "mamba.d_state": 8,
       "mamba.chunk_size": 8, "mlp.d_ff": 64, "moe.n_experts": 4, "moe.top_k": 2,
       "moe.d_ff": 32, "moe.n_shared_experts": 1, "moe.aux_loss_coeff": 0.0,
       "gdn.n_heads": 2, "gdn.n_kv_heads": 2, "mla.n_heads": 2, "mla.kv_lora_rank": 16,
       "mla.q_lora_rank": 16}
"""``attention.n_kv_heads`` 1 at tp=2: k/v are head-selecting linears; MLA's q_a/kv_a
projections are replicated with partial gradients; Mamba-2's in_proj is fused."""
BASE = {"model": {"pattern": "M*-EG+", "set": SET}, "tokens": "synthetic", "seq_len": 16,
        "steps": 2, "global_batch_size": 4, "lr": 1e-2, "device": "cpu", "precision": "fp32",
        "lora_rank": 4, "lora_alpha": 8.0}
EXPERTS = ["all", "experts"]
CASES = {"tp2": {"tp": 2}, "dp2": {"lora_targets": EXPERTS},
         "dp2-replicate": {"dp_mode": "replicate"}, "ep2": {"ep": 2, "lora_targets": EXPERTS},
         "tp2-experts": {"tp": 2, "lora_targets": EXPERTS}, "pp2": {"pp": 2, "micro_batch_size": 2},
         "cp2-ac": {"cp": 2, "ac": "full"}}
"""``tp2-experts``: the experts' hidden units split over tp (gate/up rows, down columns);
``cp2-ac``: context parallel (the hooks on the projections see each rank's tokens) with every
layer recomputed in the backward."""


def _summary(out: dict) -> dict:
    return {"losses": out["losses"], "norms": [r["grad_norm"] for r in out["rows"]],
            "params": out["params"]}


def in_ranks(tmp: str) -> dict:
    results = {name: _summary(train_case({**BASE, **layout}, fp64=True))
               for name, layout in CASES.items()}
    straight = train_case({**BASE, "tp": 2, "save": f"{tmp}/a"}, fp64=True)
    train_case({**BASE, "tp": 2, "exit_at_step": 1, "save": f"{tmp}/b"}, fp64=True)
    rest = train_case({}, source=f"{tmp}/b", fp64=True)
    results["resume"] = {"straight": _summary(straight), "rest": _summary(rest)}
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(in_ranks, 2, str(tmp_path_factory.mktemp("lora")))[0]


def _close(a: dict, b: dict, tol: float, stage: bool = False) -> None:
    """``stage``: ``a`` is rank 0's pipeline stage, which holds the first layers only."""
    assert a.keys() <= b.keys() if stage else a.keys() == b.keys()
    assert any(".lora." in k for k in a)
    for k in a:
        err = (a[k].double() - b[k].double()).abs().max()
        assert err <= tol, (k, float(err))


@pytest.mark.parametrize("name", sorted(CASES))
def test_two_ranks_equal_one_process(ranks, name):
    got = ranks[name]
    extra = {k: v for k, v in CASES[name].items() if k == "lora_targets"}
    ref = _summary(train_case({**BASE, **extra}, fp64=True))
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-10)
    assert got["norms"] == pytest.approx(ref["norms"], rel=1e-10)
    _close(got["params"], ref["params"], 1e-10, stage="pp" in CASES[name])
    adapters = {k for k in ref["params"] if ".lora." in k}
    init = train_case({**BASE, **extra, "steps": 0}, fp64=True)["params"]
    moved = {k for k in ref["params"] if not torch.equal(init[k], ref["params"][k])}
    assert moved <= adapters and any(".lora.A" in k for k in moved)  # the second step moved A
    if "lora_targets" in extra:
        assert any(".experts.lora." in k and k.endswith(".B") for k in moved)


def test_resume_is_exact(ranks):
    got = ranks["resume"]
    assert got["rest"]["losses"] == got["straight"]["losses"][1:]
    for k, v in got["straight"]["params"].items():
        assert torch.equal(got["rest"]["params"][k], v), k
