"""Context parallelism (composer.parallel.context) on gloo ranks equals one process: the eval
loss, every gradient and three AdamW steps (fp64, 1e-10) of a hybrid with every sequence-mixing
kind (Mamba-2, attention, gated delta net) and a MoE layer with its load-balancing loss, at
cp=2, cp=4, cp=2 x tp=2, cp=2 x dp=2 and cp=2 x pp=2 (no load-balancing loss there), and of
multi-latent attention and of two multi-token-prediction depths at cp=2; isolated documents
that cross the ranks' chunks (fp64); the training engine (fp64 masters, 1e-10) at cp=2 and
cp=2 x pp=2 on synthetic rows and on packed documents (with multi-token prediction too); the
chunk layout; peak memory per rank at cp=2 (4096 tokens); bad layouts, refused in one line."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from composer.build.builder import build_model
from composer.config import ModelConfig
from composer.parallel.context import check_cp, check_cp_length, local_index
from composer.parallel.launch import run_distributed
from composer.parallel.mesh import LayoutError, ParallelConfig, resolve_layout
from tests.helpers import layout_case, train_case
from tests.parallel.test_mla_tp import mla_cfg
from tests.parallel.test_pipeline import (
    BASE,
    MODEL,
    NO_AUX,
    SIZES,
    _engine,
    _merged,
    cfg_dict,
    isolated,
    write_dataset,
)

GDN = {"gdn.n_heads": 4, "gdn.n_kv_heads": 2, "gdn.d_head_k": 8, "gdn.d_head_v": 6,
       "gdn.chunk_size": 8}
PATTERN = "M*-EG-"
CFG = cfg_dict(PATTERN, {**SIZES, **GDN})  # the load-balancing loss on: statistics are global
DATA = {16: np.random.default_rng(0).integers(0, 61, (8, 16)),
        24: np.random.default_rng(1).integers(0, 61, (8, 24))}
MLA_CFG = mla_cfg(8).validate().to_dict()  # multi-latent attention, YaRN RoPE, a MoE layer
LAYOUTS = {"cp2": ({"cp": 2}, 16, 2), "cp4": ({"cp": 4}, 24, 4),
           "cp2-tp2": ({"cp": 2, "tp": 2}, 16, 4), "cp2-dp2": ({"cp": 2, "dp": 2}, 16, 4),
           "cp2-pp2": ({"cp": 2, "pp": 2}, 16, 4), "cp2-mla": ({"cp": 2}, 16, 2),
           "cp2-mtp": ({"cp": 2}, 16, 2)}


NO_AUX_CFG = cfg_dict(PATTERN, {**NO_AUX, **GDN})
"""The pipeline's load-balancing statistics are per micro-batch (test_pipeline.py): pp cases run
without them."""


MTP_CFG = cfg_dict("M*-E/G*E/G*E", {**SIZES, **GDN})  # two depths, their layers cut too


def _cfg(name: str) -> dict:
    return {"mla": MLA_CFG, "mtp": MTP_CFG}.get(name.split("-")[-1],
                                                NO_AUX_CFG if "pp" in name else CFG)


def layouts_in_ranks(names: list[str]) -> dict:
    out = {}
    for name in names:
        got = layout_case(LAYOUTS[name][0], _cfg(name), DATA[LAYOUTS[name][1]], fp64=True)
        out[name] = _merged(got) if "pp" in name else got
    return out


@pytest.fixture(scope="module")
def layouts():
    out = {}
    for world in (2, 4):
        names = [n for n, (_, _, w) in LAYOUTS.items() if w == world]
        out |= run_distributed(layouts_in_ranks, world, names)[0]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_one_process_fp64(layouts, name: str) -> None:
    ref = layout_case({}, _cfg(name), DATA[LAYOUTS[name][1]], fp64=True)
    got = layouts[name]
    assert abs(got["eval"] - ref["eval"]) < 1e-10
    assert set(got["grads"]) == set(ref["grads"])
    for k, g in ref["grads"].items():
        assert (got["grads"][k] - g).abs().max() < 1e-10, k
    assert np.allclose(got["losses"], ref["losses"], rtol=0, atol=1e-10)
    for k, p in ref["params"].items():
        assert (got["params"][k] - p).abs().max() < 1e-10, k


NO_AUX_MODEL = {**MODEL, "set": {**MODEL["set"], "moe.aux_loss_coeff": 0.0}}
GDN_MODEL = {"pattern": "M*G-E", "set": {**MODEL["set"], **GDN}}


@pytest.mark.slow
def test_adaptive_engine_equals_one_process(engine) -> None:
    """--cp-adaptive on packed documents (rows of seq_len + 1: every token is an input, so the
    MoE loss counts the same tokens as one process)."""
    tmp, _ = engine
    values = {**BASE, **isolated(tmp), "model": GDN_MODEL}
    ref = train_case(values, fp64=True)
    got = run_distributed(_engine, 2, {**values, "cp": 2, "cp_adaptive": True}, True)[0]
    assert np.allclose(got["losses"], ref["losses"], rtol=1e-10, atol=0)
    for k, p in ref["params"].items():
        assert (got["params"][k] - p).abs().max() < 1e-10, k


BALANCE_MODEL = {"pattern": "M*-E", "set": {
    **MODEL["set"], "moe.score_correction_bias": True, "moe.bias_update_rate": 0.05,
    "moe.seq_aux_loss_coeff": 0.01, "moe.aux_loss_scope": "global_batch"}}
"""Every MoE balancing statistic across the cp ranks: the aux-loss-free bias update (loads over
dp x cp), the sequence-wise loss (sums over the cut sequences), the global-batch aux loss."""


def engine_cases(tmp: str) -> dict:
    """Synthetic rows of 16 tokens; packed documents (rows of seq_len + 1 = 13 tokens: the last
    is only a target, so the MoE statistics, which count it at cp=1, are left out)."""
    return {"synthetic": {**BASE, "model": GDN_MODEL},
            "isolated": {**BASE, **isolated(tmp), "model": NO_AUX_MODEL},
            "mtp": {**BASE, **isolated(tmp), "model": {**NO_AUX_MODEL, "pattern": "M*-E/*E"}},
            "balance": {**BASE, "model": BALANCE_MODEL}}


ENGINE_LAYOUTS = {"cp2": ({"cp": 2}, 2), "cp2-pp2": ({"cp": 2, "pp": 2}, 4)}


def engine_in_ranks(tmp: str, layout: dict) -> dict:
    return {name: _engine({**values, **layout}, fp64=True)
            for name, values in engine_cases(tmp).items()}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp")
    write_dataset(f"{tmp}/docs")
    return str(tmp), {name: run_distributed(engine_in_ranks, world, str(tmp), layout)[0]
                      for name, (layout, world) in ENGINE_LAYOUTS.items()}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(ENGINE_LAYOUTS))
@pytest.mark.parametrize("name", ["synthetic", "isolated", "mtp", "balance"])
def test_engine_equals_one_process(engine, layout: str, name: str) -> None:
    tmp, got = engine
    ref = train_case(engine_cases(tmp)[name], fp64=True)
    got = got[layout][name]
    assert np.allclose(got["losses"], ref["losses"], rtol=1e-10, atol=0)
    assert np.allclose(got["norms"], [r["grad_norm"] for r in ref["rows"]], rtol=1e-10, atol=0)
    for k, p in ref["params"].items():
        assert (got["params"][k] - p).abs().max() < 1e-10, k


DOCS = np.array([[0] * 5 + [1] * 9 + [2] * 2,  # document 1 spans chunks 1, 2, 3 (ranks 1, 0)
                 [4] * 3 + [5] * 13,              # a document from chunk 0 to the row's end
                 [7] * 16, list(range(16))])      # one document; every token its own


DOCS32 = np.array([[0] * 3 + [1] * 28 + [2],      # a document long enough to split at cp=4
                   [3] * 10 + [4] * 6 + [5] * 16])


def docs_case(layout: dict, cfg: dict | None = None, docs: np.ndarray = DOCS) -> dict:
    """Loss and gradients of one batch of packed rows, documents isolated (fp64)."""
    from composer.parallel.data import finish_grads
    from composer.parallel.mesh import build_parallel_dims
    from composer.run import build_sharded

    dims = build_parallel_dims(ParallelConfig(**layout))
    model = build_sharded(ModelConfig.from_dict(cfg or CFG), dims, seed=7, dtype=torch.float64)
    rows = np.random.default_rng(2).integers(0, 61, docs.shape)
    ids = torch.from_numpy(rows).long()
    out = model(ids, ids, doc_ids=torch.from_numpy(docs).long())
    out.loss.backward()
    finish_grads(model, dims)
    whole = {k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for k, p in model.named_parameters()}
    return {"loss": float(out.loss.detach()), "grads": whole}


def _same(got: dict, ref: dict) -> None:
    assert abs(got["loss"] - ref["loss"]) < 1e-10
    for k, g in ref["grads"].items():
        assert (got["grads"][k] - g).abs().max() < 1e-10, k


def isolated_in_ranks() -> dict:
    return {"cp2-tp2": docs_case({"cp": 2, "tp": 2}, None, DOCS32),
            "cp2-dp2": docs_case({"cp": 2, "dp": 2}, None, DOCS32)}


@pytest.mark.slow
def test_isolated_documents_across_ranks_fp64() -> None:
    """Packed documents across the chunks (a 28-token one over all 4 of cp=2): the loss and
    gradients of one process, at cp=2 and with tp and dp (fp64, 1e-10; with pp: the engine
    tests below)."""
    _same(run_distributed(docs_case, 2, {"cp": 2})[0], docs_case({}))
    got = run_distributed(isolated_in_ranks, 4)[0]
    ref = docs_case({}, None, DOCS32)
    for name in ("cp2-tp2", "cp2-dp2"):
        _same(got[name], ref)


ADAPTIVE = {"default": ({"cp": 2}, None, DOCS), "all-whole": ({"cp": 2, "cp_min_tokens": 100},
                                                            None, DOCS),
            "mla": ({"cp": 2}, MLA_CFG, DOCS), "cp4": ({"cp": 4}, None, DOCS32),
            "cp2-dp2": ({"cp": 2, "dp": 2}, None, DOCS32),
            "cp2-tp2": ({"cp": 2, "tp": 2}, None, DOCS32)}


def adaptive_in_ranks(names: list[str]) -> dict:
    return {n: docs_case({**ADAPTIVE[n][0], "cp_adaptive": True}, ADAPTIVE[n][1], ADAPTIVE[n][2])
            for n in names}


@pytest.fixture(scope="module")
def adaptive():
    two = ["default", "all-whole", "mla"]
    out = run_distributed(adaptive_in_ranks, 2, two)[0]
    return out | run_distributed(adaptive_in_ranks, 4, [n for n in ADAPTIVE if n not in two])[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ADAPTIVE))
def test_adaptive_equals_one_process_fp64(adaptive, name: str) -> None:
    """Short documents whole on one rank, long ones split (default threshold: a rank's share of
    the row), every document whole (a threshold above the row), with multi-latent attention,
    at cp=4 and with dp and tp: the single-process loss and gradients (fp64, 1e-10)."""
    _, cfg, docs = ADAPTIVE[name]
    _same(adaptive[name], docs_case({}, cfg, docs))


def test_adaptive_layout() -> None:
    """Every token exactly once; short documents whole, the longest first, on the least-loaded
    rank; long ones in 2N pieces (rank j or 2N-1-j), each piece pointing at the one before."""
    from composer.parallel.context import adaptive_layout

    docs = np.array([[0] * 20 + [1] * 5 + [2] * 7])
    lay = adaptive_layout(docs, 2, min_tokens=16, halo=3)
    covered = sorted(t for p in lay.pieces for t in range(p.start, p.start + p.length))
    assert covered == list(range(32))
    long = [p for p in lay.pieces if p.doc_start == 0]
    assert [p.length for p in long] == [5, 5, 5, 5] and [p.rank for p in long] == [0, 1, 1, 0]
    assert [p.prev for p in long] == [None, 0, 1, 2]
    short = {p.doc_start: p.rank for p in lay.pieces if p.doc_start != 0}
    assert short == {25: 0, 20: 1}  # 7 tokens first (ties: rank 0), then 5 to the lighter rank
    assert [lay.tokens(r) for r in range(2)] == [17, 15]
    # too short to split into pieces that each cover the halo: whole
    assert len(adaptive_layout(docs, 2, min_tokens=16, halo=6).pieces) == 3


def test_chunk_layout() -> None:
    """Rank r holds chunks r and 2N-1-r (the causal load balance)."""
    assert local_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    got = torch.cat([local_index(24, 3, r) for r in range(3)]).sort().values
    assert got.tolist() == list(range(24))


def _peak(cp: int, tokens: int) -> float:
    sys.path.insert(0, "bench")
    from long_context import run

    return run(cp, tokens, steps=1)["peak_MB"]


@pytest.mark.slow
def test_peak_memory_at_cp2_is_at_most_065x() -> None:
    """Issue 15's goal, a hybrid training step's peak memory per rank at cp=2 at most 0.65x
    cp=1's (bench/long_context.py measures it at 8192 tokens), checked on a 1 x 4096-token row
    for half the cost: the peak is linear in the tokens (907, 1788, 3485 MB at 8k, 16k, 32k at
    cp=1 in bench/RESULTS.md; 454 MB at 4k), so the ratio is the same at every length (0.58x
    at 4k, 0.57x-0.58x at 8k, 16k and 32k; deterministic from run to run; 2026-12-03)."""
    one, two = _peak(1, 4096), _peak(2, 4096)
    assert two <= 0.65 * one, (one, two)


@pytest.mark.parametrize("pattern, seq, match", [
    ("M*-E", 18, "rows of 18 tokens do not cut into 2 x cp = 4 chunks"),
    ("M*-E", 8, "chunks of 2 tokens are shorter than the mamba convolution's halo of 3"),
])
def test_lengths_are_checked(pattern, seq, match) -> None:
    cfg = ModelConfig.from_dict(cfg_dict(pattern))
    with pytest.raises(LayoutError, match=match):
        check_cp_length(cfg, 2, seq)
    check_cp_length(cfg, 2, 17)  # seq_len + 1: the last token only a target


def test_a_kind_without_a_cp_form_is_refused() -> None:
    """Every kind composer builds has one; a mixer from elsewhere is refused by name."""
    model = build_model(ModelConfig.from_dict(cfg_dict("M*-E/*E")), device="meta")
    check_cp(model, 2)  # the trunk's and the MTP depth's layers
    model.layers["1"].mixer = torch.nn.Linear(2, 2)
    with pytest.raises(LayoutError, match=r"layers\.1 \('\*', Linear\) has no context"):
        check_cp(model, 2)


def test_layouts_cp_does_not_combine_with_yet() -> None:
    with pytest.raises(LayoutError, match="--cp with --ep"):
        resolve_layout(ParallelConfig(cp=2, ep=2), 4)


@pytest.mark.slow
def test_adaptive_needs_documents() -> None:
    got = run_distributed(_refusal, 2, {**BASE, "cp": 2, "cp_adaptive": True})[0]
    assert "needs --document-isolation" in got


def _refusal(values: dict) -> str:
    try:
        train_case(values)
    except LayoutError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_a_bad_cp_layout_is_one_line_before_any_work(tmp_path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "-m", "composer", "train", "nemotron-h-debug", "--tokens", "synthetic",
           "--seq-len", "18", "--steps", "1", "--device", "cpu", "--cp", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("composer: error")]
    assert errors and all("rows of 18 tokens do not cut into 2 x cp = 4 chunks" in e
                          for e in errors), proc.stderr[-2000:]
    assert proc.returncode != 0
