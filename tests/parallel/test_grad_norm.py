"""The logged gradient norm, and so the clipped update, of the training engine under every pair
and triple of layouts the engine accepts at world size 4 and 8 (tp, cp, dp, ep, pp; cp does not
combine with ep) equals one process in fp64. All pairs run in one spawn of 4 ranks, all triples
in one spawn of 8.

Error model: in fp64 the layouts differ from one process only in the order of sums (the
reductions over ranks, the chunked scans under cp), a relative 1e-16 per operation over some
hundred operations; 1e-10 leaves a margin of about 1e4. Pieces weighed wrongly move it far
more: FSDP2 places ``_StridedShard`` on the data-parallel dimension of 2-D DTensors, which
the norm took for replicated, so it came out 0.786x at every tp x (dp or cp), 0.653x at
tp x dp x cp, and a relative -4e-6 at dp=4 x ep=2 (the experts sharded over dp_outer x ep,
whose gradients are small, also with pp=2); the other layouts were right before."""

from __future__ import annotations

import pytest
import torch

from composer.parallel.launch import run_distributed
from tests.helpers import train_case
from tests.parallel.test_pipeline import _engine

pytestmark = pytest.mark.slow  # every test here spawns ranks or processes

MODEL = {"pattern": "M*-EG-", "set": {
    "d_model": 32, "vocab_size": 61, "tie_embeddings": True, "attention.n_heads": 4,
    "attention.n_kv_heads": 2, "mamba.n_heads": 4, "mamba.d_head": 8, "mamba.n_groups": 2,
    "mamba.d_state": 8, "mamba.chunk_size": 8, "mlp.d_ff": 64, "moe.n_experts": 4,
    "moe.top_k": 2, "moe.d_ff": 32, "moe.aux_loss_coeff": 0.0, "gdn.n_heads": 4,
    "gdn.n_kv_heads": 2, "gdn.d_head_k": 8, "gdn.d_head_v": 6, "gdn.chunk_size": 8}}
"""Every kind with a tp plan and a cp form, a MoE layer for ep, tied embeddings (two copies
under pp). No load-balancing loss: its statistics are per micro-batch (test_pipeline.py)."""
CLIP = 0.5
"""Below the step's norm (about 1.5): the update is clipped."""
BASE = {"model": MODEL, "tokens": "synthetic", "seq_len": 16, "steps": 1,
        "global_batch_size": 8, "micro_batch_size": 1, "lr": 3e-3, "adam_eps": 1e-3,
        "device": "cpu", "precision": "fp32", "grad_clip": CLIP}
"""One step: its logged norm, and its update, which sees the clipped gradient's scale because
``adam_eps`` is not small against the gradient's entries (about 3e-3; with the default 1e-8
Adam's normalisation would hide a wrong clipping factor)."""

PAIRS = {"tp2-dp2": {"tp": 2}, "tp2-cp2": {"tp": 2, "cp": 2}, "tp2-pp2": {"tp": 2, "pp": 2},
         "tp2-ep2": {"tp": 2, "ep": 2}, "dp2-cp2": {"cp": 2}, "dp2-pp2": {"pp": 2},
         "dp4-ep2": {"ep": 2}, "cp2-pp2": {"cp": 2, "pp": 2}, "ep2-pp2": {"ep": 2, "pp": 2},
         "tp2-dp2-replicate": {"tp": 2, "dp_mode": "replicate"},
         "dp4-ep2-replicate": {"ep": 2, "dp_mode": "replicate"},
         "dp4-hsdp2": {"dp_replicate": 2}, "dp2-cp2-hsdp2": {"cp": 2, "dp_replicate": 2},
         "dp4-ep2-hsdp2": {"ep": 2, "dp_replicate": 2}}
"""World 4; dp fills the rest (``ep`` splits dp: dp4-ep2 shards the experts over dp_outer)."""
TRIPLES = {"tp2-dp2-cp2": {"tp": 2, "cp": 2}, "tp2-dp2-pp2": {"tp": 2, "pp": 2},
           "tp2-dp4-ep2": {"tp": 2, "ep": 2}, "tp2-cp2-pp2": {"tp": 2, "cp": 2, "pp": 2},
           "tp2-ep2-pp2": {"tp": 2, "ep": 2, "pp": 2}, "dp2-cp2-pp2": {"cp": 2, "pp": 2},
           "dp4-ep2-pp2": {"ep": 2, "pp": 2}, "tp2-dp4-hsdp2": {"tp": 2, "dp_replicate": 2},
           "dp8-ep2-hsdp2": {"ep": 2, "dp_replicate": 2}}
"""World 8. HSDP (``dp_replicate``): dp8-ep2-hsdp2 shards the experts over the two dp_outer
ranks of each replica group (dp4-ep2-hsdp2 has one: its experts are replicated)."""


def with_micro_batches(layout: dict) -> dict:
    """The recipe of a layout. Under pp, one-row micro-batches (the schedule needs at least pp
    of them); otherwise each rank takes its rows in one forward (the default micro-batch,
    G / dp), half the cost or less, against the reference's 8 accumulated one-row micro-batches:
    any (m, dp) gives the same update (no load-balancing loss here)."""
    return {**BASE, **layout} if "pp" in layout else {**BASE, "micro_batch_size": None, **layout}


def layouts_in_ranks(layouts: dict[str, dict]) -> dict:
    return {name: _engine(with_micro_batches(layout), fp64=True)
            for name, layout in layouts.items()}


@pytest.fixture(scope="module")
def reference() -> dict:
    out = train_case(BASE, fp64=True)
    return {"norms": [r["grad_norm"] for r in out["rows"]], "params": out["params"]}


@pytest.fixture(scope="module")
def layouts() -> dict:
    return (run_distributed(layouts_in_ranks, 4, PAIRS, timeout=900)[0]
            | run_distributed(layouts_in_ranks, 8, TRIPLES, timeout=900)[0])


def test_reference_is_fp64_and_clipped(reference: dict) -> None:
    assert {p.dtype for p in reference["params"].values()} == {torch.float64}
    assert min(reference["norms"]) > 2 * CLIP


@pytest.mark.parametrize("name", [*PAIRS, *TRIPLES])
def test_grad_norm_and_clipped_update_equal_one_process(reference: dict, layouts: dict,
                                                        name: str) -> None:
    got = layouts[name]
    assert got["norms"] == pytest.approx(reference["norms"], rel=1e-10, abs=0)
    assert got["params"].keys() == reference["params"].keys()
    for k, p in reference["params"].items():
        err = float((got["params"][k] - p).abs().max())
        assert err <= 1e-10, (k, err)
