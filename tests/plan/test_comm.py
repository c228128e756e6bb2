"""composer plan's communication equals what one training step issues: every collective of the
engine's second step on 2 gloo ranks, counted by a dispatch mode (tests.helpers.CollectiveCounter),
summed by collective and group, against the plan of the same layout, exactly: FSDP2 (both
--grad-sync modes), replicate, tensor and sequence parallel, the pipeline's sends and receives,
context parallel's exchanges (K/V, MLA's latents, convolution halos, Mamba-2's and the delta
rule's states), expert parallel's all-to-alls (with the routing counts the ranks exchanged), the
MoE statistics, the gradient norm and step statistics."""

import pytest

from composer.parallel.layout import ParallelConfig
from composer.plan.comm import communication
from composer.plan.comm_parts import comm_parts
from composer.plan.ranks import ROOT_DIMS, build_rank, impersonate, rank_bytes, rank_coords
from composer.zoo import get_preset

BASE = {"tokens": "synthetic", "seq_len": 16, "steps": 2, "global_batch_size": 4,
        "micro_batch_size": 1, "precision": "fp32"}
MTP = {"model": {"preset": "deepseek-v3-debug", "set": {"pattern": "(+-)x1(+E)x2/+E"}}}
# (preset, layout and recipe values): each of tp, pp, cp, ep and dp (both modes) at 2 ranks,
# several micro-batches each
CASES = [
    ("llama-debug", {"tp": 2}),
    ("llama-debug", {"tp": 2, "precision": "bf16"}),  # the residual stream stays fp32
    ("nemotron-h-debug", {"tp": 2, "global_batch_size": 2}),
    ("llama-debug", {"grad_sync": "every"}),
    ("llama-debug", {"grad_sync": "last", "precision": "bf16"}),
    ("llama-debug", {"dp_mode": "replicate"}),
    ("llama-debug", {"pp": 2}),
    ("llama-debug", {"pp": 2, "precision": "bf16", "pp_schedule": "gpipe"}),
    ("qwen3-debug", {"pp": 2}),  # tied embeddings: their copies' gradients summed
    ("llama-debug", {"cp": 2}),
    ("nemotron-h-debug", {"cp": 2, "dp_mode": "replicate", "global_batch_size": 2}),
    ("nemotron-h-debug", {"cp": 2, "precision": "bf16", "global_batch_size": 2}),
    ("deepseek-v3-debug", {"cp": 2}),  # MLA's latents; the sequence-wise balance statistics
    ("qwen3-moe-debug", {"ep": 2}),
    ("deepseek-v3-debug", {"ep": 2}),  # aux-loss-free balancing's loads
    (None, {**MTP, "tp": 2}),  # each depth embeds, reads out and scores once more
    (None, {**MTP, "cp": 2}),
    # the other kinds: tp's crossings are per layer whatever the mixer; cp's exchange per kind
    ("kimi-linear-debug", {"tp": 2, "global_batch_size": 2}),  # K, +, E
    ("falcon-h1-debug", {"tp": 2, "global_batch_size": 2}),  # a parallel group [M*]
    ("zamba2-debug", {"tp": 2}),  # a shared block: the embeddings enter, sums inside
    ("zamba2-debug", {"tp": 2, "precision": "bf16", "sequence_parallel": False}),
    ("qwen3.5-debug", {"cp": 2, "global_batch_size": 2, "precision": "bf16"}),  # G: fp32 states
    ("kimi-linear-debug", {"cp": 2, "global_batch_size": 2}),
    ("lfm2-debug", {"cp": 2, "global_batch_size": 2}),  # C: halos only
    ("gemma3-debug", {"cp": 2, "global_batch_size": 2}),  # W
    ("falcon-h1-debug", {"cp": 2, "global_batch_size": 2}),
    ("jamba-debug", {"cp": 2, "global_batch_size": 2, "precision": "bf16"}),  # S: fp32 states
]
SPANS = {"tp": ("tp",), "cp": ("cp",), "ep": ("ep",), "pp": ("pp",), "dp_outer": ("dp_outer",),
         "dp": ("dp_outer", "ep"), "dp_cp": ("dp_outer", "ep", "cp"), "world": ROOT_DIMS}
"""The root mesh dimensions each group spans (HSDP's two are below: they split dp_cp)."""


def counted_steps(cases: list) -> list[dict]:
    """Each case's second step (the first builds the pipeline's shapes and the lazy states),
    its collectives counted; with the routing counts the ranks received."""
    from composer.train.engine import resolve, setup
    from composer.train.loop import take_step
    from tests.helpers import CollectiveCounter

    out = []
    for preset, values in cases:
        recipe, _ = resolve(preset, None, {**BASE, **values})
        run, _ = setup(recipe, None, quiet=True)
        take_step(run, 1, False)
        counter = CollectiveCounter()
        with counter:
            take_step(run, 2, False)
        run.log.close()
        routed = sum(int(c.out.sum()) for c in counter.calls if c.out is not None)
        pipeline = getattr(run.model, "pipeline", None)
        out.append({"totals": counter.totals(), "routed": routed, "grad_sync": run.grad_sync,
                    "schedule": pipeline.schedule_name if pipeline is not None else None})
    return out


def group_ranks(dims, rank: int, group: str) -> tuple[int, ...]:
    """The global ranks of ``rank``'s ``group`` (the mesh dimensions it spans; HSDP's replica
    groups are consecutive blocks of ``dp_shard`` data-parallel ranks)."""
    if group in ("dp_replicate", "dp_shard"):
        members = group_ranks(dims, rank, "dp_cp")
        i, k = members.index(rank), dims.dp_shard
        return members[i % k::k] if group == "dp_replicate" else members[i - i % k:][:k]
    mine = rank_coords(rank, dims)
    fixed = [d for d in ROOT_DIMS if d not in SPANS[group]]
    return tuple(r for r in range(dims.world_size)
                 if all(rank_coords(r, dims)[d] == mine[d] for d in fixed))


def planned(preset: str, values: dict, rank: int, got: dict, world: int = 2) -> dict:
    """The plan's bytes by (collective, group ranks), for the grad-sync mode, schedule and
    routing counts the run had (the plan resolves grad-sync for a GPU, the CPU run as the
    engine does there)."""
    from composer.train.engine import _model_config, resolve

    keys = set(ParallelConfig.__dataclass_fields__)
    v = {**BASE, **values}
    pc = ParallelConfig(**{k: x for k, x in v.items() if k in keys})
    cfg, _ = _model_config(resolve(preset, None, v)[0])  # the run's own model config
    with impersonate(rank, world):  # the rank itself, on meta
        model, dims = build_rank(cfg, pc, v["precision"])
        parts = comm_parts(model, dims)
    n_micro = v["global_batch_size"] // (v["micro_batch_size"] * dims.dp)
    size = 2 if v["precision"] == "bf16" else 4
    comm, unknown = communication(cfg, dims, parts, v["seq_len"], v["micro_batch_size"],
                                  n_micro, size, 8, got["grad_sync"], got["schedule"],
                                  got["routed"])
    assert not unknown
    out: dict = {}
    for c in comm:
        key = (c.op, group_ranks(dims, rank, c.group))
        out[key] = out.get(key, 0) + c.bytes_per_step
    return out


def check_counted(cases: list, world: int) -> None:
    from composer.parallel.launch import run_distributed

    counted = run_distributed(counted_steps, world, cases)
    for i, (preset, values) in enumerate(cases):
        for rank in range(world):
            got = counted[rank][i]
            assert got["totals"], (preset, values)
            for key in ("grad_sync", "pp_schedule"):
                if key in values:
                    assert got[key.removeprefix("pp_")] == values[key]
            assert planned(preset, values, rank, got, world) == got["totals"], \
                (preset, values, rank)


@pytest.mark.slow
@pytest.mark.distributed
def test_planned_bytes_equal_a_counted_step():
    check_counted(CASES, 2)


def test_uniform_routing_is_the_default():
    """Without measured counts the plan assumes each rank receives the rows it sends."""
    cfg = get_preset("qwen3-moe-debug").config()
    stages = []
    rank_bytes(cfg, ParallelConfig(ep=2), 4, precision="fp32", stages=stages)
    parts, dims = stages[0].comm, stages[0].dims
    args = (cfg, dims, parts, 16, 1, 2, 4, 8, "last", None)
    uniform = {c.kind: c.bytes_per_step for c in communication(*args)[0]}
    sent = 2 * 2 * 16 * cfg.moe.top_k  # MoE layers x micro-batches x tokens x top_k
    explicit = {c.kind: c.bytes_per_step for c in communication(*args, routed=sent)[0]}
    assert uniform == explicit
    counts = 2 * 2 * cfg.moe.n_experts * 8
    assert uniform["ep_all_to_all"] == 4 * sent * cfg.d_model * 4 + counts
