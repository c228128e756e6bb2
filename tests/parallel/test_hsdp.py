"""HSDP (``--dp-replicate``) and one gradient reduction per step (``--grad-sync last``) on four
gloo ranks, all cases in one spawn: ``--config debug`` at dp=4 as 2 replica groups x 2 shards
equals dp=4 and one process, each rank holding half of the weights; an HSDP checkpoint resumes
at dp=2 (x tp=2, the rest of the four ranks) and on one process; ``last`` equals ``every`` in
both dp modes and under HSDP, with one reduce-scatter (all-reduce) per unit per step instead of
one per micro-batch.

Error model: the layouts differ from one process only in the order of sums (the reductions
over ranks, and under ``last`` the micro-batches' gradients summed before the reduction rather
than after). In fp64 that is a relative 1e-16 per operation over some hundred operations, so
1e-10 leaves a margin of about 1e4. In fp32 the same reordering moves a gradient by ~1e-7 of
its scale, and AdamW divides each entry by its own magnitude: an entry whose micro-batch
gradients nearly cancel gets a different update of up to ``lr`` (3.8e-3 measured after three
steps of the debug recipe at dp=4 against one process), so no fp32 bound on the weights holds
on every CPU while catching a wrong factor: weights are compared in fp64, and the fp32 losses
(which a wrong reduction moves by far more) to 1e-5."""

from __future__ import annotations

import pytest
import torch

from composer.parallel.launch import run_distributed
from composer.train.recipe import read_recipe, recipe_path
from tests.helpers import train_case

pytestmark = pytest.mark.slow  # every test here spawns ranks or processes

DEBUG = {k: v for k, v in read_recipe(recipe_path("debug")).items() if k != "description"}
BASE = {**DEBUG, "steps": 3, "seq_len": 32, "micro_batch_size": 1, "warmup_steps": 1,
        "set": ["moe.aux_loss_coeff=0.0"]}
"""``composer train --config debug`` (the tiny Mamba-2 + MoE + attention preset), shorter: one
micro-batch of one row per forward, so dp=4 runs 2 micro-batches per rank. Without the
load-balancing loss, whose statistics are per micro-batch (the rows of one micro-batch on
every dp rank: another grouping of the rows than one process's, so another loss)."""
SYNC = {**BASE, "steps": 2, "global_batch_size": 16}
"""Four micro-batches per rank at dp=4 (and at dp=2 x tp=2: eight)."""
SYNC_LAYOUTS = {"shard": {}, "replicate": {"dp_mode": "replicate"}, "hsdp": {"dp_replicate": 2}}
HSDP = {"dp": 4, "dp_replicate": 2}


class Counting:
    """Stands in for ``torch.distributed`` inside FSDP2's collectives module and counts the
    gradient reductions that FSDP2 (and replicate) issue: ``reduce_scatter_single`` and
    ``all_reduce`` (its only all-reduce is HSDP's and replicate's of the gradients)."""

    def __init__(self, real) -> None:
        self.real, self.counts = real, {"reduce_scatter": 0, "all_reduce": 0}

    def reduce_scatter_single(self, *args, **kwargs):
        self.counts["reduce_scatter"] += 1
        return self.real.reduce_scatter_single(*args, **kwargs)

    def all_reduce(self, *args, **kwargs):
        self.counts["all_reduce"] += 1
        return self.real.all_reduce(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.real, name)


def counted_case(values: dict) -> dict:
    """:func:`train_case` with FSDP2's gradient reductions counted, and the number of units."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    import composer.train.engine as engine

    counting = Counting(_fsdp_collectives.dist)
    units = []
    setup = engine.setup

    def setup_and_count(*args, **kwargs):
        run, last = setup(*args, **kwargs)
        units.append(sum(isinstance(m, FSDPModule) for m in run.model.modules()))
        return run, last

    _fsdp_collectives.dist, engine.setup = counting, setup_and_count
    try:
        out = train_case(values, fp64=True)
    finally:
        _fsdp_collectives.dist, engine.setup = counting.real, setup
    return {**out, **counting.counts, "units": units[0]}


def _summary(out: dict) -> dict:
    keep = ("losses", "params", "local_numel", "reduce_scatter", "all_reduce", "units")
    sync = out["rows"][0]["grad_sync"] if out["rows"] else None  # no step taken: no row
    return {k: out[k] for k in keep if k in out} | {"grad_sync": sync}


def placements(values: dict) -> set[tuple[str, ...]]:
    """The data-parallel placements of the weights after a step (FSDP2's HSDP: Replicate on the
    replica dimension, Shard within a group)."""
    from composer.train.engine import resolve, setup

    recipe, resume = resolve(None, None, {**values, "steps": 0})
    run, _ = setup(recipe, resume, quiet=True)
    run.log.close()
    return {tuple(type(pl).__name__ for pl in p.placements) for p in run.model.parameters()}


def in_ranks(tmp: str) -> dict:
    out = {"hsdp": _summary(train_case({**BASE, **HSDP}, fp64=True)),
           "dp4": _summary(train_case({**BASE, "dp": 4}, fp64=True)),
           "hsdp-fp32": _summary(train_case({**BASE, **HSDP})),
           "placements": placements({**BASE, **HSDP})}
    # an HSDP run saved at step 2 of 4, resumed at dp=2 x tp=2 (here) and on one process (the
    # test); and the straight HSDP run it must continue
    out["straight"] = _summary(train_case({**BASE, **HSDP, "steps": 4}, fp64=True))
    first = train_case({**BASE, **HSDP, "steps": 4, "exit_at_step": 2,
                        "save": f"{tmp}/hsdp"}, fp64=True)
    out["first"] = _summary(first)
    out["loaded-dp2"] = _summary(train_case({"steps": 2, "dp": 2, "tp": 2, "dp_replicate": 1},
                                            source=f"{tmp}/hsdp", fp64=True))
    for name, layout in SYNC_LAYOUTS.items():
        for mode in ("every", "last"):
            out[f"sync-{name}-{mode}"] = _summary(counted_case(
                {**SYNC, **layout, "dp": 4, "grad_sync": mode}))
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hsdp")
    out = run_distributed(in_ranks, 4, str(tmp))
    return {"rank": out, "tmp": str(tmp)}


@pytest.fixture(scope="module")
def one_process() -> dict:
    return _summary(train_case(BASE, fp64=True)) | {"fp32": _summary(train_case(BASE))}


def close(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    for k in b:
        err = (a[k].double() - b[k].double()).abs().max()
        assert err <= tol, (k, float(err))


def test_hsdp_equals_dp4_and_one_process(ranks, one_process):
    hsdp, dp4 = ranks["rank"][0]["hsdp"], ranks["rank"][0]["dp4"]
    assert hsdp["losses"] == pytest.approx(one_process["losses"], rel=1e-10)
    assert hsdp["losses"] == pytest.approx(dp4["losses"], rel=1e-10)
    close(hsdp["params"], one_process["params"], 1e-10)
    close(hsdp["params"], dp4["params"], 1e-10)
    fp32 = ranks["rank"][0]["hsdp-fp32"]["losses"]
    assert fp32 == pytest.approx(one_process["fp32"]["losses"], rel=1e-5)
    assert fp32[-1] < fp32[0]


def test_each_rank_holds_half_of_the_weights(ranks, one_process):
    total = sum(v.numel() for v in one_process["params"].values())
    hsdp = [r["hsdp"]["local_numel"] / total for r in ranks["rank"]]
    fsdp = [r["dp4"]["local_numel"] / total for r in ranks["rank"]]
    # ranks 0, 1 and ranks 2, 3 each hold one whole copy between them
    assert hsdp[0] + hsdp[1] == hsdp[2] + hsdp[3] == 1.0
    assert sum(fsdp) == 1.0
    assert all(0.45 < share < 0.55 for share in hsdp), hsdp  # not 1/4, not all
    assert all(0.2 < share < 0.3 for share in fsdp), fsdp
    assert ranks["rank"][0]["placements"] == {("Replicate", "Shard")}


def test_an_hsdp_checkpoint_resumes_at_dp2_and_on_one_process(ranks):
    got = ranks["rank"][0]
    first, straight = got["first"], got["straight"]
    assert first["losses"] == straight["losses"][:2]
    # step 2 as saved under HSDP: a resumed run that takes no step holds it bit for bit
    at_two = train_case({"steps": 2, "dp": 1, "dp_replicate": 1},
                        source=f"{ranks['tmp']}/hsdp", fp64=True)
    for k, v in first["params"].items():
        assert torch.equal(got["loaded-dp2"]["params"][k], v), k
        assert torch.equal(at_two["params"][k], v), k
    # and the rest of the run, on one process, continues the HSDP run
    rest = train_case({"dp": 1, "dp_replicate": 1}, source=f"{ranks['tmp']}/hsdp", fp64=True)
    assert rest["losses"] == pytest.approx(straight["losses"][2:], rel=1e-10)
    close(rest["params"], straight["params"], 1e-10)


@pytest.mark.parametrize("layout", sorted(SYNC_LAYOUTS))
def test_grad_sync_last_equals_every_with_one_reduction_per_step(ranks, layout):
    every, last = (ranks["rank"][0][f"sync-{layout}-{mode}"] for mode in ("every", "last"))
    assert (every["grad_sync"], last["grad_sync"]) == ("every", "last")
    assert last["losses"] == pytest.approx(every["losses"], rel=1e-10)
    close(last["params"], every["params"], 1e-10)
    steps, micro = SYNC["steps"], SYNC["global_batch_size"] // 4
    units = every["units"]
    assert units == last["units"] > 1
    # replicate: all-reduces only; HSDP: a reduce-scatter within the group, then an all-reduce
    per_step = {"shard": {"reduce_scatter": 1, "all_reduce": 0},
                "replicate": {"reduce_scatter": 0, "all_reduce": 1},
                "hsdp": {"reduce_scatter": 1, "all_reduce": 1}}[layout]
    for op, n in per_step.items():
        assert last[op] == n * units * steps, (op, last[op])
        assert every[op] == n * units * steps * micro, (op, every[op])


def test_grad_sync_default_is_last_on_the_cpu(ranks):
    assert ranks["rank"][0]["hsdp"]["grad_sync"] == "last"  # 2 micro-batches per rank


@pytest.mark.parametrize(("flags", "message"), [
    ({"dp": 4, "dp_replicate": 3}, "--dp-replicate (3) must divide dp (4)"),
    ({"dp": 4, "dp_replicate": 2, "dp_mode": "replicate"},
     "--dp-replicate 2 needs --dp-mode shard (replicate already keeps a whole copy on every "
     "rank)"),
    ({"dp": 4, "ep": 4, "dp_replicate": 2},
     "--dp-replicate (2) must divide dp / ep (4 / 4): an expert-parallel group lies within one "
     "replica group"),
    ({"dp": 2, "pp": 2, "grad_sync": "every"},
     "--grad-sync every with --pp > 1: the pipeline schedule reduces the gradients once per "
     "step, after its last backward"),
    ({"dp": 4, "dp_replicate": 0}, "--dp-replicate must be >= 1, got 0"),
])
def test_layout_refusals(flags, message):
    from composer.parallel.mesh import LayoutError, ParallelConfig, resolve_layout

    world = flags["dp"] * flags.get("pp", 1)
    with pytest.raises(LayoutError) as err:
        resolve_layout(ParallelConfig(**flags), world)
    assert str(err.value) == message
